"""``qkov report``: the numbers against independent computations, the page in a real browser."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from qkov import ModelConfig, Weights
from qkov.analysis.paths.summary import PathSummary
from qkov.analysis.paths.importance import TermImportance
from qkov.analysis.heads.probes import induction_probe_tokens
from qkov.apps.cli import main
from qkov.apps.report import Report, collect, write_report
from qkov.apps.report import card as Cd
from qkov.apps.report import sections as S
from qkov.analysis.causal.composition import CompositionPaths
from qkov.analysis.causal.patching import activation_patching
from qkov.apps.claims import CIRCUIT_TOP, circuit_claim, claims
from qkov.apps.report.causal_sections import CircuitEdge, CircuitSection
from qkov.apps.report.discovery import section_task
from qkov.analysis.discovery import Circuit, CircuitLayout, edge_scores, evaluate_circuit, graph_of
from qkov.io.checkpoint import load, save_checkpoint
from qkov.training.loop import train

from browser import CHROMIUM, console_lines
from browser import chromium as _chromium
from browser import need_browser as _need_browser
from helpers import ROOT, tiny_train
from reference import reference_forward
from hand_built import CTX, V, hand_built

ARTIFACTS = Path(os.environ.get("QKOV_TEST_ARTIFACTS", ROOT / "test-artifacts"))
SECTIONS = (
    "card", "heads", "composition", "paths", "attention", "icl", "trigrams", "causal", "patching", "circuit"
)


@pytest.fixture(scope="module")
def tiny2(small_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny2") / "ckpt"
    cfg = ModelConfig(n_layers=2, n_heads=2, d_model=32, d_head=16, d_vocab=300, n_ctx=80)
    train(out, cfg, tiny_train(small_corpus, steps=20), device="cpu")
    return out


@pytest.fixture(scope="module")
def tiny2_report(tiny2: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("tiny2-report")
    clean, corrupted = _pair(out.parent)
    report = write_report(tiny2, out, icl_examples=32, batch=4, viewer_tokens=40, clean=clean, corrupted=corrupted)
    return out, report.to_dict()


def _pair(folder: Path) -> tuple[Path, Path]:
    """A clean/corrupted pair of token-id files (2 sequences of 12 tokens, 3 positions changed)."""
    g = torch.Generator().manual_seed(3)
    clean = torch.randint(1, 300, (2, 12), generator=g)
    clean[:, 0] = 0
    corrupted = clean.clone()
    corrupted[:, 4:7] = torch.randint(1, 300, (2, 3), generator=g)
    np.save(folder / "clean.npy", clean.numpy())
    np.save(folder / "corrupted.npy", corrupted.numpy())
    return folder / "clean.npy", folder / "corrupted.npy"


def test_report_numbers_match_independent_computations(tiny2: Path, tiny2_report: tuple[Path, dict]) -> None:
    out, data = tiny2_report
    on_disk = json.loads((out / "report.json").read_text())
    assert on_disk["card"]["parameters"] == data["card"]["parameters"]
    assert set(SECTIONS) <= set(on_disk) and on_disk["schema_version"] == S.SCHEMA_VERSION
    assert Report.from_dict(on_disk).to_dict() == on_disk  # the typed sections own the whole schema
    model = load(tiny2)
    w = Weights.from_model(model)
    # composition heatmap cells = [F]'s K-composition written out from the training model's own
    # matrices (no LayerNorm: the view leaves them as they are), ||W_OV1 W_QK2^T|| / (||W_OV1|| ||W_QK2||),
    # baseline-subtracted
    a0, a1 = model.blocks[0].attn, model.blocks[1].attn
    comp = data["composition"]["k"]
    assert comp["writers"] == ["0.0", "0.1"] and comp["readers"] == ["1.0", "1.1"]
    for i in range(2):
        for j in range(2):
            ov = (a0.W_V[i] @ a0.W_O[i]).detach().double()
            qk = (a1.W_Q[j] @ a1.W_K[j].T).detach().double()
            want = (ov @ qk.T).norm() / (ov.norm() * qk.norm())
            assert comp["raw"][i][j] == pytest.approx(float(want), rel=1e-3)
            assert comp["adjusted"][i][j] == pytest.approx(comp["raw"][i][j] - comp["baseline_mean"], abs=2e-3)
    # the viewer's patterns are the forward pass's on the same tokens (lower triangle, 3 decimals)
    att = data["attention"]
    assert len(att["tokens"]) == len(att["ids"]) == 40 and att["ids"][0] == model.bos_token_id
    pat = reference_forward(w, torch.tensor([att["ids"]]))[1][:, 0]
    for l in range(2):
        for h in range(2):
            rows = att["patterns"][l][h]
            assert [len(r) for r in rows] == list(range(1, 41))
            for q in (0, 7, 39):
                assert rows[q] == pytest.approx(pat[l, h, q, : q + 1].tolist(), abs=6e-4)
    # eigenvalue copying scores (and the heads table's): sum(lambda) / sum(|lambda|) of the full OV
    # circuit W_E W_V W_O W_U (the view's unembedding, centred), its eigenvalues solved here whole
    assert len(data["eigenvalues"]["heads"]) == len(data["heads"]["rows"]) == 4
    for e, row in zip(data["eigenvalues"]["heads"], data["heads"]["rows"]):
        l, h = map(int, e["head"].split("."))
        lam = torch.linalg.eigvals((w.W_E @ w.W_V[l, h] @ w.W_O[l, h] @ w.W_U).double())
        want = float(lam.sum().real / lam.abs().sum())
        assert e["score"] == pytest.approx(want, abs=1e-3) and row["eigen_copying"] == pytest.approx(want, abs=1e-3)
    # paths: the expansion is exact and the runs end at the model's own loss
    p = data["paths"]
    assert p["reconstruction_max_abs_error"] < 1e-3
    ti = p["term_importance"]
    assert ti["run_losses"][-1] == pytest.approx(ti["full_loss"], abs=1e-4)
    # the repeated-token curves: recompute the second-copy mean loss by hand
    rep = data["icl"]["repeat"]
    n = rep["length"]
    toks = induction_probe_tokens(model, length=n, repeats=2, batch=16, seed=0)
    with torch.no_grad():
        lp = model(toks)[:, :-1].log_softmax(-1)
    nll = -lp.gather(-1, toks[:, 1:, None])[..., 0].mean(0)
    assert rep["second_mean"] == pytest.approx(float(nll[n + 1 : 2 * n].mean()), abs=1e-4)
    assert rep["first_mean"] == pytest.approx(float(nll[1:n].mean()), abs=1e-4)
    # the patching section: the library's sweeps on the same pair, and its inputs named
    pt = data["patching"]
    clean, corrupted = (torch.from_numpy(np.load(f)) for f in (out.parent / "clean.npy", out.parent / "corrupted.npy"))
    assert pt["clean"].endswith("clean.npy") and [(r["method"], r["site"]) for r in pt["results"]] == [
        ("activation", "resid_pre"), ("activation", "head_out"), ("attribution", "head_out")
    ]
    want = activation_patching(w, clean, corrupted, site="head_out")
    assert np.allclose(pt["results"][1]["values"], want.values.numpy(), atol=1e-5)
    assert -1 <= pt["agreement"]["head_out"] <= 1 and data["causal"]["absent"]  # 20 steps: no induction head


def test_report_runs_its_text_once_and_each_section_equals_its_own_run(tiny2: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The heads' text scores and the path expansion read one recorded run of the report's text (a section
    running the text again fails the count; the attention viewer runs its prefix of the first sequence on its
    own), and each of those sections equals its function called alone with its own run, to 1e-6."""
    from qkov.analysis.forward import tracer
    from qkov.analysis.heads.report import head_report
    from qkov.apps.report.collect import _paths, attention_section, heads_section

    text = torch.randint(1, 300, (8, 80), generator=torch.Generator().manual_seed(5))
    batch, viewer = 4, 40
    runs: list[torch.Tensor] = []
    real_run = tracer._run

    def counted(state, tokens, positions, start_at):  # type: ignore[no-untyped-def]
        runs.append(tokens.detach().cpu())
        return real_run(state, tokens, positions, start_at)

    monkeypatch.setattr(tracer, "_run", counted)
    rep = collect(tiny2, tokens=text, batch=batch, icl_examples=8, viewer_tokens=viewer, diag_k=5)
    monkeypatch.setattr(tracer, "_run", real_run)
    # a pass over the text the heads, paths and viewer read: its first k <= batch sequences (or a prefix)
    on_text = [t for t in runs if t.shape[0] <= batch and torch.equal(t, text[: t.shape[0], : t.shape[1]])]
    assert [list(t.shape) for t in on_text] == [[batch, 80], [1, viewer]]  # the recording, the viewer's own
    assert any(t.shape[0] == 8 for t in runs)  # the counting sees the report's other passes (the ICL score's)
    model = load(tiny2)
    w = Weights.from_model(model)
    alone = {
        "heads": heads_section(head_report(w, text[:batch], bos=model.bos_token_id, icl_text=text, diag_k=5)),
        "paths": _paths(w, text[:batch], 20),
        "attention": attention_section(w, text[0, :viewer], lambda t: str(t)),
    }
    for name, section in alone.items():
        got, own = getattr(rep, name).to_dict(), section.to_dict()
        if name == "attention":
            got, own = got["patterns"], own["patterns"]  # the decoded tokens differ (no decoder here)
        _close(got, own, name)


