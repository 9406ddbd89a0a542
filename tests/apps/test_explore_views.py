"""The views of ``qkov explore`` that compute circuits and interventions (card, composition, terms,
ablate, patch, circuit, circuit_edge), on tiny models built here: each view's numbers equal the library function it wraps,
called directly, and something independent of it (a dense product in plain torch, the model's own
forward with a head's weights zeroed, the all-pairs composition scores), and bad arguments are refused
with :class:`BadRequest` (404 for a head the model lacks, 400 otherwise)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from helpers import LN_MLP, MODERN, TINY, run_main
from qkov import ModelConfig, Transformer, Weights, save_checkpoint
from qkov.analysis.causal.ablation import ablation_study
from qkov.analysis.circuits.copying import eigen_copying_score, ov_eigenvalues
from qkov.analysis.circuits.composition import composition_scores
from qkov.analysis.forward.tracer import trace
from qkov.analysis.causal.studies import patch_study
from qkov.analysis.paths.expansion import expand
from qkov.analysis.paths.effects import term_effects
from qkov.analysis.circuits.rotary import offset_profile, offset_qk
from qkov.analysis.forward.sites import Address
from qkov.analysis.circuits.trigrams import skip_trigrams
from qkov.apps.explore.context import BadRequest, Explorer
from qkov.apps.explore.views import VIEWS
from qkov.apps.report.discovery import circuit_section, section_task
from qkov.analysis.discovery import Circuit, edge_scores, evaluate_circuit, graph_of
from qkov.finite import json_safe
from hand_built import hand_built

CONFIGS = {"attn-only": TINY, "rotary-gqa": MODERN, "layernorm-mlp": LN_MLP}
TEXT = [0, 5, 6, 7, 8, 5, 6, 7, 9, 5]
NOOP = lambda *a: None  # noqa: E731


def decode(i: int) -> str:
    return f"</script><{i}>"  # raw, never escaped by a view: the page escapes


def explorer(cfg: ModelConfig, seed: int = 0) -> Explorer:
    torch.manual_seed(seed)
    model = Transformer(cfg).eval()
    w = Weights.from_model(model)
    return Explorer(model=model, weights=w, name="tiny", decode=decode, codec=None, bos=0, max_tokens=cfg.n_ctx)


def near(card_eigs: list[dict], lib: torch.Tensor, tol: float = 1e-4) -> None:
    """Every eigenvalue of the card is one of ``lib``'s and vice versa (same count)."""
    got = torch.tensor([complex(e["re"], e["im"]) for e in card_eigs])
    lib = lib.to(torch.complex64)
    assert got.shape == lib.shape
    scale = 1 + float(lib.abs().max())
    for a, b in ((got, lib), (lib, got)):
        assert float((a[:, None] - b[None, :]).abs().min(1).values.max()) < tol * scale


def close(a: float | None, b: float, rel: float = 1e-4, abs_: float = 1e-6) -> bool:
    return a is not None and abs(a - b) <= rel * abs(b) + abs_


