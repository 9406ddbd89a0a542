"""Circuits: chosen from scores as defined, run with the rest ablated as the independent edge-coefficient
forward runs them (every variant and ablation), pruned without changing what they compute, and measured:
faithfulness, its curve (CPR, CMD) and ROC AUC against brute-force definitions."""

from __future__ import annotations

import pytest
import torch

from qkov import QkovError
from qkov.analysis.discovery import (
    area, auc, Circuit, circuit_roc, edge_scores, evaluate_circuit, Evaluator, faithfulness_curve, graph_of, greedy,
    make_ablation, MIB_FRACTIONS, prune, roc_points, threshold, top_n,
)  # fmt: skip
from qkov.analysis.discovery.faithfulness import evaluate, smallest_faithful
from qkov.analysis.discovery.roc import log_counts

from edge_reference import edge_forward, logit_diff, random_case, reference_circuit, senders_of


def random_circuits(n_edges: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    dens = torch.linspace(0.1, 0.9, k)[:, None]
    return torch.rand(k, n_edges, generator=g) < dens


@pytest.mark.parametrize("name", ["gpt2-like", "llama-like"])
@pytest.mark.parametrize("ablation", ["corrupted", "zero"])
def test_circuits_run_as_the_reference_runs_them(name: str, ablation: str) -> None:
    w, task = random_case(name, n=3, T=6)
    g = graph_of(w.cfg)
    circuits = random_circuits(g.n_edges, 4)
    patch = senders_of(w, task.corrupted)
    if ablation == "zero":
        patch = {s: torch.zeros_like(v) for s, v in patch.items()}
    abl = make_ablation(w, g, task, ablation)
    names = g.names
    for variant in ("ablate-complement", "ablate-circuit"):
        ev = Evaluator(w, g, task, abl, variant=variant, max_bytes=1 << 18)  # small: a few circuits per pass
        got = ev.metrics(circuits)
        for k in range(len(circuits)):
            on = {names[i] for i in circuits[k].nonzero()[:, 0].tolist()}
            ablated = set(names) - on if variant == "ablate-complement" else on
            assert (
                abs(float(got[k]) - reference_circuit(w, task.clean, patch, task.answers, task.wrong, ablated)) < 1e-10
            )
    if ablation == "corrupted":  # patch-in: the corrupted prompts, the circuit's edges from the clean run
        ev = Evaluator(w, g, task, abl, variant="patch-in")
        got = ev.metrics(circuits)
        clean = senders_of(w, task.clean)
        one = torch.tensor(1.0, dtype=torch.float64)
        for k in range(len(circuits)):
            alpha = {names[i]: one for i in circuits[k].nonzero()[:, 0].tolist()}
            logits, _ = edge_forward(w, task.corrupted, alpha, clean)
            assert abs(float(got[k]) - float(logit_diff(logits, task.answers, task.wrong))) < 1e-10
    else:
        with pytest.raises(QkovError, match="patch-in .* needs the corrupted ablation"):
            Evaluator(w, g, task, abl, variant="patch-in")


@pytest.mark.parametrize("name", ["gpt2-like", "llama-like"])
def test_nearly_empty_nearly_full_and_per_position_circuits_run_as_the_reference_runs_them(name: str) -> None:
    """Receivers with every edge in kept, every edge ablated, one kept or one ablated (each receiver reads
    whichever form has fewer senders), and circuits per position, against the reference forward."""
    w, task = random_case(name, n=3, T=6)
    g = graph_of(w.cfg)
    names = g.names
    patch = senders_of(w, task.corrupted)
    ev = Evaluator(w, g, task, make_ablation(w, g, task, "corrupted"), max_bytes=1 << 18)
    gen = torch.Generator().manual_seed(3)
    edges = torch.stack([torch.rand(g.n_edges, generator=gen) < d for d in (0.01, 0.04, 0.96, 0.99)])
    for k, got in enumerate(ev.metrics(edges).tolist()):
        ablated = {names[i] for i in (~edges[k]).nonzero()[:, 0].tolist()}
        assert abs(got - reference_circuit(w, task.clean, patch, task.answers, task.wrong, ablated)) < 1e-10
    T = task.clean.shape[1]
    per = torch.stack([torch.rand(T, g.n_edges, generator=gen) < d for d in (0.05, 0.5, 0.95)])
    for k, got in enumerate(ev.metrics(per).tolist()):
        alpha = {n: (~per[k, :, i]).to(torch.float64)[:, None] for i, n in enumerate(names) if not per[k, :, i].all()}
        with torch.no_grad():
            logits, _ = edge_forward(w, task.clean, alpha, patch)
        assert abs(got - float(logit_diff(logits, task.answers, task.wrong))) < 1e-10


def test_the_empty_and_full_circuits_are_the_corrupted_and_clean_runs() -> None:
    w, task = random_case("neox-parallel", n=3, T=6)
    g = graph_of(w.cfg)
    ev = Evaluator(w, g, task, make_ablation(w, g, task, "corrupted"))
    empty, full = ev.metrics(
        torch.stack([torch.zeros(g.n_edges, dtype=torch.bool), torch.ones(g.n_edges, dtype=torch.bool)])
    )
    assert abs(float(empty) - ev.corrupted) < 1e-10 and abs(float(full) - ev.clean) < 1e-10
    assert abs(ev.corrupted - ev.clean) > 1e-3 and abs(ev.nothing_kept() - ev.corrupted) < 1e-10


def test_exact_patching_is_the_circuit_with_one_edge_ablated() -> None:
    w, task = random_case("llama-like", n=2, T=5)
    g = graph_of(w.cfg)
    exact = edge_scores(w, task, method="exact")
    ev = Evaluator(w, g, task, make_ablation(w, g, task, "corrupted"), variant="ablate-circuit")
    one_each = torch.eye(g.n_edges, dtype=torch.bool)
    assert (ev.metrics(one_each) - ev.clean - exact.scores).abs().max() < 1e-10
    per = edge_scores(w, task, method="exact", per_position=True, edges=[5, 17])  # one edge at one position
    at = torch.zeros(5, 5, g.n_edges, dtype=torch.bool)
    for t in range(5):
        at[t, t, 17] = True
    assert (ev.metrics(at) - ev.clean - per.scores[:, 17]).abs().max() < 1e-10


def test_pruning_removes_dead_ends_and_under_resampling_changes_nothing() -> None:
    w, task = random_case("gpt2-like", n=3, T=6)
    g = graph_of(w.cfg)
    s_node, r_node = g.edge_nodes
    logits = len(g.nodes) - 1
    circuits = random_circuits(g.n_edges, 4, seed=3) & (
        torch.rand(g.n_edges, generator=torch.Generator().manual_seed(1)) < 0.3
    )
    pruned = [prune(Circuit(g, c)) for c in circuits]
    for c, p in zip(circuits, pruned):
        on = p.edges
        assert bool((on <= c).all())
        for node in set(s_node[on].tolist()) | set(r_node[on].tolist()):
            assert node == 0 or bool((r_node[on] == node).any()), "a node of the circuit receives nothing"
            assert node == logits or bool((s_node[on] == node).any()), "a node of the circuit sends nothing"
    ev = Evaluator(w, g, task, make_ablation(w, g, task, "corrupted"))
    before, after = ev.metrics(circuits), ev.metrics(torch.stack([p.edges for p in pruned]))
    assert (before - after).abs().max() < 1e-10
    assert sum(p.n_edges for p in pruned) < int(circuits.sum())  # something was pruned


def test_top_n_threshold_and_greedy_choose_as_defined() -> None:
    w, task = random_case("gpt2-like", n=2, T=5)
    s = edge_scores(w, task, method="eap")
    r = s.scores.abs()
    c = top_n(s, 7)
    assert c.n_edges == 7 and float(r[c.edges].min()) >= float(r[~c.edges].max())
    imp = top_n(s, 7, absolute=False)
    assert float(s.importance[imp.edges].min()) >= float(s.importance[~imp.edges].max())
    tau = float(r.median())
    assert torch.equal(threshold(s, tau).edges, r >= tau)
    grown = greedy(s, 12)
    g = s.graph
    chosen = grown.edges.nonzero()[:, 0].tolist()
    reached, left = {len(g.nodes) - 1}, set(chosen)
    while True:  # every edge enters a node reached from the logits through the circuit
        step = {e for e in left if int(g.edge_nodes[1][e]) in reached}
        if not step:
            break
        reached |= {int(g.src[e]) for e in step}
        left -= step
    assert grown.n_edges == 12 and not left
    into_logits = [i for i, n in enumerate(g.names) if n.endswith("-> logits")]
    assert max(into_logits, key=lambda i: float(r[i])) in chosen  # it starts with the best edge into the logits
    ties = type(s)(**{**s.__dict__, "values": torch.full_like(s.values, s.clean + 1.0)})
    assert top_n(ties, 3).edges.nonzero()[:, 0].tolist() == [0, 1, 2]  # ties go to the lower edge number
    with pytest.raises(QkovError, match="n must be in"):
        top_n(s, g.n_edges + 1)


def test_the_faithfulness_curve_is_its_circuits_faithfulness_and_its_areas() -> None:
    w, task = random_case("gpt2-like", n=3, T=6)
    g = graph_of(w.cfg)
    s = edge_scores(w, task, method="eap")
    ev = Evaluator(w, g, task, make_ablation(w, g, task, "corrupted"))
    curve = faithfulness_curve(ev, s)
    patch = senders_of(w, task.corrupted)
    empty = reference_circuit(w, task.clean, patch, task.answers, task.wrong, set(g.names))
    full = reference_circuit(w, task.clean, patch, task.answers, task.wrong, set())
    for p, f in zip(MIB_FRACTIONS, curve.absolute.faithfulness):
        kept = set(prune(top_n(s, int(p * g.n_edges))).names)
        m = reference_circuit(w, task.clean, patch, task.answers, task.wrong, set(g.names) - kept)
        assert abs(f - (m - empty) / (full - empty)) < 1e-9
    assert abs(curve.absolute.faithfulness[-1] - 1) < 1e-9 and abs(curve.signed.faithfulness[-1] - 1) < 1e-9
    f = curve.signed.faithfulness
    assert (
        abs(curve.cpr - sum((MIB_FRACTIONS[i + 1] - MIB_FRACTIONS[i]) * (f[i] + f[i + 1]) / 2 for i in range(9)))
        < 1e-12
    )
    assert abs(area([0, 0.5, 1], [0, 1, 1]) - 0.75) < 1e-12
    assert abs(curve.cmd - area(MIB_FRACTIONS, [abs(1 - x) for x in curve.absolute.faithfulness])) < 1e-12


def test_roc_auc_is_the_chance_a_true_edge_outranks_a_false_one() -> None:
    g = torch.Generator().manual_seed(0)
    ranking = torch.randint(0, 6, (60,), generator=g).double()  # many ties
    truth = torch.rand(60, generator=g) < 0.3
    pos, neg = ranking[truth], ranking[~truth]
    brute = float(((pos[:, None] > neg[None]).double() + 0.5 * (pos[:, None] == neg[None]).double()).mean())
    assert abs(auc(roc_points(ranking, truth)) - brute) < 1e-12
    # AutoCircuit's counts: at each, every edge ranked at least as high as the count-th is found
    big = torch.rand(250, generator=g).double()
    t2 = torch.rand(250, generator=g) < 0.1
    pts = roc_points(big, t2, grid="log")
    order = big.argsort(descending=True)
    P, N = int(t2.sum()), int((~t2).sum())
    found = [order[:c] for c in log_counts(250)[1:]]
    want = [(0.0, 0.0)] + [(float((~t2[f]).sum()) / N, float(t2[f].sum()) / P) for f in found] + [(1.0, 1.0)]
    assert pts == want and log_counts(250)[:12] == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 20]
    with pytest.raises(QkovError, match="must have some of the edges and leave some out"):
        roc_points(big, torch.zeros(250, dtype=torch.bool))


