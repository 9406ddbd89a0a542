"""Bigger-than-memory weights: a checkpoint read layer by layer from a read-only memory map.

:class:`LazyCheckpoint` is a :class:`~qkov.weights.WeightSource` over ``model.safetensors``
(:class:`qkov.io.tensorfile.TensorFile`): each request copies out exactly the bytes it needs
— one layer's attention weights, one head's slice, a block of ``W_E``'s rows or ``W_U``'s
columns — folds LayerNorm into them (:func:`qkov.weights.parts.fold_reader`, the code
:meth:`Weights.fold_ln` uses, applied one layer at a time, which is exact: every reader column
folds on its own) and moves them to the requested device and dtype. MLP weights are read
only when asked for (attention analyses never do). Nothing is cached: the caller decides
what stays in memory.

LayerNorm (or RMSNorm) is always folded, and by default the writers of a LayerNorm model and
the unembedding are centred: the view :meth:`Weights.from_model` gives by default. Each writer
row centres on its own; centring ``W_U`` needs its mean over the whole vocabulary, taken once
in blocks of columns.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar

import torch
from torch import Tensor

from ..errors import QkovError
from ..expect import expect_path
from ..io.checkpoint import MODEL_FILE, TOKENIZER_FILE, read_config, read_tokenizer
from ..io.hf_families import FAMILIES, prepends_start, start_token
from ..io.hf_store import HFStore
from ..io.plausible import check_shapes
from ..io.sources import hf_model_type, source_kind
from ..io.tensorfile import TensorFile
from ..model.config import ModelConfig
from ..model.ops import expand_kv as expand
from .parts import AttentionWeights, MLPWeights, Unembedding, check_head, fold_reader, writer_centring

__all__ = ["AUTO_LAZY_BYTES", "LazyCheckpoint", "streamable", "streams_by_default", "weights_bytes"]

_BLOCK = 1 << 24  # values per block where a whole-tensor temporary would double the memory
AUTO_LAZY_BYTES = 1 << 30  # the CLI streams a checkpoint whose model.safetensors is larger than this


def streamable(path: Path | str) -> bool:
    """Whether :class:`LazyCheckpoint` reads ``path``: a qkov checkpoint, or a Hugging Face directory of one
    of :data:`~qkov.io.hf_families.FAMILIES` (GPT-2's is loaded whole)."""
    kind = source_kind(path)
    return kind == "qkov" or (kind == "hf" and hf_model_type(path) in FAMILIES)


def weights_bytes(path: Path | str) -> int:
    """The size of a checkpoint directory's weights: its ``*.safetensors`` files (0 for anything else)."""
    folder = Path(path)
    return sum(f.stat().st_size for f in folder.glob("*.safetensors")) if folder.is_dir() else 0


def streams_by_default(path: Path | str) -> bool:
    """Whether ``path`` is read layer by layer unless told otherwise: :func:`streamable` and its weights
    larger than :data:`AUTO_LAZY_BYTES`."""
    return streamable(path) and weights_bytes(path) > AUTO_LAZY_BYTES


def _config_json(path: Path) -> dict:  # type: ignore[type-arg]
    """A qkov checkpoint's config (checked), or a Hugging Face directory's ``config.json``."""
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raw = None
    if isinstance(raw, dict) and "model_type" in raw and "model" not in raw:
        return raw
    return read_config(path)


class LazyCheckpoint:
    """A checkpoint directory whose weights are read layer by layer, on demand (a
    :class:`~qkov.weights.WeightSource`).

    The header is checked against ``config.json`` on opening (every tensor present with the
    shape the config implies, nothing unexpected); each tensor read is checked for NaN/inf.
    Every getter returns new tensors on ``device`` in ``dtype``; nothing is cached, so
    the caller decides what stays in memory.
    """

    def __init__(
        self,
        path: Path | str,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        center_writing: bool | None = None,
        center_unembed: bool = True,
    ):
        """``path``: a qkov checkpoint, or a GPT-NeoX / Llama / Mistral / Qwen2 Hugging Face
        directory (read under qkov's names by :class:`~qkov.io.hf_store.HFStore`).
        ``center_writing`` and ``center_unembed`` as :meth:`Weights.from_model`'s (same defaults)."""
        expect_path("qkov.LazyCheckpoint", path)
        self.path = Path(path)
        self.dtype, self.device = dtype, torch.device(device)
        data = _config_json(self.path)
        self.file: TensorFile | HFStore
        if "model" in data:
            self.cfg = ModelConfig.from_dict(data["model"])
            tok_info = data.get("tokenizer") or {}
            self.bos_token_id = int(tok_info.get("bos_token_id", 0))
            self.default_prepend_bos = bool(tok_info.get("default_prepend_bos", True))
            weights_path = self.path / MODEL_FILE
            if not weights_path.is_file():
                raise QkovError(f"checkpoint {str(self.path)!r} has no {MODEL_FILE}")
            self.file = TensorFile(weights_path)
            where = str(weights_path)
        else:
            self.file = HFStore(self.path, data)
            self.cfg = self.file.cfg
            where = f"Hugging Face model {str(self.path)!r}"
            self.bos_token_id = start_token(data, self.cfg.d_vocab, where)
        self.tokenizer = read_tokenizer(self.path / TOKENIZER_FILE, where=where)  # None when there is none
        if "model" not in data:
            self.default_prepend_bos = prepends_start(data, self.tokenizer)
        self.centered_writing = writer_centring(self.cfg, center_writing)
        self.centered_unembed = center_unembed
        self._unembed_mean: tuple[Tensor, Tensor] | None = None
        self._check_header(where)
        self.stored_layers = self.cfg.n_layers  # a looped model's blocks as stored; the view is unrolled
        self.cfg = self.cfg.unrolled()
        # a routed model's residual-bus parameters (small: read once), None for the plain sum
        bus = {name[4:]: self._get(name) for name in self.file.entries if name.startswith("bus.")}
        self.bus = bus or None

    in_memory: ClassVar[bool] = False

    def _check_header(self, where: str) -> None:
        check_shapes(self.cfg, {name: self.file.shape(name) for name in self.file.entries}, where)

    # ------------------------------------------------------------------ reading
    @property
    def layernorm(self) -> bool:
        """Whether the model normalises (LayerNorm or RMSNorm): its gains are folded into the readers."""
        return self.cfg.normalization != "none"

    @property
    def norm(self) -> str:
        """``folded`` for a LayerNorm model, ``scale`` for an RMSNorm one (always folded here), else ``none``."""
        return {"layernorm": "folded", "rmsnorm": "scale"}.get(self.cfg.normalization, "none")

    def _ln(self, name: str) -> tuple[Tensor, Tensor | None]:
        """A normalisation's gain and bias (``None`` for RMSNorm, which has none)."""
        bias = self._get(name + ".b") if self.cfg.normalization == "layernorm" else None
        return self._get(name + ".w"), bias

    def _get(self, name: str, index: int | slice | None = None, cols: slice | None = None) -> Tensor:
        t = self.file.read(name, index, cols).to(device=self.device, dtype=self.dtype)
        # a finite sum means every value is finite (a NaN or an infinity makes it NaN or infinite): one pass,
        # no mask; only a sum that is not (a NaN, or finite values overflowing it) is looked at value by value
        if not bool(t.sum().isfinite()) and not all(bool(part.isfinite().all()) for part in t.reshape(-1).split(_BLOCK)):
            raise QkovError(f"{self.file.path}: {name} holds NaN or infinite values")
        return t

    def _get_or_zeros(self, name: str, shape: tuple[int, ...]) -> Tensor:
        if name in self.file.entries:
            return self._get(name)
        return torch.zeros(shape, device=self.device, dtype=self.dtype)

    def _writer(self, t: Tensor) -> Tensor:
        """A freshly read writer, centred in place when centring (no second copy of, say, ``W_E``)."""
        return t.sub_(t.mean(dim=-1, keepdim=True)) if self.centered_writing else t

    def embed(self, rows: slice | None = None) -> Tensor:
        """``W_E [d_vocab, d_model]``, or the block ``rows`` of it."""
        return self._writer(self._get("W_E", rows))

    def pos(self) -> Tensor | None:
        """``W_pos [n_ctx, d_model]``, or ``None`` for a model without positional embeddings."""
        if self.cfg.positional not in ("standard", "shortformer"):
            return None
        pos = self._get("W_pos")
        return self._writer(pos) if self.layernorm or self.cfg.positional == "standard" else pos

    def unembed(self, cols: slice | None = None) -> Unembedding:
        """``W_U [d_model, v]`` and ``b_U [v]`` (all ``d_vocab`` columns, or the block ``cols``),
        the final LayerNorm folded in and the vocabulary mean removed when centring."""
        part = self._unembed_folded(cols)
        if not self.centered_unembed:
            return part
        if self._unembed_mean is None:  # one pass over blocks of columns: the mean over the vocabulary
            V, step = self.cfg.d_vocab, max(1, _BLOCK // self.cfg.d_model)
            W_sum = torch.zeros(self.cfg.d_model, device=self.device, dtype=torch.float64)
            b_sum = torch.zeros((), device=self.device, dtype=torch.float64)
            for lo in range(0, V, step):
                block = self._unembed_folded(slice(lo, min(V, lo + step)))
                W_sum += block.W_U.sum(-1, dtype=torch.float64)
                b_sum += block.b_U.sum(dtype=torch.float64)
            self._unembed_mean = ((W_sum / V).to(self.dtype), (b_sum / V).to(self.dtype))
        W_mean, b_mean = self._unembed_mean
        return Unembedding(part.W_U.sub_(W_mean[:, None]), part.b_U.sub_(b_mean))  # freshly read: in place

    def _unembed_folded(self, cols: slice | None = None) -> Unembedding:
        """``W_U``/``b_U`` with the final LayerNorm folded in (in blocks of columns: no full-size temporaries)."""
        V = self.cfg.d_vocab
        if cols is None and self.layernorm and V > _BLOCK // self.cfg.d_model:
            W = torch.empty(self.cfg.d_model, V, device=self.device, dtype=self.dtype)
            b = torch.empty(V, device=self.device, dtype=self.dtype)
            step = _BLOCK // self.cfg.d_model
            for lo in range(0, V, step):
                block = slice(lo, min(V, lo + step))
                part = self._unembed_folded(cols=block)
                W[:, block], b[block] = part.W_U, part.b_U
            return Unembedding(W, b)
        W = self._get("W_U", cols=cols)
        b = self._get("b_U", cols=cols) if "b_U" in self.file.entries else W.new_zeros(W.shape[1])
        if self.layernorm:
            W, b = fold_reader(W, b, *self._ln("ln_final"), read_dim=0, inplace=True)  # freshly read: no copy
        return Unembedding(W, b)

    def attention(self, layer: int, head: int | None = None, *, expand_kv: bool = True) -> AttentionWeights:
        """Layer ``layer``'s attention (every head, or only ``head``: leading dim 1), ln1 folded.
        Grouped-query keys and values are read once per key/value head (and repeated for the
        query heads of its group, for this read only, unless ``expand_kv=False``)."""
        check_head(self.cfg, layer, head)
        c = self.cfg
        h = c.n_heads if head is None else 1
        group = c.n_heads // c.kv_heads
        block = layer % self.stored_layers  # a looped model's effective layer runs this stored block
        pre = f"blocks.{block}.attn."

        def get(name: str, shape: tuple[int, ...]) -> Tensor:
            if pre + name not in self.file.entries:
                return torch.zeros(shape, device=self.device, dtype=self.dtype)
            shared = name[-1] in "KV" and group > 1
            if head is not None:
                return self._get(pre + name, head // group if shared else head)[None]
            t = self._get(pre + name)
            return expand(t, group) if shared and expand_kv else t

        D, E = c.d_model, c.d_head
        kv = c.kv_heads if head is None and not expand_kv else h
        W = {n: get(f"W_{n}", (h if n == "Q" else kv, D, E)) for n in "QKV"}
        b = {n: get(f"b_{n}", (h if n == "Q" else kv, E)) for n in "QKV"}
        G = c.gate_width
        gate = ("G",) if G else ()  # the gate reads what W_Q reads: read and folded as W_Q is
        for n in gate:
            W[n], b[n] = get("W_G", (h, D, G)), get("b_G", (h, G))
        if self.layernorm:
            g, beta = self._ln(f"blocks.{block}.ln1")
            for n in ("Q", "K", "V", *gate):
                W[n], b[n] = fold_reader(W[n], b[n], g, beta, read_dim=1, inplace=True)
        b_O = self._writer(self._get_or_zeros(pre + "b_O", (D,)))
        W_O = self._writer(get("W_O", (h, E, D)))
        extra = {"W_G": W["G"], "b_G": b["G"]} if G else {}
        return AttentionWeights(W["Q"], W["K"], W["V"], W_O, b["Q"], b["K"], b["V"], b_O, **extra)

    def mlp(self, layer: int) -> MLPWeights | None:
        """Layer ``layer``'s MLP, ln2 folded into ``W_in``/``b_in``; ``None`` for an attention-only model."""
        check_head(self.cfg, layer)
        M, D = self.cfg.d_mlp, self.cfg.d_model
        if M is None:
            return None
        block = layer % self.stored_layers
        pre = f"blocks.{block}.mlp."
        W_in, b_in = self._get(pre + "W_in"), self._get_or_zeros(pre + "b_in", (M,))
        gated = self.cfg.gated_mlp
        W_gate = self._get(pre + "W_gate") if gated else None
        b_gate = self._get_or_zeros(pre + "b_gate", (M,)) if gated else None
        if self.layernorm:
            g, beta = self._ln(f"blocks.{block}.ln2")
            W_in, b_in = fold_reader(W_in, b_in, g, beta, read_dim=0, inplace=True)
            if W_gate is not None:
                W_gate, b_gate = fold_reader(W_gate, b_gate, g, beta, read_dim=0, inplace=True)  # type: ignore[arg-type]
        W_out, b_out = self._writer(self._get(pre + "W_out")), self._writer(self._get_or_zeros(pre + "b_out", (D,)))
        return MLPWeights(W_in, b_in, W_out, b_out, W_gate=W_gate, b_gate=b_gate)
