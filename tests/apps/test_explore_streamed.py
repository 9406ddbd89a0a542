"""The explorer on a model read from disk (``open_explorer(..., lazy=True)``: a memory-mapped LazyCheckpoint,
nothing of the weights held): the text, attention, head card, composition and ablation views give the numbers
the in-memory session gives (<= 1e-5), each reading only what it needs (a pattern the layers up to its own, or
its own layer alone from a kept run; a text each layer once; a card no MLP); the text reports each layer it
reads; views that would read every layer many times answer one line; an in-memory session keeps one folded
copy of the weights (the loaded model dropped once its view is built)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

import qkov
from helpers import LN_MLP, MODERN, TINY, perturb_non_matrices
from qkov import ModelConfig, QkovError, Transformer, Weights
from qkov.apps.explore.context import BadRequest, Explorer
from qkov.apps.explore.session import STREAMED_LOGITS_BYTES, open_explorer, streamed_tokens
from qkov.apps.explore.views import IN_MEMORY_VIEWS, VIEWS
from qkov.io import save_tl
from qkov.weights import LazyCheckpoint

CONFIGS = {
    "layernorm-mlp": LN_MLP.replace(n_layers=4, positional="standard"),
    "rotary-gqa": MODERN.replace(n_layers=3),
    "attn-only": TINY,
}
TEXT = [0, 5, 6, 7, 8, 5, 6, 7, 9, 5, 11, 3]
NOOP = lambda *a: None  # noqa: E731


def _save(path: Path, cfg: ModelConfig) -> Path:
    qkov.save_checkpoint(perturb_non_matrices(Transformer(cfg, seed=0), 0.3), path)
    return path


@pytest.fixture(scope="module", params=[*sorted(CONFIGS), "hf-llama"])
def sessions(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Explorer, Explorer]:
    """The same model in memory and streamed: a qkov checkpoint of each of CONFIGS, and a Llama-family Hugging
    Face directory in shards (grouped-query attention, biases, RMSNorm; read by qkov.io.hf_store)."""
    folder = tmp_path_factory.mktemp("streamed") / request.param
    if request.param == "hf-llama":
        pytest.importorskip("transformers", reason="transformers is a test extra: pip install -e '.[dev]'")
        from hf_models import save

        path = save("llama-gqa-bias", folder, shard="40KB")
    else:
        path = _save(folder, CONFIGS[request.param])
    memory = open_explorer(path, cache_dir=None, lazy=False)
    memory.settle()  # type: ignore[attr-defined]
    return open_explorer(path, cache_dir=None, lazy=True), memory


def near(a: Any, b: Any, tol: float = 1e-5, where: str = "") -> None:
    """``a`` equals ``b`` with every float within ``tol`` (relative above 1), everything else exactly."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            near(a[k], b[k], tol, f"{where}.{k}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            near(x, y, tol, f"{where}[{i}]")
    elif isinstance(a, float) and not isinstance(b, bool):
        assert isinstance(b, (int, float)) and math.isclose(a, b, rel_tol=tol, abs_tol=tol), (where, a, b)
    else:
        assert a == b, (where, a, b)


def test_the_views_give_the_in_memory_numbers(sessions: tuple[Explorer, Explorer], monkeypatch: pytest.MonkeyPatch) -> None:
    from qkov.analysis.forward import tracer

    monkeypatch.setattr(tracer, "VOCAB_BLOCK", 7)  # the passes' unembedding in several blocks, as a real one's
    streamed, memory = sessions
    assert streamed.streamed and streamed.model is None and isinstance(streamed.weights, LazyCheckpoint)
    L = streamed.cfg.n_layers
    head = f"{L - 1}.1"
    calls = [
        ("attention", {"text": TEXT, "head": head}),  # no run kept yet: a pass through the layers up to L - 1
        ("text", {"text": TEXT}),
        ("attention", {"text": TEXT, "head": "1.0"}),  # from the kept run's stream
        ("card", {"head": head, "text": TEXT, "top": 5}),  # with the vocabulary-wide tables
        ("ablate", {"text": TEXT, "heads": [head, "0.1"], "mode": "zero"}),
        ("ablate", {"text": TEXT, "heads": ["1.1"], "mode": "mean"}),
        ("composition", {}),
    ]
    for name, args in calls:
        near(VIEWS[name](streamed, args, NOOP), VIEWS[name](memory, args, NOOP), where=name)


