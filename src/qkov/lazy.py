"""Bigger-than-memory weights: a checkpoint's tensors read on demand from a read-only memory map.

:class:`LazyCheckpoint` opens ``model.safetensors`` without loading it: the file is
mapped read-only and shared (``mmap`` with ``PROT_READ``, ``MAP_SHARED``), so its pages
belong to the page cache, never to the process's private memory, and the kernel can drop
them at any time. Each request copies out exactly the bytes it needs — one layer's
attention weights, one head's slice, a block of ``W_U``'s columns — folds LayerNorm into
them (:func:`qkov.weights.fold_reader`, the code :meth:`Weights.fold_ln` uses, applied
one layer at a time, which is exact: every reader column folds on its own) and moves
them to the requested device and dtype. MLP weights are read only when asked for
(attention analyses never do). Pages touched while copying are released from the
process right after (``MADV_DONTNEED``), so resident memory stays the tensors held.

LayerNorm is always folded (the view :meth:`Weights.from_model` gives by default); the
optional centring of writers and of the unembedding is not offered here. The analyses
that stream layers live in :mod:`qkov.lazy_circuits`.

The safetensors format is read directly: an 8-byte little-endian header length, a JSON
header ``{name: {"dtype", "shape", "data_offsets": [begin, end]}}`` and the raw
little-endian data. (``safetensors.safe_open`` maps the file private and writable, which
counts the whole file against a data-size limit such as ``RLIMIT_DATA``.)
"""

from __future__ import annotations

import json
import mmap
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from .checkpoint import MODEL_FILE, read_config
from .config import ModelConfig
from .errors import QkovError
from .weights import Weights, fold_reader

_DTYPES: dict[str, tuple[type, torch.dtype | None]] = {
    "F64": (np.float64, None),
    "F32": (np.float32, None),
    "F16": (np.float16, None),
    "BF16": (np.uint16, torch.bfloat16),  # numpy has no bfloat16: read the bits, view them in torch
}
_PAGE = mmap.PAGESIZE
_BLOCK = 1 << 24  # values per block where a whole-tensor temporary would double the memory
AUTO_LAZY_BYTES = 1 << 30  # the CLI streams a checkpoint whose model.safetensors is larger than this


class TensorFile:
    """A safetensors file mapped read-only; :meth:`read` copies one tensor (or a slice) out.

    ``reads`` counts the tensors read by name and ``bytes_read`` the bytes copied, so a
    caller (or a test) can check what a computation touched.
    """

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        where = f"{str(self.path)!r}"
        try:
            with open(self.path, "rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                n = int.from_bytes(fh.read(8), "little") if size >= 8 else -1
                if not 2 <= n <= size - 8:
                    raise QkovError(f"{where} is not a safetensors file (bad header length)")
                header = json.loads(fh.read(n))
                self._map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as exc:
            raise QkovError(f"cannot read {where} ({exc.strerror})") from None
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise QkovError(f"{where} is not a safetensors file (header: {exc})") from None
        if not isinstance(header, dict):
            raise QkovError(f"{where} is not a safetensors file (header is not an object)")
        header.pop("__metadata__", None)
        self.entries: dict[str, tuple[str, tuple[int, ...], int]] = {}  # name -> (dtype, shape, absolute offset)
        for name, info in header.items():
            try:
                dt, shape, (begin, end) = info["dtype"], tuple(int(s) for s in info["shape"]), info["data_offsets"]
            except (TypeError, KeyError, ValueError):
                raise QkovError(f"{where}: malformed header entry for {name!r}") from None
            if dt not in _DTYPES:
                raise QkovError(f"{where}: {name} has dtype {dt}; supported: {', '.join(_DTYPES)}")
            nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(_DTYPES[dt][0]).itemsize
            if end - begin != nbytes or begin < 0 or 8 + n + end > size:
                raise QkovError(f"{where} is truncated or corrupt ({name} does not fit its shape or the file)")
            self.entries[name] = (dt, shape, 8 + n + begin)
        self.reads: Counter[str] = Counter()
        self.bytes_read = 0

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name][1]

    def read(self, name: str, index: int | slice | None = None, cols: slice | None = None) -> Tensor:
        """Tensor ``name`` as a new CPU tensor: all of it, its ``index``-th entry (or a ``lo:hi``
        block of entries) along dim 0, and/or a block ``cols`` of its last dim. Only the bytes
        needed are copied."""
        dt, shape, offset = self.entries[name]
        np_dtype, torch_view = _DTYPES[dt]
        item = np.dtype(np_dtype).itemsize
        if index is not None:  # entries of the leading dim: a contiguous block
            inner = int(np.prod(shape[1:], dtype=np.int64))
            lo, hi = (index, index + 1) if isinstance(index, int) else (index.start, index.stop)
            offset = offset + lo * inner * item
            shape = shape[1:] if isinstance(index, int) else (hi - lo, *shape[1:])
        count = int(np.prod(shape, dtype=np.int64))
        view = np.frombuffer(self._map, dtype=np_dtype, count=count, offset=offset).reshape(shape)
        part = view[..., cols] if cols is not None else view
        out = torch.from_numpy(np.array(part))  # the copy: the tensor owns its memory
        del view, part
        start = offset // _PAGE * _PAGE  # drop the touched pages from this process (page cache keeps them)
        self._map.madvise(mmap.MADV_DONTNEED, start, offset + count * item - start)
        self.reads[name] += 1
        self.bytes_read += out.numel() * item
        return out.view(torch_view) if torch_view is not None else out


