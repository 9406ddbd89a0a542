"""The causal toolkit: a Contrast's runs, swap and patched passes against the training model's own
forward; results with named axes of any kind; the registry of sweeps a study runs; path patching on a
grouped-query model against an edit written by hand."""

from __future__ import annotations

import pytest
import torch

from qkov import QkovError, Transformer, Weights, trace
from qkov.analysis.causal import SWEEPS, Contrast, Option, PatchResult, Sweep, patch_study, register_sweep
from qkov.analysis.causal.metrics import LogitDiff
from qkov.analysis.causal.path_patch import path_patching
from qkov.analysis.causal.result import largest, result_text
from qkov.analysis.forward.address import Address
from qkov.apps.cli.patch_cmds import _table

from helpers import LN_MLP, MODERN, perturb_non_matrices

D = torch.float64


def _setup(cfg=LN_MLP, seed: int = 2):  # type: ignore[no-untyped-def]
    torch.manual_seed(seed)
    m = perturb_non_matrices(Transformer(cfg, seed=seed).double().eval(), 0.2)
    g = torch.Generator().manual_seed(1)
    clean = torch.randint(1, cfg.d_vocab, (2, 10), generator=g)
    corrupted = clean.clone()
    corrupted[:, 3:6] = torch.randint(1, cfg.d_vocab, (2, 3), generator=g)
    return m, Weights.from_model(m, dtype=D), clean, corrupted


def _logit_diff(logits: torch.Tensor, correct: torch.Tensor, incorrect: int) -> float:
    """The metric written out on ``logits [B, T, V]`` (the last position, mean over the batch)."""
    last = logits[:, -1]
    return float((last.gather(-1, correct[:, None])[:, 0] - last[:, incorrect]).mean())


@pytest.mark.parametrize("direction", ["denoise", "noise"])
def test_a_contrast_records_swaps_and_measures_as_the_model_does(direction: str) -> None:
    m, w, clean, corrupted = _setup()
    metric = LogitDiff(correct=clean[:, -1], incorrect=3)
    c = Contrast.of(w, clean, corrupted, metric=metric, direction=direction).record(["z.0"])
    with torch.no_grad():
        on_clean, on_corrupted = (_logit_diff(m(t), clean[:, -1], 3) for t in (clean, corrupted))
    assert c.clean_value == pytest.approx(on_clean, abs=1e-10) and c.corrupted_value == pytest.approx(on_corrupted, abs=1e-10)
    base, source = (corrupted, clean) if direction == "denoise" else (clean, corrupted)  # the convention, written out
    assert torch.equal(c.base, base) and torch.equal(c.source, source)
    assert c.base_value == pytest.approx(on_corrupted if direction == "denoise" else on_clean, abs=1e-10)
    assert c.swap(*c.swap("clean", "corrupted")) == ("clean", "corrupted")  # its own inverse
    assert torch.equal(c.base_recording["z", 0], trace(w, base, cache="z.0")["z", 0])
    # three different inputs in one pass: each copy's metric is that input's
    copies = [base.clone() for _ in range(3)]
    copies[1][:, 4] = source[:, 4]
    copies[2][:, 2:7] = source[:, 2:7]
    got = c.measure(3, tokens=torch.cat(copies))
    with torch.no_grad():
        want = [_logit_diff(m(t), clean[:, -1], 3) for t in copies]
    assert got.tolist() == pytest.approx(want, abs=1e-10) and got.shape == (3,)
    assert len(set(round(v, 8) for v in want)) == 3  # three different answers: the test can tell copies apart


def test_a_contrast_checks_its_inputs_before_any_work() -> None:
    _, w, clean, corrupted = _setup()
    for kw, says in [
        (dict(corrupted=corrupted[:, :9]), "same shape"),
        (dict(direction="sideways"), "denoise or noise"),
        (dict(corrupted=corrupted + 1000), "out of range|outside"),
    ]:
        args = dict(clean=clean, corrupted=corrupted, direction="denoise") | kw
        with pytest.raises(QkovError, match=says):
            Contrast.of(w, args["clean"], args["corrupted"], direction=args["direction"])


