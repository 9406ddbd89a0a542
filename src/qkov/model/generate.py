"""Text from the model, one token at a time: the pieces of ``Transformer.generate`` (TransformerLens'
``HookedTransformer.generate``, with its argument names and defaults).

A text is encoded by the model's :class:`~qkov.model.tokens.TextCodec`, so it gets exactly one start
token (``prepend_bos=None``: the model's default), and a text comes back without it. Each step
(:func:`continue_tokens`) runs the model's own forward on the whole sequence so far (no key/value cache:
these are small models) and appends one token per sequence (:func:`next_tokens`): the most likely one
(``temperature=0`` or ``do_sample=False``), or one drawn from ``softmax(logits / temperature)`` over the
``top_k`` most likely tokens, from ``generator`` (or a generator seeded with ``seed``; neither: torch's
global generator, as TransformerLens draws). With ``stop_at_eos`` a sequence that produced an end token
gets the first end token from then on, and generation stops once every sequence has ended.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import torch
from torch import Tensor

from ..errors import QkovError, check_choice
from .tokens import is_text

__all__ = [
    "check_options",
    "continue_tokens",
    "end_ids",
    "next_tokens",
    "prompt_tokens",
    "RETURN_TYPES",
    "sampling_generator",
    "texts_of",
]

if TYPE_CHECKING:  # pragma: no cover
    from .transformer import Transformer

RETURN_TYPES = ("input", "str", "tokens")


def prompt_tokens(model: "Transformer", input: Any, prepend_bos: bool | None) -> tuple[Tensor, bool, int]:
    """``(tokens [B, T], given as text, start tokens to drop when decoding)``."""
    if is_text(input):
        codec = model.codec
        tokens = codec.encode_texts(input, prepend_bos=prepend_bos, where="generate")
        bos = codec.default_prepend_bos if prepend_bos is None else prepend_bos
        return model.check_tokens(tokens), True, int(bool(bos))
    if not isinstance(input, (Tensor, list, tuple)):
        raise QkovError(f"generate: expected a text, a list of texts or token ids [batch, seq], got {type(input).__name__}")
    return model.check_tokens(input), False, 0


def sampling_generator(model: "Transformer", seed: int | None, generator: torch.Generator | None) -> torch.Generator | None:
    if seed is not None and generator is not None:
        raise QkovError("generate: give seed or generator, not both")
    if seed is None:
        return generator
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise QkovError(f"generate: seed must be an integer, got {seed!r}")
    return torch.Generator(device=model.W_E.device).manual_seed(seed)


def next_tokens(
    logits: Tensor, *, temperature: float, top_k: int | None, generator: torch.Generator | None
) -> Tensor:
    """One token per row of ``logits [B, V]``: the argmax at ``temperature == 0``, else a draw from
    ``softmax(logits / temperature)`` restricted to the ``top_k`` largest logits (ties at the k-th
    value kept): ``[B]``."""
    if temperature == 0:
        return logits.argmax(-1)
    scaled = logits.float() / temperature
    if top_k is not None and top_k < scaled.shape[-1]:
        kth = scaled.topk(top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    return torch.multinomial(probs, 1, replacement=True, generator=generator)[:, 0]


def end_ids(model: "Transformer", eos_token_id: int | Sequence[int] | None) -> Tensor:
    """The end tokens ``[n]`` (the first pads a sequence that has ended); ``None``: the start token."""
    ends = [model.bos_token_id] if eos_token_id is None else eos_token_id
    ids = torch.as_tensor([ends] if isinstance(ends, int) else list(ends))
    V = model.cfg.d_vocab
    if ids.ndim != 1 or not len(ids) or ids.dtype.is_floating_point or bool(((ids < 0) | (ids >= V)).any()):
        raise QkovError(f"generate: eos_token_id must be a token id in 0..{V - 1} or a list of them, got {eos_token_id!r}")
    return ids.long()


def check_options(model: "Transformer", max_new_tokens: int, temperature: float, top_k: int | None, return_type: str) -> None:
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
        raise QkovError(f"generate: max_new_tokens must be a non-negative integer, got {max_new_tokens!r}")
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or temperature < 0:
        raise QkovError(f"generate: temperature must be a number >= 0 (0: greedy), got {temperature!r}")
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1):
        raise QkovError(f"generate: top_k must be None or an integer >= 1, got {top_k!r}")
    check_choice("generate", "return_type", return_type, RETURN_TYPES)


@torch.no_grad()
def continue_tokens(
    model: "Transformer",
    tokens: Tensor,
    max_new_tokens: int,
    *,
    temperature: float,
    top_k: int | None,
    generator: torch.Generator | None,
    ends: Tensor | None,
) -> Tensor:
    """``tokens [B, T]`` and up to ``max_new_tokens`` more: ``[B, T + new]``. ``ends`` (``[n]``, or ``None``
    never to stop): the end tokens; a sequence that produced one gets ``ends[0]`` from then on, and the
    loop stops when every sequence has ended."""
    if tokens.shape[1] + max_new_tokens > model.cfg.n_ctx:
        raise QkovError(
            f"generate: the prompt's {tokens.shape[1]} tokens and {max_new_tokens} new ones exceed the context "
            f"of {model.cfg.n_ctx} tokens"
        )
    done = torch.zeros(tokens.shape[0], dtype=torch.bool, device=tokens.device)
    for _ in range(max_new_tokens):
        new = next_tokens(model(tokens)[:, -1], temperature=temperature, top_k=top_k, generator=generator)
        if ends is not None:
            ends = ends.to(tokens.device)
            new = torch.where(done, ends[0], new)
            done = done | torch.isin(new, ends)
        tokens = torch.cat([tokens, new[:, None]], dim=1)
        if ends is not None and bool(done.all()):
            break
    return tokens


def texts_of(model: "Transformer", tokens: Tensor, skip: int) -> str | list[str]:
    """Each row of ``tokens [B, T]`` as text, less its first ``skip`` ids (the start token prepended),
    decoded without special tokens as TransformerLens decodes it: a string for one row, else a list."""
    tokenizer = model.codec.tokenizer
    texts = [tokenizer.decode(row[skip:].tolist(), skip_special_tokens=True) for row in tokens]
    return texts[0] if len(texts) == 1 else texts
