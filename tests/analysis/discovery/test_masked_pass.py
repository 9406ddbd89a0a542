"""The patched passes' savings change no value: circuits run with the prefix the clean and corrupted prompts
share computed once, the last layer at the metric's positions, each pass started at the first layer its
circuits change, a layer's receivers formed a chunk of tokens at a time from gathered changes, equal the
same pass run plainly (every position, from the first layer, one product a layer) and the independent
edge-coefficient forward, on every family of model; so do exact edge patching with the shared prefix,
the last layer's rows, the receivers' layer's attention taken from the base run and the logits unembedded at
the metric's entries alone, and every attribution method run from the shared prefix on."""

from __future__ import annotations

import pytest
import torch

import qkov.analysis.discovery.attribution as attribution
import qkov.analysis.discovery.evaluate as evaluate
import qkov.analysis.discovery.exact as exact
import qkov.analysis.discovery.masked as masked
from qkov.analysis.discovery import edge_scores, Evaluator, graph_of, make_ablation
from qkov.analysis.causal.contrast import Contrast
from qkov.analysis.discovery.evaluate import edge_weights
from qkov.analysis.forward.tracer import _Pass
from qkov.model.block import BlockPass

from edge_reference import CONFIGS, edge_forward, logit_diff, random_case, reference_circuit, senders_of