def test_results_take_named_axes_of_any_kind() -> None:
    """An edge axis labelled by addresses, a (step, head) grid: read by label, shown by label."""
    edges = [Address.parse(e) for e in ("0.0 -> 1.0<k>", "0.1 -> 1.0<k>", "0.1 -> 1.1<q>")]
    r = PatchResult("edge", "edges", ("edge",), torch.tensor([0.5, 2.0, 1.25], dtype=D), 2.0, 0.0, "denoise", "m",
                    {"edge": [e.name for e in edges]})  # fmt: skip
    assert r.at(edge="0.1 -> 1.0<k>") == 2.0 and r.at(edge=edges[2]) == 1.25 and r.at(edge=0) == 0.5
    assert r.normalized().tolist() == [0.25, 1.0, 0.625]
    assert largest(r, 1) == [("edge 0.1 -> 1.0<k>", 2.0, 1.0)]
    assert "edge patching of edges by edge" in result_text(r) and r.to_dict()["labels"]["edge"][1] == "0.1 -> 1.0<k>"
    grid = PatchResult("steps", "z", ("step", "head"), torch.arange(6, dtype=D).reshape(3, 2), 5.0, 0.0, "denoise", "m")
    assert grid.labels == {"step": ["0", "1", "2"], "head": ["0", "1"]} and grid.at(step=2, head=1) == 5.0
    table = _table(grid)  # the command line's grid: rows the first axis, columns the second
    assert [c.header for c in table.columns] == ["step", "head 0", "head 1"] and table.row_count == 3
    for bad, says in [
        (dict(axes=("edge", "edge")), "one distinct axis name per dimension"),
        (dict(axes=("a",)), "one distinct axis name per dimension"),
        (dict(labels={"step": ["a"]}), "axis step has 3 entries and 1 labels"),
    ]:
        kw = dict(axes=("step", "head"), labels={}) | bad
        with pytest.raises(QkovError, match=says):
            PatchResult("x", "z", kw["axes"], grid.values, 1.0, 0.0, "denoise", "m", kw["labels"])
    with pytest.raises(QkovError, match="axis head has no 'x'"):
        grid.at(step=0, head="x")


def test_the_study_runs_the_registered_sweeps_in_order() -> None:
    _, w, clean, corrupted = _setup()
    assert list(SWEEPS)[:3] == ["activation", "attribution", "path"]
    study = patch_study(w, clean, corrupted, sites="resid_pre,z", by_pos=True, receivers="1.0", input="v")
    assert [(r.method, r.site, r.axes) for r in study.results] == [
        ("activation", "resid_pre", ("layer", "pos")), ("activation", "z", ("layer", "pos", "head")),
        ("attribution", "z", ("layer", "pos", "head")), ("path", "sender -> 1.0 v", ("layer", "head")),
    ]  # fmt: skip
    assert set(study.agreement) == {"z"}
    one = path_patching(w, clean, corrupted, receivers=[(1, 0)], input="v")
    assert torch.equal(study.results[-1].values.nan_to_num(), one.values.nan_to_num())  # the options reach the sweep
    with pytest.raises(QkovError, match="nothing to patch"):
        patch_study(w, clean, corrupted, sites=())
    with pytest.raises(TypeError, match="unexpected keyword argument 'site'.*options: sites, by_pos"):
        patch_study(w, clean, corrupted, site="z")
    for kw, says in [(dict(by_pos="yes"), "by_pos: expected true or false"), (dict(input="o"), "input: expected one of q, k, v")]:
        with pytest.raises(QkovError, match=says):
            patch_study(w, clean, corrupted, receivers="1.0", **kw)


def test_the_registry_refuses_a_name_or_an_option_taken() -> None:
    run = lambda study: []  # noqa: E731
    with pytest.raises(QkovError, match="a sweep named 'path' is registered already"):
        register_sweep(Sweep("path", "again", run))
    with pytest.raises(QkovError, match="the option 'sites' of mine is another sweep's"):
        register_sweep(Sweep("mine", "clash", run, options=(Option("sites", (), "again", read=str),)))
    assert "mine" not in SWEEPS


