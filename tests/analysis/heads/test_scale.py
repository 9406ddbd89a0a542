"""Defaults that scale: the copying rate sampled (with its error) above 8192 tokens, path
analyses sized and refused before they exhaust memory, virtual heads streamed, progress on
long work, and ranges validated before any work."""

from __future__ import annotations

import io
import math

import pytest
import torch
from rich.console import Console

from qkov import ModelConfig, QkovError, Transformer
from qkov.analysis import circuits as C
from qkov.analysis import paths as P
from qkov.analysis.heads.report import head_report
from qkov.apps.cli import main
from qkov.apps.progress import TrainProgress
from qkov.weights import Weights

from hand_built import identity_model
from qkov.analysis.heads.repeated import _copying


def _random_weights(d_vocab: int, seed: int = 0) -> Weights:
    cfg = ModelConfig(n_layers=2, n_heads=2, d_model=16, d_head=4, d_vocab=d_vocab, n_ctx=8)
    return Weights.from_model(Transformer(cfg, seed=seed))


def _exact_rates(w: Weights, k: int, rows: torch.Tensor | None = None) -> list[float]:
    """The own-logit-in-top-k rate from the materialised W_E W_OV W_U, rows restricted after."""
    out = []
    for l in range(w.cfg.n_layers):
        for h in range(w.cfg.n_heads):
            full = (w.W_E.double() @ w.W_V[l, h].double() @ w.W_O[l, h].double() @ w.W_U.double()).float()
            idx = torch.arange(full.shape[0]) if rows is None else rows
            diag = full[idx, idx]
            rank = (full[idx] >= diag[:, None]).sum(-1) - 1
            out.append(float((rank < k).float().mean()))
    return out


def test_diag_k_must_lie_below_the_vocabulary(capsys: pytest.CaptureFixture[str]) -> None:
    w = identity_model(10, 3, +1.0)
    for bad in (10, 11, 0):
        with pytest.raises(QkovError, match=r"diag_k must be an integer from 1 to 9"):
            C.check_diag_k(bad, 10)
    with pytest.raises(QkovError, match="diag_k"):
        C.copying_scores(w, diag_k=10)
    with pytest.raises(QkovError, match="diag_k"):
        C.circuits_report(w, diag_k=50)
    with pytest.raises(QkovError, match="diag_k"):
        head_report(w, torch.zeros(1, 4, dtype=torch.long), diag_k=10)
    # the largest k allowed: the 7 all-zero rows tie everywhere, and ties count against
    assert C.copying_scores(w, diag_k=9).heads[0].diag_topk_rate == pytest.approx(0.3)


def test_the_rate_is_exact_up_to_8192_tokens_and_sampled_above() -> None:
    assert C.diag_tokens(8192) is None
    rows = C.diag_tokens(50257)
    assert rows is not None and len(rows) == C.DIAG_SAMPLE == 1024
    assert torch.equal(rows, rows.unique()) and int(rows.max()) < 50257  # sorted, no repeats
    assert torch.equal(rows, C.diag_tokens(50257)) and not torch.equal(rows, C.diag_tokens(50257, seed=1))
    assert C.diag_tokens(100, 100) is None and len(C.diag_tokens(100, 7)) == 7  # type: ignore[arg-type]
    w = _random_weights(9000)
    heads = C.copying_scores(w, diag_k=5)
    rows = C.diag_tokens(9000)
    assert rows is not None
    expected = _exact_rates(w, 5, rows)
    assert [h.diag_topk_rate for h in heads] == pytest.approx(expected, abs=1e-12)
    assert all(h.diag_tokens == 1024 and h.diag_stderr is not None and h.diag_stderr > 0 for h in heads)
    exact = C.copying_scores(_random_weights(300), diag_k=5)
    assert all(h.diag_tokens == 300 and h.diag_stderr == 0.0 for h in exact)


