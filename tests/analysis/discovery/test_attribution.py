"""Edge scores against an independent implementation: the graph's edges, EAP, AutoCircuit's integrated
edge gradients and exact edge patching against a forward pass with one coefficient per edge
(tests/edge_reference.py, autograd on those coefficients), on models of every kind qkov runs; attribution
equal to exact patching where the model is linear in the edge; completeness of the integrated gradients."""

from __future__ import annotations

import pytest
import torch

from qkov import ModelConfig, QkovError, Transformer, Weights, trace
from qkov.analysis.discovery.ablations import make_ablation, sender_deltas, sender_sites
from qkov.analysis.discovery.grads import accumulate, fast_grads, fast_sites, split_grads, split_sites
from qkov.analysis.discovery.graph import edge_count, graph_of
from qkov.analysis.discovery.score import edge_scores

from edge_reference import CONFIGS, reference_circuit, reference_eap, senders_of
from edge_reference import graph as reference_graph
from edge_reference import random_case as setup


def close(ours: dict[str, float], ref: dict[str, float], tol: float = 1e-9) -> float:
    scale = max(abs(v) for v in ref.values())
    err = max(abs(ours[k] - v) for k, v in ref.items())
    assert scale > 1e-6 and err <= tol * scale, (err, scale)
    return err / scale


def by_name(r) -> dict[str, float]:  # type: ignore[no-untyped-def]
    return dict(zip(r.labels["edge"], r.scores.tolist()))


