"""What every view of ``qkov explore`` reads: the model being explored (:class:`Explorer`) and the one
error a view raises for a bad request (:class:`BadRequest`).

A view is a function ``view(ex, args, progress) -> dict``: ``ex`` is the server's :class:`Explorer`,
``args`` the request's JSON object (validated by the view itself), ``progress`` the library's progress
protocol ``(what, done, total)``; calling it may raise :class:`Cancelled` when the page cancelled the
job. The returned dict is JSON-ready (numbers, strings, lists, dicts; token strings raw, never HTML).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ...analysis.forward.address import as_head
from ...errors import QkovError
from ...finite import rounded
from ...model.tokens import TextCodec
from ...model.transformer import Transformer
from ...model.config import ModelConfig
from ...weights.parts import WeightSource

__all__ = ["BadRequest", "Cancelled", "Explorer", "r6"]


def r6(x: float) -> float | None:
    """``x`` to 6 significant digits, ``None`` when not finite (:func:`qkov.finite.rounded`): what the
    explorer's pages show and its JSON carries."""
    return rounded(x, 6)


class BadRequest(QkovError):
    """A request the explorer cannot answer (unknown head, text too long, malformed argument): the
    server answers 400 (404 with ``status=404``) and the one-line message as JSON ``{"error": ...}``."""

    def __init__(self, message: str, *, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class Cancelled(Exception):
    """Raised inside a view (by its progress callback) when the page cancelled its job."""


@dataclass
class Explorer:
    """The model being explored and what every view needs about it.

    ``model`` is the loaded model while its folded weights view is being built (its shape, for the first page;
    ``None`` once the view is there, and for a model read from disk); ``weights`` is what every view reads (texts
    run on it: :func:`qkov.trace`): the folded weights view in memory, or a memory-mapped
    :class:`~qkov.weights.LazyCheckpoint` whose layers each view reads as it needs them (:attr:`streamed`);
    ``decode(id) -> str`` is one token's string; ``codec`` the
    model's :class:`~qkov.model.tokens.TextCodec` (texts to ids with one start token, words to tokens;
    ``None``: the model has no tokenizer, only token ids are accepted); ``bos`` the start token; ``max_tokens`` the longest text accepted (the model's context);
    ``cache_dir`` where results computed once per model are kept on disk (``None``: nowhere)."""

    model: Transformer | None
    weights: WeightSource
    name: str
    decode: Callable[[int], str]
    codec: TextCodec | None
    bos: int
    max_tokens: int
    cache_dir: Path | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def cfg(self) -> ModelConfig:
        """The model's shape as every analysis (and the weights view) sees it: a looped model unrolled into
        its effective layers. Read from the model while there is one, so it waits for no weights view (built in
        the background)."""
        model = self.model
        return model.cfg.unrolled() if model is not None else self.weights.cfg

    @property
    def streamed(self) -> bool:
        """Whether the weights stay on disk (a memory-mapped source read layer by layer as each view needs
        it) rather than in memory. Never waits for a view being built."""
        return self.model is None and not getattr(self.weights, "in_memory", True)

    def tokens(self, args: dict[str, Any], key: str = "text") -> torch.Tensor:
        """The request's text (``args[key]``: a string, encoded by :attr:`codec` with its one start
        token; or a list of token ids, taken as given) as ``[1, seq]`` ids, checked against the vocabulary and ``max_tokens``.

        Raises:
            BadRequest: missing, empty, of the wrong type, too long, or an id out of range.
        """
        value = args.get(key)
        if isinstance(value, str):
            if not value:
                raise BadRequest(f"{key!r} is empty: type some text")
            if self.codec is None:
                raise BadRequest(f"this model has no tokenizer: send {key!r} as a list of token ids")
            ids = self.codec.encode(value)
        elif isinstance(value, list) and value and all(isinstance(i, int) and not isinstance(i, bool) for i in value):
            ids = list(value)
        else:
            raise BadRequest(f"{key!r} must be a non-empty string or a list of token ids")
        if len(ids) > self.max_tokens:
            raise BadRequest(f"{key!r} is {len(ids)} tokens; this model reads at most {self.max_tokens}")
        d_vocab = self.cfg.d_vocab
        bad = [i for i in ids if not 0 <= i < d_vocab]
        if bad:
            raise BadRequest(f"{key!r}: token id {bad[0]} out of range [0, {d_vocab})")
        return torch.tensor([ids], dtype=torch.long)

    def head(self, args: dict[str, Any], key: str = "head") -> tuple[int, int]:
        """``args[key]`` (``"L.H"``, or ``[L, H]``) as ``(layer, head)``.

        Raises:
            BadRequest: malformed (400) or no such head in this model (404).
        """
        try:
            head = as_head(args.get(key), what=repr(key))
        except QkovError as exc:
            raise BadRequest(str(exc)) from None
        try:
            head.check(self.cfg, repr(key))
        except QkovError as exc:
            raise BadRequest(str(exc), status=404) from None
        return head.layer, head.head  # type: ignore[return-value]