@pytest.mark.parametrize("direction", ["denoise", "noise"])
def test_path_patching_into_a_grouped_key_equals_an_edit_by_hand(direction: str) -> None:
    """Grouped-query attention (4 query heads, 2 key/value heads): the path 0.1 -> 1.3<k> enters the key
    input slot 1 (1.3's group), computed here as one edit of ``k_input.1`` on the base run."""
    _, w, clean, corrupted = _setup(MODERN, seed=4)
    base, source = (corrupted, clean) if direction == "denoise" else (clean, corrupted)
    metric = LogitDiff(correct=clean[:, -1], incorrect=3)
    change = trace(w, source, cache="head_out.0")["head_out", 0][:, :, 1] - trace(w, base, cache="head_out.0")["head_out", 0][:, :, 1]

    def into_slot_1(value: torch.Tensor, site: Address) -> torch.Tensor:
        value = value.clone()
        value[:, :, 1] = value[:, :, 1] + change
        return value

    want = float(metric(trace(w, base, edits={"k_input.1": into_slot_1})))
    got = path_patching(w, clean, corrupted, receivers="1.3", input="k", senders=["0.1"], metric=metric, direction=direction)
    assert got.at(layer=0, head=1) == pytest.approx(want, abs=1e-10)
    assert abs(want - got.base) > 1e-6  # the path moves the metric: the test can tell
    assert got.site == "sender -> 1.3 k" and bool(got.values[0, 0].isnan())


@pytest.mark.parametrize("direction", ["denoise", "noise"])
def test_a_study_shares_one_base_and_one_source_run_and_changes_no_number(direction: str, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The sweeps (activation of resid_pre, head_out and z, attribution of both head sites, path patching) read one base and
    one source recording, made once with every site they read and the base's graph; each result equals the
    function run on its own (its own recordings), as does a study on a GPT-2-like model with the loss metric."""
    from qkov.analysis.causal import patching as Pt

    for cfg, metric in ((LN_MLP, LogitDiff(correct=3, incorrect=5)), (LN_MLP.replace(positional="standard"), None)):
        _, w, clean, corrupted = _setup(cfg)
        recorded: list[bool] = []
        real = Contrast.record

        def counted(self, *a, **k):  # type: ignore[no-untyped-def]
            recorded.append(k.get("grad", False))
            return real(self, *a, **k)

        monkeypatch.setattr(Contrast, "record", counted)
        sites = "resid_pre,head_out,z"  # two head sites: the metric's gradient taken once for both
        study = patch_study(w, clean, corrupted, metric=metric, direction=direction, receivers="1.0", sites=sites)
        assert recorded == [True]  # one recording of each run, the base's with its graph
        monkeypatch.setattr(Contrast, "record", real)
        kw = dict(metric=metric, direction=direction)
        alone = [
            Pt.activation_patching(w, clean, corrupted, site="resid_pre", **kw),
            Pt.activation_patching(w, clean, corrupted, site="head_out", **kw),
            Pt.activation_patching(w, clean, corrupted, site="z", **kw),
            Pt.attribution_patching(w, clean, corrupted, site="head_out", **kw),
            Pt.attribution_patching(w, clean, corrupted, site="z", **kw),
            path_patching(w, clean, corrupted, receivers="1.0", **kw),
        ]
        assert [(r.method, r.site) for r in study.results] == [(r.method, r.site) for r in alone]
        for got, want in zip(study.results, alone):
            assert got.values.shape == want.values.shape
            assert torch.allclose(got.values, want.values, atol=1e-10, equal_nan=True), (got.method, got.site)
            assert got.clean == pytest.approx(want.clean, abs=1e-12) and got.corrupted == pytest.approx(want.corrupted, abs=1e-12)
        assert (study.results[-1].values.nan_to_num() - study.results[-1].base).abs().max() > 1e-6  # the paths move it


def test_gradients_are_taken_whatever_the_callers_grad_mode() -> None:
    """``trace(grad=True)`` and attribution patching run differentiably inside ``torch.no_grad()`` too (a script
    that switches gradients off, as inference code does, still gets attribution patching)."""
    from qkov.analysis.causal import patching as Pt

    _, w, clean, corrupted = _setup()
    want = Pt.attribution_patching(w, clean, corrupted)
    with torch.no_grad():
        got = Pt.attribution_patching(w, clean, corrupted)
        study = patch_study(w, clean, corrupted)
        r = trace(w, clean, cache=["embed"], grad=True)
    r.logits[0, -1, 3].backward()  # the recording made under no_grad kept its graph
    assert torch.equal(got.values, want.values) and torch.equal(study.result("attribution", "head_out").values, want.values)
    assert r["embed"].grad is not None and r["embed"].grad.abs().max() > 0