@pytest.mark.parametrize("name", list(CONFIGS))
def test_card_equals_the_library(name: str) -> None:
    ex = explorer(CONFIGS[name])
    cfg, w = ex.model.cfg, ex.weights
    eig = ov_eigenvalues(w)
    comp = composition_scores(w, "qkv")
    for layer in range(cfg.n_layers):
        head = cfg.n_heads - 1
        c = VIEWS["card"](ex, {"head": f"{layer}.{head}", "top": 8}, NOOP)
        near(c["ov_eigenvalues"], eig[layer, head])
        assert close(c["copying"], float(eigen_copying_score(eig[layer, head])))
        for row in c["composition"]["reads"]:
            l1, h1 = map(int, row["head"].split("."))
            for k in "qkv":
                assert close(row[k], float(comp.kinds[k].raw[l1, h1, layer, head]))
        for row in c["composition"]["read_by"]:
            l2, h2 = map(int, row["head"].split("."))
            for k in "qkv":
                assert close(row[k], float(comp.kinds[k].raw[layer, head, l2, h2]))
        assert len(c["composition"]["reads"]) == layer * cfg.n_heads
        assert len(c["composition"]["read_by"]) == (cfg.n_layers - 1 - layer) * cfg.n_heads
        lib = skip_trigrams(w, layer, head, top=8, exclude=(0,)).trigrams
        assert [(t["src_id"], t["dest_id"], t["out_id"]) for t in c["trigrams"]] == [
            (s.source, s.destination, s.output) for s in lib
        ]
        assert all(close(t["value"], s.score) for t, s in zip(c["trigrams"], lib))
        assert all(t["src"] == decode(t["src_id"]) and t["out"] == decode(t["out_id"]) for t in c["trigrams"])
        if cfg.positional == "rotary":
            prof = offset_profile(w, layer, head, c["positional"]["offsets"])
            assert c["positional"]["kind"] == "rotary"
            assert all(close(a, float(b)) for a, b in zip(c["positional"]["values"], prof))
            assert c["qk_offset"] == c["positional"]["offsets"][int(prof.argmax())]
            table = offset_qk(w, layer, head, c["qk_offset"]).materialize()
            ev = torch.linalg.eigvals(table.double())
            near(c["qk_eigenvalues"], ev[ev.abs().argsort(descending=True)[: cfg.d_head]])
            dense_top(c["top_qk"], table, "query_id", "key_id")


def dense_top(entries: list[dict], dense: torch.Tensor, row: str, col: str, left_out: tuple[int, ...] = (0,)) -> None:
    """The card's top entries are the dense matrix's largest, in order (plain ``torch.topk``), the
    ``left_out`` tokens' rows and columns aside (the start token: the views' model has no tokenizer)."""
    dense = dense.clone()
    dense[list(left_out)], dense[:, list(left_out)] = float("-inf"), float("-inf")
    v, i = dense.flatten().topk(len(entries))
    assert [(e[row], e[col]) for e in entries] == [divmod(int(j), dense.shape[1]) for j in i]
    assert all(close(e["value"], float(x), abs_=1e-5) for e, x in zip(entries, v))


@pytest.mark.parametrize("name", ["attn-only", "layernorm-mlp"])
def test_card_tables_equal_dense_products(name: str) -> None:
    """Top full-OV / full-QK entries, the QK spectrum and the positional profile against the matrices
    multiplied out in plain torch from the weights view."""
    ex = explorer(CONFIGS[name])
    w = ex.weights
    E, P, W_U = w.embed(), w.pos(), w.unembed().W_U
    for layer, head in ((0, 0), (1, 1)):
        att = w.attention(layer)
        c = VIEWS["card"](ex, {"head": [layer, head], "top": 10}, NOOP)
        dense_top(c["top_ov"], E @ att.W_V[head] @ att.W_O[head] @ W_U, "src_id", "out_id")
        qk = E @ att.W_Q[head] @ att.W_K[head].T @ E.T
        dense_top(c["top_qk"], qk, "query_id", "key_id")
        ev = torch.linalg.eigvals(qk.double())
        near(c["qk_eigenvalues"], ev[ev.abs().argsort(descending=True)[: ex.model.cfg.d_head]])
        pos = P @ att.W_Q[head] @ att.W_K[head].T @ P.T  # [query position, key position]
        n = pos.shape[0]
        for d, got in zip(c["positional"]["offsets"], c["positional"]["values"]):
            want = sum(float(pos[i, i - d]) for i in range(d, n)) / (n - d)
            assert close(got, want, abs_=1e-6)
        assert c["positional"]["kind"] == "learned"


