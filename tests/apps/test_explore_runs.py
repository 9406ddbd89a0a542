"""The explorer's clean run per text (:mod:`qkov.apps.explore.runs`): the text, attention and ablate views
give the same numbers, bit for bit, whether or not the session already holds the text's run (a pass from
the first token in a fresh session; with it, the ablated pass and the pattern start from the kept stream),
and the same as the plain forward passes they replace; the session keeps a few texts, least recent dropped
first, and a run too long to keep its streams still gives the same numbers."""

from __future__ import annotations

import pytest
import torch

from helpers import LN_MLP, MODERN, TINY
from qkov import Transformer, Weights
from qkov.analysis.causal.ablation import ablation_edits, z_means
from qkov.analysis.forward import tracer
from qkov.analysis.forward.tracer import trace
from qkov.apps.explore import runs as R
from qkov.apps.explore.context import Explorer
from qkov.apps.explore.views import VIEWS
from qkov.apps.explore.views_card import r6
from qkov.model.ops import next_token_nll

CONFIGS = {"attn-only": TINY, "rotary-gqa": MODERN, "layernorm-mlp": LN_MLP.replace(n_layers=3)}
TEXT = [0, 5, 6, 7, 8, 5, 6, 7, 9, 5, 11, 3]
NOOP = lambda *a: None  # noqa: E731


def explorer(name: str) -> Explorer:
    model = Transformer(CONFIGS[name], seed=0).eval()
    w = Weights.from_model(model)
    return Explorer(model=model, weights=w, name="tiny", decode=str, codec=None, bos=0, max_tokens=model.cfg.n_ctx)


def fresh(ex: Explorer) -> Explorer:
    """The same explorer with no kept runs."""
    return Explorer(ex.model, ex.weights, ex.name, ex.decode, ex.codec, ex.bos, ex.max_tokens)


@pytest.fixture
def layers_read(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The layers whose attention each pass runs (what a kept stream saves)."""
    seen: list[int] = []
    real = tracer._Pass.attention_weights

    def attention(self, l):  # type: ignore[no-untyped-def]
        seen.append(l)
        return real(self, l)

    monkeypatch.setattr(tracer._Pass, "attention_weights", attention)
    return seen


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("mode", ["zero", "mean"])
def test_views_are_equal_with_and_without_the_kept_run(name: str, mode: str, layers_read: list[int]) -> None:
    ex = explorer(name)
    L = ex.model.cfg.n_layers
    heads, first = [f"{L - 1}.1", f"{L // 2}.0"], L // 2
    cold = VIEWS["ablate"](fresh(ex), {"text": TEXT, "heads": heads, "mode": mode}, NOOP)
    text = VIEWS["text"](ex, {"text": TEXT}, NOOP)
    layers_read.clear()
    warm = VIEWS["ablate"](ex, {"text": TEXT, "heads": heads, "mode": mode}, NOOP)
    assert warm == cold
    # the kept run is the "before"; the ablated pass ran from the first ablated layer (mean: z_means stops at its z)
    assert layers_read == ([*range(L)] if mode == "mean" else []) + [*range(first, L)]
    assert text["loss"] == warm["loss_before"] and text["top"] == warm["top_before"]

    # the plain passes the views replace: the forward from the first token, intact and ablated
    ids = torch.tensor([TEXT])
    intact = trace(ex.weights, ids).logits
    means = z_means(ex.weights, ids, heads) if mode == "mean" else None
    ablated = trace(ex.weights, ids, edits=ablation_edits(heads, mode, means=means)).logits
    assert warm["loss_before"][:-1] == pytest.approx(next_token_nll(intact, ids)[0].tolist(), rel=1e-5)
    assert warm["loss_after"][:-1] == pytest.approx(next_token_nll(ablated, ids)[0].tolist(), rel=1e-5)
    assert warm["loss_after"] != warm["loss_before"]
    top = torch.softmax(ablated[0], -1).topk(R.TOP_K)
    assert [[p["id"] for p in row] for row in warm["top_after"]] == top.indices.tolist()
    assert [p["p"] for row in warm["top_after"] for p in row] == pytest.approx(top.values.flatten().tolist(), rel=1e-5)

    for layer in range(L):
        args = {"text": TEXT, "head": f"{layer}.1"}
        layers_read.clear()
        got = VIEWS["attention"](ex, args, NOOP)
        assert layers_read == [layer]  # from the stream entering the layer, up to its pattern
        assert got == VIEWS["attention"](fresh(ex), args, NOOP)
        pattern = trace(ex.weights, ids, cache=[f"pattern.{layer}"])["pattern", layer][0, 1]
        assert got["argmax"] == pattern.argmax(-1).tolist()
        assert got["pattern"][-1] == [r6(v) for v in pattern[-1].tolist()]


def test_a_session_keeps_a_few_texts_and_long_runs_without_streams(monkeypatch: pytest.MonkeyPatch) -> None:
    ex = explorer("layernorm-mlp")
    texts = [[0, i, i + 1, 3] for i in range(1, R.KEEP + 2)]
    for t in texts:
        VIEWS["text"](ex, {"text": t}, NOOP)
    kept = [R.kept_run(ex, torch.tensor([t])) is not None for t in texts]
    assert kept == [False] + [True] * R.KEEP  # the first (least recently used) was dropped
    monkeypatch.setattr(R, "STREAM_BYTES", 0)
    long = fresh(ex)
    args = {"text": TEXT, "heads": ["1.0"], "mode": "zero"}
    VIEWS["text"](long, {"text": TEXT}, NOOP)
    assert R.kept_run(long, torch.tensor([TEXT])).streams is None
    assert VIEWS["ablate"](long, args, NOOP) == VIEWS["ablate"](ex, args, NOOP)
    attention = {"text": TEXT, "head": "2.1"}
    assert VIEWS["attention"](long, attention, NOOP) == VIEWS["attention"](ex, attention, NOOP)
