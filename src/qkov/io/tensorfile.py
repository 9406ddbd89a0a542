"""A safetensors file mapped read-only: tensors (or slices of them) copied out on demand.

The format is read directly: an 8-byte little-endian header length, a JSON header
``{name: {"dtype", "shape", "data_offsets": [begin, end]}}`` and the raw little-endian data.
The file is mapped read-only and shared (``mmap`` with ``PROT_READ``, ``MAP_SHARED``), so its
pages belong to the page cache, never to the process's private memory, and the kernel can
drop them at any time. (``safetensors.safe_open`` maps the file private and writable, which
counts the whole file against a data-size limit such as ``RLIMIT_DATA``.) Pages touched while
copying are released from the process right after (``MADV_DONTNEED``), so resident memory
stays the tensors held.
"""

from __future__ import annotations

import json
import mmap
import os
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from ..errors import QkovError

__all__ = ["TensorFile"]

_DTYPES: dict[str, tuple[type, torch.dtype | None]] = {
    "F64": (np.float64, None),
    "F32": (np.float32, None),
    "F16": (np.float16, None),
    "BF16": (np.uint16, torch.bfloat16),  # numpy has no bfloat16: read the bits, view them in torch
}
_PAGE = mmap.PAGESIZE


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
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise QkovError(f"{where} is not a safetensors file (header: {type(exc).__name__}: {exc})") from None
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