def test_card_pattern_and_partial_card() -> None:
    ex = explorer(TINY)
    full = VIEWS["card"](ex, {"head": "1.0", "text": TEXT}, NOOP)
    assert full["pattern"] == VIEWS["attention"](ex, {"head": "1.0", "text": TEXT}, NOOP)
    quick = VIEWS["card"](ex, {"head": "1.0", "tables": False}, NOOP)
    assert quick["top_ov"] is None and quick["top_qk"] is None and quick["trigrams"] is None
    assert quick["pattern"] is None
    for key in ("ov_eigenvalues", "qk_eigenvalues", "copying", "positional", "composition"):
        assert quick[key] == full[key]


@pytest.mark.parametrize(
    "args, status",
    [
        ({"head": "2.0"}, 404),
        ({"head": "0.9"}, 404),
        ({"head": "zero"}, 400),
        ({}, 400),
        ({"head": "0.0", "top": 0}, 400),
        ({"head": "0.0", "top": "5"}, 400),
        ({"head": "0.0", "tables": "yes"}, 400),
        ({"head": "0.0", "text": list(range(40))}, 400),
        ({"head": "0.0", "text": [0, 999]}, 400),
    ],
)
def test_card_bad_args(args: dict, status: int) -> None:
    with pytest.raises(BadRequest) as err:
        VIEWS["card"](explorer(TINY), args, NOOP)
    assert err.value.status == status


@pytest.mark.parametrize("name", list(CONFIGS))
def test_composition_graph_is_all_pairs_and_matches_the_cards(name: str) -> None:
    ex = explorer(CONFIGS[name])
    cfg = ex.model.cfg
    L, H = cfg.n_layers, cfg.n_heads
    seen: list[tuple] = []
    g = VIEWS["composition"](ex, {}, lambda what, done, total: seen.append((what, done, total)))
    lib = composition_scores(ex.weights, "qkv")
    assert len(g["edges"]) == 3 * H * H * L * (L - 1) // 2
    assert g["heads"] == [f"{l}.{h}" for l in range(L) for h in range(H)]
    assert seen and seen[-1][1] == seen[-1][2]  # progress reached its end
    for e in g["edges"]:
        (l1, h1), (l2, h2) = (map(int, e[x].split(".")) for x in ("src", "dst"))
        assert l1 < l2
        assert close(e["value"], float(lib.kinds[e["kind"]].raw[l1, h1, l2, h2]))
        assert close(e["baseline"], lib.kinds[e["kind"]].baseline.mean)
    # every card's row and column (computed for its own pairs) equal the all-pairs graph
    by = {(e["src"], e["dst"], e["kind"]): e["value"] for e in g["edges"]}
    for l in range(L):
        for h in range(H):
            comp = VIEWS["card"](ex, {"head": f"{l}.{h}", "tables": False}, NOOP)["composition"]
            for r in comp["reads"]:
                assert all(close(r[k], by[(r["head"], f"{l}.{h}", k)]) for k in "qkv")
            for r in comp["read_by"]:
                assert all(close(r[k], by[(f"{l}.{h}", r["head"], k)]) for k in "qkv")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_terms_equal_term_effects(name: str) -> None:
    ex = explorer(CONFIGS[name])
    res = VIEWS["terms"](ex, {"text": TEXT, "position": 4}, NOOP)
    ids = torch.tensor([TEXT])
    lib = term_effects(expand(ex.weights, ids), positions=torch.tensor([[0, 4]]))
    heads = {r["term"]: r["effect"] for r in res["rows"] if r["kind"] == "head"}
    assert set(heads) == {e.name for e in lib.singles}
    assert all(close(heads[e.name], e.loss_change, rel=1e-3, abs_=1e-5) for e in lib.singles)
    assert res["token"] == decode(TEXT[4]) and res["next"] == decode(TEXT[5])
    with torch.no_grad():
        logits = ex.model(ids)[0, 4]
    assert close(res["loss"], float(F.cross_entropy(logits[None], torch.tensor([TEXT[5]]))), abs_=1e-5)
    assert VIEWS["terms"](ex, {"text": TEXT, "position": -1}, NOOP)["position"] == len(TEXT) - 2


