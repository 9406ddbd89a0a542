"""Activation, path and attribution patching: batched sweeps against one patch at a time, path
patching against a hand computation and on the hand-built induction model (known answer),
attribution against finite differences; bad input."""

from __future__ import annotations

import itertools

import pytest
import torch

from qkov import QkovError, Transformer, Weights, trace
from qkov.analysis.causal import patching as Pt
from qkov.analysis.causal.contrast import copy_bytes
from qkov.analysis.causal.result import agreement
from qkov.analysis.causal.metrics import Attention, LogitDiff, Loss, parse_metric
from qkov.analysis.causal.path_patch import path_patching
from qkov.analysis.causal.studies import patch_study
from qkov.analysis.heads.probes import induction_probe_tokens
from qkov.model.tokens import TextCodec
from tokenizers import Tokenizer, models, pre_tokenizers

from helpers import LN_MLP, perturb_non_matrices, one_patch
from hand_built import V, hand_built

D = torch.float64
GPT2_LIKE = LN_MLP.replace(positional="standard", act_fn="gelu_new")


def _setup():  # type: ignore[no-untyped-def]
    m = perturb_non_matrices(Transformer(GPT2_LIKE, seed=2).double().eval(), 0.2)
    w = Weights.from_model(m, dtype=D)
    g = torch.Generator().manual_seed(1)
    clean = torch.randint(1, GPT2_LIKE.d_vocab, (2, 10), generator=g)
    corrupted = clean.clone()
    corrupted[:, 3:6] = torch.randint(1, GPT2_LIKE.d_vocab, (2, 3), generator=g)
    return w, clean, corrupted


@pytest.mark.parametrize("direction", ["denoise", "noise"])
def test_batched_sweeps_equal_one_patch_at_a_time(direction: str) -> None:
    w, clean, corrupted = _setup()
    base, src = (corrupted, clean) if direction == "denoise" else (clean, corrupted)
    metric = LogitDiff(correct=clean[:, -1], incorrect=3)
    cases = [
        ("resid_pre", ("layer", "pos"), lambda p: (p,)),
        ("mlp_out", ("layer", "pos"), lambda p: (p,)),
        ("head_out", ("layer", "head"), lambda h: (slice(None), h)),
        ("z", ("layer", "pos", "head"), lambda p, h: (p, h)),
        ("pattern", ("layer", "head", "pos"), lambda h, p: (h, p)),
    ]
    for kind, axes, index in cases:
        budget = 3 * copy_bytes(w, clean, metric.logit_positions(clean.shape[1]))
        got = Pt.activation_patching(
            w, clean, corrupted, site=kind, axes=axes, metric=metric, direction=direction, max_bytes=budget
        )  # batches of three patched copies (the last one shorter)
        for cell in itertools.product(*(range(n) for n in got.values.shape)):  # every patch
            want = one_patch(w, base, src, kind, cell[0], index(*cell[1:]), lambda r: metric(r))
            assert got.values[cell] == pytest.approx(want, abs=1e-10), (kind, cell)
    assert got.base == pytest.approx(float(metric(trace(w, base)))) and got.target == pytest.approx(float(metric(trace(w, src))))
    n = got.normalized()
    assert torch.allclose(n, (got.values - got.base) / (got.target - got.base))


