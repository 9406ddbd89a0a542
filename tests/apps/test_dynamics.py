"""Training dynamics: snapshots, `qkov dynamics` on built and trained series, its errors, torchrun."""

from __future__ import annotations

import json
import re
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import qkov
from qkov.analysis.heads.probes import default_icl_examples, induction_probe_tokens
from qkov.apps.inputs import analysis_inputs
from qkov.apps.dynamics.study import dynamics
from qkov.io.checkpoint import save_checkpoint
from qkov.model.ops import next_token_loss
from qkov.training import snapshots as snaps

from helpers import TINY, run_main, tiny_train, torchrun
from reference import reference_forward
from hand_built import CTX, V, hand_built

T0, WIDTH = 6e6, 4e5  # where the hand-made series forms its induction circuit, in tokens


def _structured_text(n: int = 24, seed: int = 0) -> np.ndarray:
    """Sequences of 55 random tokens that then start again (positions 56-63 repeat 1-8): text an
    induction head predicts late in the context (the ICL score's late window) and not early."""
    g = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        block = g.integers(1, V, size=55)
        rows.append(np.concatenate([[0], block, block[: CTX - 56]]))
    return np.stack(rows).astype(np.int64)


def _hand_series(folder: Path, alphas: list[float], tokens: list[int]) -> list[str]:
    """Checkpoints of the hand-built induction model with every weight scaled by ``alpha``
    (0: every attention uniform and every output zero; 1: the circuit as built)."""
    base = hand_built()
    paths = []
    for i, (a, t) in enumerate(zip(alphas, tokens)):
        m = hand_built()
        with torch.no_grad():
            for p, q in zip(m.parameters(), base.parameters()):
                p.copy_(a * q)
        path = folder / f"ckpt-{i:02d}"
        save_checkpoint(m, path, training={"step": i * 100, "tokens": t})
        paths.append(str(path))
    return paths


def test_the_window_is_where_the_circuit_was_built_and_a_flat_series_has_none(tmp_path: Path) -> None:
    tokens = [int(x) for x in np.linspace(0, 12e6, 31)]
    alphas = [1 / (1 + math.exp(-(t - T0) / WIDTH)) for t in tokens]
    text = tmp_path / "text.npy"
    np.save(text, _structured_text())
    built = dynamics(_hand_series(tmp_path / "rise", alphas, tokens), tokens=text, draws=2, device="cpu")
    assert built.axis == "tokens"
    windows = built.reading.windows
    for key in ("induction", "previous_token", "icl"):
        w = windows[key]
        assert w is not None and w.start <= T0 <= w.end and w.end - w.start < 3e6, (key, w)
    assert built.reading.together is True
    # the last snapshot is the hand-built model: its induction head is found and ablated
    assert built.induction_heads == ["1.0"]
    ab = built.ablation
    assert ab is not None and ab.heads == ["1.0"]
    assert ab.icl_removed() > 0.5 and ab.ablated.repeat_second > 0.9 * ab.ablated.repeat_first
    last = built.snapshots[-1]
    assert last["k_composition"]["writer"] == "0.0" and last["k_composition"]["reader"] == "1.0"
    # the induction score of the model (the last snapshot is it, to 1e-6): on the probe's repeated
    # tokens (copies of L = 31 after the start token), the attention from each second-copy token to
    # the token after its first occurrence, averaged, best layer-1 head; patterns of the reference forward
    L = (CTX - 1) // 2
    rep = induction_probe_tokens(hand_built(), length=L, repeats=2, batch=8, seed=0)
    pat = reference_forward(qkov.Weights.from_model(hand_built()), rep)[1]  # [L, B, H, T, T]
    q = torch.arange(L + 1, 2 * L + 1)
    want = pat[1][:, :, q, q - L + 1].mean(dim=(0, 2)).max()
    assert last["induction"] == pytest.approx(float(want), abs=1e-4) and float(want) > 0.5
    flat = dynamics(_hand_series(tmp_path / "flat", [0.9] * 12, tokens[:12]), tokens=text, draws=0, device="cpu")
    assert all(w is None for w in flat.reading.windows.values()) and flat.reading.together is None


