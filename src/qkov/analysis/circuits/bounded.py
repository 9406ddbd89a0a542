"""The largest entries of a low-rank product ``A @ B``, exact, by bound and refine.

A full circuit at GPT-2's vocabulary is a 50257 x 50257 product of inner dimension 64: one exact
float32 scan of it is about 320 GFLOP. Its largest entries and its rows' maxima are found here in
two steps:

* **screen** (:func:`row_bounds`): the product once more in a fast low precision, keeping only each
  row's largest entry ``max_j S_ij``, plus a bound on how far any evaluation of an entry in the factors'
  own dtype can lie from the screened one: ``|C_ij - S_ij| <= delta ||a_i|| ||b_j||`` (``a_i`` row
  ``i`` of ``A``, ``b_j`` column ``j`` of ``B``; ``delta`` from the error model below). So
  ``U_i = max_j S_ij + delta ||a_i|| max_j ||b_j||`` is at least row ``i``'s largest entry however
  that entry is computed. On a CPU with bfloat16 matrix units (AMX, AVX-512 BF16) that run faster than
  its float32 ones (timed once per process: :func:`screen_dtype`) the screen runs in bfloat16 with float32
  accumulation, with the large factor on the left (measured at GPT-2 shape on a shared 2-core Sapphire
  Rapids VM, best runs: 0.6 s for the whole 50257 x 50257 screen against 1.5 s for a float32 scan);
  elsewhere it is the product in the factors' dtype itself (no faster than a scan, and still exact: the
  search then costs about what a plain scan costs).
* **refine** (:func:`top_entries`): rows in order of their bound, largest first, in small chunks,
  computed exactly; once ``k`` values are known, a row whose bound is below the k-th of them cannot
  hold one of the ``k`` largest entries and is never computed. At GPT-2 shape with random weights
  about 45 of the 50257 rows are computed for ``k = 20``, about 350 for ``k = 200``.

Error model (``u`` a unit roundoff: ``2^-8`` for bfloat16, ``2^-24`` float32, ``2^-53`` float64):
an evaluation that rounds its inputs (``u_in``), sums the ``r`` products in any order (``u_acc``,
``gamma = r u_acc / (1 - r u_acc)``) and rounds the sum (``u_out``) is within
``(2 u_in + u_in^2 + (1 + u_in)^2 (gamma + u_out (1 + gamma))) ||a|| ||b||`` of the exact dot product
(each input's error is relative, and ``sum_d |a_d b_d| <= ||a|| ||b||``). ``delta`` is this for the
exact evaluation plus this for the screen, times ``1 + 2^-40``; a tiny absolute term covers values
flushed to zero below float32's normal range. Assumed: a bfloat16 product accumulates in float32
(the CPU kernels do); the exact evaluation accumulates in at least its own precision (a float32
product allowed to use TF32 or bfloat16 internally is counted with ``u_in = 2^-8``).

Ties are deterministic (:func:`stable_topk`): equal values come in index order, lower row then lower
column first, and an equal value straddling the k-th place is taken from the lowest index.
"""

from __future__ import annotations

import functools
import math
import time

import torch
from torch import Tensor

__all__ = ["row_bounds", "screen_bytes", "screen_dtype", "SCREEN_ROWS", "stable_topk", "top_entries"]

SCREEN_ROWS = 256  # rows of A per screened block (measured: 64..512 rows equally fast, 1024 slower)
_BITS = {
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
    torch.float32: torch.int32,
    torch.float64: torch.int64,
}


@functools.cache
def _bf16_cpu() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AMX tiles or AVX-512 BF16)."""
    cpu = getattr(torch, "cpu", None)
    probes = [getattr(cpu, name, None) for name in ("_is_amx_tile_supported", "_is_avx512_bf16_supported")]
    return any(p is not None and bool(p()) for p in probes)


@functools.cache
def _bf16_faster() -> bool:
    """Whether bfloat16 products run faster than float32 ones here: the CPU multiplies bfloat16 natively
    (:func:`_bf16_cpu`) and a screen-shaped product, timed once per process (a few milliseconds), bears it
    out. A CPU with AVX-512 BF16 but no AMX tiles may run bfloat16 at half the float32 rate (measured on a
    2-core Intel Xeon: 146 against 285 GFLOP/s at ``[50257, 64] @ [64, 256]``), where AMX or a Zen 4 core
    runs it 2-3x faster. Only the time depends on the answer: the bound holds for either screen."""
    if not _bf16_cpu():
        return False
    g = torch.Generator().manual_seed(0)
    left, right = torch.randn(16384, 64, generator=g), torch.randn(64, 256, generator=g)

    def best(dtype: torch.dtype) -> float:
        a, b = left.to(dtype), right.to(dtype)
        out = torch.empty(len(a), b.shape[1], dtype=dtype)
        torch.matmul(a, b, out=out)  # the first call sets its kernel up
        times = []
        for _ in range(5):
            t = time.perf_counter()
            torch.matmul(a, b, out=out)
            times.append(time.perf_counter() - t)
        return min(times)

    return best(torch.bfloat16) < 0.8 * best(torch.float32)


def screen_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The dtype :func:`row_bounds` screens float32 factors of ``dtype`` on ``device`` in: bfloat16 on
    a CPU that multiplies it natively and faster than float32 (:func:`_bf16_faster`), else ``dtype`` itself."""
    return torch.bfloat16 if dtype == torch.float32 and device.type == "cpu" and _bf16_faster() else dtype


