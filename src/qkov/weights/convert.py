"""What a user holds, made into what the analyses read: :func:`as_source` and :func:`source_bos`.

Every public analysis takes any of

* a weights source (:class:`~qkov.Weights`, :class:`~qkov.LazyCheckpoint`, or another object with
  the :class:`~qkov.weights.WeightSource` parts) — used as it is;
* a loaded model (:class:`~qkov.Transformer`, what :func:`qkov.load` / :func:`qkov.load_any` return) —
  read once into the default view, ``Weights.from_model(model)``;
* a path (``str`` or ``os.PathLike``) to a qkov checkpoint, a Hugging Face directory or a
  TransformerLens file — loaded with :func:`qkov.load_any`, then read into the default view;

and converts it once, with :func:`as_source`, at its entry. Anything else is a
:class:`~qkov.expect.SourceTypeError` (a ``TypeError`` and a :class:`~qkov.QkovError`) saying
what can be passed. The start token and the tokenizer travel with the source: a view made from a
model carries the model's ``bos_token_id`` and ``tokenizer``, and :func:`source_bos` is what every
analysis that builds or prepends a start token uses when the caller passes ``bos=None``.

**Which residual stream.** The default view of a LayerNorm model centres the writers (what
TransformerLens' processed default does, and exact for the model's function): its ``resid_*``,
``attn_out``, ``mlp_out``, ``embed`` and ``pos`` sites are the model's own minus their mean over
``d_model``. ``as_source(value, stream="model")`` reads a model or path with the writers left as
they are (``Weights.from_model(model, center_writing=False)``), so those sites hold the stream the
model itself computes (``transformers``' ``output_hidden_states``, an unprocessed TransformerLens model);
a weights source given as it is must already be uncentred. Without LayerNorm the two are the same.
"""

from __future__ import annotations

import os
from typing import Any, Union

from ..errors import QkovError
from ..expect import is_source, refuse_source
from ..io.sources import load_any
from ..model.transformer import Transformer
from .parts import WeightSource
from .view import Weights

__all__ = ["as_source", "source_bos", "source_tokenizer", "SourceLike", "stream_centring", "STREAMS", "vocab_and_bos"]

SourceLike = Union[WeightSource, Transformer, str, "os.PathLike[str]"]
"""What an analysis takes as its model: a weights source, a loaded model or a path (see the module docstring)."""


STREAMS: tuple[str | None, ...] = (None, "model")
"""What ``stream=`` takes: ``None`` (the default view: writers centred under LayerNorm) or ``"model"``
(the model's own residual stream); see the module docstring."""


def stream_centring(where: str, stream: str | None) -> bool | None:
    """The ``center_writing`` of :meth:`Weights.from_model` that ``stream`` asks for (``None``: the
    default; ``False`` for ``"model"``); anything but :data:`STREAMS` is a one-line error."""
    if stream not in STREAMS:
        raise QkovError(
            f"{where}: stream must be None (the default view) or 'model' (the model's own stream), got {stream!r}"
        )
    return False if stream == "model" else None


def as_source(value: Any, *, where: str = "qkov.as_source", stream: str | None = None) -> WeightSource:
    """``value`` as a weights source (see the module docstring): a source as it is, a
    :class:`~qkov.Transformer` as ``Weights.from_model(value)``, a path through :func:`qkov.load_any`.

    ``stream="model"``: a model or path is read with its writers uncentred (the model's own residual
    stream); a source given as it is must be uncentred already (else a :class:`QkovError` says how to
    make one). ``where`` names the calling function in the error for anything else."""
    centre = stream_centring(where, stream)
    if is_source(value):
        if centre is False and getattr(value, "centered_writing", False):
            raise QkovError(
                f"{where}: stream='model' needs uncentred writers, and this weights view centres them: pass the model "
                "itself, Weights.from_model(model, center_writing=False) or LazyCheckpoint(path, center_writing=False)"
            )
        return value  # type: ignore[no-any-return]
    if isinstance(value, Transformer):
        return Weights.from_model(value, center_writing=centre)
    if isinstance(value, (str, os.PathLike)):
        try:
            model = load_any(value)
        except QkovError as exc:  # "'x' does not exist" names no function: say which one was called
            raise QkovError(f"{where}: {exc}", hint=exc.hint) from None
        return Weights.from_model(model, center_writing=centre)
    refuse_source(where, value)
    raise AssertionError("unreachable")  # refuse_source always raises


def source_bos(where: str, source: Any, bos: int | None) -> int:
    """The start token to use: ``bos`` when given, else the source's own ``bos_token_id``.

    A source that carries none (an object built by hand) and no ``bos`` is a :class:`QkovError`
    naming the parameter to pass: a silent token 0 would be the wrong start token for most models."""
    if bos is not None:
        if not isinstance(bos, int) or isinstance(bos, bool) or bos < 0:
            raise QkovError(f"{where}: bos must be a token id (a non-negative integer), got {bos!r}")
        return bos
    own = getattr(source, "bos_token_id", None)
    if own is None:
        raise QkovError(f"{where}: this weights source carries no start token: pass bos=<token id>")
    return int(own)


def source_tokenizer(source: Any) -> Any:
    """The tokenizer that travels with ``source`` (a ``tokenizers.Tokenizer``), or ``None``."""
    return getattr(source, "tokenizer", None)


def vocab_and_bos(where: str, vocab: Any, bos: int | None) -> tuple[int, int]:
    """``(d_vocab, start token)`` for a token builder given a vocabulary size or a source.

    ``vocab`` is an ``int`` (then ``bos`` must be given: a bare size knows no start token) or
    anything :func:`as_source` takes (its ``d_vocab``, and its start token unless ``bos`` is given)."""
    if isinstance(vocab, int) and not isinstance(vocab, bool):
        if bos is None:
            raise QkovError(
                f"{where}: a vocabulary size carries no start token: pass bos=<token id>, or pass the model "
                "(or its weights) instead of its vocabulary size"
            )
        return vocab, source_bos(where, None, bos)
    holder = vocab if isinstance(vocab, Transformer) else as_source(vocab, where=where)
    return holder.cfg.d_vocab, source_bos(where, holder, bos)
