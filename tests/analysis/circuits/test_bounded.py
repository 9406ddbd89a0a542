"""Bound and refine: the screen's row bounds against the exact rows, and the top-k of a low-rank product
against the dense product's (stable) sort, on random, tied and adversarial matrices."""

from __future__ import annotations

import pytest
import torch

from qkov.analysis.circuits import bounded as Bd
from qkov.analysis.circuits.factored import LowRank

SCREENS = [torch.bfloat16, torch.float32]  # the fast screen and the plain one (other CPUs, GPUs)
BIG = 256 * 2**20


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def dense_top(full: torch.Tensor, k: int, largest: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: the dense matrix flattened, sorted stably (equal values keep index order)."""
    v, i = torch.sort(full.reshape(-1), descending=largest, stable=True)
    return v[:k], i[:k]


def chunked(A: torch.Tensor, B: torch.Tensor, rows: int = 7) -> torch.Tensor:
    """``A @ B`` in row chunks (at least two rows each), as a scan computes it."""
    return torch.cat([A[lo : lo + rows] @ B for lo in range(0, A.shape[0], rows)])


def adversarial(seed: int) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """Factor pairs a careless bound gets wrong: entries closer than bfloat16 resolves, rows of very
    different scales, rows with no positive entry, inputs on bfloat16's rounding midpoints."""
    g = gen(seed)
    near_A = 1 + 1e-3 * torch.randn(300, 16, generator=g)
    near_B = 1 + 1e-3 * torch.randn(16, 400, generator=g)
    scales = torch.randn(200, 8, generator=g) * torch.logspace(-6, 6, 200)[:, None]
    neg_A, neg_B = -torch.rand(150, 6, generator=g) - 0.1, torch.rand(6, 300, generator=g) + 0.1
    up = torch.randint(0, 2, (120, 12), generator=g).bool()
    mid = torch.where(up, 1 + 2.0**-8, 1 - 2.0**-9)  # exactly between two bfloat16s (above 1, below 1)
    return [
        ("near ties", near_A, near_B),
        ("scales", scales, torch.randn(8, 250, generator=g)),
        ("all negative", neg_A, neg_B),
        ("midpoints", mid * torch.randn(120, 12, generator=g).sign(), 1 + 2.0**-9 * torch.randn(12, 180, generator=g)),
    ]


@pytest.mark.parametrize("screen", SCREENS)
def test_row_bounds_cover_every_evaluation_of_every_row_and_stay_close(screen: torch.dtype) -> None:
    g = gen(0)
    cases = [("random", torch.randn(700, 64, generator=g), torch.randn(64, 900, generator=g)), *adversarial(1)]
    for name, A, B in cases:
        for max_bytes in (BIG, 3 * B.shape[1] * 2):  # one block, and blocks of a few rows
            U = Bd.row_bounds(A, B, max_bytes=max_bytes, dtype=screen)
            whole, rows = (A @ B).amax(-1).double(), chunked(A, B).amax(-1).double()
            assert U.dtype == torch.float64 and bool((U >= whole).all()) and bool((U >= rows).all()), name
            # and not far above: the screen's error bound, twice over
            room = 2 * Bd._delta(A.shape[1], A.dtype, screen, A.device) * A.norm(dim=-1) * B.norm(dim=0).max()
            assert bool((U - whole <= room.double() + 1e-30).all()), name


def test_float64_factors_screen_in_float64() -> None:
    g = gen(2)
    A, B = torch.randn(90, 5, generator=g, dtype=torch.float64), torch.randn(5, 70, generator=g, dtype=torch.float64)
    assert Bd.screen_dtype(A.device, A.dtype) == torch.float64
    U = Bd.row_bounds(A, B, max_bytes=BIG)
    assert bool((U >= (A @ B).amax(-1)).all()) and bool((U - (A @ B).amax(-1) < 1e-12).all())


def test_stable_topk_is_the_stable_sort() -> None:
    g = gen(3)
    x = torch.randint(-3, 4, (5, 2, 300), generator=g).float()  # many ties, several leading dims
    x[0, 0] = 1.0  # a row of one value
    x[1, 1, :250] = float("-inf")
    for k in (1, 7, 50, 300):
        v, i = Bd.stable_topk(x, k)
        rv, ri = torch.sort(x, dim=-1, descending=True, stable=True)
        assert torch.equal(v, rv[..., :k]) and torch.equal(i, ri[..., :k]), k


def tied_cases() -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    g = gen(4)
    ints_A, ints_B = (
        torch.randint(-2, 3, (300, 3), generator=g).float(),
        torch.randint(-2, 3, (3, 500), generator=g).float(),
    )
    rep_A, rep_B = torch.randn(40, 4, generator=g).repeat(3, 1), torch.randn(4, 30, generator=g).repeat(1, 4)
    return [
        ("integers", ints_A, ints_B),
        ("repeated rows and columns", rep_A, rep_B),
        ("all equal", torch.full((50, 2), 0.5), torch.full((2, 60), 3.0)),
        ("zero", torch.zeros(20, 3), torch.randn(3, 25, generator=g)),
    ]


@pytest.mark.parametrize("screen", SCREENS)
def test_top_entries_equal_the_dense_sort_on_ties(screen: torch.dtype) -> None:
    for name, A, B in tied_cases():
        full = chunked(A, B)  # the values a scan computes (the repeated rows' equal in any chunk)
        for k in (1, 5, 120, 2 * B.shape[1] + 3):  # the last: more than a chunk of rows holds
            for chunk in (1, 3, 41):
                v, i = Bd.top_entries(A, B, k, max_bytes=2 * B.shape[1] * 2, chunk_rows=chunk, dtype=screen)
                rv, ri = dense_top(full, k)
                assert torch.equal(v, rv) and torch.equal(i, ri), (name, k, chunk)


@pytest.mark.parametrize("screen", SCREENS)
def test_top_entries_equal_the_dense_top_on_adversarial_factors(screen: torch.dtype) -> None:
    for name, A, B in adversarial(5):
        rows = chunked(A, B)  # the values a scan computes, ties (rare) in index order
        for k in (1, 9, 60):
            v, i = Bd.top_entries(A, B, k, max_bytes=4 * B.shape[1] * 2, chunk_rows=5, dtype=screen)
            rv, ri = dense_top(rows, k)
            assert torch.equal(v, rv) and torch.equal(i, ri), (name, k)


def test_the_refine_computes_few_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Random factors: the bounds rule out almost every row before it is computed."""
    g = gen(6)
    A, B = torch.randn(4096, 64, generator=g), torch.randn(64, 4096, generator=g)
    computed: list[int] = []
    exact_rows = Bd._exact_rows
    monkeypatch.setattr(Bd, "_exact_rows", lambda A, B, rows: computed.append(rows.numel()) or exact_rows(A, B, rows))
    for screen in SCREENS:
        computed.clear()
        v, i = Bd.top_entries(A, B, 20, max_bytes=BIG, chunk_rows=41, dtype=screen)
        assert sum(computed) < 4096 // 10, (screen, sum(computed))
        rv, ri = torch.topk((A @ B).reshape(-1), 20)
        assert torch.equal(i, ri) and torch.allclose(v, rv, rtol=1e-6, atol=1e-6)


def test_topk_at_vocabulary_8192_against_the_dense_product() -> None:
    g = gen(7)
    f = LowRank(torch.randn(8192, 64, generator=g) / 8, torch.randn(64, 8192, generator=g) / 8)
    full = f.materialize()
    for largest in (True, False):
        top = f.topk(50, largest=largest)
        rv, ri = torch.topk(full.reshape(-1), 50, largest=largest)
        assert torch.equal(top.rows * 8192 + top.cols, ri) and torch.allclose(top.values, rv, rtol=1e-6, atol=1e-6)
    del full


def test_topk_ties_smallest_subsets_and_batches() -> None:
    g = gen(8)
    A = torch.randint(-2, 3, (2, 3, 120, 3), generator=g).float()
    B = torch.randint(-2, 3, (3, 150), generator=g).float()  # shared across the batch (broadcast)
    f, full = LowRank(A, B), A @ B
    for largest in (True, False):
        top = f.topk(40, largest=largest, max_bytes=5 * 150 * 4)
        for b in range(2):
            for h in range(3):
                rv, ri = dense_top(full[b, h], 40, largest)
                assert torch.equal(top.values[b, h], rv) and torch.equal(top.rows[b, h] * 150 + top.cols[b, h], ri)
    # rows and columns given (unsorted): ties come in their order, indices are the whole matrix's
    rows, cols = torch.randperm(120, generator=g)[:70], torch.randperm(150, generator=g)[:90]
    sub = full[0, 1][rows][:, cols]
    for largest in (True, False):
        top = f[0, 1].topk(33, rows=rows, cols=cols, largest=largest)
        rv, ri = dense_top(sub, 33, largest)
        assert torch.equal(top.values, rv)
        assert torch.equal(top.rows, rows[ri // 90]) and torch.equal(top.cols, cols[ri % 90])


def test_the_screen_is_bfloat16_only_where_it_runs_faster(monkeypatch: pytest.MonkeyPatch) -> None:
    """bfloat16 screens float32 factors on a CPU only where its bfloat16 products are faster (some CPUs with
    AVX-512 BF16 and no AMX run them at half the float32 rate); float64 factors and other devices screen in
    their own dtype; a CPU without native bfloat16 is not timed at all."""
    cpu = torch.device("cpu")
    for faster, want in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(Bd, "_bf16_faster", lambda faster=faster: faster)
        assert Bd.screen_dtype(cpu, torch.float32) == want
        assert Bd.screen_dtype(cpu, torch.float64) == torch.float64
        assert Bd.screen_dtype(torch.device("meta"), torch.float32) == torch.float32
    monkeypatch.undo()
    monkeypatch.setattr(Bd, "_bf16_cpu", lambda: False)
    monkeypatch.setattr(Bd.torch, "matmul", None)  # nothing is timed
    assert Bd._bf16_faster.__wrapped__() is False
