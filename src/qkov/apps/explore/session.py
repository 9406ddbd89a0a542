"""Open a model for ``qkov explore``: any source qkov reads, its tokenizer, where results are kept on disk.

:func:`open_explorer` opens the source one of two ways and builds the
:class:`~qkov.apps.explore.context.Explorer` every view reads. A model without a tokenizer accepts token-id
lists only (``codec`` is ``None``) and its tokens read ``<id>``.

* **In memory** (the default up to :data:`~qkov.weights.lazy.AUTO_LAZY_BYTES` of weights): the source is
  loaded (:func:`qkov.io.sources.load_any`: a qkov checkpoint, a Hugging Face directory, a TransformerLens
  file or a Hub name) and its folded weights view built on a thread (:class:`Session`: ~1 s at GPT-2 size),
  so the server starts, and the first page (which needs only the model's shape) is served, without waiting
  for it; the first view that reads ``ex.weights`` waits for it. Once the view is there the loaded model is
  dropped: the session holds one folded copy of the weights.
* **Streamed** (a larger qkov checkpoint or Hugging Face directory of a family qkov streams, or when asked):
  the weights stay in the memory-mapped file (:class:`~qkov.weights.LazyCheckpoint`, opened from its
  headers in well under a second); each view reads the layers it needs as it runs (a text runs layer by
  layer, a pattern reads layers up to its own, a head card one head's weights and the vocabulary in
  blocks), so the session holds no copy of the weights. Views that would run the model many times over
  say so in one line (:data:`~qkov.apps.explore.views.IN_MEMORY_VIEWS`), and a text is at most
  :func:`streamed_tokens` tokens (its logits' size).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch

from ...device import pick_device
from ...errors import QkovError
from ...io.sources import load_any
from ...model.config import ModelConfig
from ...model.tokens import source_codec, token_decoder
from ...weights.lazy import LazyCheckpoint, streamable, streams_by_default
from ...weights.view import Weights
from ..inputs import analysis_inputs
from .context import BadRequest, Explorer
from .disk_cache import default_cache_dir, tensors_fingerprint

__all__ = ["DEFAULT", "fingerprint", "open_explorer", "Session", "STREAMED_LOGITS_BYTES", "streamed_tokens"]

DEFAULT = "default"
"""``cache_dir=DEFAULT``: :func:`~qkov.apps.explore.disk_cache.default_cache_dir`."""
STREAMED_LOGITS_BYTES = 512 * 2**20
"""The most one text's float32 logits ``[seq, d_vocab]`` may take in a streamed session (it bounds the text)."""


