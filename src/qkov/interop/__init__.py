"""Import models into qkov and export them: TransformerLens and Hugging Face GPT-2.

* :func:`load_any` — any source: a qkov checkpoint, a Hugging Face GPT-2 directory, a
  TransformerLens state-dict file, or a Hub name (when a network or the local cache has it).
* :func:`from_hooked` / :func:`to_hooked` — TransformerLens ``HookedTransformer`` objects
  (and, for import, ``TransformerBridge``).
* :func:`load_tl` / :func:`save_tl` — TransformerLens state-dict files plus config
  (``.pt`` read with ``weights_only=True``, or ``.safetensors``).
* :func:`load_hf` / :func:`save_hf` — Hugging Face GPT-2 directories (safetensors + JSON;
  reading one needs neither ``transformers`` nor pickle).
* :func:`from_hf` / :func:`to_hf` — ``transformers`` ``GPT2LMHeadModel`` objects.

Every conversion is exact (the same function of the tokens, up to float rounding; tested
against the other library's own forward pass) or refused with a :class:`~qkov.QkovError`
naming the feature that has no exact counterpart. The peer libraries are optional and are
imported only by the functions that build their objects.
"""

from .hf import from_hf, load_hf, save_hf, to_hf
from .sources import load_any, source_kind
from .tl import from_hooked, load_tl, save_tl, to_hooked

__all__ = [
    "from_hf",
    "from_hooked",
    "load_any",
    "load_hf",
    "load_tl",
    "save_hf",
    "save_tl",
    "source_kind",
    "to_hf",
    "to_hooked",
]