def test_path_patching_into_keys_and_logits_equals_a_hand_computation() -> None:
    """The receiver 1.1's pattern with the sender 0.0's change added to its key input only, computed
    from the weights by hand; and the path into the logits, from the base final stream."""
    w, clean, corrupted = _setup()
    r_base = trace(w, corrupted, cache=["resid_pre.1", "head_out.0", "q.1", "resid_post.1"])
    r_src = trace(w, clean, cache=["head_out.0"])
    delta = r_src["head_out", 0][:, :, 0] - r_base["head_out", 0][:, :, 0]
    x = r_base["resid_pre", 1] + delta
    xn = (x - x.mean(-1, keepdim=True)) / ((x - x.mean(-1, keepdim=True)).pow(2).mean(-1, keepdim=True) + 1e-5).sqrt()
    att = w.attention(1)
    k = xn @ att.W_K[1] + att.b_K[1]
    q = r_base["q", 1][:, :, 1]
    scores = (q @ k.transpose(-1, -2)) / 8**0.5
    pattern = scores.masked_fill(torch.ones(10, 10).triu(1).bool(), float("-inf")).softmax(-1)
    queries = list(range(4, 10))
    want = float(pattern[:, queries, [q - 2 for q in queries]].mean())
    m = Attention(layer=1, head=1, queries=queries, offset=2)
    got = path_patching(w, clean, corrupted, receivers=[(1, 1)], input="k", metric=m)
    assert got.values[0, 0] == pytest.approx(want, abs=1e-10) and bool(got.values[1].isnan().all())
    # -> logits: the base final stream plus the change, through the final LayerNorm and W_U
    f = r_base["resid_post", 1] + delta
    f = (f - f.mean(-1, keepdim=True)) / ((f - f.mean(-1, keepdim=True)).pow(2).mean(-1, keepdim=True) + 1e-5).sqrt()
    logits = f @ w.W_U + w.b_U
    lm = LogitDiff(correct=clean[:, -1], incorrect=3)
    want = float((logits[:, -1].gather(-1, clean[:, -1:])[:, 0] - logits[:, -1, 3]).mean())
    assert path_patching(w, clean, corrupted, receivers="logits", metric=lm).values[0, 0] == pytest.approx(want, abs=1e-10)


def _induction_pair(batch: int = 4):  # type: ignore[no-untyped-def]
    length = 15
    clean = induction_probe_tokens(V, length=length, repeats=2, batch=batch, seed=1, bos=0)
    corrupted = clean.clone()
    corrupted[:, 1:] = torch.randint(1, V, corrupted[:, 1:].shape, generator=torch.Generator().manual_seed(5))
    queries = list(range(length + 1, clean.shape[1]))
    return clean, corrupted, Attention(layer=1, head=0, queries=queries, offset=length - 1)


def test_the_induction_heads_key_path_carries_its_prefix_matching() -> None:
    """Known answer: on the hand-built model, noising the path previous-token head 0.0 -> induction
    head 1.0's key input removes (almost) all of 1.0's prefix-matching attention; the query and value
    paths remove none of it, nor does the sink head 0.1's path."""
    w = Weights.from_model(hand_built())
    clean, corrupted, m = _induction_pair()
    removed = {}
    for inp in ("q", "k", "v"):
        r = path_patching(w, clean, corrupted, receivers=[(1, 0)], input=inp, metric=m, direction="noise")
        assert r.clean > 0.8 and r.corrupted < 0.1
        removed[inp] = r.normalized()[0].tolist()
    assert removed["k"][0] >= 0.9 and abs(removed["k"][1]) < 0.01
    assert max(abs(x) for x in removed["q"] + removed["v"]) < 0.01


@pytest.mark.parametrize("direction", ["denoise", "noise"])
def test_one_senders_paths_into_each_input_in_one_pass_equal_path_patching(direction: str) -> None:
    from qkov.analysis.causal.path_patch import input_paths

    w, clean, corrupted = _setup()
    m = LogitDiff(correct=clean[:, -1], incorrect=3)
    got, c, x = input_paths(w, clean, corrupted, sender=(0, 1), receiver=(1, 0), metric=m, direction=direction)
    for inp in ("q", "k", "v"):
        r = path_patching(w, clean, corrupted, receivers=[(1, 0)], input=inp, senders=[(0, 1)], metric=m, direction=direction)
        assert got[inp] == pytest.approx(float(r.values[0, 1]), abs=1e-10) and (c, x) == pytest.approx((r.clean, r.corrupted))
    assert len({round(v, 6) for v in got.values()}) == 3  # three different paths
    with pytest.raises(QkovError, match="must come before the receiver"):
        input_paths(w, clean, corrupted, sender=(1, 1), receiver=(1, 0), metric=m)


