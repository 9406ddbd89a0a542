"""Text from the model, one token at a time: :func:`generate`, what ``Transformer.generate`` runs
(TransformerLens' ``HookedTransformer.generate``, with its argument names and defaults).

A text is encoded by the model's :class:`~qkov.model.tokens.TextCodec`, so it gets exactly one start
token (``prepend_bos=None``: the model's default), and a text comes back without it. Each step runs
the model's own forward on the whole sequence so far (no key/value cache: these are small models)
and appends one token per sequence: the most likely one (``temperature=0`` or ``do_sample=False``),
or one drawn from ``softmax(logits / temperature)`` over the ``top_k`` most likely tokens, from
``generator`` (or a generator seeded with ``seed``; neither: torch's global generator, as
TransformerLens draws). With ``stop_at_eos`` a sequence that produced the end token gets the end token
from then on, and generation stops once every sequence has ended.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import torch
from torch import Tensor

from ..errors import QkovError, check_choice
from .tokens import is_text

if TYPE_CHECKING:  # pragma: no cover
    from .transformer import Transformer

RETURN_TYPES = ("input", "str", "tokens")


def _prompt(model: "Transformer", input: Any, prepend_bos: bool | None) -> tuple[Tensor, bool, int]:
    """``(tokens [B, T], given as text, start tokens to drop when decoding)``."""
    if is_text(input):
        codec = model.codec
        tokens = codec.encode_texts(input, prepend_bos=prepend_bos, where="generate")
        bos = codec.default_prepend_bos if prepend_bos is None else prepend_bos
        return model.check_tokens(tokens), True, int(bool(bos))
    if not isinstance(input, (Tensor, list, tuple)):
        raise QkovError(f"generate: expected a text, a list of texts or token ids [batch, seq], got {type(input).__name__}")
    return model.check_tokens(input), False, 0


def _generator(model: "Transformer", seed: int | None, generator: torch.Generator | None) -> torch.Generator | None:
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


def _end_ids(model: "Transformer", eos_token_id: int | Sequence[int] | None) -> Tensor:
    """The end tokens ``[n]`` (the first pads a sequence that has ended); ``None``: the start token."""
    ends = [model.bos_token_id] if eos_token_id is None else eos_token_id
    ids = torch.as_tensor([ends] if isinstance(ends, int) else list(ends))
    V = model.cfg.d_vocab
    if ids.ndim != 1 or not len(ids) or ids.dtype.is_floating_point or bool(((ids < 0) | (ids >= V)).any()):
        raise QkovError(f"generate: eos_token_id must be a token id in 0..{V - 1} or a list of them, got {eos_token_id!r}")
    return ids.long()


def _check(model: "Transformer", max_new_tokens: int, temperature: float, top_k: int | None, return_type: str) -> None:
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
        raise QkovError(f"generate: max_new_tokens must be a non-negative integer, got {max_new_tokens!r}")
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or temperature < 0:
        raise QkovError(f"generate: temperature must be a number >= 0 (0: greedy), got {temperature!r}")
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1):
        raise QkovError(f"generate: top_k must be None or an integer >= 1, got {top_k!r}")
    check_choice("generate", "return_type", return_type, RETURN_TYPES)


@torch.no_grad()
def generate(
    model: "Transformer",
    input: str | Sequence[str] | Tensor,
    max_new_tokens: int = 10,
    *,
    stop_at_eos: bool = True,
    eos_token_id: int | Sequence[int] | None = None,
    do_sample: bool = True,
    top_k: int | None = None,
    temperature: float = 1.0,
    seed: int | None = None,
    generator: torch.Generator | None = None,
    prepend_bos: bool | None = None,
    return_type: str = "input",
) -> str | list[str] | Tensor:
    """Continue ``input`` (a text, a list of texts of equal token counts, or ids ``[B, T]`` / ``[T]``)
    by up to ``max_new_tokens`` tokens; see the module docstring.

    ``eos_token_id``: the end token(s) ``stop_at_eos`` stops at; ``None``: the model's start token
    (``<|bos|>`` of qkov's models and ``<|endoftext|>`` of GPT-2 also end a text; pass the end token of a
    model whose end differs, such as Llama's ``</s>``). The prompt and the new tokens must fit the
    context (``n_ctx``). ``return_type``: ``"input"`` (text for text, ids for ids), ``"str"`` (the
    whole text, prompt included, decoded without special tokens as TransformerLens decodes it: a string
    for one sequence, a list for several) or ``"tokens"`` (``[B, T + new]``, prompt included).
    """
    _check(model, max_new_tokens, temperature, top_k, return_type)
    tokens, as_text, skip = _prompt(model, input, prepend_bos)
    if tokens.shape[1] + max_new_tokens > model.cfg.n_ctx:
        raise QkovError(
            f"generate: the prompt's {tokens.shape[1]} tokens and {max_new_tokens} new ones exceed the context "
            f"of {model.cfg.n_ctx} tokens"
        )
    gen = _generator(model, seed, generator)
    end_ids = _end_ids(model, eos_token_id).to(tokens.device)
    done = torch.zeros(tokens.shape[0], dtype=torch.bool, device=tokens.device)
    greedy = temperature == 0 or not do_sample
    for _ in range(max_new_tokens):
        logits = model(tokens)[:, -1]
        new = next_tokens(logits, temperature=0 if greedy else temperature, top_k=top_k, generator=gen)
        if stop_at_eos:
            new = torch.where(done, end_ids[0], new)
            done = done | torch.isin(new, end_ids)
        tokens = torch.cat([tokens, new[:, None]], dim=1)
        if stop_at_eos and bool(done.all()):
            break
    if return_type == "tokens" or (return_type == "input" and not as_text):
        return tokens
    tokenizer = model.codec.tokenizer
    texts = [tokenizer.decode(row[skip:].tolist(), skip_special_tokens=True) for row in tokens]
    return texts[0] if len(texts) == 1 else texts
