"""Head ablation: exact against independent forwards, and causal on a hand-built induction head."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from qkov import QkovError, trace
from qkov.analysis import budget
from qkov.analysis.causal import ablation as Ab
from qkov.analysis.causal.sweep import ablation_sweep
from qkov.weights import Weights

from hand_built import hand_built, natural_text


def _module_logits(model, tokens, heads, means=None):  # type: ignore[no-untyped-def]
    """The training model (fused SDPA forward, not qkov.trace) with ``heads``' W_O zeroed and, for
    mean or resample ablation, ``means[i]`` (a vector, or one per sequence and position) added to
    the attention block's output by a hook."""
    m = copy.deepcopy(model)
    hooks = []
    with torch.no_grad():
        for i, (l, h) in enumerate(heads):
            m.blocks[l].attn.W_O[h] = 0
            if means is not None:
                add = means[i].clone()
                hooks.append(m.blocks[l].attn.register_forward_hook(lambda _m, _i, out, add=add: out + add))
    with torch.no_grad():
        logits = m(tokens)
    for hk in hooks:
        hk.remove()
    return logits


def _head_outputs(model, tokens: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Every head's output ``[L, B, T, H, d_model]`` of the hand-built model (shortformer,
    attention only, no normalisation, no biases), written here head by head in plain torch from
    the training model's parameters: the oracle the ablations' means and resampled outputs are
    checked against (it shares no code with qkov.trace; its logits are checked against the model's)."""
    T = tokens.shape[1]
    x, pos = model.W_E[tokens], model.W_pos[:T]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    outs = []
    with torch.no_grad():
        for block in model.blocks:
            a = block.attn
            q, k = (torch.einsum("btd,hde->bhte", x + pos, W) for W in (a.W_Q, a.W_K))
            v = torch.einsum("btd,hde->bhte", x, a.W_V)
            scores = (q @ k.transpose(-1, -2) / a.W_Q.shape[-1] ** 0.5).masked_fill(~causal, float("-inf"))
            z = scores.softmax(-1) @ v  # [B, H, T, E]
            out = torch.einsum("bhte,hed->bthd", z, a.W_O)
            outs.append(out)
            x = x + out.sum(2)
        assert torch.allclose(x @ model.W_U, model(tokens), atol=1e-3)  # the oracle is the model
    return torch.stack(outs)


def _ablated_logits(w: Weights, toks: torch.Tensor, heads, mode: str = "zero", **kw) -> torch.Tensor:  # type: ignore[no-untyped-def]
    means = Ab.z_means(w, toks, heads) if mode == "mean" else None
    return trace(w, toks, edits=Ab.ablation_edits(heads, mode, means=means, **kw)).logits


@pytest.mark.parametrize("heads", [[(0, 0)], [(0, 1)], [(1, 0)], [(0, 0), (1, 1)]])
def test_zero_ablation_equals_the_training_model_with_the_head_removed(heads) -> None:  # type: ignore[no-untyped-def]
    model = hand_built()
    w = Weights.from_model(model, center_unembed=False)
    toks = natural_text(3)
    got = _ablated_logits(w, toks, heads)
    want = _module_logits(model, toks, heads)
    assert (got - want).abs().max() < 1e-3 * want.abs().max()
    change = float((got - trace(w, toks).logits).abs().max())
    assert (change == 0) == (heads == [(0, 1)])  # 0.1 (the sink) has a zero OV: removing it changes nothing


def test_mean_ablation_equals_independent_forwards() -> None:
    """A head's mean z times its W_O is its output averaged over every position of the sample
    (recomputed head by head in plain torch, also when the sample runs in uneven chunks), and the
    mean-ablated model is the training model with the head zeroed and that mean added by a hook."""
    model = hand_built()
    w = Weights.from_model(model, center_unembed=False)
    toks = natural_text(3)
    full = _head_outputs(model, toks)  # [L, B, T, H, D]
    heads = [(0, 0), (1, 0), (1, 1)]
    for chunk in (None, 2):  # 2: two passes of 2 and 1 sequences
        means = Ab.z_means(w, toks, heads, chunk=chunk)
        for i, (l, h) in enumerate(heads):
            want_mean = full[l, :, :, h].mean(dim=(0, 1))
            assert (means[i] @ w.W_O[l, h] - want_mean).abs().max() < 1e-4 * want_mean.abs().max(), (chunk, l, h)
    for l in (0, 1):  # every layer: the training model with the head zeroed and its mean output added by a hook
        got = _ablated_logits(w, toks, [(l, 0)], "mean")
        want = _module_logits(model, toks, [(l, 0)], [full[l, :, :, 0].mean(dim=(0, 1))])
        assert (got - want).abs().max() < 1e-3 * want.abs().max(), l


@pytest.mark.parametrize("layer", [0, 1])
def test_resample_ablation_takes_the_output_another_sequence_gave(layer: int) -> None:
    """Head ``layer``.0's output at every position is the one it gave on another sequence of the batch
    (a seeded derangement): the training model with the head zeroed and that output added by a hook."""
    model = hand_built()
    w = Weights.from_model(model, center_unembed=False)
    toks = natural_text(4)
    full = _head_outputs(model, toks)
    perm = Ab.derangement(4, seed=3)
    assert sorted(perm.tolist()) == [0, 1, 2, 3] and bool((perm != torch.arange(4)).all())
    got = _ablated_logits(w, toks, [(layer, 0)], "resample", seed=3)
    want = _module_logits(model, toks, [(layer, 0)], [full[layer, perm, :, 0]])
    assert (got - want).abs().max() < 1e-3 * want.abs().max()
    with pytest.raises(QkovError, match="at least 2 sequences"):
        _ablated_logits(w, toks[:1], [(layer, 0)], "resample")


def test_ablation_at_positions_changes_only_those_positions_onwards() -> None:
    """Zero ablation at some positions: the training model with the head's output removed there by a
    hook; earlier positions' logits are untouched."""
    model = hand_built()
    w = Weights.from_model(model, center_unembed=False)
    toks = natural_text(3)
    full = _head_outputs(model, toks)
    at = torch.tensor([5, 6, *range(40, 64)])
    got = _ablated_logits(w, toks, [(0, 0)], positions="5,6,40:")
    removed = torch.zeros_like(full[0, :, :, 0])
    removed[:, at] = full[0, :, at, 0]
    m = copy.deepcopy(model)
    hook = m.blocks[0].attn.register_forward_hook(lambda _m, _i, out: out - removed)
    with torch.no_grad():
        want = m(toks)
    hook.remove()
    assert (got - want).abs().max() < 1e-3 * want.abs().max()
    assert torch.equal(got[:, :5], trace(w, toks).logits[:, :5]) and (got[:, 5:] - trace(w, toks).logits[:, 5:]).abs().max() > 1


def test_ablating_the_induction_head_on_the_second_copy_removes_only_the_second_copy_advantage() -> None:
    """On repeated random tokens, zero-ablating 1.0 (the last layer) at the second copy's positions
    costs the second copy exactly what ablating it everywhere costs, and the first copy nothing;
    at the first copy's positions, the reverse."""
    w = Weights.from_model(hand_built())
    L = min(50, (w.cfg.n_ctx - 1) // 2)  # the probe's copy length (31 for a 64-token context)
    at = lambda positions: Ab.measures(w, None, None, edits=Ab.ablation_edits([(1, 0)], "zero", positions=positions))  # noqa: E731
    intact, everywhere = Ab.measures(w, None, None), at(None)
    second, first = at(slice(L + 1, None)), at(slice(1, L + 1))
    assert everywhere.repeat_second > 2.5 * intact.repeat_second  # 1.0 carries the second-copy advantage
    assert second.repeat_second == pytest.approx(everywhere.repeat_second, abs=1e-5)
    assert second.repeat_first == pytest.approx(intact.repeat_first, abs=1e-5)
    assert first.repeat_second == pytest.approx(intact.repeat_second, abs=1e-5)
    assert first.repeat_first == pytest.approx(everywhere.repeat_first, abs=1e-5)


@pytest.mark.parametrize("mode", ["zero", "mean", "resample"])
def test_ablating_the_induction_head_removes_its_advantage_and_a_distractor_does_not(mode: str) -> None:
    w = Weights.from_model(hand_built())
    text = natural_text(4)
    study = Ab.ablation_study(w, text, [(1, 0)], mode=mode, draws=3)
    i, a = study.intact, study.ablated
    assert i.repeat_second < 0.5 * i.repeat_first  # the intact model predicts the second copy
    assert a.repeat_second > 0.9 * a.repeat_first  # ... the ablated one no longer does
    distractor = Ab.ablation_study(w, text, [(1, 1)], mode=mode, draws=0).ablated
    assert distractor.repeat_second < 0.5 * distractor.repeat_first
    assert len(study.random) == 3 and all(len(h) == 1 and h != ["1.0"] for h in study.random_heads)
    if mode == "mean":
        assert "4 validation sequences" in (study.mean_sample or "")


def test_each_random_set_of_a_mean_ablation_study_is_measured_with_its_own_means() -> None:
    """The study takes every head's mean from one pass over the sample: each random set's measures are
    those of a study of that set alone (which takes the means of its own heads)."""
    w = Weights.from_model(hand_built())
    text = natural_text(4)
    study = Ab.ablation_study(w, text, [(1, 0)], mode="mean", draws=3)
    assert len(study.random) == 3
    for heads, got in zip(study.random_heads, study.random):
        alone = Ab.ablation_study(w, text, heads, mode="mean", draws=0).ablated
        assert got == alone, heads


@pytest.mark.parametrize("mode,positions", [("zero", None), ("mean", "3:"), ("resample", None)])
def test_the_ablated_passes_start_from_the_intact_streams_and_measure_the_same(
    mode: str, positions: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each ablated text pass and ICL pass starts at its first ablated layer from the intact run's stream there:
    the study's measures are those of passes from the first token (the streams not kept)."""
    from qkov.analysis.heads import probes

    w = Weights.from_model(hand_built())
    text, icl = natural_text(4), natural_text(3, seed=7)
    starts: list[object] = []
    icl_starts: list[object] = []
    real, real_trace = Ab.pass_nll, probes.trace
    monkeypatch.setattr(Ab, "pass_nll", lambda *a, **k: starts.append(k.get("start_at")) or real(*a, **k))
    monkeypatch.setattr(probes, "trace", lambda *a, **k: icl_starts.append(k.get("start_at")) or real_trace(*a, **k))
    got = Ab.ablation_study(w, text, [(1, 0)], icl_text=icl, mode=mode, draws=3, positions=positions)
    started = [1] * (1 + sum(h[0].startswith("1.") for h in got.random_heads))
    assert [s[0] for s in starts if s is not None] == started
    assert [s[0] for s in icl_starts if s is not None] == started  # the ICL passes (the probe's run from token 0)
    monkeypatch.setattr(budget, "KEEP_STREAMS_BYTES", 0)
    starts.clear()
    want = Ab.ablation_study(w, text, [(1, 0)], icl_text=icl, mode=mode, draws=3, positions=positions)
    assert starts == [None] * 5 and got.random_heads == want.random_heads
    for a, b in zip([got.intact, got.ablated, *got.random], [want.intact, want.ablated, *want.random]):
        assert a.loss == pytest.approx(b.loss, rel=1e-6, abs=1e-7)
        assert a.icl == pytest.approx(b.icl, rel=1e-6, abs=1e-7)
        assert (a.repeat_first, a.repeat_second) == (b.repeat_first, b.repeat_second)
    assert len({m.icl for m in [got.intact, got.ablated, *got.random]}) > 1  # the ablations move the ICL score


def test_icl_removed_is_the_share_of_the_intact_improvement() -> None:
    m = lambda icl: Ab.Measures(1.0, icl, 5.0, 1.0)  # noqa: E731
    s = Ab.AblationStudy(["1.0"], "mean", None, m(-0.2), m(-0.05), [["0.1"], ["1.1"]], [m(-0.2), m(-0.1)])
    assert s.icl_removed() == pytest.approx(0.75)
    assert s.random_icl_removed() == pytest.approx(0.25)
    assert s.random_icl_removed("median") == pytest.approx(0.25)  # two draws: the mean of the middle two
    s.random.append(m(-0.2))  # removes nothing: median 0, mean (0 + 0.5 + 0) / 3
    assert s.random_icl_removed("median") == 0 and s.random_icl_removed() == pytest.approx(1 / 6)
    # fewer sets than draws exist: each of the three, once (in a seeded order)
    assert sorted(Ab.random_sets([(0, 0), (0, 1), (1, 1)], 1, 5, seed=0)) == [[(0, 0)], [(0, 1)], [(1, 1)]]
    pairs = Ab.random_sets([(0, 0), (0, 1), (1, 0), (1, 1)], 2, 3, seed=0)  # 3 of the 6 pairs, distinct
    assert len({tuple(x) for x in pairs}) == 3 and all(len(set(x)) == 2 for x in pairs)
    assert Ab.AblationStudy(["1.0"], "zero", None, m(0.1), m(0.3)).icl_removed() is None  # nothing to remove


def test_bad_heads_are_one_line_errors() -> None:
    w = Weights.from_model(hand_built())
    bad_heads = [("2.0", "ablate: the model has no head 2.0"), ("1.2", "no head 1.2"), ("x", "not a head"), ("1", "not a head")]
    for bad, says in bad_heads:
        with pytest.raises(QkovError, match=says):
            Ab.ablation_study(w, natural_text(2), bad, mode="zero", draws=0)
    with pytest.raises(QkovError, match="mode"):
        Ab.ablation_edits([(0, 0)], "half")
    with pytest.raises(QkovError, match="mean z per head"):
        Ab.ablation_edits([(0, 0)], "mean")
    with pytest.raises(QkovError, match="out of range for a sequence of 64"):
        trace(w, natural_text(2), edits=Ab.ablation_edits([(0, 0)], "zero", positions=70))


def test_zero_ablation_on_a_hugging_face_gpt2_equals_its_c_proj_rows_zeroed(tmp_path: Path) -> None:
    """A GPT-2 directory (transformers' own GPT2LMHeadModel, LayerNorm, MLP, value biases moved off zero):
    zero-ablating heads through qkov (the study, and the explorer's ablate view) equals transformers with the
    heads' input rows of ``attn.c_proj.weight`` (Conv1D layout ``[d_model in, d_model out]``) zeroed by hand.
    The head's ``b_V`` goes with it: removing only ``z @ W_O`` minus the bias (TransformerLens after its default
    ``fold_value_biases``) is a different, measurably different ablation (checked to differ here)."""
    tf = pytest.importorskip("transformers")
    from qkov.apps.explore.session import open_explorer
    from qkov.apps.explore.views import VIEWS

    torch.manual_seed(0)
    cfg = tf.GPT2Config(vocab_size=96, n_embd=32, n_layer=3, n_head=4, n_positions=64, n_inner=64,
                        initializer_range=0.15, bos_token_id=0, eos_token_id=0)  # fmt: skip
    hf = tf.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "ln" in n and n.endswith("weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif n.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    hf.save_pretrained(tmp_path / "gpt2")
    ids = torch.randint(0, 96, (1, 40), generator=torch.Generator().manual_seed(1))
    heads, E = [(1, 2), (2, 0)], 32 // 4

    def losses(m) -> torch.Tensor:  # type: ignore[no-untyped-def]
        with torch.no_grad():
            logits = m(ids).logits[0, :-1].double()
        return torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="none")

    hand, folded = copy.deepcopy(hf), copy.deepcopy(hf)
    with torch.no_grad():
        for l, h in heads:
            hand.transformer.h[l].attn.c_proj.weight[h * E : (h + 1) * E] = 0
            attn, rows = folded.transformer.h[l].attn, slice(h * E, (h + 1) * E)
            b_v = attn.c_attn.bias[2 * 32 + h * E : 2 * 32 + (h + 1) * E]  # c_attn's output: q, k, v
            attn.c_proj.bias += b_v @ attn.c_proj.weight[rows]  # b_V @ W_O moved into b_O, then the head zeroed
            attn.c_proj.weight[rows] = 0
    want = losses(hand)
    assert (losses(folded) - want).abs().max() > 1e-3  # the two ablations differ: the test can tell them apart
    study = Ab.ablation_study(tmp_path / "gpt2", ids, heads, mode="zero", draws=0)
    assert study.ablated.loss == pytest.approx(float(want.mean()), abs=1e-5)
    assert study.intact.loss == pytest.approx(float(losses(hf).mean()), abs=1e-5)
    ex = open_explorer(tmp_path / "gpt2", cache_dir=None)
    out = VIEWS["ablate"](ex, {"text": ids[0].tolist(), "heads": ["1.2", "2.0"], "mode": "zero"}, lambda *a: None)
    assert out["loss_after"][:-1] == pytest.approx(want.tolist(), rel=1e-5, abs=1e-5)


@pytest.mark.parametrize("mode", ["zero", "mean", "resample"])
def test_ablating_last_layer_heads_keeps_the_few_positions_pass_exact(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ablations of every position are marked as acting on each position alone, so the forward still
    runs the last layer at a few positions only with them (the ICL score's passes): its logits there
    are the full ablated pass's. Ablated at some positions only, the whole last layer runs (same check)."""
    from qkov.model.block import BlockPass

    calls: list[int] = []
    real = BlockPass.attention_at  # the last layer at a few query positions
    monkeypatch.setattr(BlockPass, "attention_at", lambda *a: calls.append(1) or real(*a))
    w = Weights.from_model(hand_built(), center_unembed=False)
    toks = natural_text(4)
    at, heads = torch.tensor([3, 20, toks.shape[1] - 1]), [(1, 0), (0, 1)]
    means = Ab.z_means(w, toks, heads) if mode == "mean" else None
    intact = trace(w, toks, positions=at).logits
    for positions, fast in ((None, True), ("5:", False)):
        edits = Ab.ablation_edits(heads, mode, means=means, seed=3, positions=positions)
        calls.clear()
        got = trace(w, toks, edits=edits, positions=at).logits
        assert bool(calls) == fast, positions
        full = trace(w, toks, edits=edits).logits
        assert (got - full[:, at]).abs().max() <= 1e-6 * full.abs().max(), positions
        assert (got - intact).abs().max() > 1e-2 * intact.abs().max()  # the ablation changed the logits


@pytest.mark.parametrize("mode", ["zero", "mean", "resample"])
@pytest.mark.parametrize("positions", [None, "20:"])
def test_the_sweep_equals_one_study_per_head(mode: str, positions: str | None) -> None:
    """``qkov ablate --heads all``: every head ablated alone, several per forward pass (inputs tiled),
    gives what one ablation_study per head gives (loss, ICL, both copies), at every position or some."""
    w = Weights.from_model(hand_built())
    text = natural_text(4)
    icl = natural_text(4)
    assert icl.shape[1] >= 61  # long enough for the ICL score
    sweep = ablation_sweep(w, text, icl_text=icl, mode=mode, positions=positions, seed=3)
    heads = [(l, h) for l in range(w.cfg.n_layers) for h in range(w.cfg.n_heads)]
    assert sweep.heads == [f"{l}.{h}" for l, h in heads] and len(sweep.ablated) == len(heads)
    for (l, h), got in zip(heads, sweep.ablated):
        want = Ab.ablation_study(w, text, [(l, h)], icl_text=icl, mode=mode, draws=0, positions=positions, seed=3)
        for name in ("loss", "icl", "repeat_first", "repeat_second"):
            assert getattr(got, name) == pytest.approx(getattr(want.ablated, name), abs=2e-5), (l, h, name)
        assert sweep.intact == want.intact
    assert any(abs(m.repeat_second - sweep.intact.repeat_second) > 0.1 for m in sweep.ablated)  # something moved


@pytest.mark.parametrize("mode", ["zero", "mean"])
def test_a_sweep_of_deeper_layers_starts_each_input_at_the_layer_and_measures_the_same(mode: str, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """With the intact streams kept, the sweep's groups hold one layer's heads and every input's pass (text, ICL
    examples, repeated tokens) starts at that layer from the intact stream there: each head's measures are
    still one ablation_study's, and no pass of a layer-2 group runs layers 0 or 1."""
    from qkov import ModelConfig, Transformer
    from qkov.analysis.causal import sweep as S

    cfg = ModelConfig(n_layers=3, n_heads=3, d_model=32, d_head=8, d_vocab=40, n_ctx=64)
    w = Weights.from_model(Transformer(cfg, seed=4))
    text, icl = natural_text(3, seed=1), natural_text(4, seed=2)
    started: list[int | None] = []
    for name in ("pass_nll", "trace"):
        real = getattr(S, name)

        def noted(*a, start_at=None, real=real, **k):  # type: ignore[no-untyped-def]
            started.append(None if start_at is None else start_at[0])
            return real(*a, start_at=start_at, **k)

        monkeypatch.setattr(S, name, noted)
    heads = [(l, h) for l in (1, 2) for h in range(3)]
    sweep = ablation_sweep(w, text, heads=heads, icl_text=icl, mode=mode, seed=5)
    assert sorted(set(started) - {None}) == [1, 2] and started.count(2) == 3  # text, ICL, probe of layer 2's group
    for (l, h), got in zip(heads, sweep.ablated):
        want = Ab.ablation_study(w, text, [(l, h)], icl_text=icl, mode=mode, draws=0, seed=5)
        for name in ("loss", "icl", "repeat_first", "repeat_second"):
            assert getattr(got, name) == pytest.approx(getattr(want.ablated, name), abs=2e-5), (l, h, name)


def test_the_probe_follows_the_ablated_positions() -> None:
    """An ablation from position 100 on cannot change the losses of a 1 + 50 + 50-token probe (its
    last loss is predicted at position 99): the probe grows to the longest the context holds; where
    no probe the context holds is reached, the repeated-token losses are left out and say why."""
    assert Ab.probe_plan(256, None) == (50, None)
    assert Ab.probe_plan(256, "40:") == (50, None)
    assert Ab.probe_plan(256, "100:") == (127, None)
    assert Ab.probe_plan(64, None) == (31, None)
    length, why = Ab.probe_plan(64, "62:")
    assert length is None and "lie after every loss" in (why or "") and "position 61" in (why or "")
    w = Weights.from_model(hand_built())  # a 64-token context: probes of 31 per copy at most
    study = Ab.ablation_study(w, None, [(1, 0)], mode="zero", draws=0, positions="40:")
    assert study.probe_length == 31 and study.ablated.repeat_second > study.intact.repeat_second + 0.5
    late = Ab.ablation_study(w, None, [(1, 0)], mode="zero", draws=0, positions="62:")
    assert late.intact.repeat_first is None and "repeated" in late.left_out