def streamed_tokens(cfg: ModelConfig) -> int:
    """The longest text a streamed session reads: its context, or fewer so that the text's float32 logits take
    at most :data:`STREAMED_LOGITS_BYTES` (1,046 tokens at Llama-3's vocabulary of 128,256)."""
    return max(2, min(cfg.n_ctx, STREAMED_LOGITS_BYTES // (4 * cfg.d_vocab)))


def open_explorer(
    source: Path | str,
    *,
    device: torch.device | str = "cpu",
    cache_dir: Path | str | None = DEFAULT,
    config: dict[str, Any] | Path | str | None = None,
    name: str | None = None,
    text: Path | str | None = None,
    lazy: bool | None = None,
) -> Explorer:
    """The :class:`Explorer` over ``source`` (module docstring): in memory (the model, eval, on ``device``, then
    its folded weights view) or streamed from its memory map, with its tokenizer's codec and token strings,
    start token and longest text.

    ``lazy``: ``True`` streams the weights from disk (a qkov checkpoint or a Hugging Face directory of a family
    qkov streams); ``False`` loads them; ``None`` (default) streams exactly when the weights are larger than
    :data:`~qkov.weights.lazy.AUTO_LAZY_BYTES` (:func:`~qkov.weights.lazy.streams_by_default`, the rule every
    command follows).

    ``text``: a text file the heads table is measured on (``extra["text"]``), read here once to check it; without
    one, a qkov checkpoint's validation text or, for a model without a corpus, seeded random tokens (the
    table says which: :func:`qkov.apps.inputs.analysis_inputs`).

    ``cache_dir``: where once-per-model results are stored (``DEFAULT``: :func:`~qkov.apps.explore.disk_cache.default_cache_dir`;
    ``None``: nowhere; the folder is made only when something is written). ``config``: the TransformerLens
    config of a file that carries none. ``extra["source"]`` is the source as given.

    Raises:
        QkovError: the source cannot be read (or streamed, with ``lazy=True``), the device is unusable, or the
            text cannot be read (it is missing, holds no tokens, or the model has no tokenizer); one line each.
    """
    dev = pick_device(device)
    streamed = streams_by_default(source) if lazy is None else lazy
    if streamed and not streamable(source):
        raise QkovError(
            f"{str(source)!r} cannot be streamed from disk: a qkov checkpoint or a Hugging Face directory of a "
            "family qkov streams can (convert the model to a qkov checkpoint first)"
        )
    model = None if streamed else load_any(source, config=config).to(dev).eval()
    opened: Any = LazyCheckpoint(source, device=dev) if streamed else model  # the headers only
    if text is not None:  # bad text fails now, not when the page first asks for the heads table
        analysis_inputs(Path(str(source)), opened, text=Path(text), batch=1)
    tokenizer = opened.tokenizer
    cfg: ModelConfig = opened.cfg
    folder = default_cache_dir() if cache_dir == DEFAULT else (None if cache_dir is None else Path(cache_dir))
    ex = Session(
        model=model,
        weights=opened if streamed else None,  # type: ignore[arg-type]  (in memory: built next, on a thread)
        name=name or _name(source),
        decode=token_decoder(tokenizer),
        codec=None if tokenizer is None else source_codec(opened),
        bos=int(opened.bos_token_id),
        max_tokens=streamed_tokens(cfg) if streamed else int(cfg.n_ctx),
        cache_dir=folder,
        extra={"source": str(source), **({} if text is None else {"text": str(text)})},
    )
    if not streamed:
        ex.build_weights(dev)
    return ex


class Session(Explorer):
    """An :class:`Explorer` whose ``weights`` are built on a thread (:meth:`build_weights`); reading them
    waits until they are there (and raises what building them raised)."""

    @property  # type: ignore[override]
    def weights(self) -> Weights:
        self._ready.wait()
        if self._failed is not None:
            raise self._failed
        return self._weights

    @weights.setter
    def weights(self, value: Weights | None) -> None:
        self._weights, self._failed = value, None
        self._ready = threading.Event()
        if value is not None:
            self._ready.set()

    def build_weights(self, device: torch.device) -> None:
        """Start building the folded weights view of ``self.model`` on ``device`` on a thread; once it is
        built the model is dropped (the view holds everything the views read: one copy of the weights)."""

        def build() -> None:
            try:
                self._weights = Weights.from_model(self.model, device=device)  # type: ignore[arg-type]
                self._ready.set()  # the view first: ``cfg`` reads the model until it is gone
                self.model = None
            except BaseException as exc:  # kept, and raised where the weights are read
                self._failed = exc
            finally:
                self._ready.set()

        # not a daemon: the interpreter waits for it at exit (torch aborts the process, "terminate called
        # without an active exception", when a daemon thread is still inside it at shutdown)
        self._thread = threading.Thread(target=build, name="qkov-explore-weights", daemon=False)
        self._thread.start()

    def settle(self) -> None:
        """Wait for the weights' thread to end (before the process exits: torch must not be stopped mid-work)."""
        self._ready.wait()


def _name(source: Path | str) -> str:
    path = Path(source)
    return path.name or str(source)


def fingerprint(ex: Explorer) -> str:
    """The weights' content fingerprint (:func:`~qkov.apps.explore.disk_cache.tensors_fingerprint` of the folded
    weights view's tensors), computed once and kept in ``ex.extra["fingerprint"]``.

    Raises:
        BadRequest: the session streams its weights from disk (hashing them would read them all).
    """
    if "fingerprint" not in ex.extra:
        w = ex.weights
        if not isinstance(w, Weights):
            raise BadRequest("this model is read from disk layer by layer: its weights are not fingerprinted")
        tensors = {f: v for f, v in vars(w).items() if isinstance(v, torch.Tensor)}
        tensors |= {f"bus.{k}": v for k, v in (w.bus or {}).items()}  # a routed model's residual bus
        ex.extra["fingerprint"] = tensors_fingerprint(tensors)
    return str(ex.extra["fingerprint"])
