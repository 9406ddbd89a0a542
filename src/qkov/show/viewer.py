"""The report's attention viewer in a notebook cell: hover a token to shade the earlier tokens by
how much it attends to them; choose the head; the head's whole pattern as a heatmap."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor

from ..analysis.forward.tracer import trace
from ..apps.report.collect import attention_section
from ..errors import QkovError
from ..io.sources import load_any
from ..model.tokens import check_tokens, text_codec, token_decoder
from ..model.transformer import Transformer
from ..weights.parts import WeightSource
from ..weights.view import Weights
from .page import mounted, page

__all__ = ["attention", "AttentionView"]


class AttentionView:
    """Every head's attention pattern on one sequence, shown as the report's viewer.

    ``patterns [n_layers, n_heads, seq, seq]`` (query, key), ``ids [seq]``, ``tokens`` (strings);
    ``layer``/``head``/``query`` are what the viewer opens on."""

    def __init__(self, source: WeightSource, ids: Tensor, decode: Callable[[int], str], where: tuple[int, ...]) -> None:
        self.ids, self.tokens = ids.cpu(), [decode(int(i)) for i in ids]
        self.layer, self.head, self.query = where
        self.patterns = trace(source, ids[None], cache="pattern.*", logits=False).stack("pattern")[:, 0].float().cpu()
        self._section = attention_section(source, ids, decode)  # type: ignore[arg-type]

    def argmax(self, layer: int, head: int, query: int) -> int:
        """The key position ``query`` attends to most in head ``layer.head``."""
        return int(self.patterns[layer, head, query, : query + 1].argmax())

    def __repr__(self) -> str:
        L, H, T = *self.patterns.shape[:2], len(self.tokens)
        q, k = self.query, self.argmax(self.layer, self.head, self.query)
        w = float(self.patterns[self.layer, self.head, q, k])
        return (
            f"AttentionView: {T} tokens, {L} layers x {H} heads; head {self.layer}.{self.head}, "
            f"token {q} {self.tokens[q]!r} attends most to token {k} {self.tokens[k]!r} ({w:.2f})"
        )

    def _repr_html_(self) -> str:
        opts = {"hash": f"#attend={self.layer}.{self.head}.{self.query}"}
        data = {"attention": self._section.to_dict()}
        return page(mounted("attention", data, repr(self), title="Attention patterns", opts=opts))


def _source(model: Any) -> tuple[WeightSource, Any, int | None]:
    """(weights, tokenizer, start token) of a model, a weights view, or a path any loader reads."""
    if isinstance(model, (str, Path)):
        model = load_any(model)
    if isinstance(model, Transformer):
        return Weights.from_model(model), model.tokenizer, model.bos_token_id
    if hasattr(model, "cfg") and hasattr(model, "attention"):  # a WeightSource (a protocol)
        return model, getattr(model, "tokenizer", None), getattr(model, "bos_token_id", None)
    raise QkovError(f"attention: expected a model, a Weights view or a checkpoint path, got {type(model).__name__}")


def attention(
    model: Any,
    text_or_tokens: str | Tensor | list[int],
    layer: int | None = None,
    head: int | None = None,
    *,
    query: int | None = None,
    tokenizer: Any = None,
) -> AttentionView:
    """The attention viewer of ``model`` on a text (start token prepended, cut to ``n_ctx``) or on
    token ids ``[seq]``, opened on head ``layer.head`` (default 0.0) at token ``query`` (default: the last).

    ``model``: a :class:`~qkov.Transformer`, a weights view (:class:`~qkov.Weights`, a lazy
    checkpoint: give token ids, or ``tokenizer`` for token strings), or a path
    :func:`qkov.io.load_any` reads. Display the result (the last expression of a cell)."""
    source, tok, bos = _source(model)
    tok = tokenizer or tok
    cfg = source.cfg
    if cfg.n_layers == 0:
        raise QkovError("attention: a 0-layer model has no attention")
    if isinstance(text_or_tokens, str):
        if tok is None or bos is None:
            raise QkovError("attention: text needs a model with a tokenizer; give token ids instead")
        prepend = getattr(model, "default_prepend_bos", None)
        ids = torch.tensor(text_codec(tok, bos, default_prepend_bos=prepend).encode(text_or_tokens))
        if len(ids) > cfg.n_ctx:  # said, not cut silently
            raise QkovError(
                f"attention: the text is {len(ids)} tokens and the model reads at most {cfg.n_ctx}; give a shorter text"
            )
    else:
        ids = check_tokens(text_or_tokens, cfg)[0]
    layer, head = layer or 0, head or 0
    if not (0 <= layer < cfg.n_layers and 0 <= head < cfg.n_heads):
        raise QkovError(f"attention: no head {layer}.{head} in {cfg.n_layers} layers x {cfg.n_heads} heads")
    q = len(ids) - 1 if query is None else query
    if not 0 <= q < len(ids):
        raise QkovError(f"attention: query {q} is outside the {len(ids)} tokens")
    return AttentionView(source, ids.to(source.device), token_decoder(tok), (layer, head, q))
