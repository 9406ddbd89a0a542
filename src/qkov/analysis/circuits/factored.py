"""Low-rank products ``A @ B`` kept factored, batched over leading dims (e.g. ``[layer, head]``).

A full OV circuit ``W_E @ W_V @ W_O @ W_U`` at GPT-2's vocabulary is a 50257 x 50257
matrix (10 GB in float32) of rank <= d_head. :class:`LowRank` never builds it: every
operation works through the factors ``A [..., m, r]`` and ``B [..., r, n]``:

* eigenvalues: the non-zero eigenvalues of ``A @ B`` are those of ``B @ A`` (``r x r``);
* SVD: QR of ``A`` and ``B^T``, then the SVD of the small ``r x r`` middle;
* Frobenius norm and trace through ``r x r`` Gram matrices;
* :meth:`LowRank.row_factor` / :meth:`LowRank.col_factor`: the smallest factor with the same
  norms under multiplication, so norms of products of many pairs (composition scores) need
  only ``r``-sized products;
* rows, columns, diagonal, top-k entries (whole matrix or per row) and diagonal
  ranks in row chunks whose size obeys a caller-set memory bound (``max_bytes``); the whole
  matrix's top-k and bounds on its rows' maxima by bound and refine (:mod:`.bounded`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import Tensor

from ...errors import QkovError
from ..shown import Shown
from .bounded import row_bounds, top_entries
from ..shown import TEXT, decoder, num, register, table, token

__all__ = [
    "CACHE_BYTES",
    "SCREEN_COLS",
    "DEFAULT_MAX_BYTES",
    "eigenvalues",
    "gram_sqrt",
    "LowRank",
    "serial_linalg",
    "TopK",
    "topk_text",
]

DEFAULT_MAX_BYTES = 256 * 2**20  # working memory of one chunk
CACHE_BYTES = 8 * 2**20  # a row chunk this small stays in cache: scans over it run several times faster
SCREEN_COLS = 4096  # columns :meth:`LowRank.diag_in_top` reads every row against before the rest


@contextlib.contextmanager
def serial_linalg() -> Iterator[None]:
    """Run batched small decompositions (eig, eigh, QR, SVD) on one CPU thread.

    Measured on a 2-core machine: ``eigh`` of 144 matrices of 64 x 64 takes 0.02 s on
    one thread and 6 s on two (the batch loop and the LAPACK kernel both spawn threads
    and oversubscribe the cores). The matrices are small, so one thread loses nothing.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass(frozen=True, repr=False)
class TopK(Shown):
    """Top-k entries: ``values [..., k]``, ``rows [..., k]``, ``cols [..., k]``."""

    values: Tensor
    rows: Tensor
    cols: Tensor