def _close(a: object, b: object, where: str) -> None:
    """``a`` and ``b`` (nested JSON-like values) equal, numbers to 1e-6."""
    if isinstance(a, dict) and isinstance(b, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _close(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _close(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and isinstance(b, float):
        assert abs(a - b) <= 1e-6, (where, a, b)
    else:
        assert a == b, (where, a, b)


def test_report_on_a_hand_built_model_names_its_circuit(tmp_path: Path) -> None:
    """The hand-built 2-layer model: previous-token head 0.0, sink 0.1, induction head 1.0
    K-composing with 0.0. The report (and the tour's claims) must say exactly that."""
    save_checkpoint(hand_built(), tmp_path / "hand")
    g = torch.Generator().manual_seed(0)
    toks = torch.randint(1, V, (8, CTX), generator=g)
    toks[:, 0] = 0
    report = collect(tmp_path / "hand", tokens=toks, batch=4)
    assert isinstance(report.heads, S.HeadsSection) and isinstance(report.composition, S.CompositionSection)
    roles = {r.head: r.roles for r in report.heads.rows}
    assert "previous-token" in roles["0.0"] and "sink" in roles["0.1"] and "induction" in roles["1.0"]
    assert "induction" not in roles["1.1"] and "induction" not in roles["0.0"]
    top = report.composition.kinds["k"].top[0]
    assert (top.writer, top.reader) == ("0.0", "1.0")
    (induction,) = [c for c in claims({2: report}) if c.claim.startswith("2-layer: induction")]
    assert induction.holds is True
    assert [f["head"] for f in induction.values["induction_heads"]] == ["1.0"]
    assert induction.values["induction_heads"][0]["k_writer"] == "0.0"
    # the composition made causal: the key path carries 1.0's prefix matching, query and value none
    c = report.causal
    assert isinstance(c, CompositionPaths) and (c.writer, c.reader) == ("0.0", "1.0")
    assert c.prefix_removed["k"] >= 0.9 and max(abs(c.prefix_removed["q"]), abs(c.prefix_removed["v"])) < 0.01
    (causal,) = [c for c in claims({2: report}) if "K-composition with the previous-token head" in c.claim]
    assert causal.holds is True and "K 99%" in causal.measured and "Q 0%" in causal.measured
    # found from behaviour: EAP is blind to the key edge here (the attention is saturated: its gradient is 0)
    (found,) = [c for c in claims({2: report}) if "finds the induction circuit" in c.claim]
    assert found.holds is False and "0.0 -> 1.0<k> is not in the top" in found.measured
    # an untrained model of the same shape has no induction head: the claim does not hold
    from qkov import Transformer

    save_checkpoint(Transformer(hand_built().cfg, seed=1), tmp_path / "random")
    rnd = collect(tmp_path / "random", tokens=toks, batch=4)
    (c,) = [c for c in claims({2: rnd}) if c.claim.startswith("2-layer: induction")]  # type: ignore[dict-item]
    assert c.holds is False


def test_report_circuit_section_finds_the_induction_circuit_and_is_the_librarys(tmp_path: Path) -> None:
    """The hand-built induction model with the induction head's attention ten times softer (so the key
    edge has a gradient): the circuit section finds input -> 0.0<v>, 0.0 -> 1.0<k>, 1.0 -> logits and the
    tour's claim holds; every number of the section is the library's, and exact patching of each top edge
    equals that edge ablated alone by circuit evaluation (the other edges all kept: another code path)."""
    model = hand_built()
    with torch.no_grad():
        model.blocks[1].attn.W_Q[0] *= 0.1
    save_checkpoint(model, tmp_path / "soft")
    g = torch.Generator().manual_seed(0)
    toks = torch.randint(1, V, (8, CTX), generator=g)
    toks[:, 0] = 0
    report = collect(tmp_path / "soft", tokens=toks, batch=4)
    c = report.circuit
    assert isinstance(c, CircuitSection)
    assert {"embed -> 0.0<v>", "0.0 -> 1.0<k>", "1.0 -> logits"} <= set(c.circuit) and len(c.circuit) <= 4
    (claim,) = [x for x in claims({2: report}) if "finds the induction circuit" in x.claim]
    assert claim.holds is True and claim.values["pairs"][0]["writer"] == "0.0"
    assert "0.0 -> 1.0<k> ranks 3rd and 1.0 -> logits ranks 1st of 29 edges" in claim.measured
    # the numbers against the library, on the same view and task
    w = Weights.from_model(load(tmp_path / "soft"))
    task = section_task(w)
    assert (c.pairs, c.tokens, c.task) == (len(task), 12, task.describe())
    eap = edge_scores(w, task, method="eap")
    assert [e.edge for e in c.top] == [n for n, _ in eap.top(len(c.top))]
    assert c.clean == pytest.approx(eap.clean, rel=1e-3) and c.ablated == pytest.approx(eap.corrupted, rel=1e-3)
    graph = graph_of(w.cfg)
    alone = [Circuit.of(graph, [n for n in graph.names if n != e.edge]) for e in c.top]
    got = evaluate_circuit(w, task, alone)
    for e, v in zip(c.top, got.values):
        assert e.score == pytest.approx(eap.at_edge(e.edge), rel=1e-3, abs=1e-6)
        assert e.exact == pytest.approx(v - eap.clean, rel=1e-3, abs=1e-5), e.edge
    key = next(e for e in c.top if e.edge == "0.0 -> 1.0<k>")
    assert abs(key.exact - key.score) > 1.0  # EAP is first order: it underestimates the key edge here
    run = evaluate_circuit(w, task, c.circuit)
    assert c.faithfulness == pytest.approx(run.faithfulness[0], rel=1e-3)
    # the circuit is the smallest of the curve's circuits (by |score|) reaching the target
    f, n = c.curve["absolute"]["faithfulness"], c.curve["absolute"]["edges"]
    first = next(i for i, v in enumerate(f) if v >= c.target)
    assert len(c.circuit) == n[first] and all(v < c.target for v in f[:first])
    drawn = {e["name"]: e for e in c.layout.edges}
    assert set(drawn) == set(c.circuit) and max(e["width"] for e in drawn.values()) == 5.0
    assert drawn["0.0 -> 1.0<k>"]["input"] == "k" and drawn["1.0 -> logits"]["input"] is None
    assert CircuitSection.from_dict(c.to_dict()).to_dict() == c.to_dict()


def _circuit_report(top: list[tuple[str, float]], circuit: list[str], roles: dict[str, list[str]]) -> Report:
    rows = [S.HeadRow(h, int(h[0]), int(h[2]), {"prefix_matching": 0.0, "induction": 0.0}, r) for h, r in roles.items()]
    rep = _fake_report(rows, [], 0.0, [1.0])
    lay = CircuitLayout(10, 10)
    curve = {"cpr": 0.9, "cmd": 0.1}
    edges = [CircuitEdge(name, v, v, name in circuit) for name, v in top]
    rep.circuit = CircuitSection("t", 4, 12, "eap", "corrupted", "g", 81, "m", 1.0, 0.0, 0.8, circuit, 0.9, curve, edges, lay)
    return rep


def test_circuit_claim_follows_its_rule() -> None:
    """The claim holds when a previous-token head's edge into an induction head's key and that head's edge into
    the logits rank in the top CIRCUIT_TOP and are in the circuit; each condition alone flips it."""
    roles = {"0.1": ["previous-token"], "1.0": ["induction"], "1.1": []}
    top = [("embed -> 0.1<v>", -5.0), ("0.1 -> 1.0<k>", -4.0), ("1.0 -> logits", -3.0)]
    top += [(f"embed -> 1.1<{k}>", -1.0) for k in "qkv"] + [("1.1 -> logits", -0.5)]
    circuit = ["embed -> 0.1<v>", "0.1 -> 1.0<k>", "1.0 -> logits"]
    assert circuit_claim(_circuit_report(top, circuit, roles)).holds is True
    assert f"top {CIRCUIT_TOP} edges by |score|" in circuit_claim(_circuit_report(top, circuit, roles)).rule
    assert circuit_claim(_circuit_report(top, circuit[:2], roles)).holds is False  # not in the circuit
    late = top[:1] + top[3:] + top[1:3]  # the two edges ranked 6th and 7th
    assert CIRCUIT_TOP == 5 and circuit_claim(_circuit_report(late, circuit, roles)).holds is False
    assert circuit_claim(_circuit_report(top, circuit, {**roles, "0.1": []})).holds is False  # no previous-token head
    assert circuit_claim(_circuit_report(top, circuit, {**roles, "1.0": []})).holds is False  # no induction head
    swapped = [("embed -> 0.1<v>", -5.0), ("0.1 -> 1.0<q>", -4.0), ("1.0 -> logits", -3.0)] + top[3:]
    assert circuit_claim(_circuit_report(swapped, [n for n, _ in swapped[:3]], roles)).holds is False  # query, not key


def test_report_page_is_self_contained(tiny2_report: tuple[Path, dict]) -> None:
    out, _ = tiny2_report
    page = (out / "index.html").read_text()
    assert not re.search(r"<script[^>]+src=", page), "scripts must be inline"
    assert not re.search(r"<link[^>]+href=", page), "no external stylesheets"
    assert "Plotly.newPlot(" in page  # the report's script calls the embedded bundle
    assert page.count("</script>") == 3  # plotly, the data, the report's script
    size = (out / "index.html").stat().st_size
    assert size < 10e6
    assert oct((out / "index.html").stat().st_mode & 0o777) == oct(0o666 & ~_umask())


def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m


def _check_page(index: Path, profile: Path, name: str, sections: tuple[str, ...], hash_: str = "") -> str:
    res = _chromium(index.as_uri() + hash_, profile, "--dump-dom")
    assert res.returncode == 0, res.stderr[-2000:]
    console = console_lines(res)
    assert not console, "console output from the page:\n" + "\n".join(console)
    dom = res.stdout
    assert 'data-ready="1"' in dom
    assert "data-errors" not in dom
    for s in sections:
        assert re.search(rf'data-section="{s}" data-rendered="ok"', dom), f"section {s} did not render"
    assert not re.search(r"<p class=\"error\"", dom)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / f"report-{name}.png"
    res = _chromium(index.as_uri(), profile, f"--screenshot={shot}", "--window-size=1400,6000")
    assert res.returncode == 0 and shot.stat().st_size > 50_000
    return dom


def test_report_renders_in_headless_chromium(tiny2_report: tuple[Path, dict], tmp_path: Path) -> None:
    _need_browser()
    out, data = tiny2_report
    dom = _check_page(out / "index.html", tmp_path / "profile", "tiny-2l", SECTIONS, "#attend=1.1.30")
    # the card says what the analyses read: which weights, and which tokens
    assert "unembedding centred" in dom and "validation split of the training corpus" in dom
    # the viewer, opened on head 1.1 and token 30, names the key that token attends to most
    row = data["attention"]["patterns"][1][1][30]
    best = max(range(len(row)), key=lambda i: row[i])
    status = re.search(r'id="viewer-status"[^>]*>([^<]*)<', dom)
    assert status is not None and "head 1.1, token 30 " in status.group(1)
    assert f"attends most to token {best} " in status.group(1)
    # every token of the viewer is on the page, shaded by its weight from that row
    weights = re.findall(r'data-pos="(\d+)"[^>]*data-weight="([^"]*)"', dom)
    assert len(weights) == 40
    for pos, wt in weights[:31]:
        assert float(wt) == pytest.approx(row[int(pos)], abs=1e-6)


def test_zero_layer_report_renders(small_corpus: Path, tmp_path: Path) -> None:
    cfg = ModelConfig(n_layers=0, d_model=32, d_head=16, d_vocab=300, n_ctx=80)
    train(tmp_path / "ckpt", cfg, tiny_train(small_corpus, steps=10), device="cpu")
    assert main(["report", str(tmp_path / "ckpt"), "-o", str(tmp_path / "rep"), "--icl-examples", "16", "--quiet"]) == 0
    data = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert data["heads"]["absent"] and data["attention"]["absent"]
    assert data["trigrams"]["heads"] == []
    # the bigrams: the 20 largest entries of W_E W_U, each row centred, outside the start token's row
    # and column, written out from the training model
    model = load(tmp_path / "ckpt")
    direct = (model.W_E @ (model.W_U - model.W_U.mean(-1, keepdim=True))).detach()
    direct[model.bos_token_id, :] = direct[:, model.bos_token_id] = float("-inf")
    top = direct.flatten().topk(20)
    want = [(i // cfg.d_vocab, i % cfg.d_vocab) for i in top.indices.tolist()]
    assert [(b["token"], b["next"]) for b in data["trigrams"]["bigrams"]] == want
    assert [b["logit"] for b in data["trigrams"]["bigrams"]] == pytest.approx(top.values.tolist(), abs=1e-3)
    assert len(data["paths"]["term_importance"]["run_losses"]) == 1
    if CHROMIUM is not None:
        _check_page(tmp_path / "rep" / "index.html", tmp_path / "profile", "tiny-0l", SECTIONS)


def test_report_cli_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("qkov: error:") and err.count("\n") == 1
    (tmp_path / "file").write_text("x")
    save_checkpoint(hand_built(), tmp_path / "hand")
    assert main(["report", str(tmp_path / "hand"), "-o", str(tmp_path / "file")]) == 2
    err = capsys.readouterr().err
    assert "not a directory" in err and err.count("\n") == 1
    # a model with no training corpus and no text: the report runs on seeded random tokens and says so
    assert main(["report", str(tmp_path / "hand"), "--quiet", "--icl-examples", "4"]) == 0
    data = json.loads((tmp_path / "hand" / "report" / "report.json").read_text())
    assert data["inputs"].startswith("seeded random tokens") and "score" not in data["icl"]
    with pytest.raises(SystemExit) as exit_:
        main(["report", str(tmp_path / "hand"), "-o", str(tmp_path / "r2"), "--text", "a.txt", "--tokens", "b"])
    assert exit_.value.code == 2 and "not allowed with" in capsys.readouterr().err


def test_tour_trains_reports_and_reuses(small_corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The main job end to end on a short budget: models, reports, comparison page, claims;
    a second run reuses the finished models instead of retraining them."""
    args = ["tour", "--out", str(tmp_path / "t"), "--layers", "0,1", "--steps", "8", "--device", "cpu", "--quiet"]
    assert main([*args, "--corpus", str(small_corpus)]) == 0
    text = capsys.readouterr().out
    assert "training in" in text and "1-layer models have no induction heads" in text
    assert f"qkov explore {tmp_path / 't' / 'qkov-1l'}" in text, "the tour says how to explore its deepest model"
    for n in (0, 1):
        assert (tmp_path / "t" / f"qkov-{n}l" / "report" / "index.html").is_file()
    summary = json.loads((tmp_path / "t" / "tour.json").read_text())
    assert [m["layers"] for m in summary["models"]] == [0, 1]
    assert summary["models"][1]["heads"] == 4
    page = (tmp_path / "t" / "index.html").read_text()
    assert "qkov-1l/report/index.html" in page and "1-layer models have no induction heads" in page
    weights = tmp_path / "t" / "qkov-1l" / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert (tmp_path / "t" / "qkov-1l" / "dynamics" / "index.html").is_file()
    assert "The phase change" in page and "1-layer: no such window" in page
    assert main(args) == 0
    again = capsys.readouterr().out
    assert "reusing the finished run" in again and "reusing the dynamics of these snapshots" in again
    assert weights.stat().st_mtime_ns == stamp
    assert main(["tour", "--layers", "1,x"]) == 2
    assert "--layers" in capsys.readouterr().err
    (tmp_path / "file").write_text("x")
    assert main(["tour", "--out", str(tmp_path / "file")]) == 2
    assert "not a directory" in capsys.readouterr().err
    (tmp_path / "t2" / "qkov-0l").mkdir(parents=True)
    (tmp_path / "t2" / "qkov-0l" / "notes.txt").write_text("mine")
    assert main(["tour", "--out", str(tmp_path / "t2"), "--layers", "0"]) == 2
    assert "neither a finished nor a resumable" in capsys.readouterr().err


def _fake_report(rows: list[S.HeadRow], tris: list[S.TrigramRow], icl: float, marginal: list[float]) -> Report:
    """A report with only the numbers the claims read; everything else empty."""
    runs = [10.0 - marginal[0]]
    for m in marginal[1:]:
        runs.append(runs[-1] - m)
    return Report(
        path="x",
        name="x",
        card=Cd.Card("x", {}, 0, Cd.Curve(), []),
        heads=S.HeadsSection(rows, {}, 0, None, []),
        eigenvalues=S.Absent("-"),
        composition=S.CompositionSection({"k": S.CompositionKind([], [], [], [], 0.0, 0.0, [])}),
        paths=PathSummary([1, 2], 0.0, TermImportance(runs, runs[-1], 10.0), [], []),
        attention=S.Absent("-"),
        icl=S.ICLSection(None, S.RepeatCurves(1, [], [], 0.0, 0.0), score=icl),
        trigrams=S.TrigramsSection([S.HeadTrigrams("0.0", tris)], []),
    )


def test_claims_verdicts_follow_the_numbers() -> None:
    """claims() on hand-written reports: each verdict flips with the number behind it."""

    def rows(prefix: float, eig: list[float]) -> list[S.HeadRow]:
        scores = lambda e: {"prefix_matching": prefix, "induction": 0.0, "eigen_copying": e}  # noqa: E731
        return [S.HeadRow(f"0.{h}", 0, h, scores(e), ["copying"] if e > 0.5 else []) for h, e in enumerate(eig)]

    tri = S.TrigramRow(1, 2, 3, 1.0, 9.0, 9.0, "def", "(", " self")
    one = _fake_report(rows(0.02, [0.9, 0.8, 0.1, 0.7]), [tri], 0.01, [2.0, 1.0])
    two = _fake_report([], [], -0.4, [1.8, 5.2, 0.3])
    assert two.paths.importance.marginal_by_order == pytest.approx([1.8, 5.2, 0.3])
    by = {c.claim.split(":")[0] + c.claim[:12]: c for c in claims({1: one, 2: two})}
    verdicts = [c.holds for c in claims({1: one, 2: two})]
    assert verdicts == [True, True, True, False, False, False, None, True]  # no induction head: nothing patched
    assert "3 of 4 heads copying" in claims({1: one})[0].measured and len(by) == 8
    (importance,) = [c for c in claims({2: two}) if "term importance" in c.claim]
    assert importance.measured.startswith("1.80 / 5.20 / 0.30 nats")
    # every verdict states its rule beside the paper's number, and says when it is looser
    rules = {c.claim: c.rule for c in claims({1: one, 2: two})}
    rule = lambda start: next(r for claim, r in rules.items() if claim.startswith(start))  # noqa: E731
    assert all(rules.values())
    assert "looser than the paper's 10 of 12" in rule("1-layer: 10 of 12")
    assert "looser than the paper's ~0.4" in rule("ICL score")
    assert "rank copying > 0.5" in rule("2-layer: induction")
    one.heads.rows = rows(0.6, [0.1, 0.1, 0.1, 0.9])  # type: ignore[union-attr]
    two.icl.score = 0.0
    two.causal = CompositionPaths("0.1", "1.0", 0.8, 0.05, {"q": 0.1, "k": 0.7, "v": 0.2}, -0.2, {"q": 0.0, "k": 0.5, "v": 0.1})
    assert [c.holds for c in claims({1: one, 2: two})] == [False, True, False, False, True, False, None, False]
    assert "K 70% (in-context improvement 50%), Q 10%" in claims({2: two})[1].measured
    for flip in ({"k": 0.49}, {"q": 0.21}, {"v": 0.25}):
        two.causal.prefix_removed = {"q": 0.1, "k": 0.7, "v": 0.2, **flip}
        assert claims({2: two})[1].holds is False, flip
    assert "key input removes >= 50%" in rule("2-layer: the induction head's K-composition")


def test_report_of_an_imported_gpt2_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Any source the analyses read: a Hugging Face GPT-2 directory (LayerNorm, MLPs, biases),
    with --text; the page renders and its paths section is exact for the MLP model."""
    transformers = pytest.importorskip("transformers", reason="transformers is a test extra")
    from qkov.training.data import train_tokenizer

    tok = train_tokenizer(["def f(self):\n    return self.x\n"] * 50, 271, start="<|endoftext|>")
    cfg = transformers.GPT2Config(
        vocab_size=271, n_positions=96, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0
    )
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(cfg).eval().save_pretrained(tmp_path / "gpt2")
    tok.save(str(tmp_path / "gpt2" / "tokenizer.json"))
    (tmp_path / "t.py").write_text("class A:\n    def f(self, x):\n        return self.x + x\n" * 40)
    assert main(["report", str(tmp_path / "gpt2")]) == 2
    assert "-o DIR" in capsys.readouterr().err
    args = ["report", str(tmp_path / "gpt2"), "-o", str(tmp_path / "rep"), "--text", str(tmp_path / "t.py")]
    assert main([*args, "--quiet", "--icl-examples", "8"]) == 0
    data = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert data["card"]["source"] == "hf" and data["card"]["model"]["d_mlp"] == 128
    assert data["paths"]["reconstruction_max_abs_error"] < 1e-3
    assert data["attention"]["tokens"][0] == "<|endoftext|>"
    if CHROMIUM is not None:
        _check_page(tmp_path / "rep" / "index.html", tmp_path / "profile", "gpt2-import", SECTIONS)