def test_node_roc_ranks_each_node_by_its_best_edge() -> None:
    w, task = random_case("gpt2-like", n=2, T=5)
    s = edge_scores(w, task, method="eap")
    truth = ["0.1", "mlp.1"]
    roc = circuit_roc(s, truth)
    assert roc.edge_auc is None and roc.true_nodes == 2
    g = s.graph
    best = {}
    for i, e in enumerate(g.names):
        for node in (g.edge(i).sender.name, g.edge(i).receiver._replace(input=None).name):
            best[node] = max(best.get(node, 0.0), abs(float(s.scores[i])))
    inner = [n for n in best if n not in ("embed", "logits")]
    pos, neg = [best[n] for n in inner if n in truth], [best[n] for n in inner if n not in truth]
    brute = sum((p > q) + 0.5 * (p == q) for p in pos for q in neg) / (len(pos) * len(neg))
    assert abs(roc.node_auc - brute) < 1e-12
    with pytest.raises(QkovError, match=r"ground truth: the model has no head 7\.0 \(2 layers of 2 heads\)"):
        circuit_roc(s, ["7.0"])
    with pytest.raises(QkovError, match="give edges or nodes, not both"):
        circuit_roc(s, ["0.1", "0.1 -> 1.0<q>"])


def test_the_smallest_faithful_circuit_reaches_the_target_and_a_smaller_one_does_not() -> None:
    w, task = random_case("gpt2-like", n=3, T=6)
    g = graph_of(w.cfg)
    s = edge_scores(w, task, method="eap")
    ev = Evaluator(w, g, task, make_ablation(w, g, task, "corrupted"))
    c, f = smallest_faithful(ev, s, 0.9, rounds=4, per_round=8)
    assert f.faithfulness[0] >= 0.9 and f.edges == [c.n_edges]
    n = int(c.how.split()[1])
    smaller = evaluate(ev, [prune(top_n(s, n - 1))])
    assert smaller.faithfulness[0] < 0.9


def test_evaluate_circuit_takes_written_edges_and_refuses_an_empty_circuit() -> None:
    w, task = random_case("gpt2-like", n=2, T=5)
    r = evaluate_circuit(w, task, ["embed -> logits", "0.1 -> logits"])
    patch = senders_of(w, task.corrupted)
    g = graph_of(w.cfg)
    ref = reference_circuit(
        w, task.clean, patch, task.answers, task.wrong, set(g.names) - {"embed -> logits", "0.1 -> logits"}
    )
    assert r.edges == [2] and abs(r.values[0] - ref) < 1e-10
    with pytest.raises(QkovError, match="the circuit is empty"):
        evaluate_circuit(w, task, Circuit(g, torch.zeros(g.n_edges, dtype=torch.bool)))
    with pytest.raises(QkovError, match=r"circuit: the model has no mlp\.5 \(MLPs in layers 0\.\.1\)"):
        evaluate_circuit(w, task, ["embed -> mlp.5"])
    with pytest.raises(QkovError, match="circuit: in mlp.1 -> mlp.0 the sender mlp.1 must come before the receiver"):
        evaluate_circuit(w, task, ["mlp.1 -> mlp.0"])