class LowRank:
    """The matrix ``A @ B`` with ``A [..., m, r]`` and ``B [..., r, n]``, never materialised unless asked."""

    def __init__(self, A: Tensor, B: Tensor) -> None:
        if A.ndim < 2 or B.ndim < 2:
            raise QkovError(f"LowRank: factors need >= 2 dims, got {tuple(A.shape)} and {tuple(B.shape)}")
        if A.shape[-1] != B.shape[-2]:
            raise QkovError(
                f"LowRank: inner dimensions differ: A is {tuple(A.shape)}, B is {tuple(B.shape)} "
                f"(expected A [..., m, r] and B [..., r, n])"
            )
        batch = _broadcast(A.shape[:-2], B.shape[:-2])
        self.A = A.expand(*batch, *A.shape[-2:])
        self.B = B.expand(*batch, *B.shape[-2:])

    # ------------------------------------------------------------ shape
    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.A.shape[:-1], self.B.shape[-1]))

    @property
    def batch_shape(self) -> torch.Size:
        return self.A.shape[:-2]

    @property
    def rdim(self) -> int:
        """The inner dimension ``r`` (an upper bound on the rank)."""
        return self.A.shape[-1]

    @property
    def dtype(self) -> torch.dtype:
        return self.A.dtype

    @property
    def device(self) -> torch.device:
        return self.A.device

    def __repr__(self) -> str:
        return f"LowRank(shape={tuple(self.shape)}, inner={self.rdim}, dtype={self.dtype})"

    def __getitem__(self, index: int | tuple | slice) -> "LowRank":
        """Index the leading (batch) dimensions only, e.g. ``ov[layer, head]``."""
        if not isinstance(index, tuple):
            index = (index,)
        if len(index) > len(self.batch_shape):
            raise QkovError(f"LowRank: {len(index)} indices for batch shape {tuple(self.batch_shape)}")
        return LowRank(self.A[index], self.B[index])

    def to(self, *args: object, **kwargs: object) -> "LowRank":
        return LowRank(self.A.to(*args, **kwargs), self.B.to(*args, **kwargs))  # type: ignore[arg-type]

    # ------------------------------------------------------------ algebra
    @property
    def T(self) -> "LowRank":
        return LowRank(self.B.transpose(-1, -2), self.A.transpose(-1, -2))

    def __matmul__(self, other: "Tensor | LowRank") -> "LowRank":
        if isinstance(other, LowRank):
            # (A B)(C D): put the middle on the side that keeps the inner dimension smallest
            middle = self.B @ other.A
            if self.rdim <= other.rdim:
                return LowRank(self.A, middle @ other.B)
            return LowRank(self.A @ middle, other.B)
        return LowRank(self.A, self.B @ other)

    def __rmatmul__(self, other: Tensor) -> "LowRank":
        return LowRank(other @ self.A, self.B)

    def __mul__(self, scalar: float) -> "LowRank":
        return LowRank(self.A * scalar, self.B)

    __rmul__ = __mul__

    def __neg__(self) -> "LowRank":
        return LowRank(-self.A, self.B)

    def materialize(self, *, max_bytes: int | None = None) -> Tensor:
        """The full matrix ``[..., m, n]``. Refuses if it would exceed ``max_bytes`` (when given)."""
        size = self.shape.numel() * self.A.element_size()
        if max_bytes is not None and size > max_bytes:
            raise QkovError(f"LowRank: materialising {tuple(self.shape)} needs {size / 2**20:.0f} MiB > bound")
        return self.A @ self.B

    # ------------------------------------------------------------ spectra
    def twin(self) -> Tensor:
        """``B @ A [..., r, r]``: its eigenvalues are the ``r`` eigenvalues of ``A @ B`` that can be non-zero."""
        if self.shape[-1] != self.shape[-2]:
            raise QkovError(f"eigenvalues need a square matrix, got {tuple(self.shape[-2:])}")
        return self.B @ self.A

    def eigenvalues(self) -> Tensor:
        """The ``r`` eigenvalues of ``A @ B`` that can be non-zero (complex ``[..., r]``), via :meth:`twin`."""
        return eigenvalues(self.twin())

    def svd(self) -> tuple[Tensor, Tensor, Tensor]:
        """``U [..., m, r]``, ``S [..., r]``, ``Vh [..., r, n]`` with ``A @ B = U diag(S) Vh``."""
        with serial_linalg():
            qa, ra = torch.linalg.qr(self.A)
            qb, rb = torch.linalg.qr(self.B.transpose(-1, -2))
            u, s, vh = torch.linalg.svd(ra @ rb.transpose(-1, -2))
        return qa @ u, s, vh @ qb.transpose(-1, -2)

    def norm(self) -> Tensor:
        """Frobenius norm ``[...]``: ``||AB||^2 = sum((A^T A) * (B B^T))``."""
        ga = self.A.transpose(-1, -2) @ self.A
        gb = self.B @ self.B.transpose(-1, -2)
        return (ga * gb).sum(dim=(-1, -2)).clamp_min(0).sqrt()

    def row_factor(self) -> Tensor:
        """``F [..., r, n]`` with ``F^T F = (AB)^T (AB)``, so ``||A B X||_F = ||F X||_F`` for any ``X``.

        ``F = S B`` where ``S^T S = A^T A`` (the Gram matrix's square root, via ``eigh``: exact
        even when ``A`` is rank-deficient).
        """
        return gram_sqrt(self.A.transpose(-1, -2) @ self.A) @ self.B

    def col_factor(self) -> Tensor:
        """``G [..., m, r]`` with ``G G^T = (AB)(AB)^T``, so ``||X A B||_F = ||X G||_F`` for any ``X``."""
        return self.A @ gram_sqrt(self.B @ self.B.transpose(-1, -2)).transpose(-1, -2)

    def trace(self) -> Tensor:
        if self.shape[-1] != self.shape[-2]:
            raise QkovError(f"trace needs a square matrix, got {tuple(self.shape[-2:])}")
        return (self.A * self.B.transpose(-1, -2)).sum(dim=(-1, -2))

    def diag(self) -> Tensor:
        """Diagonal ``[..., min(m, n)]``."""
        k = min(self.shape[-1], self.shape[-2])
        return (self.A[..., :k, :] * self.B[..., :, :k].transpose(-1, -2)).sum(-1)

    # ------------------------------------------------------------ entries
    def rows(self, index: Tensor | list[int] | slice) -> Tensor:
        """Chosen rows ``[..., len(index), n]`` (materialised)."""
        return self.A[..., index, :] @ self.B

    def cols(self, index: Tensor | list[int] | slice) -> Tensor:
        """Chosen columns ``[..., m, len(index)]`` (materialised)."""
        return self.A @ self.B[..., :, index]

    def _cache_rows(self, max_bytes: int) -> int:
        """Rows of one matrix per chunk: at most ``max_bytes`` and :data:`CACHE_BYTES` of them (at least one)."""
        m, n = self.shape[-2], self.shape[-1]
        return max(1, min(m, min(max_bytes, CACHE_BYTES) // max(1, n * self.A.element_size())))

    def _flat(self) -> tuple[Tensor, Tensor]:
        """The factors of each matrix of the batch in one leading dim (the constructor broadcast them):
        ``[N, m, r]``, ``[N, r, n]``."""
        return self.A.reshape(-1, *self.A.shape[-2:]), self.B.reshape(-1, *self.B.shape[-2:])

    def _row_chunks(self, max_bytes: int) -> Iterator[tuple[int, int]]:
        m, n = self.shape[-2], self.shape[-1]
        per_row = max(1, n * self.A.element_size() * max(1, self.batch_shape.numel()))
        step = max(1, min(m, max_bytes // per_row))
        for lo in range(0, m, step):
            yield lo, min(m, lo + step)

    def topk(
        self,
        k: int,
        *,
        largest: bool = True,
        max_bytes: int = DEFAULT_MAX_BYTES,
        rows: Tensor | None = None,
        cols: Tensor | None = None,
    ) -> TopK:
        """The ``k`` largest (or smallest) entries of the whole matrix, per batch element; with
        ``rows`` / ``cols`` (1-D index tensors), of the entries in those rows and columns only
        (indices in the result are still the whole matrix's). ``values/rows/cols [..., k]``.

        Exact, by bound and refine (:mod:`~qkov.analysis.circuits.bounded`): a fast screen bounds
        every row's largest entry, then only the rows whose bound reaches the k-th best exact value
        are computed, in row chunks of at most ``max_bytes`` and 8 MiB (the values are those of the
        product in the factors' dtype computed in row chunks). The screen holds a low-precision copy of both
        factors and blocks of at most ``max_bytes``; nothing ``m x n`` is held. Ties: largest first
        (smallest first with ``largest=False``), equal values in row-major order (of ``rows`` and
        ``cols`` as given), an equal value straddling the k-th place taken from the first.
        """
        if rows is not None or cols is not None:
            r = torch.arange(self.shape[-2], device=self.A.device) if rows is None else rows.to(self.A.device)
            c = torch.arange(self.shape[-1], device=self.B.device) if cols is None else cols.to(self.B.device)
            sub = LowRank(self.A[..., r, :], self.B[..., :, c]).topk(k, largest=largest, max_bytes=max_bytes)
            return TopK(sub.values, r[sub.rows], c[sub.cols])
        m, n = self.shape[-2], self.shape[-1]
        k = _check_k(k, m * n)
        flat_A, flat_B = self._flat()
        if not largest:  # smallest entries of AB are the largest of (-A)B, exactly (rounding is symmetric)
            flat_A = -flat_A
        chunk = self._cache_rows(max_bytes)
        found = [top_entries(a, b, k, max_bytes=max_bytes, chunk_rows=chunk) for a, b in zip(flat_A, flat_B)]
        values = torch.stack([v if largest else -v for v, _ in found]).reshape(*self.batch_shape, k)
        flat = torch.stack([i for _, i in found]).reshape(*self.batch_shape, k)
        return TopK(values, flat // n, flat % n)

    def topk_rows(self, k: int, *, largest: bool = True, max_bytes: int = DEFAULT_MAX_BYTES) -> tuple[Tensor, Tensor]:
        """Per row: the ``k`` largest entries ``values [..., m, k]`` and their columns ``[..., m, k]``."""
        k = _check_k(k, self.shape[-1])
        vals, idx = [], []
        for lo, hi in self._row_chunks(max_bytes):
            v, i = torch.topk(self.A[..., lo:hi, :] @ self.B, k, dim=-1, largest=largest)
            vals.append(v)
            idx.append(i)
        return torch.cat(vals, -2), torch.cat(idx, -2)

    def row_max(self, *, max_bytes: int = DEFAULT_MAX_BYTES) -> Tensor:
        """Largest entry of every row ``[..., m]``, in cache-sized row chunks (one pass, no top-k)."""
        m, n = self.shape[-2], self.shape[-1]
        chunk = self._cache_rows(max_bytes)
        if self.A.dim() != 2 or self.B.dim() != 2:
            return torch.cat([(self.A[..., lo : lo + chunk, :] @ self.B).amax(dim=-1) for lo in range(0, m, chunk)], -1)
        # one reused block: a fresh one per chunk fragments glibc's per-thread heaps (measured: a
        # GPT-2-vocabulary pass in a worker thread grew the process by 5.4 GiB; in the main thread, 0.1)
        buf, out = self.A.new_empty(chunk, n), self.A.new_empty(m)
        for lo in range(0, m, chunk):
            hi = min(m, lo + chunk)
            torch.amax(torch.matmul(self.A[lo:hi], self.B, out=buf[: hi - lo]), dim=-1, out=out[lo:hi])
        return out

    def row_max_bound(self, *, max_bytes: int = DEFAULT_MAX_BYTES) -> Tensor:
        """An upper bound ``[..., m]`` (float64) on the largest entry of every row, from a fast
        low-precision screen (:func:`~qkov.analysis.circuits.bounded.row_bounds`): at least the
        row's largest entry however it is computed, above it by at most about 1.2 % of
        ``||A_i|| max_j ||B_:j||``. For a search that needs a bound, not the maximum itself."""
        flat_A, flat_B = self._flat()
        out = [row_bounds(a, b, max_bytes=max_bytes) for a, b in zip(flat_A, flat_B)]
        return torch.stack(out).reshape(self.shape[:-1])

    def diag_rank(self, *, max_bytes: int = DEFAULT_MAX_BYTES, cols: Tensor | None = None) -> Tensor:
        """For each row ``i``, how many other entries of row ``i`` are at least its diagonal entry:
        ties count against it.

        The diagonal entry of row ``i`` is ``(i, i)`` (a square matrix), or ``(i, cols[i])`` with
        ``cols [m]`` (rows taken from a square matrix: ``A`` holds rows ``cols`` of its left factor).
        ``[..., m]`` integers; 0 means the diagonal is strictly the row's largest, so a row whose
        entries are all equal (a zero circuit) has rank ``n - 1``, never 0. Computed in row
        chunks of at most ``max_bytes`` and 8 MiB (a chunk that stays in cache is several times
        faster to compare against its diagonal).
        """
        m, n = self.shape[-2], self.shape[-1]
        cols = self._diag_cols(cols, "diag_rank")
        chunks = list(self._row_chunks(min(max_bytes, CACHE_BYTES)))
        if self.A.dim() != 2 or self.B.dim() != 2 or not chunks:
            out = []
            for lo, hi in chunks:
                block = self.A[..., lo:hi, :] @ self.B
                d = block[..., torch.arange(hi - lo, device=block.device), cols[lo:hi]]
                out.append((block >= d[..., None]).sum(-1) - 1)  # the diagonal itself is not counted
            return torch.cat(out, -1) if out else torch.zeros(self.shape[:-1], dtype=torch.long, device=self.A.device)
        # one reused block and comparison for every chunk (as row_max): no fresh 8 MiB per chunk. The
        # comparison is written as 0.0 / 1.0 and summed as floats, exact (integers below 2^24, or 2^53):
        # a float row sum is vectorised, a bool one is not (measured: ~20x slower on a CPU)
        rows = chunks[0][1] - chunks[0][0]
        count = torch.float32 if n < 2**24 else torch.float64
        buf, above = self.A.new_empty(rows, n), torch.empty(rows, n, dtype=count, device=self.A.device)
        out_ = torch.empty(m, dtype=count, device=self.A.device)
        for lo, hi in chunks:
            block = torch.matmul(self.A[lo:hi], self.B, out=buf[: hi - lo])
            d = block[torch.arange(hi - lo, device=block.device), cols[lo:hi]]
            torch.ge(block, d[:, None], out=above[: hi - lo])
            torch.sum(above[: hi - lo], -1, out=out_[lo:hi])
        return out_.long().sub_(1)  # the diagonal itself is not counted

    def _diag_cols(self, cols: Tensor | None, where: str) -> Tensor:
        """The column of each row's diagonal entry ``[m]``: ``0..m-1`` for a square matrix, else ``cols`` checked."""
        m, n = self.shape[-2], self.shape[-1]
        if cols is None:
            if m != n:
                raise QkovError(f"{where} needs a square matrix, got {tuple(self.shape[-2:])}")
            return torch.arange(m, device=self.A.device)
        if cols.shape != (m,) or (m and not 0 <= int(cols.min()) <= int(cols.max()) < n):
            raise QkovError(f"{where}: cols must be {m} column indices below {n}")
        return cols.to(self.A.device)

    def diag_in_top(
        self, k: int, *, cols: Tensor | None = None, max_bytes: int = DEFAULT_MAX_BYTES, screen: int = SCREEN_COLS
    ) -> Tensor:
        """For each row ``i``: whether its diagonal entry is among the row's ``k`` largest, ties counting
        against it: ``diag_rank() < k`` (``[..., m]`` bools; ``cols`` as in :meth:`diag_rank`), decided
        exactly for the factors as given, whatever order a product sums in.

        Each entry is computed in the factors' precision, whose rounding error is at most
        ``r u ||A_i|| max_j ||B_:j||`` (``u`` the unit roundoff, ``r`` the inner size, any summation
        order); an entry that far from the diagonal one (held in float64) is decided by its computed value,
        and a row whose decision rests on an entry within that margin is recomputed in float64 (a near tie).
        Rows are first read against the ``screen`` leading columns only: a row with ``k`` entries there
        surely above its diagonal is out of its top ``k`` without the rest (for a head that does not copy,
        most rows), the others read every column. Memory: row chunks as :meth:`diag_rank`.
        """
        m, n = self.shape[-2], self.shape[-1]
        cols = self._diag_cols(cols, "diag_in_top")
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise QkovError(f"diag_in_top: k must be a positive integer, got {k!r}")
        if self.A.dim() != 2 or self.B.dim() != 2:
            out = [LowRank(a, b).diag_in_top(k, cols=cols, max_bytes=max_bytes, screen=screen) for a, b in zip(*self._flat())]
            return torch.stack(out).reshape(*self.batch_shape, m) if out else torch.zeros(self.shape[:-1], dtype=torch.bool)
        A, B = self.A, self.B
        inside = torch.zeros(m, dtype=torch.bool, device=A.device)
        if m == 0 or k >= n:  # every entry of a row is in its top n
            return inside.fill_(True)
        # the diagonal entry in float64, and each row's margin: the bound on an entry's rounding error,
        # doubled (and the float64 diagonal's own rounding into the factors' dtype on top)
        d = (A.double() * B[:, cols].t().double()).sum(-1)
        u = torch.finfo(A.dtype).eps / 2
        # the longest column (its float32 sum of squares raised by its own rounding bound; a strided norm is slower)
        col_max = ((B * B).sum(0).max().double() * (1 + 2 * self.rdim * u)).sqrt()
        gamma = self.rdim * u / (1 - self.rdim * u)  # a sum of r products, in any order
        margin = 2 * (gamma * A.double().norm(dim=-1) * col_max + u * d.abs())
        above, maybe = (d + margin).to(A.dtype), (d - margin).to(A.dtype)  # v > above: surely above d
        count = torch.float32 if n < 2**24 else torch.float64  # float sums of 0/1 vectorise, bool sums do not
        step = self._cache_rows(max_bytes)
        buf, flags = A.new_empty(step, n), torch.empty(step, n, dtype=count, device=A.device)
        s = min(n, max(1, screen))
        sure = torch.zeros(m, dtype=count, device=A.device)
        if s < n:  # the screen: rows with k entries surely above their diagonal among the leading columns
            sbuf, sflags = buf.view(-1)[: step * s].view(step, s), flags.view(-1)[: step * s].view(step, s)
            for lo in range(0, m, step):
                hi = min(m, lo + step)
                v = torch.matmul(A[lo:hi], B[:, :s], out=sbuf[: hi - lo])
                torch.gt(v, above[lo:hi, None], out=sflags[: hi - lo])
                torch.sum(sflags[: hi - lo], -1, out=sure[lo:hi])
        rest = torch.nonzero(sure < k).flatten() if s < n else torch.arange(m, device=A.device)
        for lo in range(0, len(rest), step):
            idx = rest[lo : lo + step]
            v = torch.matmul(A[idx], B, out=buf[: len(idx)])
            f = flags[: len(idx)]
            surely = torch.gt(v, above[idx, None], out=f).sum(-1)
            possibly = torch.ge(v, maybe[idx, None], out=f).sum(-1) - 1  # the diagonal itself is not counted
            inside[idx] = possibly < k
            for i in idx[(surely < k) & (possibly >= k)].tolist():  # a near tie decides it: float64
                row = A[i].double() @ B.double()
                inside[i] = int((row >= row[cols[i]]).sum()) - 1 < k
        return inside


def eigenvalues(small: Tensor) -> Tensor:
    """Eigenvalues of a batch of small square matrices ``[..., r, r]`` (complex), on one thread
    (:func:`serial_linalg`). Stack the twins of many products and solve them in one call: each
    change of the thread count costs time, most of all the first."""
    with serial_linalg():
        return torch.linalg.eigvals(small)


def gram_sqrt(G: Tensor) -> Tensor:
    """``S [..., r, r]`` with ``S^T S = G`` for a positive semi-definite Gram matrix ``G [..., r, r]``
    (via ``eigh``, negative round-off eigenvalues clamped to zero)."""
    with serial_linalg():
        evals, evecs = torch.linalg.eigh(G)
    return evals.clamp_min(0).sqrt()[..., :, None] * evecs.transpose(-1, -2)


def _broadcast(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    """The broadcast of two batch shapes. (``torch.broadcast_shapes`` costs ~0.3 s on its first
    call in a process, more than a whole copying analysis at GPT-2-small shape.)"""
    n = max(len(a), len(b))
    a, b = (1,) * (n - len(a)) + tuple(a), (1,) * (n - len(b)) + tuple(b)
    out = []
    for x, y in zip(a, b):
        if x != y and 1 not in (x, y):
            raise QkovError(f"LowRank: batch shapes {a} and {b} do not broadcast")
        out.append(y if x == 1 else x)
    return tuple(out)


def _check_k(k: int, limit: int) -> int:
    if not isinstance(k, int) or k < 1:
        raise QkovError(f"k must be a positive integer, got {k!r}")
    if k > limit:
        raise QkovError(f"k={k} exceeds the number of entries ({limit})")
    return k


@register(TEXT, TopK)
def topk_text(t: TopK) -> str:
    decode, k = decoder(t), t.values.shape[-1]
    values, rows, cols = (x.reshape(-1, k)[0].tolist() for x in (t.values, t.rows, t.cols))
    batch = tuple(t.values.shape[:-1])
    where = f" (first of batch {list(batch)})" if batch else ""
    body = [[i, token(decode, r), token(decode, c), num(v, 4)] for i, (v, r, c) in enumerate(zip(values, rows, cols))]
    return f"TopK: the {k} largest entries{where}:\n" + table(["#", "row", "col", "value"], body)
