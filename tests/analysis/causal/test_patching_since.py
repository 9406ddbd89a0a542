"""Patched passes compute only what a patch can change: a patch that writes the base run's own value is not
run (its metric is the base run's), and the positions before a patch's first change take their logits from
the base recording (attention is causal) instead of being unembedded again. The results equal one patch at a
time with every position unembedded (a metric over every position, both directions), and equal the sweeps
with every copy run whole; the work saved is counted."""

from __future__ import annotations

import itertools

import pytest
import torch

from qkov import Transformer, Weights
from qkov.analysis.causal import patching as Pt
from qkov.analysis.causal.contrast import Contrast, copy_bytes
from qkov.analysis.causal.metrics import Loss
from qkov.analysis.causal.path_patch import path_patching

from helpers import LN_MLP, perturb_non_matrices, one_patch

GPT2_LIKE = LN_MLP.replace(positional="standard", act_fn="gelu_new")


def _setup():  # type: ignore[no-untyped-def]
    m = perturb_non_matrices(Transformer(GPT2_LIKE, seed=2).double().eval(), 0.2)
    w = Weights.from_model(m, dtype=torch.float64)
    g = torch.Generator().manual_seed(1)
    clean = torch.randint(1, GPT2_LIKE.d_vocab, (2, 10), generator=g)
    corrupted = clean.clone()
    corrupted[:, 4:6] = torch.randint(1, GPT2_LIKE.d_vocab, (2, 2), generator=g)  # positions 0-3 the same
    return w, clean, corrupted


