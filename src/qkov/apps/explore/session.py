"""Open a model for ``qkov explore``: any source qkov reads, its tokenizer, where results are kept on disk.

:func:`open_explorer` loads the source (:func:`qkov.io.sources.load_any`: a qkov checkpoint, a Hugging
Face directory, a TransformerLens file or a Hub name), builds its folded weights view on the device and
the :class:`~qkov.apps.explore.context.Explorer` every view reads. A model without a tokenizer accepts
token-id lists only (``encode`` is ``None``) and its tokens read ``<id>``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ...device import pick_device
from ...io.sources import load_any
from ...model.tokens import token_decoder
from ...weights.view import Weights
from .context import Explorer
from .disk_cache import default_cache_dir, tensors_fingerprint

DEFAULT = "default"
"""``cache_dir=DEFAULT``: :func:`~qkov.apps.explore.disk_cache.default_cache_dir`."""


def open_explorer(
    source: Path | str,
    *,
    device: torch.device | str = "cpu",
    cache_dir: Path | str | None = DEFAULT,
    config: dict[str, Any] | Path | str | None = None,
    name: str | None = None,
) -> Explorer:
    """The :class:`Explorer` over ``source``: the model (eval, on ``device``), its folded weights view, its
    tokenizer's ``encode``/``decode``, start token and context length.

    ``cache_dir``: where once-per-model results are stored (``DEFAULT``: ``$XDG_CACHE_HOME/qkov/explore``;
    ``None``: nowhere; the folder is made only when something is written). ``config``: the TransformerLens
    config of a file that carries none. ``extra["source"]`` is the source as given.

    Raises:
        QkovError: the source cannot be read, or the device is unusable (one line each).
    """
    dev = pick_device(device)
    model = load_any(source, config=config).to(dev).eval()
    weights = Weights.from_model(model, device=dev)
    tokenizer = model.tokenizer
    encode = None if tokenizer is None else (lambda text: list(tokenizer.encode(text).ids))
    folder = default_cache_dir() if cache_dir == DEFAULT else (None if cache_dir is None else Path(cache_dir))
    return Explorer(
        model=model,
        weights=weights,
        name=name or _name(source),
        decode=token_decoder(tokenizer),
        encode=encode,
        bos=int(model.bos_token_id),
        max_tokens=int(model.cfg.n_ctx),
        cache_dir=folder,
        extra={"source": str(source)},
    )


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