def test_terms_against_hand_computed_paths() -> None:
    """A one-layer attention-only model without biases: the direct path is ``W_E[token] @ W_U``, and
    removing a head's term is zero-ablating the head (nothing downstream reads it): both by hand."""
    cfg = ModelConfig(n_layers=1, n_heads=2, d_model=16, d_head=8, d_vocab=40, n_ctx=16)
    ex = explorer(cfg, seed=3)
    ids, t = torch.tensor([TEXT]), 6
    res = VIEWS["terms"](ex, {"text": TEXT, "position": t}, NOOP)
    rows = {r["term"]: r["effect"] for r in res["rows"]}
    logits = ex.model(ids)[0, t].double()
    target = torch.tensor([TEXT[t + 1]])
    base = float(F.cross_entropy(logits[None], target))
    direct = ex.model.W_E[TEXT[t]].double() @ ex.model.W_U.double()
    assert close(rows["direct"], float(F.cross_entropy((logits - direct)[None], target)) - base, rel=1e-3, abs_=1e-5)
    for h in range(2):
        m = copy.deepcopy(ex.model)
        with torch.no_grad():
            m.blocks[0].attn.W_O[h] = 0
        ablated = float(F.cross_entropy(m(ids)[0, t].double()[None], target))
        assert close(rows[f"0.{h}"], ablated - base, rel=1e-3, abs_=1e-5)


@pytest.mark.parametrize("args", [{"text": TEXT}, {"text": TEXT, "position": len(TEXT) - 1},
                                  {"text": TEXT, "position": "1"}, {"text": TEXT, "position": True}])  # fmt: skip
def test_terms_bad_position(args: dict) -> None:
    with pytest.raises(BadRequest) as err:
        VIEWS["terms"](explorer(TINY), args, NOOP)
    assert err.value.status == 400


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("mode", ["zero", "mean"])
def test_ablate_agrees_with_ablation_study(name: str, mode: str) -> None:
    """The view's mean loss before/after is ``qkov ablate``'s intact/ablated loss on this text."""
    ex = explorer(CONFIGS[name])
    heads = ["1.0", "0.1"]
    res = VIEWS["ablate"](ex, {"text": TEXT, "heads": heads, "mode": mode}, NOOP)
    study = ablation_study(ex.weights, torch.tensor([TEXT]), [(1, 0), (0, 1)], mode=mode, draws=0, bos=0)
    assert close(res["mean_before"], study.intact.loss, abs_=1e-5)
    assert close(res["mean_after"], study.ablated.loss, abs_=1e-5)
    assert res["mean_after"] != res["mean_before"]
    assert res["heads"] == heads and len(res["loss_after"]) == len(TEXT) and res["loss_after"][-1] is None
    assert len(res["top_after"]) == len(TEXT) and len(res["top_after"][0]) == 5


