"""``qkov architectures``: the variants trained and compared on the same budget (qkov.apps.architectures).

Checked against independent computations: the last point of the loss by path order is the model's own
next-token loss (its forward pass), and the attention-sink mass of layer 0 equals the attention on the
first token computed by hand from the embeddings and W_Q, W_K (an attention-only shortformer model)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import qkov
from qkov.analysis.heads.gates import gate_stats
from qkov.analysis.causal.composition import k_path_share
from qkov.apps.architectures import induction_circuit, paths_by_order, run_architectures, variant_config
from qkov.apps.cli import main
from qkov.errors import QkovError

from helpers import TINY, tiny_train

STUDIED = ["standard", "attnres", "hyper", "gate", "loop"]


@pytest.fixture(scope="module")
def study(small_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("arch")
    options = {k: v for k, v in vars(tiny_train(small_corpus, steps=24, snapshots=6)).items() if k not in ("steps", "corpus")}
    rows = run_architectures(
        out, variants=STUDIED, steps=24, corpus=str(small_corpus), base=TINY, train_options=options, device="cpu",
        quiet=True, say=lambda s: None,
    )  # fmt: skip
    return out, rows


def test_every_variant_is_trained_measured_and_written(study: tuple[Path, list[dict]]) -> None:
    out, rows = study
    assert [r["variant"] for r in rows] == STUDIED
    data = json.loads((out / "architectures.json").read_text())
    assert [r["variant"] for r in data["variants"]] == STUDIED
    for r in rows:
        cfg = variant_config(r["variant"], TINY)
        assert r["tokens"] == 24 * 4 * TINY.n_ctx and r["tokens_per_s"] > 0
        assert len(r["paths_by_order"]) == cfg.n_layers * cfg.loop + 1
        assert len(r["sink_mass"]) == cfg.n_layers * cfg.loop
        assert (r["gate_mean"] is None) == (cfg.gate == "none")
        assert r["curves"]["tokens"] == sorted(r["curves"]["tokens"]) and len(r["curves"]["tokens"]) >= 2
        assert (out / r["dynamics"]).is_file()
        _check_k_path_share(out, r)
    page = (out / "index.html").read_text()
    assert '"variant": "standard"' in page or '"variant":"standard"' in page


def _check_k_path_share(out: Path, row: dict) -> None:
    """The row's K path share is that of the heads its dynamics scored highest (the last snapshot), measured
    on the final model (k_path_share itself is checked against runs edited by hand in its own tests)."""
    heads = json.loads((out / row["variant"] / "dynamics" / "dynamics.json").read_text())["snapshots"][-1]["heads"]
    writer, reader = induction_circuit(heads)  # type: ignore[misc]
    k = row["k_path_share"]
    assert (k["writer"], k["reader"]) == (f"{writer[0]}.{writer[1]}", f"{reader[0]}.{reader[1]}")
    assert writer[0] < reader[0] and heads["induction"][reader[0]][reader[1]] == max(max(r) for r in heads["induction"][1:])
    assert k == k_path_share(qkov.Weights.from_model(qkov.load(out / row["variant"])), writer, reader).to_dict()


def test_the_induction_circuit_is_the_best_induction_head_and_an_earlier_previous_token_head() -> None:
    heads = {"induction": [[0.9, 0.1], [0.2, 0.4], [0.6, 0.3]], "previous_token": [[0.1, 0.2], [0.8, 0.1], [0.9, 0.0]]}
    assert induction_circuit(heads) == ((1, 0), (2, 0))  # not 2.0 (same layer) nor 0.0 (layer 0 reads no writer)
    assert induction_circuit({**heads, "previous_token": None}) is None and induction_circuit(None) is None
    assert induction_circuit({"induction": [[0.5]], "previous_token": [[0.5]]}) is None


def test_a_second_run_reuses_every_finished_variant(study: tuple[Path, list[dict]], small_corpus: Path) -> None:
    out, rows = study
    said: list[str] = []
    again = run_architectures(out, variants=STUDIED[:1], steps=24, base=TINY, device="cpu", quiet=True, say=said.append)
    assert any("reusing the finished run" in s for s in said) and not any("training" in s for s in said)
    assert again[0]["paths_by_order"] == rows[0]["paths_by_order"]


def test_the_last_order_is_the_models_own_loss(study: tuple[Path, list[dict]]) -> None:
    out, _ = study
    for name in STUDIED:
        model = qkov.load(out / name)
        tokens = torch.randint(1, TINY.d_vocab, (3, TINY.n_ctx), generator=torch.Generator().manual_seed(1))
        by_order = paths_by_order(qkov.Weights.from_model(model), tokens)
        with torch.no_grad():
            logits = model(tokens).double()
        own = float(torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, TINY.d_vocab), tokens[:, 1:].reshape(-1)))
        assert math.isclose(by_order[-1], own, abs_tol=2e-5), name
        assert by_order[0] != by_order[-1]  # the heads do something: the orders differ


def test_the_studys_sink_mass_of_layer_0_equals_the_hand_computed_attention_on_the_first_token(study: tuple[Path, list[dict]]) -> None:
    model = qkov.load(study[0] / "standard")
    tokens = torch.randint(1, TINY.d_vocab, (2, TINY.n_ctx), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        x = model.W_E[tokens] + model.W_pos[: TINY.n_ctx]  # shortformer: positions enter Q and K
        a = model.blocks[0].attn
        q = torch.einsum("btd,hde->bhte", x, a.W_Q)
        k = torch.einsum("btd,hde->bhte", x, a.W_K)
        scores = q @ k.transpose(-1, -2) / math.sqrt(TINY.d_head)
        scores = scores.masked_fill(torch.ones(TINY.n_ctx, TINY.n_ctx).triu(1).bool(), float("-inf"))
        hand = scores.softmax(-1)[:, :, 1:, 0].mean(dim=(0, 2))
    got = gate_stats(qkov.Weights.from_model(model), tokens).sink
    assert torch.allclose(got[0], hand.double(), atol=1e-5)


def test_bad_variants_are_one_line_errors(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["architectures", "--out", str(tmp_path / "a"), "--variants", "standard,warp"]) == 2
    err = capsys.readouterr().err
    assert "warp" in err and len(err.strip().splitlines()) == 1
    with pytest.raises(QkovError, match="no variant"):
        run_architectures(tmp_path / "b", variants=[])


def test_a_diverging_variant_is_a_row_not_the_end_of_the_study(small_corpus: Path, tmp_path: Path) -> None:
    """At a learning rate that blows the loss up, the run stops (its checkpoint kept) and the study writes a
    row saying where, with no measures, and still writes its page."""
    options = {k: v for k, v in vars(tiny_train(small_corpus, steps=30, snapshots=3)).items() if k not in ("steps", "corpus")}
    options.update(lr=1e4, warmup=1, grad_clip=0.0)
    said: list[str] = []
    rows = run_architectures(
        tmp_path / "a", variants=["standard"], steps=30, corpus=str(small_corpus), base=TINY, train_options=options,
        device="cpu", quiet=True, say=said.append,
    )  # fmt: skip
    assert rows[0]["diverged"] is not None and 1 <= rows[0]["diverged"] <= 30
    assert rows[0]["paths_by_order"] == [] and rows[0]["val_loss"] is None
    assert any("diverged at step" in s for s in said)
    data = json.loads((tmp_path / "a" / "architectures.json").read_text())
    assert data["variants"][0]["diverged"] == rows[0]["diverged"]


def test_a_run_of_another_model_in_the_folder_is_refused_before_any_training(study: tuple[Path, list[dict]], capsys: pytest.CaptureFixture) -> None:
    out, _ = study
    with pytest.raises(QkovError, match="another model"):
        run_architectures(out, variants=["standard"], steps=24, base=TINY.replace(normalization="rmsnorm"), device="cpu")
    assert main(["architectures", "--out", str(out), "--variants", "standard", "--norm", "rmsnorm", "--steps", "24"]) == 2
    assert "another model" in capsys.readouterr().err
