"""Head ablation: exact against independent forwards, and causal on a hand-built induction head."""

from __future__ import annotations

import copy

import pytest
import torch

from qkov import QkovError, run
from qkov.analysis import ablation as Ab
from qkov.weights import Weights

from test_heads import V, hand_built, natural_text


def _module_logits(model, tokens, heads, means=None):  # type: ignore[no-untyped-def]
    """The training model (fused SDPA forward, not qkov.run) with ``heads``' W_O zeroed and, for
    mean ablation, the mean added to the attention block's output by a hook."""
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


@pytest.mark.parametrize("heads", [[(0, 0)], [(0, 1)], [(1, 0)], [(0, 0), (1, 1)]])
def test_zero_ablation_equals_the_training_model_with_the_head_removed(heads) -> None:  # type: ignore[no-untyped-def]
    model = hand_built()
    w = Weights.from_model(model, center_unembed=False)
    toks = natural_text(3)
    got = run(Ab.ablated(w, heads, "zero"), toks, record=()).logits
    want = _module_logits(model, toks, heads)
    assert (got - want).abs().max() < 1e-3 * want.abs().max()
    change = float((got - run(w, toks, record=()).logits).abs().max())
    assert (change == 0) == (heads == [(0, 1)])  # 0.1 (the sink) has a zero OV: removing it changes nothing


def test_mean_ablation_equals_independent_forwards() -> None:
    model = hand_built()
    w = Weights.from_model(model, center_unembed=False)
    toks = natural_text(3)
    # layer 0: the training model with the head zeroed and its mean added by a hook
    means = Ab.head_means(w, toks, [(0, 0)])
    full = run(w, toks, record=("head_outputs",)).head_outputs
    assert torch.allclose(means[0], full[0, :, 0].mean(dim=(0, 1)))
    got = run(Ab.ablated(w, [(0, 0)], "mean", means), toks, record=()).logits
    want = _module_logits(model, toks, [(0, 0)], means)
    assert (got - want).abs().max() < 1e-3 * want.abs().max()
    # last layer: the analysis forward with that head's recorded output replaced by its mean
    means1 = Ab.head_means(w, toks, [(1, 0)])
    swapped = full.clone()
    swapped[1, :, 0] = means1[0]
    want1 = run(w, toks, record=(), head_outputs=swapped).logits
    got1 = run(Ab.ablated(w, [(1, 0)], "mean", means1), toks, record=()).logits
    assert torch.allclose(got1, want1, atol=1e-4)


@pytest.mark.parametrize("mode", ["zero", "mean"])
def test_ablating_the_induction_head_removes_its_advantage_and_a_distractor_does_not(mode: str) -> None:
    w = Weights.from_model(hand_built())
    text = natural_text(4)
    study = Ab.ablation_study(w, [(1, 0)], text=text, mode=mode, draws=3)
    i, a = study.intact, study.ablated
    assert i.repeat_second < 0.5 * i.repeat_first  # the intact model predicts the second copy
    assert a.repeat_second > 0.9 * a.repeat_first  # ... the ablated one no longer does
    distractor = Ab.ablation_study(w, [(1, 1)], text=text, mode=mode, draws=0).ablated
    assert distractor.repeat_second < 0.5 * distractor.repeat_first
    assert len(study.random) == 3 and all(len(h) == 1 and h != ["1.0"] for h in study.random_heads)
    if mode == "mean":
        assert "4 validation sequences" in (study.mean_sample or "")


def test_icl_removed_is_the_share_of_the_intact_improvement() -> None:
    m = lambda icl: Ab.Measures(1.0, icl, 5.0, 1.0)  # noqa: E731
    s = Ab.AblationStudy(["1.0"], "mean", None, m(-0.2), m(-0.05), [["0.1"], ["1.1"]], [m(-0.2), m(-0.1)])
    assert s.icl_removed() == pytest.approx(0.75)
    assert s.random_icl_removed() == pytest.approx(0.25)
    assert s.random_icl_removed("median") == pytest.approx(0.25)  # two draws: the mean of the middle two
    s.random.append(m(-0.2))  # removes nothing: median 0, mean (0 + 0.5 + 0) / 3
    assert s.random_icl_removed("median") == 0 and s.random_icl_removed() == pytest.approx(1 / 6)
    assert (
        Ab.random_sets([(0, 0), (0, 1), (1, 1)], 1, 5, seed=0) == [[(0, 0)], [(0, 1)], [(1, 1)]]
        or len({tuple(x) for x in Ab.random_sets([(0, 0), (0, 1), (1, 1)], 1, 5, seed=0)}) == 3
    )  # all three distinct sets when fewer than the draws exist
    assert Ab.AblationStudy(["1.0"], "zero", None, m(0.1), m(0.3)).icl_removed() is None  # nothing to remove


def test_bad_heads_are_one_line_errors() -> None:
    cfg = hand_built().cfg
    assert Ab.parse_heads("1.0, 0.1,1.0", cfg) == [(1, 0), (0, 1)]
    for bad, says in [("2.0", "no head 2.0"), ("1.2", "no head 1.2"), ("x", "not a head"), ("1", "not a head")]:
        with pytest.raises(QkovError, match=says):
            Ab.parse_heads(bad, cfg)
    with pytest.raises(QkovError, match="mode"):
        Ab.ablated(Weights.from_model(hand_built()), [(0, 0)], "half")
    assert V == cfg.d_vocab