@dataclass(frozen=True)
class Attention:
    """One layer's attention weights, LayerNorm folded: ``W_Q/W_K/W_V [h, d_model, d_head]``,
    ``W_O [h, d_head, d_model]``, ``b_Q/b_K/b_V [h, d_head]``, ``b_O [d_model]`` (h = heads read)."""

    W_Q: Tensor
    W_K: Tensor
    W_V: Tensor
    W_O: Tensor
    b_Q: Tensor
    b_K: Tensor
    b_V: Tensor
    b_O: Tensor


class LazyCheckpoint:
    """A checkpoint directory whose weights are read layer by layer, on demand.

    The header is checked against ``config.json`` on opening (every tensor present with the
    shape the config implies, nothing unexpected); each tensor read is checked for NaN/inf.
    Every getter returns new tensors on ``device`` in ``dtype``; nothing is cached, so
    the caller decides what stays in memory.
    """

    def __init__(self, path: Path | str, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        self.path = Path(path)
        data = read_config(self.path)
        self.cfg = ModelConfig.from_dict(data["model"])
        self.bos_token_id = int((data.get("tokenizer") or {}).get("bos_token_id", 0))
        self.dtype, self.device = dtype, torch.device(device)
        weights_path = self.path / MODEL_FILE
        if not weights_path.is_file():
            raise QkovError(f"checkpoint {str(self.path)!r} has no {MODEL_FILE}")
        self.file = TensorFile(weights_path)
        self._check_header(str(weights_path))

    def _check_header(self, where: str) -> None:
        from .model import Transformer

        with torch.device("meta"):  # shapes only: nothing is allocated
            expected = {k: tuple(v.shape) for k, v in Transformer(self.cfg, seed=0).state_dict().items()}
        have = self.file.entries
        missing, unexpected = sorted(set(expected) - set(have)), sorted(set(have) - set(expected))
        for what, names in (("missing", missing), ("unexpected", unexpected)):
            if names:
                raise QkovError(f"{where}: {what} weight(s) {', '.join(names[:4])}{' ...' if len(names) > 4 else ''}")
        for name, shape in expected.items():
            if self.file.shape(name) != shape:
                raise QkovError(f"{where}: {name} has shape {self.file.shape(name)} but the config implies {shape}")

    # ------------------------------------------------------------------ reading
    @property
    def layernorm(self) -> bool:
        return self.cfg.normalization == "layernorm"

    def _get(self, name: str, index: int | slice | None = None, cols: slice | None = None) -> Tensor:
        t = self.file.read(name, index, cols)
        if not all(bool(part.isfinite().all()) for part in t.reshape(-1).split(_BLOCK)):  # no full-size mask
            raise QkovError(f"{self.file.path}: {name} holds NaN or infinite values")
        return t.to(device=self.device, dtype=self.dtype)

    def _get_or_zeros(self, name: str, shape: tuple[int, ...]) -> Tensor:
        if name in self.file.entries:
            return self._get(name)
        return torch.zeros(shape, device=self.device, dtype=self.dtype)

    def _check_layer(self, layer: int, head: int | None = None) -> None:
        c = self.cfg
        if not 0 <= layer < c.n_layers or (head is not None and not 0 <= head < c.n_heads):
            what = f"head {layer}.{head}" if head is not None else f"layer {layer}"
            raise QkovError(f"no {what}: the model has {c.n_layers} layers x {c.n_heads} heads")

    def embed(self) -> Tensor:
        """``W_E [d_vocab, d_model]``."""
        return self._get("W_E")

    def pos(self) -> Tensor | None:
        """``W_pos [n_ctx, d_model]``, or ``None`` for a model without positional embeddings."""
        return self._get("W_pos") if self.cfg.positional != "none" else None

    def unembed(self, cols: slice | None = None) -> tuple[Tensor, Tensor]:
        """``W_U [d_model, v]`` and ``b_U [v]`` (all ``d_vocab`` columns, or the block ``cols``),
        the final LayerNorm folded in (in blocks of columns: no full-size temporaries)."""
        V = self.cfg.d_vocab
        if cols is None and self.layernorm and V > _BLOCK // self.cfg.d_model:
            W = torch.empty(self.cfg.d_model, V, device=self.device, dtype=self.dtype)
            b = torch.empty(V, device=self.device, dtype=self.dtype)
            step = _BLOCK // self.cfg.d_model
            for lo in range(0, V, step):
                block = slice(lo, min(V, lo + step))
                W[:, block], b[block] = self.unembed(cols=block)
            return W, b
        W = self._get("W_U", cols=cols)
        b = self._get("b_U", cols=cols) if "b_U" in self.file.entries else W.new_zeros(W.shape[1])
        if self.layernorm:
            W, b = fold_reader(W, b, self._get("ln_final.w"), self._get("ln_final.b"), read_dim=0)
        return W, b

    def unembed_embed(self, *, chunk: int = 4096) -> Tensor:
        """``W_U @ W_E [d_model, d_model]`` (``W_U`` folded), summed over blocks of ``chunk`` tokens:
        neither matrix is ever held whole."""
        V, D = self.cfg.d_vocab, self.cfg.d_model
        G = torch.zeros(D, D, device=self.device, dtype=self.dtype)
        for lo in range(0, V, chunk):
            block = slice(lo, min(V, lo + chunk))
            W_U, _ = self.unembed(cols=block)
            G += W_U @ self._get("W_E", block)
        return G

    def attention(self, layer: int, head: int | None = None) -> Attention:
        """Layer ``layer``'s attention (every head, or only ``head``: leading dim 1), ln1 folded."""
        self._check_layer(layer, head)
        c = self.cfg
        h = c.n_heads if head is None else 1
        pre = f"blocks.{layer}.attn."

        def get(name: str, shape: tuple[int, ...]) -> Tensor:
            if pre + name not in self.file.entries:
                return torch.zeros(shape, device=self.device, dtype=self.dtype)
            return self._get(pre + name) if head is None else self._get(pre + name, head)[None]

        D, E = c.d_model, c.d_head
        W = {n: get(f"W_{n}", (h, D, E)) for n in "QKV"}
        b = {n: get(f"b_{n}", (h, E)) for n in "QKV"}
        if self.layernorm:
            g, beta = self._get(f"blocks.{layer}.ln1.w"), self._get(f"blocks.{layer}.ln1.b")
            for n in "QKV":
                W[n], b[n] = fold_reader(W[n], b[n], g, beta, read_dim=1)
        b_O = self._get_or_zeros(pre + "b_O", (D,))
        return Attention(W["Q"], W["K"], W["V"], get("W_O", (h, E, D)), b["Q"], b["K"], b["V"], b_O)

    def mlp(self, layer: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``W_in [d_model, d_mlp]``, ``b_in [d_mlp]`` (ln2 folded), ``W_out [d_mlp, d_model]``, ``b_out [d_model]``."""
        self._check_layer(layer)
        M, D = self.cfg.d_mlp, self.cfg.d_model
        if M is None:
            raise QkovError("this model has no MLP")
        pre = f"blocks.{layer}.mlp."
        W_in, b_in = self._get(pre + "W_in"), self._get_or_zeros(pre + "b_in", (M,))
        if self.layernorm:
            g, beta = self._get(f"blocks.{layer}.ln2.w"), self._get(f"blocks.{layer}.ln2.b")
            W_in, b_in = fold_reader(W_in, b_in, g, beta, read_dim=0)
        return W_in, b_in, self._get(pre + "W_out"), self._get_or_zeros(pre + "b_out", (D,))

    def head_weights(self, layer: int, head: int) -> Weights:
        """A one-layer, one-head :class:`Weights` (``W_E``, ``W_pos``, ``W_U`` and head ``layer.head``
        as head ``0.0``): what the full circuits and skip-trigram tables of that head read."""
        att = self.attention(layer, head)
        W_U, b_U = self.unembed()
        f = {k: getattr(att, k)[None] for k in ("W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V", "b_O")}
        return Weights(
            cfg=self.cfg.replace(n_layers=1, n_heads=1, d_mlp=None),
            W_E=self.embed(),
            W_pos=self.pos(),
            W_U=W_U,
            b_U=b_U,
            norm="folded" if self.layernorm else "none",
            **f,
        )
