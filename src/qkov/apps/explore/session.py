"""Open a model for ``qkov explore``: any source qkov reads, its tokenizer, where results are kept on disk.

:func:`open_explorer` loads the source (:func:`qkov.io.sources.load_any`: a qkov checkpoint, a Hugging
Face directory, a TransformerLens file or a Hub name), builds its folded weights view on the device and
the :class:`~qkov.apps.explore.context.Explorer` every view reads. A model without a tokenizer accepts
token-id lists only (``codec`` is ``None``) and its tokens read ``<id>``.

The weights view (a folded copy: ~1 s and the model's size again at GPT-2 size) is built on a thread from the
moment the model is loaded (:class:`Session`), so the server starts, and the first page (which needs only the
model's shape) is served, without waiting for it; the first view that reads ``ex.weights`` waits for it.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch

from ...device import pick_device
from ...io.sources import load_any
from ...model.tokens import token_decoder
from ...weights.view import Weights
from ..inputs import analysis_inputs
from .context import Explorer
from .disk_cache import default_cache_dir, tensors_fingerprint

__all__ = ["DEFAULT", "fingerprint", "open_explorer", "Session"]

DEFAULT = "default"
"""``cache_dir=DEFAULT``: :func:`~qkov.apps.explore.disk_cache.default_cache_dir`."""


def open_explorer(
    source: Path | str,
    *,
    device: torch.device | str = "cpu",
    cache_dir: Path | str | None = DEFAULT,
    config: dict[str, Any] | Path | str | None = None,
    name: str | None = None,
    text: Path | str | None = None,
) -> Explorer:
    """The :class:`Explorer` over ``source``: the model (eval, on ``device``), its folded weights view, its
    tokenizer's codec and token strings, start token and context length.

    ``text``: a text file the heads table is measured on (``extra["text"]``), read here once to check it; without
    one, a qkov checkpoint's validation text or, for a model without a corpus, seeded random tokens (the
    table says which: :func:`qkov.apps.inputs.analysis_inputs`).

    ``cache_dir``: where once-per-model results are stored (``DEFAULT``: :func:`~qkov.apps.explore.disk_cache.default_cache_dir`;
    ``None``: nowhere; the folder is made only when something is written). ``config``: the TransformerLens
    config of a file that carries none. ``extra["source"]`` is the source as given.

    Raises:
        QkovError: the source cannot be read, the device is unusable, or the text cannot be read (it is
            missing, holds no tokens, or the model has no tokenizer); one line each.
    """
    dev = pick_device(device)
    model = load_any(source, config=config).to(dev).eval()
    if text is not None:  # bad text fails now, not when the page first asks for the heads table
        analysis_inputs(Path(str(source)), model, text=Path(text), batch=1)
    tokenizer = model.tokenizer
    folder = default_cache_dir() if cache_dir == DEFAULT else (None if cache_dir is None else Path(cache_dir))
    ex = Session(
        model=model,
        weights=None,  # type: ignore[arg-type]  (built next, on a thread)
        name=name or _name(source),
        decode=token_decoder(tokenizer),
        codec=None if tokenizer is None else model.codec,
        bos=int(model.bos_token_id),
        max_tokens=int(model.cfg.n_ctx),
        cache_dir=folder,
        extra={"source": str(source), **({} if text is None else {"text": str(text)})},
    )
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
        """Start building the folded weights view of ``self.model`` on ``device`` on a thread."""

        def build() -> None:
            try:
                self._weights = Weights.from_model(self.model, device=device)
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
    """The weights' content fingerprint (:func:`~qkov.apps.explore.disk_cache.tensors_fingerprint` of the
    model's parameters and buffers), computed once and kept in ``ex.extra["fingerprint"]``."""
    if "fingerprint" not in ex.extra:
        tensors = {k: v for k, v in ex.model.state_dict().items() if isinstance(v, torch.Tensor)}
        ex.extra["fingerprint"] = tensors_fingerprint(tensors)
    return str(ex.extra["fingerprint"])