def test_the_graph_counts_every_sender_into_every_later_receiver() -> None:
    gpt2 = ModelConfig(n_layers=12, n_heads=12, d_model=768, d_head=64, d_vocab=10, n_ctx=8, d_mlp=3072)
    assert edge_count(gpt2) == graph_of(gpt2).n_edges == 32_491  # EAP-IG's, AutoCircuit's and MIB's count
    assert edge_count(gpt2.replace(d_mlp=None)) == 29_089
    for name, cfg in CONFIGS.items():
        w = Weights.from_model(Transformer(cfg, seed=0))
        g = graph_of(cfg)
        assert g.names == reference_graph(w)[2], name  # the same edges, in the same order
        assert g.n_edges == edge_count(cfg)
        for i in (0, g.n_edges // 2, g.n_edges - 1):
            assert g.index(g.names[i]) == i and g.edge(i).name == g.names[i]
    g = graph_of(CONFIGS["llama-like"])  # grouped-query: a key input is written with any head of its group
    assert g.index("0.1 -> 1.3<k>") == g.index("0.1 -> 1.2<k>") != g.index("0.1 -> 1.3<q>")
    for bad, says in [("1.0 -> 0.1<k>", "must come before"), ("0.1 -> 1.0", "receives through its query, key or value"),
                      ("mlp.1 -> 1.0<q>", "must come before"), ("mlp.7 -> logits", "no mlp.7"),
                      ("embed", "not an edge")]:  # fmt: skip
        with pytest.raises(QkovError, match=says):
            g.index(bad)


@pytest.mark.parametrize("name", CONFIGS)
def test_eap_equals_the_gradient_of_every_edge_coefficient(name: str) -> None:
    w, task = setup(name)
    ours = edge_scores(w, task, method="eap", batch=3)  # two batches of different sizes: the mean over prompts
    patch = senders_of(w, task.corrupted)
    ref = reference_eap(w, task.clean, patch, task.answers, task.wrong)
    close(by_name(ours), ref)
    assert ours.prompts == 4 and ours.ablation == "corrupted" and ours.method == "eap"


@pytest.mark.parametrize("ablation", ["zero", "mean", "mean-position"])
def test_eap_under_zero_and_mean_ablation_equals_the_reference(ablation: str) -> None:
    w, task = setup("gpt2-like")
    ours = edge_scores(w, task, method="eap", ablation=ablation)
    corrupted = senders_of(w, task.corrupted)
    if ablation == "zero":
        patch = {s: torch.zeros_like(v) for s, v in corrupted.items()}
    elif ablation == "mean":
        patch = {s: v.mean((0, 1), keepdim=True).expand_as(v) for s, v in corrupted.items()}
    else:
        patch = {s: v.mean(0, keepdim=True).expand_as(v) for s, v in corrupted.items()}
    close(by_name(ours), reference_eap(w, task.clean, patch, task.answers, task.wrong))
    # m(empty): every edge ablated, not the corrupted run
    empty = reference_circuit(w, task.clean, patch, task.answers, task.wrong, set(ours.labels["edge"]))
    assert abs(ours.corrupted - empty) < 1e-9


@pytest.mark.parametrize("name", ["gpt2-like", "llama-like"])
def test_integrated_edge_gradients_equal_the_reference_at_every_point(name: str) -> None:
    w, task = setup(name, n=3, T=5)
    ours = edge_scores(w, task, method="ieg", steps=3)
    patch = senders_of(w, task.corrupted)
    close(by_name(ours), reference_eap(w, task.clean, patch, task.answers, task.wrong, alphas=[0, 1 / 3, 2 / 3, 1]))
    assert ours.steps == 3


@pytest.mark.parametrize("name", ["gpt2-like", "llama-like"])
def test_eap_ig_over_the_inputs_equals_the_reference(name: str) -> None:
    """The gradient at every receiver averaged over inputs moved k/m of the way from the corrupted
    prompt's to the clean one's (k = 0 .. m-1), times the change of the plain runs."""
    w, task = setup(name, n=3, T=5)
    ours = edge_scores(w, task, method="eap-ig", steps=3)
    clean, corrupted = senders_of(w, task.clean), senders_of(w, task.corrupted)
    change = {s: corrupted[s] - clean[s] for s in clean}
    embeds = [corrupted["embed"] + k / 3 * (clean["embed"] - corrupted["embed"]) for k in range(3)]
    close(by_name(ours), reference_eap(w, task.clean, change, task.answers, task.wrong, mode="fixed", embeds=embeds))


@pytest.mark.parametrize("name", ["gpt2-like", "neox-parallel", "llama-like"])
def test_exact_patching_equals_the_reference_edge_by_edge(name: str) -> None:
    w, task = setup(name, n=3, T=5)
    ours = by_name(edge_scores(w, task, method="exact", max_bytes=1 << 20))  # small copies: several passes per layer
    patch = senders_of(w, task.corrupted)
    clean = reference_circuit(w, task.clean, patch, task.answers, task.wrong, set())
    ref = {e: reference_circuit(w, task.clean, patch, task.answers, task.wrong, {e}) - clean for e in ours}
    close(ours, ref)


def test_exact_patching_of_a_subset_leaves_the_others_unmeasured() -> None:
    w, task = setup("llama-like", n=2, T=5)
    chosen = ["embed -> logits", "0.3 -> 1.2<k>", "mlp.0 -> 1.0<v>"]
    r = edge_scores(w, task, method="exact", edges=chosen)
    full = edge_scores(w, task, method="exact")
    for e in chosen:
        assert abs(r.at_edge(e) - full.at_edge(e)) < 1e-12
    assert int(r.scores.isnan().sum()) == r.graph.n_edges - 3


def test_attribution_is_exact_where_the_model_is_linear_in_the_edge() -> None:
    """Without normalisation, the logits are linear in the final stream and a last-layer head's output is
    linear in its value input (its pattern reads the queries and keys): EAP of those edges is exact
    patching, whatever the size of the change."""
    w, task = setup("attention-only", n=3, T=6)
    eap, exact = edge_scores(w, task, method="eap"), edge_scores(w, task, method="exact")
    g = eap.graph
    L = w.cfg.n_layers
    linear = [i for i, n in enumerate(g.names) if n.endswith("-> logits") or n.endswith("<v>") and f"-> {L - 1}." in n]
    other = [i for i in range(g.n_edges) if i not in linear]
    assert len(linear) > 10 and exact.scores[linear].abs().max() > 1e-2
    assert (eap.scores[linear] - exact.scores[linear]).abs().max() < 1e-10
    assert (eap.scores[other] - exact.scores[other]).abs().max() > 1e-7  # elsewhere it is an approximation


@pytest.mark.parametrize("name", CONFIGS)
def test_the_fast_and_split_receiver_gradients_agree(name: str) -> None:
    """Reading each head's input gradient through its weights and the norm's Jacobian equals reading it
    from the per-head input copies."""
    w, task = setup(name, n=2, T=5)
    g = graph_of(w.cfg)
    metric = task.answer_metric(torch.arange(2))
    run = trace(w, task.clean, cache=[*sender_sites(g), *fast_sites(g, w.norm), *split_sites(g)], grad=True)
    metric(run).backward()
    delta = sender_deltas(make_ablation(w, g, task, "zero"), run, None, w, g)
    a = torch.zeros(len(g.senders), len(g.receivers), dtype=torch.float64)
    b = a.clone()
    accumulate(a, delta, fast_grads(run, w, g), g)
    accumulate(b, delta, split_grads(run, g), g)
    assert a.abs().max() > 1e-3 and (a - b).abs().max() < 1e-10 * a.abs().max()


def test_integrated_gradients_are_complete_as_the_steps_grow() -> None:
    """The edges' integrated edge gradients sum to m(empty) - m(clean), and EAP-IG's input edges to
    m(corrupted) - m(clean) (the input feeds the rest only through the receivers), closer as m grows."""
    w, task = setup("gpt2-like", n=3, T=5)
    gaps = []
    for m in (1, 4, 32):
        r = edge_scores(w, task, method="ieg", steps=m)
        gaps.append(abs(float(r.scores.sum()) - (r.corrupted - r.clean)))
    assert gaps[2] < gaps[1] < gaps[0] and gaps[2] < 0.02 * abs(r.corrupted - r.clean)
    inputs = []
    for m in (1, 4, 32):
        r = edge_scores(w, task, method="eap-ig", steps=m)
        from_input = [i for i, n in enumerate(r.labels["edge"]) if n.startswith("embed ->")]
        inputs.append(abs(float(r.scores[from_input].sum()) - (r.corrupted - r.clean)))
    assert inputs[2] < inputs[1] < inputs[0] and inputs[2] < 0.05 * abs(r.corrupted - r.clean)


def test_per_position_scores_sum_over_positions_to_the_edge_scores() -> None:
    w, task = setup("llama-like", n=2, T=5)
    per = edge_scores(w, task, method="eap", per_position=True)
    whole = edge_scores(w, task, method="eap")
    assert per.scores.shape == (5, whole.graph.n_edges) and per.axes == ("pos", "edge")
    assert (per.scores.sum(0) - whole.scores).abs().max() < 1e-12
    ex = edge_scores(w, task, method="exact", per_position=True, edges=["embed -> logits"])
    i = ex.graph.index("embed -> logits")
    assert (
        ex.scores[:-1, i].abs().max() == 0
        and abs(float(ex.scores[-1, i]) - edge_scores(w, task, method="exact").at_edge(i)) < 1e-12
    )


def test_eap_ig_activations_and_inputs_run_and_refuse_what_they_cannot_do() -> None:
    w, task = setup("gpt2-like", n=2, T=5)
    acts = edge_scores(w, task, method="eap-ig-activations", steps=2)
    eap = edge_scores(w, task, method="eap")
    assert torch.corrcoef(torch.stack([acts.scores, eap.scores]))[0, 1] > 0.5
    with pytest.raises(QkovError, match="eap-ig .* needs the corrupted ablation"):
        edge_scores(w, task, method="eap-ig", ablation="zero")
    with pytest.raises(QkovError, match="eap with the KL metric is 0"):
        edge_scores(w, task.with_metric("kl"), method="eap")
    with pytest.raises(QkovError, match="the method is one of"):
        edge_scores(w, task, method="acdc")
    with pytest.raises(QkovError, match="steps must be a positive integer"):
        edge_scores(w, task, method="ieg", steps=0)


@pytest.mark.parametrize("direction", ["noise", "denoise"])
def test_edge_attribution_is_a_sweep_of_the_patching_study(direction: str) -> None:
    """``patch_study(..., edge_attribution=True)`` scores every edge on the study's own contrast, in its
    direction: the base run's gradient times the change to the source run's senders."""
    from qkov import patch_study

    w, task = setup("gpt2-like", n=3, T=6)
    metric = task.answer_metric(torch.arange(3))
    study = patch_study(
        w, task.clean, task.corrupted, metric=metric, direction=direction, sites=(), edge_attribution=True
    )
    (r,) = study.results
    assert r.method == "eap" and r.axes == ("edge",) and r.direction == direction
    base, source = (task.clean, task.corrupted) if direction == "noise" else (task.corrupted, task.clean)
    ref = reference_eap(w, base, senders_of(w, source), task.answers, task.wrong)
    close(by_name(r), ref)
    if direction == "noise":
        assert (r.scores - edge_scores(w, task).scores).abs().max() < 1e-12


def test_scores_are_the_same_inside_torch_no_grad() -> None:
    """A caller that switched gradients off (a script under ``torch.no_grad()``) gets the same scores: the
    gradient passes enable gradients themselves (the backward failed: no graph)."""
    from qkov.analysis.discovery import contrast_edge_scores

    w, task = setup("gpt2-like", n=2, T=5)
    want = {m: edge_scores(w, task, method=m, steps=2).values for m in ("eap", "eap-ig", "ieg")}
    want_c = contrast_edge_scores(w, task.clean[:1], task.corrupted[:1]).values
    with torch.no_grad():
        for m, v in want.items():
            assert torch.equal(edge_scores(w, task, method=m, steps=2).values, v), m
        assert torch.equal(contrast_edge_scores(w, task.clean[:1], task.corrupted[:1]).values, want_c)


def test_the_allocator_keeps_freed_memory_for_a_model_in_memory_only(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """edge_scores and the circuit evaluator keep freed buffers in the process (glibc's thresholds raised) for a
    model in memory; not for a streamed one, whose weights, read anew each pass in many sizes, grew the kept
    heap by a layer's attention weights per layer (11 GB at Llama-3-8B shape, against 2.8 GB now)."""
    import qkov
    from qkov.analysis.discovery import Evaluator, Task, make_ablation as ablation_of
    from qkov import device
    from qkov.analysis.discovery import evaluate, score
    from qkov.weights import LazyCheckpoint

    model = Transformer(ModelConfig(n_layers=2, n_heads=2, d_model=16, d_head=8, d_vocab=30, n_ctx=12), seed=2)
    qkov.save_checkpoint(model, tmp_path / "ck")
    g = torch.Generator().manual_seed(0)
    clean = torch.randint(0, 30, (3, 6), generator=g)
    corrupted = clean.clone()
    corrupted[:, 2] = (clean[:, 2] + 1) % 30
    task = Task("t", clean, corrupted, torch.randint(0, 30, (3, 1), generator=g), torch.randint(0, 30, (3, 1), generator=g))
    for source, tuned in ((LazyCheckpoint(tmp_path / "ck"), False), (Weights.from_model(model), True)):
        calls: list[str] = []
        monkeypatch.setattr(device, "tune_cpu_allocator", lambda: calls.append("tuned"))
        for module in (score, evaluate):
            asked = lambda s, name=module.__name__.rsplit(".", 1)[1]: (calls.append(name), device.tune_allocator_for(s))  # noqa: E731
            monkeypatch.setattr(module, "tune_allocator_for", asked)
        edge_scores(source, task)
        graph = graph_of(source.cfg)
        Evaluator(source, graph, task, ablation_of(source, graph, task, "corrupted"))
        assert calls == (["score", "tuned", "evaluate", "tuned"] if tuned else ["score", "evaluate"])