def test_attribution_is_the_first_order_term_of_the_patch() -> None:
    """Attribution patching against finite differences of the same patch scaled by a small eps."""
    w, clean, corrupted = _setup()
    metric = Loss(tokens=clean)
    att = Pt.attribution_patching(w, clean, corrupted, site="head_out", metric=metric)
    base = trace(w, corrupted, cache="head_out.*")
    src = trace(w, clean, cache="head_out.*")
    f0, eps = float(metric(base)), 1e-6
    for l, h in [(0, 0), (0, 1), (1, 1)]:
        d = src["head_out", l][:, :, h] - base["head_out", l][:, :, h]
        moved = trace(w, corrupted, edits={f"head_out.{l}.{h}": lambda v, s: v + eps * d})
        slope = (float(metric(moved)) - f0) / eps
        assert att.values[l, h] - att.base == pytest.approx(slope, rel=1e-4, abs=1e-8)
    act = Pt.activation_patching(w, clean, corrupted, site="head_out", metric=metric)
    assert agreement(act, act) == pytest.approx(1.0) and -1 <= agreement(act, att) <= 1


def test_study_and_metrics_and_one_line_errors() -> None:
    w, clean, corrupted = _setup()
    study = patch_study(w, clean, corrupted, receivers=[(1, 0)], decode=str)
    kinds = [(r.method, r.site) for r in study.results]
    assert kinds == [("activation", "resid_pre"), ("activation", "head_out"), ("attribution", "head_out"), ("path", "sender -> 1.0 k")]
    assert "head_out" in study.agreement and study.result("activation", "resid_pre").labels["pos"][0].startswith("0 ")
    assert "activation patching of resid_pre" in repr(study) and study.to_dict()["results"][0]["axes"] == ["layer", "pos"]
    words = Tokenizer(models.WordLevel({"<s>": 0, "x": 1, "y": 2, "a": 5, "b": 6}, unk_token="<s>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    codec = TextCodec(words, 0)
    assert isinstance(parse_metric(None, clean, None, 30), Loss)
    lm = parse_metric("logit-diff: a,b", clean, codec, 30)
    assert (lm.correct, lm.incorrect) == (5, 6) and parse_metric("prob:4", clean, None, 30).token == 4
    assert lm.name == "logit diff 'a' (5) - 'b' (6)"
    bad = [
        (lambda: parse_metric("logit-diff: x y,b", clean, codec, 30), r"' x y' is not one token: it splits into \['x', 'y'\]"),
        (lambda: parse_metric("logit-diff:x,3", clean, None, 30), "no tokenizer"),
        (lambda: parse_metric("prob:99", clean, None, 30), "out of range"),
        (lambda: parse_metric("median", clean, None, 30), "expected loss, logit-diff"),
        (lambda: Pt.activation_patching(w, clean, corrupted[:, :9]), "same shape"),
        (lambda: Pt.activation_patching(w, clean, corrupted, direction="sideways"), "denoise or noise"),
        (lambda: Pt.activation_patching(w, clean, corrupted, site="embed"), "has no layer|per-layer site"),
        (lambda: Pt.activation_patching(w, clean, corrupted, site="resid_pre", axes=("layer", "head")), "no head index"),
        (lambda: path_patching(w, clean, corrupted, receivers=[(0, 1)]), "layer 0 has no earlier head"),
        (lambda: path_patching(w, clean, corrupted, receivers=[(1, 0)], senders=[(1, 1)]), "before layer 1"),
        (lambda: path_patching(w, clean, corrupted, receivers=[(1, 0)], input="o"), "q, k or v"),
        (lambda: path_patching(w, clean, corrupted, receivers="lgts"), "heads or 'logits'"),
    ]
    for call, says in bad:
        with pytest.raises(QkovError, match=says):
            call()