@pytest.fixture
def every_copy_whole(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """A switch: run every copy, alone, from the first position, unembedded whole (the plain procedure)."""

    def plain(self, firsts, K):  # type: ignore[no-untyped-def]
        return [(0, [i]) for i in range(len(firsts))]

    def whole() -> None:
        monkeypatch.setattr(Contrast, "passes", plain)
        monkeypatch.setattr(Contrast, "_ragged", lambda self, firsts, since: False)

    return whole


@pytest.mark.parametrize("direction", ["denoise", "noise"])
def test_sweeps_with_a_metric_over_every_position_equal_one_patch_at_a_time(direction: str) -> None:
    w, clean, corrupted = _setup()
    base, src = (corrupted, clean) if direction == "denoise" else (clean, corrupted)
    metric = Loss(tokens=clean)
    cases = [
        ("resid_pre", ("layer", "pos"), lambda p: (p,)),
        ("head_out", ("layer", "head"), lambda h: (slice(None), h)),
        ("z", ("layer", "pos", "head"), lambda p, h: (p, h)),
        ("pattern", ("layer", "head", "pos"), lambda h, p: (h, p)),
    ]
    for kind, axes, index in cases:
        budget = 3 * copy_bytes(w, clean, None)  # three copies a pass
        got = Pt.activation_patching(w, clean, corrupted, site=kind, axes=axes, metric=metric, direction=direction, max_bytes=budget)
        for cell in itertools.product(*(range(n) for n in got.values.shape)):
            want = one_patch(w, base, src, kind, cell[0], index(*cell[1:]), metric)
            assert got.values[cell] == pytest.approx(want, abs=1e-10), (kind, cell)
        assert (got.values - got.base).abs().max() > 1e-6


@pytest.mark.parametrize("receivers", ["1.0", "logits"])
def test_the_work_saved_changes_no_number(receivers: str, monkeypatch: pytest.MonkeyPatch, every_copy_whole) -> None:  # type: ignore[no-untyped-def]
    w, clean, corrupted = _setup()
    rows: list[int] = []  # positions unembedded, per sequence of each pass
    real = Contrast.measure

    def counted(self, K, *a, **k):  # type: ignore[no-untyped-def]
        rows.append(K * (self.base.shape[1] - k.get("since", 0)))
        return real(self, K, *a, **k)

    monkeypatch.setattr(Contrast, "measure", counted)
    runs = lambda: [  # noqa: E731
        Pt.activation_patching(w, clean, corrupted, site="resid_pre").values,
        Pt.activation_patching(w, clean, corrupted, site="head_out").values,
        path_patching(w, clean, corrupted, receivers=receivers).values,
    ]
    fast, saved = runs(), list(rows)
    rows.clear()
    every_copy_whole()
    whole = runs()
    for a, b in zip(fast, whole):
        assert torch.allclose(a, b, atol=1e-10, equal_nan=True)
    L, H, T = w.cfg.n_layers, w.cfg.n_heads, clean.shape[1]
    senders = H * (L if receivers == "logits" else 1)
    assert sum(rows) == T * (L * T + L * H + senders)  # the plain procedure: every copy, every position
    # resid_pre: positions 0-3 equal in both runs at every layer (never run), the others from their own position
    assert sum(saved) < 0.6 * sum(rows)


@pytest.mark.parametrize("kind", ["resid_pre", "head_out", "z", "mlp_out"])
def test_suffix_passes_run_the_positions_from_the_first_change_only_and_change_no_number(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A patched pass whose copies change nothing before position ``since`` runs the blocks on the positions from
    there on only, after the base run's keys and values (as a generation cache would): the same metric as the
    pass over every position, to 1e-10, with fewer positions through the blocks."""
    w, clean, corrupted = _setup()
    from qkov.analysis.forward import tracer

    seen: list[tuple[int, int]] = []  # (positions run, positions in the past) per patched pass
    real = tracer.trace

    def counted(source, tokens, *a, **k):  # type: ignore[no-untyped-def]
        past = k.get("past")
        seen.append((tokens.shape[1], 0 if past is None else past[0].shape[2]))
        return real(source, tokens, *a, **k)

    monkeypatch.setattr("qkov.analysis.causal.contrast.trace", counted)
    budget = 3 * copy_bytes(w, clean, None)
    fast = Pt.activation_patching(w, clean, corrupted, site=kind, max_bytes=budget).values
    suffixes = [s for s in seen if s[1] > 0]
    assert suffixes and all(t + f == clean.shape[1] for t, f in suffixes)  # positions 0-3 never changed: from 4 on
    seen.clear()
    monkeypatch.setattr(Pt, "_suffix_passes", lambda c, kind: False)
    whole = Pt.activation_patching(w, clean, corrupted, site=kind, max_bytes=budget).values
    assert all(f == 0 for _, f in seen)
    assert torch.allclose(fast, whole, atol=1e-10, equal_nan=True)
    assert (fast - fast[0, 0]).abs().max() > 1e-6  # the sweep measured something


def test_each_copy_is_unembedded_from_its_own_first_change(monkeypatch: pytest.MonkeyPatch) -> None:
    """A metric over every position: a pass of copies changing from different positions unembeds each from its
    own first change (the rows counted: one per copy, sequence and position from its patch on, the last position
    predicting nothing kept), and gives the values of a pass that unembeds every copy from the pass's start."""
    w, clean, corrupted = _setup()
    B, T = clean.shape
    from qkov.analysis.forward import tracer

    unembedded: list[int] = []  # logit rows of the patched passes (the two recordings not counted)
    real = tracer.trace

    def counted(source, tokens, *a, **k):  # type: ignore[no-untyped-def]
        out = real(source, tokens, *a, **k)
        if k.get("start_at") is not None:
            unembedded.append(out.logits.shape[0] * out.logits.shape[1])
        return out

    monkeypatch.setattr("qkov.analysis.causal.contrast.trace", counted)
    budget = 5 * copy_bytes(w, clean, None)
    fast = Pt.activation_patching(w, clean, corrupted, site="resid_pre", max_bytes=budget).values
    L = w.cfg.n_layers
    # positions 0-3 never change; at layer 0 the tokens differ at 4 and 5; later every position from 4 on
    firsts = [4, 5] + [p for l in range(1, L) for p in range(4, T)]
    assert sum(unembedded) == B * sum(T - p for p in firsts)
    monkeypatch.setattr(Contrast, "_ragged", lambda self, firsts, since: False)
    unembedded.clear()
    whole = Pt.activation_patching(w, clean, corrupted, site="resid_pre", max_bytes=budget).values
    assert sum(unembedded) > B * sum(T - p for p in firsts)
    assert torch.allclose(fast, whole, atol=1e-10)


@pytest.mark.parametrize("at", [None, [1, 3, -2]])
@pytest.mark.parametrize("given", [True, False])
def test_the_loss_is_the_sum_of_its_position_terms(at, given: bool) -> None:  # type: ignore[no-untyped-def]
    """Loss.position_terms over every position, summed and averaged over the batch, is the loss (float64); a
    batch of copies reads the metric's tokens repeated; the last position and those the loss skips add 0."""
    w, clean, corrupted = _setup()
    from qkov.analysis.forward.tracer import trace

    metric = Loss(tokens=clean if given else None, at=at)
    run = trace(w, clean.repeat(3, 1))
    T = clean.shape[1]
    terms = metric.position_terms(run.logits, torch.arange(T), clean.repeat(3, 1))
    assert terms.shape == (3 * clean.shape[0], T) and terms.dtype == torch.float64
    rel = 1e-12 if at is None else 1e-6  # the loss at chosen positions is taken in float32, as the metric takes it
    assert float(terms.sum(1).mean()) == pytest.approx(float(metric(run)), rel=rel)
    skipped = [p for p in range(T) if p not in ({q % T for q in at} if at else set(range(T - 1)))]
    assert bool((terms[:, skipped] == 0).all()) and bool((terms[:, [p for p in range(T) if p not in skipped]] > 0).all())
    part = metric.position_terms(run.logits[:, 5:], torch.arange(5, T), clean.repeat(3, 1))  # a suffix's terms
    assert torch.equal(part, terms[:, 5:])


@pytest.mark.parametrize("start", ["logits", "layer 1"])
def test_copies_changing_from_their_own_positions_measure_as_a_whole_pass(start: str) -> None:
    """Contrast.measure with ``firsts``: copies whose streams change from different positions (into the logits:
    the final stream given; into a layer: an edit of its input), each unembedded from its own first change, give
    the metric of the same pass unembedded whole."""
    w, clean, corrupted = _setup()
    c = Contrast.of(w, clean, corrupted, metric=Loss(tokens=clean))
    L, (B, T) = w.cfg.n_layers, clean.shape
    c.record([f"resid_pre.{l}" for l in range(L)] + [f"resid_post.{L - 1}"])
    firsts = [4, 6, 8, T - 1]  # the last: a change at the last position, which predicts nothing
    g = torch.Generator().manual_seed(3)
    delta = torch.zeros(len(firsts), B, T, w.cfg.d_model, dtype=torch.float64)
    for k, p in enumerate(firsts):
        delta[k, :, p:] = torch.randn(B, T - p, w.cfg.d_model, generator=g, dtype=torch.float64)
    K = len(firsts)
    if start == "logits":
        final = c.base_recording[("resid_post", L - 1)]  # type: ignore[index]
        stream = (final[None] + delta).reshape(K * B, T, -1)
        run = lambda f: c.measure(K, start=L, stream=stream, since=4, firsts=f)  # noqa: E731
    else:
        edit = {"resid_pre.1": lambda v, site: v + delta.reshape(K * B, T, -1)}
        run = lambda f: c.measure(K, edit, start=1, since=4, firsts=f)  # noqa: E731
    ragged, whole = run(firsts), run(None)
    assert torch.allclose(ragged, whole, atol=1e-10, rtol=0)
    assert len(set(whole[:3].tolist())) == 3 and float(whole[3]) == pytest.approx(c.base_value, abs=1e-12)