def test_each_view_reads_only_what_it_needs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ex = open_explorer(_save(tmp_path / "ck", CONFIGS["layernorm-mlp"]), cache_dir=None, lazy=True)
    file = ex.weights.file
    seen: list[tuple[str, Any, Any]] = []
    real = file.read
    monkeypatch.setattr(file, "read", lambda name, index=None, cols=None: seen.append((name, index, cols)) or real(name, index, cols))
    layer = lambda name: int(name.split(".")[1]) if name.startswith("blocks.") else None  # noqa: E731

    VIEWS["attention"](ex, {"text": TEXT, "head": "1.0"}, NOOP)  # no kept run: layers 0 and 1's attention
    names = {n for n, _, _ in seen}
    assert {n for n in names if layer(n) is not None and layer(n) > 1} == set() and "W_U" not in names
    assert {n for n in names if layer(n) == 1} == {f"blocks.1.{p}" for p in ("ln1.w", "ln1.b", "attn.W_Q", "attn.W_K", "attn.W_V", "attn.W_O", "attn.b_Q", "attn.b_K", "attn.b_V", "attn.b_O")}
    assert any(layer(n) == 0 and ".mlp." in n for n in names)

    seen.clear()
    VIEWS["text"](ex, {"text": TEXT}, NOOP)
    blocks = [n for n, _, _ in seen if layer(n) is not None]
    assert len(blocks) == len(set(blocks)) and {layer(n) for n in blocks} == {0, 1, 2, 3}  # each layer's tensors once
    assert all(i is not None for n, i, _ in seen if n == "W_E") and all(c is not None for n, _, c in seen if n == "W_U")

    seen.clear()
    VIEWS["attention"](ex, {"text": TEXT, "head": "2.1"}, NOOP)  # from the kept run: layer 2's attention alone
    names = {n for n, _, _ in seen}
    assert {layer(n) for n in names - {"W_pos"}} == {2} and not [n for n in names if ".mlp." in n or ".ln2." in n]

    seen.clear()
    VIEWS["card"](ex, {"head": "2.1", "top": 3}, NOOP)
    assert seen and not [n for n, _, _ in seen if ".mlp." in n or ".ln2." in n]


def test_a_streamed_text_reports_each_layer_as_it_reads_it(sessions: tuple[Explorer, Explorer]) -> None:
    streamed, memory = sessions
    L = streamed.cfg.n_layers
    said: list[tuple[str, int, int]] = []
    VIEWS["text"](streamed, {"text": TEXT[:-1]}, lambda *a: said.append(a))
    assert said == [(f"reading layer {l} of {L} from disk", l, L) for l in range(L)]
    said.clear()
    VIEWS["attention"](streamed, {"text": TEXT[:-2], "head": "1.0"}, lambda *a: said.append(a))  # layers 0 and 1
    assert [s[1:] for s in said] == [(0, 2), (1, 2)]
    said.clear()
    VIEWS["text"](memory, {"text": TEXT[:-1]}, lambda *a: said.append(a))
    assert said == []  # in memory a pass takes milliseconds: nothing to report


def test_views_that_would_read_every_layer_many_times_are_one_line(sessions: tuple[Explorer, Explorer]) -> None:
    streamed, memory = sessions
    model = VIEWS["model"](streamed, {}, NOOP)
    assert model["streamed"] is True and model["unavailable"] == IN_MEMORY_VIEWS
    assert VIEWS["model"](memory, {}, NOOP)["streamed"] is False and VIEWS["model"](memory, {}, NOOP)["unavailable"] == {}
    for name, why in IN_MEMORY_VIEWS.items():
        with pytest.raises(BadRequest) as err:
            VIEWS[name](streamed, {"text": TEXT, "clean": TEXT, "corrupted": TEXT}, NOOP)
        assert err.value.status == 400 and "\n" not in str(err.value)
        assert str(err.value).startswith(f"{name}: not available while the weights are read from disk") and why in str(err.value)


def test_an_in_memory_session_keeps_one_copy(sessions: tuple[Explorer, Explorer]) -> None:
    """Once the folded view is built the loaded model is dropped; the shape then comes from the view."""
    streamed, memory = sessions
    assert memory.model is None and isinstance(memory.weights, Weights) and not memory.streamed
    assert memory.cfg == streamed.cfg


def test_streaming_is_chosen_as_every_command_chooses_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """By default above AUTO_LAZY_BYTES of weights; ``lazy=True`` on a source qkov cannot stream is one line."""
    from qkov.weights import lazy

    path = _save(tmp_path / "ck", TINY)
    ex = open_explorer(path, cache_dir=None)
    ex.settle()  # type: ignore[attr-defined]
    assert not ex.streamed
    monkeypatch.setattr(lazy, "AUTO_LAZY_BYTES", (path / "model.safetensors").stat().st_size - 1)
    assert open_explorer(path, cache_dir=None).streamed
    save_tl(Transformer(TINY), tmp_path / "m.pt")
    with pytest.raises(QkovError, match="cannot be streamed from disk") as err:
        open_explorer(tmp_path / "m.pt", cache_dir=None, lazy=True)
    assert "\n" not in str(err.value)


def test_a_streamed_text_is_bounded_by_its_logits() -> None:
    llama = ModelConfig(n_layers=1, n_heads=1, d_model=8, d_head=8, d_vocab=128256, n_ctx=8192)
    n = streamed_tokens(llama)
    assert n == 1046 and n * 4 * llama.d_vocab <= STREAMED_LOGITS_BYTES < (n + 1) * 4 * llama.d_vocab
    assert streamed_tokens(TINY) == TINY.n_ctx