def test_a_sampled_rate_lands_within_its_error_of_the_exact_one() -> None:
    """A hand-built head with a known rate: W_OV copies the first 600 of 3000 tokens (rate 0.2)."""
    d = 3000
    cfg = ModelConfig(n_layers=1, n_heads=1, d_model=d, d_head=600, d_vocab=d, n_ctx=4)
    m = Transformer(cfg, seed=0)
    with torch.no_grad():
        m.W_E.copy_(torch.eye(d))
        m.W_U.copy_(torch.eye(d))
        proj = torch.eye(d)[:, :600]
        m.blocks[0].attn.W_V.copy_(proj[None] * 3)
        m.blocks[0].attn.W_O.copy_(proj.T[None])
    w = Weights.from_model(m)
    assert C.copying_scores(w, diag_k=1).heads[0].diag_topk_rate == pytest.approx(0.2)
    misses = 0
    for seed in range(20):
        h = C.copying_scores(w, diag_k=1, diag_sample=300, seed=seed).heads[0]
        assert h.diag_tokens == 300 and h.diag_stderr == pytest.approx(
            math.sqrt(0.2 * 0.8 / 300 * 2700 / 2999), rel=0.1
        )
        misses += abs(h.diag_topk_rate - 0.2) > 2 * h.diag_stderr  # type: ignore[operator]
    assert misses <= 4, "about 5% of samples should land beyond two standard errors"