def circuits_of(g, seed: int = 0) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Random circuits of several densities, one changing only the last layer and the logits, one only
    the logits, one nearly empty and one nearly full."""
    gen = torch.Generator().manual_seed(seed)
    L = g.cfg.n_layers
    layer = torch.tensor([L if r.kind == "logits" else r.layer for r in g.receivers])[g.dst]
    rand = lambda d: torch.rand(g.n_edges, generator=gen) < d  # noqa: E731
    return torch.stack([rand(0.1), rand(0.5), rand(0.9), ~((layer >= L - 1) & rand(0.5)), ~((layer == L) & rand(0.5)),
                        rand(0.02), rand(0.98)])  # fmt: skip


def run(w, g, task, circuits, variant, ablation="corrupted"):  # type: ignore[no-untyped-def]
    ev = Evaluator(w, g, task, make_ablation(w, g, task, ablation), variant=variant, max_bytes=1 << 18)
    return ev, ev.metrics(circuits)


def plainly(monkeypatch: pytest.MonkeyPatch) -> None:
    """No shared prefix, every position through the last layer, every pass from the first layer, no chunks,
    no gathers."""
    monkeypatch.setattr(evaluate, "shared_prefix", lambda c, ablation: 0)
    monkeypatch.setattr(_Pass, "query_rows", lambda self, *a, **k: None)
    monkeypatch.setattr(evaluate, "first_layers", lambda g, flat: torch.zeros(len(flat), dtype=torch.long))
    monkeypatch.setattr(masked, "CHUNK_BYTES", 1 << 40)
    monkeypatch.setattr(masked, "GATHER", 0.0)


@pytest.mark.parametrize("name", CONFIGS)
def test_the_masked_pass_with_its_savings_equals_it_run_plainly_and_the_reference(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    w, task = random_case(name, n=3, T=6)  # the corrupted prompts differ from position 2 on
    g = graph_of(w.cfg)
    circuits, names = circuits_of(g), g.names
    patch, clean = senders_of(w, task.corrupted), senders_of(w, task.clean)
    calls: list[int] = []
    real = BlockPass.attention_at
    monkeypatch.setattr(BlockPass, "attention_at", lambda self, l, x, rows: calls.append(l) or real(self, l, x, rows))
    monkeypatch.setattr(masked, "CHUNK_BYTES", 1)  # a chunk a token; a gather whenever a change goes unread
    monkeypatch.setattr(masked, "GATHER", 1.01)
    fast = {v: run(w, g, task, circuits, v) for v in evaluate.VARIANTS}
    assert fast["ablate-complement"][0].parts[0][1].since == 2 and calls  # the prefix shared, the last layer's rows
    for k in range(len(circuits)):
        on = {names[i] for i in circuits[k].nonzero()[:, 0].tolist()}
        for variant, ablated in (("ablate-complement", set(names) - on), ("ablate-circuit", on)):
            want = reference_circuit(w, task.clean, patch, task.answers, task.wrong, ablated)
            assert abs(float(fast[variant][1][k]) - want) < 1e-10, (variant, k)
        one = torch.tensor(1.0, dtype=torch.float64)
        logits, _ = edge_forward(w, task.corrupted, {n: one for n in on}, clean)
        assert abs(float(fast["patch-in"][1][k]) - float(logit_diff(logits, task.answers, task.wrong))) < 1e-10
    plainly(monkeypatch)
    calls.clear()
    for v in evaluate.VARIANTS:
        ev, got = run(w, g, task, circuits, v)
        assert ev.parts[0][1].since == 0 and (got - fast[v][1]).abs().max() < 1e-12, v
    assert not calls


@pytest.mark.parametrize("name", ["gpt2-like", "llama-like"])
def test_every_edge_ablated_is_the_corrupted_run_without_a_pass_and_with_one(name: str) -> None:
    """Under the corrupted ablation a circuit with every edge ablated is the corrupted run: taken as it is
    by the evaluation, and what the masked pass computes (every receiver its fully ablated input)."""
    w, task = random_case(name, n=3, T=6)
    g = graph_of(w.cfg)
    ev, got = run(w, g, task, torch.zeros(1, g.n_edges, dtype=torch.bool), "ablate-complement")
    assert float(got[0]) == ev.corrupted and ev.nothing_kept() == ev.corrupted
    W = edge_weights(g, torch.ones(1, g.n_edges, dtype=torch.float64))
    p = ev.parts[0][1]
    assert abs(float(masked.MaskedPass(p, g, W).run()[0]) - ev.corrupted) < 1e-10
    _, mean = run(w, g, task, torch.zeros(1, g.n_edges, dtype=torch.bool), "ablate-complement", "mean")
    assert abs(float(mean[0]) - ev.corrupted) > 1e-6  # the fully mean-ablated model is not the corrupted run


@pytest.mark.parametrize("ablation", ["mean", "mean-position", "zero"])
def test_the_means_and_zero_run_from_the_first_position_as_the_reference(ablation: str) -> None:
    w, task = random_case("llama-like", n=3, T=6)
    g = graph_of(w.cfg)
    circuits, names = circuits_of(g, 1), g.names
    ev, got = run(w, g, task, circuits, "ablate-complement", ablation)
    assert ev.parts[0][1].since == 0
    means = make_ablation(w, g, task, ablation).means
    patch = senders_of(w, task.corrupted)
    for i, n in enumerate(("embed", *(a.name for a in g.senders[1:]))):
        if ablation == "zero":
            patch[n] = torch.zeros_like(patch[n])
        else:
            m = means[i]  # type: ignore[index]
            patch[n] = (m if m.ndim == 2 else m[None]).expand_as(patch[n])
    for k in range(len(circuits)):
        ablated = set(names) - {names[i] for i in circuits[k].nonzero()[:, 0].tolist()}
        assert abs(float(got[k]) - reference_circuit(w, task.clean, patch, task.answers, task.wrong, ablated)) < 1e-10


@pytest.mark.parametrize("name", ["llama-like", "ln-mlp-shortformer", "neox-parallel"])
def test_exact_patching_with_its_savings_equals_it_run_plainly(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    w, task = random_case(name, n=3, T=6)
    g = graph_of(w.cfg)
    last = [i for i, n in enumerate(g.names) if f"-> {w.cfg.n_layers - 1}." in n or "-> mlp." in n][::7]
    last += [i for i, n in enumerate(g.names) if "-> 0." in n and "<q>" not in n][::3]  # keys, values: layer 0
    calls: list[int] = []
    real = BlockPass.attention_at
    monkeypatch.setattr(BlockPass, "attention_at", lambda self, l, x, rows: calls.append(l) or real(self, l, x, rows))
    skipped: list[int] = []
    real_out = exact._attention_out
    monkeypatch.setattr(exact, "_attention_out", lambda c, l, *a: skipped.append(l) or real_out(c, l, *a))
    fast = edge_scores(w, task, method="exact", max_bytes=1 << 20)
    per = edge_scores(w, task, method="exact", per_position=True, edges=last)
    assert calls and (per.scores[:2, last] == 0).all() and (per.scores[2:, last] != 0).any()
    assert set(skipped) == set(range(w.cfg.n_layers - 1))  # the attention of the receivers' layer not run again
    monkeypatch.setattr(exact, "shared_prefix", lambda c, ablation: 0)
    monkeypatch.setattr(_Pass, "query_rows", lambda self, *a, **k: None)
    monkeypatch.setattr(exact, "skips_attention", lambda c, l: False)
    monkeypatch.setattr(Contrast, "_narrowed", lambda self, edits=None: None)  # the logits unembedded whole
    calls.clear()
    assert (edge_scores(w, task, method="exact", max_bytes=1 << 20).scores - fast.scores).abs().max() < 1e-12
    plain = edge_scores(w, task, method="exact", per_position=True, edges=last)
    assert not calls and (plain.scores[:, last] - per.scores[:, last]).abs().max() < 1e-12


@pytest.mark.parametrize("name", ["llama-like", "ln-mlp-shortformer"])
def test_attribution_from_the_shared_prefix_equals_it_from_the_first_position(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    w, task = random_case(name, n=3, T=6)
    runs = {}
    for shared in (True, False):
        if not shared:
            monkeypatch.setattr(attribution, "shared_prefix", lambda c, ablation: 0)
        runs[shared] = [edge_scores(w, task, method=m, steps=2) for m in attribution.ATTRIBUTION]
        runs[shared].append(edge_scores(w, task, method="eap", per_position=True))
    for fast, plain in zip(runs[True], runs[False]):
        assert (fast.scores - plain.scores).abs().max() < 1e-12, fast.method
    assert (runs[True][-1].scores[:2] == 0).all() and runs[True][0].scores.abs().max() > 1e-3
