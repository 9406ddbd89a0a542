"""LowRank: every factored operation against the materialised matrix."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from qkov import QkovError
from qkov.analysis.circuits.factored import LowRank

torch.manual_seed(0)


def make(batch=(2, 3), m=40, r=5, n=40, dtype=torch.float64) -> tuple[LowRank, torch.Tensor]:
    A = torch.randn(*batch, m, r, dtype=dtype)
    B = torch.randn(*batch, r, n, dtype=dtype)
    return LowRank(A, B), A @ B


def test_shape_and_indexing() -> None:
    f, full = make()
    assert f.shape == full.shape and f.batch_shape == (2, 3) and f.rdim == 5
    assert torch.allclose(f[1, 2].materialize(), full[1, 2])
    assert torch.allclose(f[1].materialize(), full[1])
    with pytest.raises(QkovError, match="inner"):
        LowRank(torch.zeros(3, 4), torch.zeros(5, 3))
    # batch dims broadcast like tensors': a shared B against a batch of A, and mismatches refused
    g = LowRank(torch.randn(2, 3, 6, 4, dtype=torch.float64), torch.randn(1, 4, 5, dtype=torch.float64))
    assert g.batch_shape == (2, 3) and torch.allclose(g.materialize(), g.A @ g.B)
    with pytest.raises(QkovError, match="do not broadcast"):
        LowRank(torch.zeros(2, 6, 4), torch.zeros(3, 4, 5))


def test_algebra() -> None:
    f, full = make()
    g, gfull = make(m=40, r=3, n=30)
    x = torch.randn(40, 7, dtype=torch.float64)
    assert torch.allclose(f.T.materialize(), full.transpose(-1, -2))
    assert torch.allclose((f @ g).materialize(), full @ gfull)
    assert (f @ g).rdim == 3
    assert torch.allclose((f @ x).materialize(), full @ x)
    assert torch.allclose((x.T @ f).materialize(), x.T @ full)
    assert torch.allclose((2.5 * f).materialize(), 2.5 * full)
    assert torch.allclose((-f).materialize(), -full)


def test_eigenvalues_match_the_full_matrix() -> None:
    f, full = make()
    ours = f.eigenvalues()  # [2, 3, 5]
    ref = torch.linalg.eigvals(full)  # [2, 3, 40], 35 of them ~0
    for b in range(2):
        for h in range(3):
            nz = ref[b, h][ref[b, h].abs() > 1e-8]
            assert len(nz) == 5
            # every eigenvalue of ours has a partner in the full spectrum and vice versa
            dist = (nz[:, None] - ours[b, h][None, :]).abs()
            assert dist.min(0).values.max() < 1e-6 and dist.min(1).values.max() < 1e-6


def test_svd_norm_trace_diag() -> None:
    f, full = make(m=40, n=30)
    u, s, vh = f.svd()
    assert torch.allclose(u @ torch.diag_embed(s) @ vh, full, atol=1e-10)
    assert torch.allclose(s, torch.linalg.svdvals(full)[..., :5], atol=1e-10)
    assert torch.allclose(f.norm(), torch.linalg.matrix_norm(full), atol=1e-10)
    sq, sqfull = make()
    assert torch.allclose(sq.trace(), sqfull.diagonal(dim1=-2, dim2=-1).sum(-1))
    assert torch.allclose(sq.diag(), sqfull.diagonal(dim1=-2, dim2=-1))
    assert torch.allclose(f.rows([3, 7]), full[..., [3, 7], :])
    assert torch.allclose(f.cols([0, 29]), full[..., :, [0, 29]])


@pytest.mark.parametrize("max_bytes", [1, 2000, 10**9])
def test_topk_whole_matrix_and_per_row_in_chunks(max_bytes: int) -> None:
    f, full = make(batch=(3,), m=50, n=60, dtype=torch.float32)
    top = f.topk(7, max_bytes=max_bytes)
    ref_v, ref_i = torch.topk(full.reshape(3, -1), 7)
    assert torch.allclose(top.values, ref_v)
    assert torch.equal(top.rows * 60 + top.cols, ref_i)
    low = f.topk(4, largest=False, max_bytes=max_bytes)
    assert torch.allclose(low.values, torch.topk(full.reshape(3, -1), 4, largest=False).values)
    v, i = f.topk_rows(3, max_bytes=max_bytes)
    rv, ri = torch.topk(full, 3, dim=-1)
    assert torch.allclose(v, rv) and torch.equal(i, ri)


def test_diag_rank() -> None:
    f, full = make(batch=(2,), m=30, n=30, dtype=torch.float64)
    ranks = f.diag_rank(max_bytes=500)
    ref = (full > full.diagonal(dim1=-2, dim2=-1)[..., None]).sum(-1)  # no ties in random matrices
    assert torch.equal(ranks, ref)
    # one matrix in several row chunks (the last one short), and rows of a square one with their columns
    f2, full2 = make(batch=(), m=37, n=37, dtype=torch.float64)
    assert torch.equal(f2.diag_rank(max_bytes=700), (full2 > full2.diagonal()[:, None]).sum(-1))
    rows = torch.tensor([5, 0, 36, 12])
    want = (full2[rows] > full2[rows, rows][:, None]).sum(-1)
    assert torch.equal(LowRank(f2.A[rows], f2.B).diag_rank(cols=rows, max_bytes=300), want)
    eye = LowRank(torch.eye(6, dtype=torch.float64), torch.eye(6, dtype=torch.float64))
    assert eye.diag_rank().max() == 0
    # ties count against the diagonal: a zero matrix, a constant row, a row tied at the top
    zero = LowRank(torch.zeros(5, 2, dtype=torch.float64), torch.zeros(2, 5, dtype=torch.float64))
    assert zero.diag_rank().tolist() == [4] * 5
    tied = LowRank(torch.eye(3, dtype=torch.float64), torch.tensor([[2.0, 2.0, 0.0], [0, 1, 5], [1, 1, 1]]).double())
    assert tied.diag_rank().tolist() == [1, 1, 2]
    # float32, a wide row of many ties (entries rounded to a few values) over several chunks
    g = torch.Generator().manual_seed(5)
    A, B = torch.randint(-2, 3, (40, 3), generator=g).float(), torch.randint(-2, 3, (3, 5000), generator=g).float()
    full3, rows3 = A @ B, torch.randint(0, 5000, (40,), generator=g)
    want3 = (full3 >= full3[torch.arange(40), rows3][:, None]).sum(-1) - 1
    got3 = LowRank(A, B).diag_rank(cols=rows3, max_bytes=5000 * 4 * 7)
    assert torch.equal(got3, want3) and got3.dtype == torch.long and int(want3.max()) > 1000


def _in_top_dense(A: Tensor, B: Tensor, k: int, cols: Tensor | None = None) -> Tensor:
    """The dense answer of ``diag_in_top``: float64 products, ties counting against the diagonal."""
    full = A.double() @ B.double()
    cols = torch.arange(full.shape[-2]) if cols is None else cols
    d = full[..., torch.arange(full.shape[-2]), cols]
    return (full >= d[..., None]).sum(-1) - 1 < k


@pytest.mark.parametrize("V", [300, 8192])
def test_diag_in_top_equals_the_dense_answer(V: int) -> None:
    """Whether each row's diagonal entry is in its top k, against the dense float64 answer: on vocabularies up
    to 8192, sampled rows (``cols``), rows that copy (the diagonal at or near the top) among rows that do not,
    screens of every size (none, a few columns, all), small chunks, and a batch."""
    g = torch.Generator().manual_seed(V)
    r, m = 16, 256
    B = torch.randn(r, V, generator=g)
    cols = torch.randperm(V, generator=g)[:m]
    A = torch.randn(m, r, generator=g)
    A[: m // 4] = 4 * B[:, cols[: m // 4]].t() + 0.5 * torch.randn(m // 4, r, generator=g)  # copying rows
    f = LowRank(A, B)
    for k in (1, 5, 40):
        want = _in_top_dense(A, B, k, cols)
        assert 0 < int(want.sum()) < m  # both answers occur
        for screen in (1, 64, V):
            for max_bytes in (V * 4 * 3, 2**28):
                assert torch.equal(f.diag_in_top(k, cols=cols, screen=screen, max_bytes=max_bytes), want)
        assert torch.equal(f.diag_in_top(k, cols=cols), f.diag_rank(cols=cols) < k)
    sq = LowRank(torch.randn(2, V, r, generator=g), B)  # a batch of square ones
    assert torch.equal(sq.diag_in_top(3, screen=32), _in_top_dense(sq.A, B, 3))


def test_diag_in_top_ties_and_near_ties() -> None:
    """Exact ties count against the diagonal (a zero matrix, the identity, duplicated columns); entries
    within float32 rounding of the diagonal are decided in float64 (each computed value may fall on either
    side, the answer may not); k at least the row length holds every row."""
    zero = LowRank(torch.zeros(5, 3), torch.zeros(3, 5))
    assert zero.diag_in_top(4).tolist() == [False] * 5 and zero.diag_in_top(5).tolist() == [True] * 5
    eye = LowRank(torch.eye(6), torch.eye(6))
    assert eye.diag_in_top(1).all()
    tied = LowRank(torch.eye(3), torch.tensor([[2.0, 2.0, 0.0], [0, 1, 5], [1, 1, 1]]))
    assert tied.diag_in_top(1).tolist() == [False, False, False] and tied.diag_in_top(2).tolist() == [True, True, False]
    # near ties: the diagonal's column copied into k others, each moved by one float32 step up or down in one
    # coordinate, so its entry differs from the diagonal's by far less than float32 rounding of a 64-term sum
    g = torch.Generator().manual_seed(3)
    r, n, k = 64, 3000, 3
    A, B = torch.randn(40, r, generator=g), torch.randn(r, n, generator=g)
    cols = torch.arange(40)
    A[:] = B[:, :40].t() * 3  # every row copies: its diagonal near the top
    for i in range(40):
        for j, step in enumerate((1, -1, 1, -1, 1)):
            c = 100 + 5 * i + j
            B[:, c] = B[:, i]
            B[j, c] = torch.nextafter(B[j, i], torch.tensor(step * float("inf")))
    f = LowRank(A, B)
    want = _in_top_dense(A, B, k, cols)
    for kk in (1, 2, k, 5, 6):
        want = _in_top_dense(A, B, kk, cols)
        assert torch.equal(f.diag_in_top(kk, cols=cols), want)
    assert 0 < int(_in_top_dense(A, B, k, cols).sum()) < 40
    with pytest.raises(QkovError, match="k must be a positive"):
        f.diag_in_top(0, cols=cols)
    with pytest.raises(QkovError, match="square"):
        f.diag_in_top(1)


def test_bad_k_and_materialise_bound() -> None:
    f, _ = make(batch=(), m=4, n=4)
    with pytest.raises(QkovError):
        f.topk(0)
    with pytest.raises(QkovError):
        f.topk(17)
    with pytest.raises(QkovError, match="MiB"):
        make(batch=(), m=1000, r=2, n=1000)[0].materialize(max_bytes=1000)


def test_row_max_equals_the_dense_rows_maxima_across_chunk_edges() -> None:
    g = torch.Generator().manual_seed(0)
    A, B = torch.randn(37, 5, generator=g), torch.randn(5, 23, generator=g)
    dense = (A @ B).amax(-1)
    for max_bytes in (23 * 4, 3 * 23 * 4, 10**6):  # one row, three rows (37 is not a multiple), all rows per chunk
        # a chunk's product may round differently from the whole one (another kernel): 1e-6
        torch.testing.assert_close(LowRank(A, B).row_max(max_bytes=max_bytes), dense, rtol=1e-6, atol=1e-6)
    batched = LowRank(torch.stack([A, -A]), torch.stack([B, B]))
    expect = torch.stack([dense, (-A @ B).amax(-1)])
    torch.testing.assert_close(batched.row_max(max_bytes=3 * 23 * 4), expect, rtol=1e-6, atol=1e-6)