def test_circuits_says_when_the_rate_is_an_estimate(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    from qkov.io.checkpoint import save_checkpoint

    cfg = ModelConfig(n_layers=2, n_heads=2, d_model=16, d_head=4, d_vocab=9000, n_ctx=8)
    save_checkpoint(Transformer(cfg, seed=0), tmp_path / "big")
    assert main(["circuits", str(tmp_path / "big")]) == 0
    out = " ".join(capsys.readouterr().out.split())  # the caption wraps at the terminal's width
    assert "estimated on a seeded sample of 1,024 of 9,000 tokens" in out and "±" in out
    assert main(["circuits", str(tmp_path / "big"), "--diag-k", "9000"]) == 2
    assert "diag_k must be an integer from 1 to 8999" in capsys.readouterr().err


# ------------------------------------------------------------------ streamed head scores
@pytest.mark.parametrize("norm, positional", [("none", "shortformer"), ("layernorm", "standard")])
def test_text_scores_streamed_by_layer_and_chunk_equal_the_whole_pattern_definitions(norm, positional) -> None:
    """The streamed text scores (one layer's attention at a time, a few sequences at a time) equal
    the definitions on the whole ``[L, B, H, T, T]`` pattern stack, to 1e-6 (float64 here)."""
    from qkov.analysis.heads import pattern_scores as Ts
    from qkov.analysis.forward.tracer import trace

    cfg = ModelConfig(
        n_layers=3, n_heads=2, d_model=16, d_head=4, d_vocab=50, n_ctx=12, normalization=norm,
        positional=positional, d_mlp=32 if norm == "layernorm" else None,
    )  # fmt: skip
    w = Weights.from_model(Transformer(cfg, seed=3).double(), dtype=torch.float64)
    text = torch.randint(0, 50, (5, 12), generator=torch.Generator().manual_seed(2))
    r = trace(w, text, cache=["pattern", "v", "qk_in", *(["*_scale*"] if norm != "none" else [])])
    W_O = torch.stack([w.attention(l).W_O for l in range(3)])
    values = r.stack("v").transpose(2, 3)  # [L, B, H, T, E] (no grouped-query heads here)
    norms = torch.einsum("lbhte,lhed->lbhtd", values, W_O).norm(dim=-1)
    patterns = r.stack("pattern")
    whole = {
        "previous_token": Ts.previous_token_scores(patterns),
        "self_attention": Ts.self_attention_scores(patterns),
        "sink": Ts.sink_scores(patterns),
        "sink_value_weighted": Ts.value_weighted_sink_scores(patterns, norms),
        "positional_fraction": Ts.positional_fraction(w, r),
    }
    assert float(whole["positional_fraction"].abs().sum()) > 0  # a score that is there to compare
    for chunk in (1, 2, 5):
        streamed = Ts.text_scores(w, text, chunk=chunk)
        assert streamed.keys() == whole.keys()
        for k in whole:
            assert torch.allclose(streamed[k], whole[k], atol=1e-6, rtol=0), (chunk, k)
    # the default chunk: as many sequences as fit TEXT_CHUNK_BYTES at one layer's peak
    per_sequence = (12 * 1024 * (4 * 1024 + 768) + 1024 * 50257) * 4  # GPT-2 small, float32
    assert Ts.sequence_bytes(_Shape(), 1024) == per_sequence  # type: ignore[arg-type]
    n = Ts.chunk_size(_Shape(), 1024)  # type: ignore[arg-type]
    assert n == 1 and n * per_sequence <= Ts.TEXT_CHUNK_BYTES < (n + 1) * per_sequence


def test_text_scores_read_the_leading_sequences_from_a_recording() -> None:
    """A pass already made over the first n sequences (the report's one recorded run of its text) gives the
    streamed scores: bit for bit where its rows are the streamed first chunk, else to 1e-12 (float64);
    a recording of other tokens, or without a site the scores read, is refused in one line."""
    from qkov.analysis.heads import pattern_scores as Ts
    from qkov.analysis.forward.tracer import trace

    cfg = ModelConfig(n_layers=2, n_heads=2, d_model=16, d_head=4, d_vocab=50, n_ctx=12, normalization="rmsnorm")
    w = Weights.from_model(Transformer(cfg, seed=5).double(), dtype=torch.float64)
    text = torch.randint(0, 50, (5, 12), generator=torch.Generator().manual_seed(4))
    sites = Ts.text_sites(w)
    assert {"pattern.*", "v.*", "qk_in.*"} <= set(sites) and len(sites) == 4  # and the query/key divisor
    for n, chunk in ((1, 1), (2, 2), (5, 5), (2, 3), (3, 1)):
        streamed = Ts.text_scores(w, text, chunk=chunk)
        read = Ts.text_scores(w, text, chunk=chunk, recording=trace(w, text[:n], cache=sites))
        for k in streamed:
            if n == chunk:
                assert torch.equal(read[k], streamed[k]), (n, chunk, k)
            assert torch.allclose(read[k], streamed[k], atol=1e-12, rtol=0), (n, chunk, k)
    with pytest.raises(QkovError, match="leading sequences"):
        Ts.text_scores(w, text, recording=trace(w, text[1:3], cache=sites))
    with pytest.raises(QkovError, match="qk_in"):
        Ts.text_scores(w, text, recording=trace(w, text[:2], cache=["pattern", "v"]))


class _Shape:
    cfg = ModelConfig(n_layers=12, n_heads=12, d_model=768, d_head=64, d_vocab=50257, n_ctx=1024)
    dtype = torch.float32


# ------------------------------------------------------------------ paths
def test_virtual_heads_are_streamed_keeping_only_the_largest() -> None:
    cfg = ModelConfig(n_layers=3, n_heads=3, d_model=24, d_head=8, d_vocab=40, n_ctx=10)
    w = Weights.from_model(Transformer(cfg, seed=1).double(), dtype=torch.float64)
    tokens = torch.randint(0, 40, (2, 10), generator=torch.Generator().manual_seed(0))
    every = P.expand(w, tokens, virtual_heads=True)
    kept = P.expand(w, tokens, virtual_heads=True, keep_virtual=5)
    largest = sorted(every.virtual, key=lambda k: -float(every.virtual[k].pow(2).mean()))[:5]
    assert sorted(kept.virtual) == sorted(largest)
    assert all(torch.equal(kept.virtual[k], every.virtual[k]) for k in largest)
    assert P.virtual_pairs(w) == 27 == len(every.virtual)
    # the virtual heads are the order-2 term, exactly
    assert torch.allclose(sum(every.virtual.values()), every.orders[2], atol=1e-12)
    full = P.summarize(w, tokens, top_virtual=5)
    assert full.coverage is not None and full.coverage.exact and len(full.virtual) == 5
    assert full.coverage.explained == pytest.approx(1.0, abs=1e-12) and full.coverage.left_bound == 0
    off = P.summarize(w, tokens, top_virtual=5, virtual_terms=0)
    assert off.coverage is None and off.virtual == [] and off.to_dict()["virtual_coverage"] is None
    assert off.importance.run_losses == full.importance.run_losses


def test_virtual_heads_beyond_the_budget_are_chosen_by_a_bound_that_holds() -> None:
    """Above ``virtual_terms`` pairs, the ones materialised are those with the largest upper
    bounds; every bound holds (no term is larger than its bound), no term left out is larger
    than the largest bound left out, and the stated share of the order-2 term is exact."""
    from qkov.analysis.paths import virtual as Vh

    cfg = ModelConfig(n_layers=3, n_heads=3, d_model=24, d_head=8, d_vocab=40, n_ctx=10, normalization="layernorm")
    model = Transformer(cfg, seed=2).double()
    with torch.no_grad():
        model.W_E.mul_(0.01)  # a small stream: LayerNorm divisors well below 1, so the bound must include them
    w = Weights.from_model(model, dtype=torch.float64)
    tokens = torch.randint(0, 40, (3, 10), generator=torch.Generator().manual_seed(1))
    every = P.expand(w, tokens, virtual_heads=True)
    assert float(every.recording.divisor("attn_v", 1).max()) < 1
    bounds = Vh.virtual_bounds(w, every.recording, every.heads)
    norms = {k: float(t.pow(2).sum().sqrt()) for k, t in every.virtual.items()}
    assert bounds.keys() == norms.keys() and len(norms) == 27
    assert all(norms[k] <= bounds[k] * (1 + 1e-9) for k in norms)
    s = P.summarize(w, tokens, top_virtual=4, virtual_terms=9)
    cover = s.coverage
    assert cover is not None and (cover.pairs, cover.materialised) == (27, 9) and not cover.exact
    chosen = sorted(bounds, key=lambda k: -bounds[k])[:9]
    left = [k for k in bounds if k not in chosen]
    assert max(norms[k] for k in left) <= cover.left_bound * max(norms[k] for k in chosen) * (1 + 1e-9)
    rest = every.orders[2] - sum(every.virtual[k] for k in chosen)
    assert cover.explained == pytest.approx(1 - float(rest.pow(2).sum() / every.orders[2].pow(2).sum()), abs=1e-9)
    assert 0 < cover.explained < 1
    listed = {e.name for e in s.virtual}
    largest = sorted(chosen, key=lambda k: -norms[k])[:4]
    assert listed == {f"{a}.{b}->{c}.{d}" for a, b, c, d in largest}, (listed, largest)
    assert P.PathSummary.from_dict(s.to_dict()).coverage == cover
    with pytest.raises(QkovError, match="must be >= 0"):
        Vh.select_virtual(w, every.recording, every.heads, every.orders[2], most=-1, keep=1)
    # bounds are computed in float64 whatever the view's dtype (half-precision views have no QR on CPU)
    half = Weights.from_model(model.float(), dtype=torch.bfloat16)
    assert len(Vh.virtual_bounds(half, P.expand(half, tokens).recording, P.expand(half, tokens).heads)) == 27


def test_paths_refuses_what_would_not_fit_before_any_work(
    monkeypatch: pytest.MonkeyPatch, tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    import qkov.device as D
    from qkov.io.checkpoint import save_checkpoint

    w = _random_weights(40)
    need = P.expansion_bytes(w, 1, 8, virtual=11)  # the 10 largest virtual heads kept, and their sum
    monkeypatch.setattr(D, "free_memory", lambda _dev: need - 1)
    with pytest.raises(
        QkovError, match=r"paths: the expansion of 1 x 8 tokens needs about 21\.2 KiB, more than .* free: analyse fewer"
    ):
        P.summarize(w, torch.zeros(1, 8, dtype=torch.long))
    save_checkpoint(Transformer(w.cfg, seed=0), tmp_path / "m")
    assert main(["paths", str(tmp_path / "m"), "--batch", "1"]) == 2
    assert "analyse fewer sequences" in capsys.readouterr().err
    monkeypatch.setattr(D, "free_memory", lambda _dev: need)
    P.summarize(w, torch.zeros(1, 8, dtype=torch.long))  # exactly enough
    # a budget below what is free (--max-memory) refuses the same way, and says which limit it hit
    monkeypatch.setattr(D, "free_memory", lambda _dev: 2**40)
    monkeypatch.setattr(D, "_budget", None)  # restored after the test, whatever the CLI set
    assert main(["paths", str(tmp_path / "m"), "--batch", "1", "--max-memory", f"{need - 1}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "memory budget" in err and "pass a smaller --batch, or a larger --max-memory" in err
    assert main(["paths", str(tmp_path / "m"), "--batch", "1", "--max-memory", f"{need}", "--json"]) == 0
    assert D._budget is None, "--max-memory belongs to one command: later library calls are not capped"
    with pytest.raises(SystemExit) as bad:
        main(["paths", str(tmp_path / "m"), "--max-memory", "lots"])
    assert bad.value.code == 2 and "expected a memory size such as 4GiB" in capsys.readouterr().err


def test_the_default_batch_holds_at_most_2048_tokens() -> None:
    assert [P.default_batch(n) for n in (8, 32, 256, 512, 1024, 2048, 4096)] == [8, 8, 8, 4, 2, 1, 1]


def test_the_gpt2_small_estimate_is_a_few_gib() -> None:
    """GPT-2 small's default paths batch (2 x 1024 tokens) is sized at a few GiB, not the 24+ GiB
    that holding its 9,504 virtual heads took."""

    class Shape:
        cfg = ModelConfig(n_layers=12, n_heads=12, d_model=768, d_head=64, d_vocab=50257, n_ctx=1024)
        dtype = torch.float32

    gib = P.expansion_bytes(Shape(), P.default_batch(1024), 1024, virtual=10) / 2**30  # type: ignore[arg-type]
    assert 2 < gib < 6


# ------------------------------------------------------------------ training progress
def test_a_slow_first_step_says_how_long_the_run_will_take() -> None:
    """Training's display hears the steps through the progress protocol: the time from the start to the
    first step, times the steps left, is said once (a quick first step says nothing)."""
    buf = io.StringIO()
    with TrainProgress(console=Console(file=buf, force_terminal=False)) as progress:
        progress.clock = iter([100.0, 130.0, 160.0]).__next__
        for step in range(3):
            progress("train", step, 101)
    assert buf.getvalue().count("the first step took 30.0 s: about 50 min for the 100 steps left") == 1
    quick = io.StringIO()
    with TrainProgress(console=Console(file=quick, force_terminal=False)) as progress:
        progress.clock = iter([100.0, 100.01]).__next__
        progress("train", 0, 101)
        progress("train", 1, 101)
    assert quick.getvalue() == ""


def test_copying_scores_read_a_seeded_sample_of_queries_only_at_large_vocabularies(monkeypatch) -> None:
    from qkov.analysis import heads as Hd
    from qkov.analysis.forward.tracer import trace
    from qkov.analysis.heads.probes import prefix_matching_tokens

    q = torch.arange(26, 101)
    assert torch.equal(Hd.copying_queries(q, 10, 1024), q)  # the default models: every query (2^24 logits)
    few = Hd.copying_queries(q, 10, 50257)  # GPT-2's vocabulary: 33 of 75
    assert len(few) == 2**24 // (10 * 50257) == 33 and torch.equal(few, few.sort().values)
    assert set(few.tolist()) <= set(q.tolist()) and torch.equal(few, Hd.copying_queries(q, 10, 50257))
    # the scores on a sample are the definition applied to exactly those queries
    w = _random_weights(40)
    tokens = prefix_matching_tokens(40, length=3, seed=0, bos=0)[:, :8]
    whole = Hd.repeat_scores(w, tokens, 3)
    assert whole.copying_queries == (4, 4)
    from qkov.analysis.heads import repeated

    monkeypatch.setattr(repeated, "COPYING_LOGITS", 2 * tokens.shape[0] * 40)  # where repeat_scores reads it
    part = Hd.repeat_scores(w, tokens, 3)
    picked = Hd.copying_queries(torch.arange(4, 8), tokens.shape[0], 40, 2 * tokens.shape[0] * 40)
    assert part.copying_queries == (2, 4)
    r = trace(w, tokens, cache=["pattern", "head_out"])
    for l, h in ((0, 0), (1, 1)):
        A = r["pattern", l][:, h][:, picked]
        want = _copying(A, r["head_out", l][:, :, h][:, picked] @ w.W_U, r.tokens)
        assert (float(part.copying[l, h]), float(part.copying_rank[l, h])) == pytest.approx(want, abs=1e-6)
    assert torch.equal(part.prefix_matching, whole.prefix_matching)  # attention scores read every query


def test_report_trigram_tables_of_a_few_heads_at_large_vocabularies(monkeypatch) -> None:
    import importlib

    Co = importlib.import_module("qkov.apps.report.collect")  # the package exports a function of that name
    cfg = ModelConfig(n_layers=1, n_heads=5, d_model=16, d_head=4, d_vocab=40, n_ctx=8)
    w = Weights.from_model(Transformer(cfg, seed=4))
    assert Co._trigram_heads(w) == ([0, 1, 2, 3, 4], None)  # a small vocabulary: every head
    monkeypatch.setattr(Co, "DIAG_EXACT_MAX", 39)
    monkeypatch.setattr(Co, "TRIGRAM_HEADS", 2)
    chosen, note = Co._trigram_heads(w)
    dense = [float((w.W_E @ w.W_V[0, h] @ w.W_O[0, h] @ w.W_U).norm()) for h in range(5)]
    assert chosen == sorted(sorted(range(5), key=lambda h: -dense[h])[:2])
    assert note is not None and "2 of the 5 layer-0 heads" in note
    section = Co._trigrams(w, lambda i: f"<{i}>", 0, 3)
    assert [h.head for h in section.heads] == [f"0.{h}" for h in chosen] and section.note == note


def test_the_fast_copying_scores_equal_their_definition_with_repeated_attended_tokens() -> None:
    """_copying_in (logits made a block of rows at a time, a gather at each attended token once, the rank
    from one sign sum) gives _copying's numbers where several attended keys hold the same token and
    attention ties, whatever the block size."""
    from qkov.analysis.heads import repeated

    g = torch.Generator().manual_seed(0)
    B, Q, T, V, E = 3, 5, 12, 7, 4  # few token ids: many keys share one
    tokens = torch.randint(0, V, (B, T), generator=g)
    A = torch.rand(B, Q, T, generator=g).round(decimals=1)  # ties: several keys at the row's top half
    z, OU = torch.randn(B, Q, E, generator=g, dtype=torch.float64), torch.randn(E, V, generator=g, dtype=torch.float64)
    OU[:, 2] = OU[:, 5]  # two tokens with the same logit in every row: a tie in each rank
    z[0, 0] = 0.0  # a constant row: every rank a tie (the definition rounds its rank in float32)
    want = repeated._copying(A, z @ OU, tokens)
    assert repeated._copying_in(A, z, OU, tokens) == pytest.approx(want, abs=1e-6)
    shared = repeated.earlier_same(tokens, torch.float64)
    for rows in (1, 2, 4, 15, 16):  # a block of one row, blocks that leave a remainder, one block for all 15
        work = torch.empty(2, rows, V, dtype=torch.float64)
        assert repeated._copying_in(A, z, OU, tokens, work, shared) == pytest.approx(want, abs=1e-6)
