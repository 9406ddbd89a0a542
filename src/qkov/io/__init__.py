"""Models on disk and in other libraries.

* :mod:`~qkov.io.checkpoint` — qkov checkpoint directories (safetensors + JSON, no pickle):
  :func:`load`, :func:`save_checkpoint`, :func:`checkpoint_info`.
* :mod:`~qkov.io.manifest` — which files in a directory are qkov's (``.qkov-manifest.json``):
  qkov replaces or deletes only files it recorded there.
* :mod:`~qkov.io.tensorfile` — a safetensors file memory-mapped read-only, read tensor by tensor.
* :mod:`~qkov.io.tl` — TransformerLens objects and state-dict files (:func:`from_hooked`,
  :func:`to_hooked`, :func:`load_tl`, :func:`save_tl`).
* :mod:`~qkov.io.hf` — Hugging Face GPT-2 directories and objects (:func:`load_hf`,
  :func:`save_hf`, :func:`from_hf`, :func:`to_hf`).
* :mod:`~qkov.io.sources` — :func:`load_any`: any of the above, or a Hub name.

Every conversion is exact (the same function of the tokens, up to float rounding; tested
against the other library's own forward pass) or refused with a :class:`~qkov.QkovError`
naming the feature that has no exact counterpart. The peer libraries are optional and are
imported only by the functions that build their objects. Every file is written atomically
(:mod:`~qkov.io.atomic`).
"""

from .checkpoint import checkpoint_info, save_checkpoint
from .hf import from_hf, load_hf, save_hf, to_hf
from .sources import load, load_any, source_kind
from .tl import from_hooked, load_tl, save_tl, to_hooked

__all__ = [
    "checkpoint_info",
    "from_hf",
    "from_hooked",
    "load",
    "load_any",
    "load_hf",
    "load_tl",
    "save_checkpoint",
    "save_hf",
    "save_tl",
    "source_kind",
    "to_hf",
    "to_hooked",
]