@pytest.fixture(scope="module")
def tiny_run(small_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dyn") / "run"
    qkov.train(out, TINY, tiny_train(small_corpus, steps=30, snapshots=8), device="cpu")
    return out


def test_training_keeps_scheduled_snapshots_equal_to_the_weights_at_their_step(tiny_run: Path) -> None:
    steps = [s for s, _ in snaps.listing(tiny_run)]
    assert steps == snaps.schedule(30, 8) and steps[0] == 0 and steps[-1] == 30
    final = load_file(str(tiny_run / "model.safetensors"))
    last, meta = snaps.read(snaps.path_for(tiny_run, 30))
    assert meta == {"step": 30, "tokens": 30 * 4 * TINY.n_ctx}
    assert final.keys() == last.keys() and all(torch.equal(final[k], last[k]) for k in final)
    init = qkov.Transformer(TINY, seed=0).state_dict()  # the run's seed: step 0 is the initial weights
    first, _ = snaps.read(snaps.path_for(tiny_run, 0))
    assert all(torch.equal(init[k], first[k]) for k in init)


def test_dynamics_cli_on_a_run_matches_independent_measures(tiny_run: Path, capsys: pytest.CaptureFixture) -> None:
    code, out, err = run_main(capsys, "dynamics", tiny_run, "--draws", "1", "--device", "cpu", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert len(data["snapshots"]) == len(snaps.listing(tiny_run)) and data["axis"] == "tokens"
    assert (tiny_run / "dynamics" / "index.html").is_file() and (tiny_run / "dynamics" / "dynamics.json").is_file()
    # the final snapshot's validation loss: the training model's own loss on the same tokens
    model = qkov.load(tiny_run)
    ids = analysis_inputs(tiny_run, model, batch=max(16, default_icl_examples(TINY))).tokens[:16]
    with torch.no_grad():
        want = float(next_token_loss(model(ids), ids))
    assert data["snapshots"][-1]["val_loss"] == pytest.approx(want, abs=1e-4)
    assert "validation split" in data["sample"]
    assert len(data["snapshots"][-1]["per_token_loss"]) == 8 * (TINY.n_ctx - 1)
    assert qkov.training.rundir.inspect(tiny_run) == "resumable"  # the dynamics folder is the run's own


def test_resume_rewrites_the_snapshots_after_the_state(tmp_path: Path, small_corpus: Path) -> None:
    tc = tiny_train(small_corpus, steps=20, ckpt_interval=10, snapshots=(0, 5, 12, 15, 20))
    full, cut = tmp_path / "full", tmp_path / "cut"
    qkov.train(full, TINY, tc, device="cpu")
    qkov.train(cut, TINY, tc, device="cpu", stop_after=10)
    snaps.write(cut, qkov.Transformer(TINY, seed=5), 12, 0)  # a stale snapshot after the state (as a kill leaves)
    # a killed snapshot write: its name recorded in the run's manifest first, then its temporary
    qkov.io.manifest.record(cut, [snaps.name_for(15)])
    (cut / "snapshots" / ".step-00000015.safetensors.x.tmp").write_text("half")
    qkov.train(cut, device="cpu", resume=True)
    names = sorted(p.name for p in (cut / "snapshots").iterdir())
    assert names == sorted(p.name for p in (full / "snapshots").iterdir()) and len(names) == 5
    for name in names:
        a, b = load_file(str(full / "snapshots" / name)), load_file(str(cut / "snapshots" / name))
        assert all(torch.equal(a[k], b[k]) for k in a), name


def test_bad_series_are_one_line_errors(tmp_path: Path, tiny_run: Path, capsys: pytest.CaptureFixture) -> None:
    plain = tmp_path / "plain"
    save_checkpoint(hand_built(), plain)
    other = tmp_path / "other"
    save_checkpoint(qkov.Transformer(TINY, seed=0), other)
    cases = [
        ((plain,), "holds no snapshots"),
        ((plain, other, "-o", tmp_path / "o1"), "different architecture"),
        ((str(tmp_path / "nothing*"), "-o", tmp_path / "o2"), "matches nothing"),
        ((plain, "-o", tmp_path / "o3", "--revisions", "step1"), "revisions apply to one Hugging Face Hub name|Hub"),
        ((tmp_path / "absent", "-o", tmp_path / "o4"), "does not exist"),
    ]
    for args, says in cases:
        code, _, err = run_main(capsys, "dynamics", *args, "--device", "cpu")
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith("qkov: error:"), (args, err)
        assert any(s in lines[0] for s in says.split("|")), (args, lines[0])
    code, _, err = run_main(capsys, "ablate", tiny_run, "--heads", "1.9")
    assert code == 2 and "no head 1.9" in err and len(err.strip().splitlines()) == 1


def _fake_hub(cache: Path, repo: str, revisions: dict[str, Path]) -> None:
    """A Hugging Face cache holding ``repo`` at ``revisions`` (name -> a saved model directory)."""
    root = cache / ("models--" + repo.replace("/", "--"))
    (root / "refs").mkdir(parents=True)
    for i, (rev, src) in enumerate(revisions.items()):
        commit = f"{i + 1:040x}"
        (root / "refs" / rev).write_text(commit)
        snap = root / "snapshots" / commit
        snap.mkdir(parents=True)
        for f in src.iterdir():
            (snap / f.name).write_bytes(f.read_bytes())


def test_hub_revisions_from_the_local_cache(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("transformers")
    import hf_models

    dirs = {f"step{s}": hf_models.save("neox-parallel", tmp_path / f"s{s}") for s in (0, 1000, 2000)}
    for i, d in enumerate(dirs.values()):  # three different points of "training"
        w = load_file(str(d / "model.safetensors"))
        save_file({k: v * (1 + 0.1 * i) for k, v in w.items()}, str(d / "model.safetensors"))
    cache = tmp_path / "hub"
    _fake_hub(cache, "acme/pythia-mini", dirs)
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        import huggingface_hub.constants as C  # read once at import: point it at the fake cache

        C.HF_HUB_CACHE, C.HF_HUB_OFFLINE = str(cache), True
        code, out, err = run_main(
            capsys,
            "dynamics",
            "acme/pythia-mini",
            "--revisions",
            "step2000,step0,step1000",
            "--tokens-per-step",
            "100",
            "-o",
            tmp_path / "d",
            "--device",
            "cpu",
            "--json",
            "--draws",
            "0",
        )
        assert code == 0, err
        data = json.loads(out)
        assert [s["label"] for s in data["snapshots"]] == ["step0", "step1000", "step2000"]  # in training order
        assert [s["tokens"] for s in data["snapshots"]] == [0, 100000, 200000]
        assert data["snapshots"][0]["val_loss"] is None  # no text given: random tokens, no loss
        code, _, err = run_main(
            capsys,
            "dynamics",
            "acme/pythia-mini",
            "--revisions",
            "step0,step9",
            "-o",
            tmp_path / "e",
            "--device",
            "cpu",
        )
        assert code == 2 and "revision 'step9'" in err and len(err.strip().splitlines()) == 1
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        import importlib

        importlib.reload(C)


EVERY_RANK = """
import json, os, sys
from pathlib import Path
from qkov.apps.dynamics.study import write_dynamics
run, out = sys.argv[1], Path(sys.argv[2])
result = write_dynamics(out, [run], device="cpu", draws=1)
(out.parent / f"rank{os.environ['RANK']}.json").write_text(json.dumps(result.to_dict()))
"""


def test_two_ranks_give_the_same_result_as_one_and_every_rank_gets_it(tiny_run: Path, tmp_path: Path) -> None:
    env, one_dir = {**os.environ, "OMP_NUM_THREADS": "1"}, tmp_path / "one"
    one = subprocess.run(
        [sys.executable, "-m", "qkov", "dynamics", str(tiny_run), "--device", "cpu", "--draws", "1", "-o", one_dir],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert one.returncode == 0, one.stderr[-2000:]
    script = tmp_path / "every_rank.py"
    script.write_text(EVERY_RANK)
    two = torchrun([str(script), str(tiny_run), str(tmp_path / "two")], env, script=True)
    assert two.returncode == 0, two.stderr[-3000:]

    def strip(data: dict) -> dict:
        data.pop("timings")
        for s in data["snapshots"]:
            s.pop("seconds")
        return data

    read = lambda path: json.loads(path.read_text())  # noqa: E731
    ranks = [read(tmp_path / f"rank{r}.json") for r in (0, 1)]
    assert ranks[0] == ranks[1]  # timings too: rank 1 holds rank 0's result, not one of its own
    assert strip(read(one_dir / "dynamics.json")) == strip(read(tmp_path / "two" / "dynamics.json"))
    assert strip(ranks[1]) == strip(read(one_dir / "dynamics.json"))


def test_dynamics_page_renders_offline_in_headless_chromium(tiny_run: Path, tmp_path: Path) -> None:
    from browser import RESOURCES_PROBE, chromium, console_lines, need_browser, requested

    need_browser()
    folder = tiny_run / "dynamics"
    if not (folder / "index.html").exists():
        qkov.apps.dynamics.study.write_dynamics(folder, [tiny_run], device="cpu", draws=1)
    data = json.loads((folder / "dynamics.json").read_text())
    probed = tmp_path / "index.html"
    probed.write_text((folder / "index.html").read_text().replace("</body>", RESOURCES_PROBE + "</body>"))
    res = chromium(probed.as_uri(), tmp_path / "profile", "--dump-dom")
    assert res.returncode == 0, res.stderr[-2000:]
    assert not console_lines(res), console_lines(res)
    dom = res.stdout
    assert 'data-ready="1"' in dom and "data-errors" not in dom
    for s in ("summary", "curves", "loss", "heads", "trajectory", "ablation", "table"):
        assert f'data-section="{s}" data-rendered="ok"' in dom, s
    assert requested(dom) == []
    # the snapshot table shows every snapshot's numbers as the JSON has them
    table = dom[dom.index('id="snapshot-table"') :]
    rows = re.findall(r"<tr><td[^>]*>(step \d+)</td>(.*?)</tr>", table)
    assert [r[0] for r in rows] == [s["label"] for s in data["snapshots"]]
    for (_, cells), snap in zip(rows, data["snapshots"]):
        assert re.search(rf"<td[^>]*>{snap['val_loss']:.4f}</td>", cells), (snap["label"], cells)


def test_dynamics_and_ablation_show_their_numbers(tmp_path: Path) -> None:
    """The notebook forms (text and HTML) of a dynamics result and an ablation study show the
    object's own numbers."""
    from qkov.apps.dynamics.study import DynamicsResult
    from qkov.analysis.causal import ablation as Ab
    from qkov.analysis.series.phase import Window
    from qkov.analysis.series.measures import SeriesReading

    win = Window(start=1234567.0, end=2345678.0, peak=2e6, rise=0.4321, share=0.8, sharpness=6.5)
    snap = {"at": 0.0, "induction": 0.1, "previous_token": 0.2, "icl": -0.01}
    icl = lambda v: Ab.Measures(2.5, v, 5.0, 1.25)  # noqa: E731
    # removes (−0.17 − −1) / 1 = 83%; the random sets remove 0%, 2%, 10%: median 2%, mean 4%
    randoms = [icl(v) for v in (-1.0, -0.98, -0.9)]
    study = Ab.AblationStudy(["1.0"], "mean", None, icl(-1.0), icl(-0.17), [["0.1"]] * 3, randoms)
    r = DynamicsResult(
        sources=["toy"],
        model=TINY,
        axis="tokens",
        sample="text",
        left_out={},
        snapshots=[snap, {**snap, "at": 3e6, "induction": 0.5}],
        reading=SeriesReading({"induction": win, "previous_token": None, "icl": None}, None, None, None),
        induction_heads=["1.0"],
        ablation=study,
    )
    text, page = repr(r), r._repr_html_()
    assert text.startswith(f"dynamics of {TINY.describe()}: 2 snapshots (tokens)")
    assert "1,234,567 - 2,345,678 (rise 0.432)" in text and "removes 83%" in text
    assert "random heads 2% (median), 4% (mean)" in text
    assert "<td>1,234,567</td><td>2,345,678</td><td>0.432</td><td>6.5</td>" in page and 'class="window"' in page
    assert r.to_dict()["reading"]["windows"]["induction"]["start"] == 1234567.0
    assert r.to_dict()["ablation"]["random_icl_removed_median"] == pytest.approx(0.02)
    assert r.to_dict()["model"] == TINY.to_dict() and r.to_dict()["description"] == TINY.describe()
    m = lambda loss, icl: Ab.Measures(loss, icl, 5.0, 1.25)  # noqa: E731
    study = Ab.AblationStudy(["1.0"], "zero", None, m(2.5, -0.2), m(2.75, -0.05), [["0.1"]], [m(2.6, -0.19)])
    assert "2.5000" in repr(study) and "+0.0500" not in repr(study) and "-0.0500" in repr(study)
    assert "75%" in repr(study) and "random heads: median 5%, mean 5%" in repr(study)
    html_ = study._repr_html_()
    assert "<td>intact</td><td>2.5000</td><td>-0.2000</td><td>5.000</td><td>1.250</td>" in html_


@pytest.mark.parametrize("length", [64, 56])
def test_icl_score_read_at_its_window_positions_equals_the_full_curve(length: int) -> None:
    from qkov.analysis.heads.probes import icl_score

    w = qkov.Weights.from_model(qkov.Transformer(TINY.replace(n_ctx=64), seed=3))
    ex = torch.from_numpy(_structured_text(12, seed=1)[:, :length] % TINY.d_vocab)
    with pytest.raises(qkov.QkovError, match="too short"):  # 40 tokens: the early and late positions meet
        icl_score(w, ex[:, :40], curve=False)
    full, fast = icl_score(w, ex), icl_score(w, ex, curve=False, chunk=5)
    assert fast.score == pytest.approx(full.score, abs=1e-6) and fast.loss_by_position == []
    assert (fast.early, fast.late) == (full.early, full.late) and len(full.loss_by_position) == length - 1


def test_phase_claims_follow_the_numbers() -> None:
    from qkov.apps.dynamics.phase import phase_claims

    win = {"start": 8e6, "end": 1.2e7, "peak": 1e7, "rise": 0.4, "share": 0.8, "sharpness": 4.0}
    meas = lambda icl: {"loss": 2.5, "icl": icl, "repeat_first": 10.0, "repeat_second": 7.0}  # noqa: E731

    def two(together: bool, removed: float, median: float | None) -> dict:
        ab = {
            "heads": ["1.1"],
            "mode": "mean",
            "intact": meas(-0.1),
            "ablated": meas(0.0),
            "random": [meas(-0.1)],
            "random_heads": [["0.1"]],
            "icl_removed": removed,
            "random_icl_removed": median,
            "random_icl_removed_median": median,
        }
        windows = {"induction": win, "previous_token": win, "icl": win}
        return {"reading": {"windows": windows, "together": together}, "ablation": ab}

    one = {"reading": {"windows": {"induction": None, "previous_token": None, "icl": None}}}
    verdicts = lambda t, o: [c.holds for c in phase_claims(t, o)]  # noqa: E731
    assert verdicts(two(True, 1.6, -0.1), one) == [True, True, True]
    assert verdicts(two(False, 0.4, -0.1), one) == [False, True, False]  # not together; removes too little
    assert verdicts(two(True, 0.9, 0.6), one) == [True, True, False]  # a typical random set removes most too
    one_with = {"reading": {"windows": {"induction": None, "icl": win}}}
    assert verdicts(None, one_with) == [False]  # a 1-layer ICL window is a difference
    no_heads = two(True, 1.0, 0.0)
    no_heads["ablation"] = None
    assert phase_claims(no_heads, None)[1].holds is False