@pytest.mark.parametrize("mode", ["zero", "mean"])
def test_ablate_agrees_with_the_qkov_ablate_command(tmp_path: Path, capsys: pytest.CaptureFixture, mode: str) -> None:
    """``qkov ablate CKPT --tokens FILE`` on the same text, heads and mode prints the same losses."""
    ex = explorer(LN_MLP)
    save_checkpoint(ex.model, tmp_path / "m")
    np.save(tmp_path / "t.npy", np.array([TEXT], dtype=np.int64))
    argv = ["ablate", tmp_path / "m", "--tokens", tmp_path / "t.npy", "--heads", "1.0,0.1", "--mode", mode]
    rc, out, err = run_main(capsys, *argv, "--draws", "0", "--json")
    assert rc == 0, err
    cli = json.loads(out)
    res = VIEWS["ablate"](ex, {"text": TEXT, "heads": ["1.0", "0.1"], "mode": mode}, NOOP)
    assert close(res["mean_before"], cli["intact"]["loss"], abs_=1e-5)
    assert close(res["mean_after"], cli["ablated"]["loss"], abs_=1e-5)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_zero_ablation_is_the_model_with_the_heads_weights_zeroed(name: str) -> None:
    ex = explorer(CONFIGS[name])
    res = VIEWS["ablate"](ex, {"text": TEXT, "heads": ["1.1", "0.0"], "mode": "zero"}, NOOP)
    m = copy.deepcopy(ex.model)
    with torch.no_grad():
        m.blocks[1].attn.W_O[1] = 0
        m.blocks[0].attn.W_O[0] = 0
    ids = torch.tensor([TEXT])
    logp = torch.log_softmax(m(ids)[0].double(), -1)
    want = [-float(logp[i, TEXT[i + 1]]) for i in range(len(TEXT) - 1)]
    assert all(close(a, b, rel=1e-4, abs_=1e-5) for a, b in zip(res["loss_after"], want))
    top = logp[2].topk(5)
    assert [p["id"] for p in res["top_after"][2]] == top.indices.tolist()


@pytest.mark.parametrize(
    "args, status",
    [
        ({"text": TEXT, "heads": ["1.0"], "mode": "resample"}, 400),
        ({"text": TEXT, "heads": [], "mode": "zero"}, 400),
        ({"text": TEXT, "mode": "zero"}, 400),
        ({"text": TEXT, "heads": ["3.0"], "mode": "zero"}, 404),
        ({"heads": ["1.0"], "mode": "zero"}, 400),
    ],
)
def test_ablate_bad_args(args: dict, status: int) -> None:
    with pytest.raises(BadRequest) as err:
        VIEWS["ablate"](explorer(TINY), args, NOOP)
    assert err.value.status == status


@pytest.mark.parametrize("name", ["attn-only", "rotary-gqa"])
def test_patch_equals_patch_study_and_a_hand_patch(name: str) -> None:
    ex = explorer(CONFIGS[name])
    clean, corrupted = TEXT, TEXT[:3] + [11] + TEXT[4:]
    res = VIEWS["patch"](ex, {"clean": clean, "corrupted": corrupted}, NOOP)
    c, x = torch.tensor([clean]), torch.tensor([corrupted])
    lib = patch_study(ex.weights, c, x).to_dict()
    assert [r["site"] for r in res["results"]] == [r["site"] for r in lib["results"]]
    for got, want in zip(res["results"], lib["results"]):
        flat_g, flat_w = torch.tensor(got["values"]).flatten(), torch.tensor(want["values"]).flatten()
        assert torch.allclose(flat_g, flat_w, rtol=1e-5, atol=1e-5, equal_nan=True)
    head_out = next(r for r in res["results"] if r["method"] == "activation" and r["site"] == "head_out")
    z = trace(ex.weights, c, cache=[("z", 1)])["z", 1]
    for h in range(ex.model.cfg.n_heads):  # the corrupted run with head 1.h's z from the clean run
        logits = trace(ex.weights, x, edits={Address("z", 1, h): z[:, :, h]}).logits
        want = float(F.cross_entropy(logits[0, :-1].double(), c[0, 1:]))
        assert close(head_out["values"][1][h], want, rel=1e-4, abs_=1e-5)
    assert res["tokens"] == [decode(i) for i in clean]


@pytest.mark.parametrize(
    "args",
    [
        {"clean": TEXT, "corrupted": TEXT[:-1]},
        {"clean": TEXT, "corrupted": TEXT, "metric": "bogus"},
        {"clean": TEXT, "corrupted": TEXT, "metric": 3},
        {"clean": TEXT},
    ],
)
def test_patch_bad_args(args: dict) -> None:
    with pytest.raises(BadRequest) as err:
        VIEWS["patch"](explorer(TINY), args, NOOP)
    assert err.value.status == 400