def _unit(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2


def _evaluation_error(r: int, u_in: float, u_acc: float, u_out: float) -> float:
    """``e`` with ``|E - a.b| <= e ||a|| ||b||`` for an evaluation ``E`` of an ``r``-term dot product
    (module docstring); ``inf`` when ``r u_acc`` is too large for the bound."""
    if r * u_acc >= 0.5:
        return math.inf
    gamma = r * u_acc / (1 - r * u_acc)
    return 2 * u_in + u_in**2 + (1 + u_in) ** 2 * (gamma + u_out * (1 + gamma))


def _delta(r: int, dtype: torch.dtype, screen: torch.dtype, device: torch.device) -> float:
    """The relative bound ``delta`` between an exact evaluation in ``dtype`` and the screen's (module docstring)."""
    u = _unit(dtype)
    lowered = dtype == torch.float32 and (
        torch.get_float32_matmul_precision() != "highest"
        or (device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32)
    )
    exact = _evaluation_error(r, 2.0**-8 if lowered else 0.0, u, u)
    if screen == dtype:
        return 2 * exact * (1 + 2.0**-40)
    us = _unit(screen)  # a half-precision screen accumulates in float32
    fast = _evaluation_error(r, us, min(us, 2.0**-24), us)
    return (exact + fast) * (1 + 2.0**-40)


def _column_max(S: Tensor) -> Tensor:
    """The largest entry of each column of ``S [n, c]`` (float64 ``[c]``).

    A float's bits read as a signed integer order the non-negative floats as the floats (and the
    negative ones below them, in reverse), so an integer maximum finds it where a column holds an entry
    ``>= +0``; a column of negative entries takes its integer minimum (the entry of least magnitude).
    Measured: four times faster than a bfloat16 ``amax``."""
    bits = S.view(_BITS[S.dtype])
    top = bits.amax(0)
    negative = torch.nonzero(top < 0).squeeze(-1)
    if negative.numel():
        top[negative] = bits[:, negative].amin(0)
    return top.view(S.dtype).double()


def screen_bytes(m: int, n: int, r: int, max_bytes: int, dtype: torch.dtype) -> int:
    """Peak memory of :func:`row_bounds` on ``A [m, r] @ B [r, n]`` screened in ``dtype``: the factors'
    copies, one block of at most ``max_bytes`` and the bounds."""
    item = torch.empty(0, dtype=dtype).element_size()
    rows = max(1, min(SCREEN_ROWS, m, max_bytes // max(1, n * item)))
    return (m + n) * r * item + rows * (n + r) * item + 8 * (m + n)


def row_bounds(A: Tensor, B: Tensor, *, max_bytes: int, dtype: torch.dtype | None = None) -> Tensor:
    """Upper bounds ``[m]`` (float64) on the largest entry of each row of ``A [m, r] @ B [r, n]``, however
    an evaluation in the factors' dtype computes it (module docstring): above the screened maximum by
    ``delta ||a_i|| max_j ||b_j||``, about 1.2 % of it for bfloat16 at ``r = 64``.

    ``dtype``: the screen's (default :func:`screen_dtype`). Blocks of at most :data:`SCREEN_ROWS` rows
    and ``max_bytes``; a non-finite bound (factors holding NaN or overflowing) becomes ``inf``."""
    m, r = A.shape
    n = B.shape[1]
    screen = screen_dtype(A.device, A.dtype) if dtype is None else dtype
    delta = _delta(r, A.dtype, screen, A.device)
    item = torch.empty(0, dtype=screen).element_size()
    rows = max(1, min(SCREEN_ROWS, m, max_bytes // max(1, n * item)))
    left = B.T.to(screen).contiguous()  # [n, r]: the large operand on the left keeps the matrix units busy
    right = A.T.to(screen).contiguous()  # [r, m]
    b_max = max(float(torch.linalg.vector_norm(B[:, lo : lo + 4096].double(), dim=0).max()) for lo in range(0, n, 4096))
    block = left.new_empty(n, rows)
    out = torch.empty(m, dtype=torch.float64, device=A.device)
    for lo in range(0, m, rows):
        hi = min(m, lo + rows)
        S = torch.matmul(left, right[:, lo:hi], out=block[:, : hi - lo])
        a_norm = torch.linalg.vector_norm(A[lo:hi].double(), dim=-1)
        tiny = 2.0**-118 * (r + math.sqrt(r) * (a_norm + b_max))  # values flushed to zero below float32's range
        out[lo:hi] = _column_max(S) + delta * a_norm * b_max + tiny
    return out.nan_to_num_(nan=math.inf)


def stable_topk(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The ``k`` largest entries along the last dimension, largest first, equal values in index order
    (and an equal value straddling the k-th place taken from the lowest indices): ``values, indices
    [..., k]``. (``torch.topk`` leaves both unspecified among equal values.)"""
    n = x.shape[-1]
    flat = x.reshape(-1, n)
    v, i = torch.topk(flat, min(k + 1, n), dim=-1)
    # a row whose (k+1)-th value equals its k-th has an equal value straddling the k-th place
    cut = torch.nonzero(v[:, k] == v[:, k - 1]).squeeze(-1) if k < n else v.new_empty(0, dtype=torch.long)
    v, i = v[:, :k], i[:, :k]
    kth = v[:, -1:]
    if cut.numel():  # there, of the entries equal to the k-th value, the first ones
        rows, t = flat[cut], kth[cut]
        above, tied = rows > t, rows == t
        need = k - torch.count_nonzero(above, -1)[:, None]
        keep = above | (tied & (tied.cumsum(-1) <= need))
        i = i.clone()
        i[cut] = torch.nonzero(keep)[:, 1].reshape(-1, k)
    i = i.sort(-1).values
    v = flat.gather(-1, i)
    order = torch.sort(v, dim=-1, descending=True, stable=True).indices
    shape = (*x.shape[:-1], k)
    return v.gather(-1, order).reshape(shape), i.gather(-1, order).reshape(shape)


def _merge(v: Tensor, i: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The ``k`` best of candidates ``v`` (values) at distinct flat indices ``i``: values descending,
    equal values by index."""
    by_index = torch.argsort(i)
    v, i = v[by_index], i[by_index]
    best = torch.sort(v, descending=True, stable=True).indices[:k]
    return v[best], i[best]


def _exact_rows(A: Tensor, B: Tensor, rows: Tensor) -> Tensor:
    """Rows ``rows`` of ``A @ B`` as a scan in row chunks computes them: at least two rows at once (a
    one-row product may take another kernel and round differently)."""
    if rows.numel() == 1:
        return (A[rows.repeat(2)] @ B)[:1]
    return A[rows] @ B


def top_entries(
    A: Tensor, B: Tensor, k: int, *, max_bytes: int, chunk_rows: int, dtype: torch.dtype | None = None
) -> tuple[Tensor, Tensor]:
    """The ``k`` largest entries of ``A [m, r] @ B [r, n]``, exact (module docstring): ``values [k]``
    (largest first, equal values by index) and their flat indices ``row * n + col [k]``.

    The screen takes blocks of at most ``max_bytes`` (``dtype``: :func:`row_bounds`), the exact rows
    chunks of ``chunk_rows``."""
    n = B.shape[1]
    bound = row_bounds(A, B, max_bytes=max_bytes, dtype=dtype)
    order = torch.argsort(bound, descending=True)
    best_v, best_i = A.new_empty(0), torch.empty(0, dtype=torch.long, device=A.device)
    for lo in range(0, order.numel(), chunk_rows):
        rows = order[lo : lo + chunk_rows]
        if best_v.numel() == k:  # a row whose bound is below the k-th value cannot reach it; one equal to it can tie
            rows = rows[bound[rows] >= float(best_v[-1])]
            if rows.numel() == 0:
                break  # the rest of the order is bounded lower still
        rows = rows.sort().values  # in index order, a chunk's ties come out by flat index
        block = _exact_rows(A, B, rows)
        v, pos = stable_topk(block.reshape(-1), min(k, block.numel()))
        best_v, best_i = _merge(torch.cat([best_v, v]), torch.cat([best_i, rows[pos // n] * n + pos % n]), k)
    return best_v, best_i