@pytest.mark.parametrize("name", ["hand-built", *CONFIGS])
def test_circuit_views_are_the_report_section_and_exact_patching(name: str) -> None:
    """``circuit`` is the report's circuit section on the explorer's weights (on the hand-built induction model,
    attention softened so EAP sees the key edge: the induction circuit); ``circuit_edge`` patches one edge on the
    same task, equal to exact edge patching and to circuit evaluation with every other edge kept."""
    if name == "hand-built":
        model = hand_built()
        with torch.no_grad():
            model.blocks[1].attn.W_Q[0] *= 0.1
        w = Weights.from_model(model)
        ex = Explorer(model=model, weights=w, name="hand", decode=decode, codec=None, bos=0, max_tokens=model.cfg.n_ctx)
    else:
        ex = explorer(CONFIGS[name])
    c = VIEWS["circuit"](ex, {}, NOOP)
    assert c == json_safe(circuit_section(ex.weights).to_dict())
    if name == "hand-built":
        assert {"embed -> 0.0<v>", "0.0 -> 1.0<k>", "1.0 -> logits"} <= set(c["circuit"])
    g, task = graph_of(ex.weights.cfg), section_task(ex.weights)
    picks = [c["top"][0]["edge"], next(n for n in g.names if n.endswith("<k>") and not n.startswith("embed"))]
    picks += [n for n in g.names if "mlp" in n][:1]
    kept = evaluate_circuit(ex.weights, task, [Circuit.of(g, [n for n in g.names if n != p]) for p in picks])
    for p, other in zip(picks, kept.values):
        r = VIEWS["circuit_edge"](ex, {"edge": p}, NOOP)
        want = edge_scores(ex.weights, task, method="exact", edges=[p]).at_edge(p)
        assert r["edge"] == p and close(r["exact"], want) and close(r["exact"], other - r["clean"], abs_=1e-5), p
        assert close(r["ablated"], other, abs_=1e-5)
    by_number = VIEWS["circuit_edge"](ex, {"edge": g.index(picks[0])}, NOOP)
    assert by_number["edge"] == picks[0] and close(by_number["eap"], c["top"][0]["score"])
    if name == "hand-built":  # EAP is first order: through the softmax it misses most of the key edge
        key = VIEWS["circuit_edge"](ex, {"edge": "0.0 -> 1.0<k>"}, NOOP)
        assert abs(key["exact"] - key["eap"]) > 1.0


@pytest.mark.parametrize(
    "args,status",
    [({}, 400), ({"edge": ""}, 400), ({"edge": True}, 400), ({"edge": "1.0 -> 0.0<k>"}, 404), ({"edge": 10**6}, 404),
     ({"edge": "9.0 -> logits"}, 404), ({"edge": "0.0 -> 1.0"}, 404)],
)  # fmt: skip
def test_circuit_edge_bad_args(args: dict, status: int) -> None:
    with pytest.raises(BadRequest) as e:
        VIEWS["circuit_edge"](explorer(TINY), args, NOOP)
    assert e.value.status == status


def test_a_looped_model_shows_its_effective_layers() -> None:
    """A looped model (2 stored blocks applied twice) is explored as the analyses see it: 4 effective
    layers, head 3.1 (block 1 on its second pass) has a card and an attention pattern equal to the trace's."""
    ex = explorer(TINY.replace(loop=2, gate="headwise"))
    assert ex.weights.cfg.n_layers == 4
    pattern = VIEWS["attention"](ex, {"head": "3.1", "text": TEXT}, NOOP)
    want = trace(ex.weights, torch.tensor([TEXT]), cache=["pattern.3"])["pattern", 3][0, 1]
    got = torch.tensor(pattern["pattern"] if isinstance(pattern, dict) else pattern)
    assert torch.allclose(got.reshape(want.shape), want, atol=1e-5)
    assert VIEWS["card"](ex, {"head": "3.1", "tables": False}, NOOP)["head"] in ("3.1", [3, 1], {"layer": 3, "head": 1})
