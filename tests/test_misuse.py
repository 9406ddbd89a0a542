"""Library misuse: every public entry point that takes a model, a weights source, tokens or a path
refuses a wrong argument with a one-line QkovError naming the function, what it expected, what it
got and what to pass, never an AttributeError from deep inside (issue 24, case 9)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import qkov
from qkov import LazyCheckpoint, ModelConfig, QkovError, Transformer, Weights

CFG = ModelConfig(n_layers=2, n_heads=2, d_model=16, d_head=8, n_ctx=16, d_vocab=32)
MODEL = Transformer(CFG, seed=0)
VIEW = Weights.from_model(MODEL)
TOKENS = torch.arange(8)[None] % CFG.d_vocab
OTHER = (TOKENS + 1) % CFG.d_vocab


def _gpt2() -> Any:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=32, n_positions=16, bos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


# what each bad value is described as in the message, and the advice it gets
NOT_MODELS: dict[str, tuple[Callable[[], Any], str, str]] = {
    "None": (lambda: None, "got None", "qkov.Transformer(cfg)"),
    "str": (lambda: "runs/model", "got a str ('runs/model')", "qkov.load_any(path)"),
    "linear": (lambda: torch.nn.Linear(2, 2), "got a torch.nn Linear", "qkov.Transformer(cfg)"),
    "dict": (lambda: {"W_E": torch.zeros(2, 2)}, "got a dict", "qkov.Transformer(cfg)"),
    "weights": (lambda: VIEW, "got a Weights", "already a weights source"),
    "gpt2": (_gpt2, "got a transformers GPT2LMHeadModel", "qkov.io.from_hf(model)"),
}
# what an analysis cannot read (a model, a weights source and a path it can), and the advice it gets
NOT_SOURCES: dict[str, tuple[Callable[[], Any], str, str]] = {
    "None": (lambda: None, "got None", ""),
    "int": (lambda: 3, "got an int", ""),
    "linear": (lambda: torch.nn.Linear(2, 2), "got a torch.nn Linear", ""),
    "dict": (lambda: {}, "got a dict", ""),
    "gpt2": (_gpt2, "got a transformers GPT2LMHeadModel", "qkov.io.from_hf(model)"),
}
KINDS = "a model (qkov.Transformer, what qkov.load returns), a weights view (qkov.Weights), a qkov.LazyCheckpoint or a path"

SOURCE_ENTRY_POINTS: dict[str, Callable[[Any], Any]] = {
    "qkov.trace": lambda s: qkov.trace(s, TOKENS),
    "qkov.induction_probe": lambda s: qkov.induction_probe(s),
    "qkov.ablation_study": lambda s: qkov.ablation_study(s, None, [(0, 0)], mode="zero"),
    "qkov.head_report": lambda s: qkov.head_report(s, TOKENS),
    "qkov.composition_scores": lambda s: qkov.composition_scores(s),
    "qkov.copying_scores": lambda s: qkov.copying_scores(s),
    "qkov.skip_trigrams": lambda s: qkov.skip_trigrams(s, 0, 0),
    "qkov.expand": lambda s: qkov.expand(s, TOKENS),
    "qkov.term_importance": lambda s: qkov.term_importance(s, TOKENS),
    "qkov.activation_patching": lambda s: qkov.activation_patching(s, TOKENS, OTHER),
    "qkov.attribution_patching": lambda s: qkov.attribution_patching(s, TOKENS, OTHER),
    "qkov.path_patching": lambda s: qkov.path_patching(s, TOKENS, OTHER, receivers="logits"),
    "qkov.patch_study": lambda s: qkov.patch_study(s, TOKENS, OTHER),
}


@pytest.mark.parametrize("bad", NOT_MODELS)
def test_weights_from_model_refuses_what_is_not_a_model(bad: str) -> None:
    make, got, advice = NOT_MODELS[bad]
    with pytest.raises(QkovError) as err:
        Weights.from_model(make())
    msg = str(err.value)
    assert msg.startswith("qkov.Weights.from_model expects a qkov model (qkov.Transformer); ") and "\n" not in msg
    assert got in msg and advice in msg, msg


@pytest.mark.parametrize("bad", NOT_SOURCES)
@pytest.mark.parametrize("entry", SOURCE_ENTRY_POINTS)
def test_source_entry_points_refuse_what_is_not_a_weights_source(entry: str, bad: str) -> None:
    make, got, advice = NOT_SOURCES[bad]
    with pytest.raises(TypeError) as err:  # a TypeError that is also a QkovError (one line at the CLI)
        SOURCE_ENTRY_POINTS[entry](make())
    assert isinstance(err.value, QkovError)
    msg = str(err.value)
    assert msg.startswith(f"{entry} expects {KINDS}"), msg
    assert got in msg and advice in msg and "\n" not in msg, msg


@pytest.mark.parametrize("entry", SOURCE_ENTRY_POINTS)
def test_source_entry_points_name_themselves_for_a_missing_path(entry: str, tmp_path: Path) -> None:
    with pytest.raises(QkovError, match=rf"^{entry}: '.*nothing' does not exist$"):
        SOURCE_ENTRY_POINTS[entry](str(tmp_path / "nothing"))


def test_every_analysis_reads_a_model_a_view_a_lazy_checkpoint_or_a_path(tmp_path: Path) -> None:
    """The same analysis of the same weights, whatever the caller holds (converted once, equal to
    the explicit ``Weights.from_model``)."""
    qkov.save_checkpoint(MODEL, tmp_path / "m")
    lazy = LazyCheckpoint(tmp_path / "m")
    expected = qkov.trace(VIEW, TOKENS).logits
    for source in (VIEW, lazy, MODEL, tmp_path / "m", str(tmp_path / "m")):
        torch.testing.assert_close(qkov.trace(source, TOKENS).logits, expected, rtol=0, atol=1e-5)
    probe = qkov.induction_probe(VIEW, seed=1).induction_attention
    for source in (MODEL, tmp_path / "m", lazy):
        torch.testing.assert_close(qkov.induction_probe(source, seed=1).induction_attention, probe, rtol=0, atol=1e-5)
    for source in (VIEW, lazy):
        assert Weights.from_source(source).cfg == CFG
    assert "Weights" in str(type(Weights.from_model(MODEL)))
    with pytest.raises(QkovError, match=r"read it into memory with qkov\.Weights\.from_source"):
        Weights.from_model(lazy)


@pytest.mark.parametrize("bad", [None, 3, MODEL, VIEW])
@pytest.mark.parametrize(
    "entry, call",
    [
        ("qkov.load", lambda p: qkov.load(p)),
        ("qkov.load_any", lambda p: qkov.load_any(p)),
        ("qkov.LazyCheckpoint", lambda p: LazyCheckpoint(p)),
    ],
)
def test_path_entry_points_refuse_what_is_not_a_path(entry: str, call: Callable[[Any], Any], bad: Any) -> None:
    with pytest.raises(QkovError, match=rf"^{entry}: path must be a path \(str or pathlib\.Path\); got "):
        call(bad)


@pytest.mark.parametrize(
    "bad, expected",
    [
        ("runs/x", r"sources must be a list of paths; got a str \('runs/x'\): pass \['runs/x'\]"),
        (None, "sources must be a list of paths; got None"),
        ([MODEL], r"each of sources must be a path .*got a Transformer"),
    ],
)
def test_dynamics_refuses_what_is_not_a_list_of_paths(bad: Any, expected: str) -> None:
    with pytest.raises(QkovError, match=rf"^qkov\.dynamics: {expected}"):
        qkov.dynamics(bad)


@pytest.mark.parametrize("bad", [None, MODEL, "0 1 2"])
def test_run_refuses_tokens_that_are_not_ids(bad: Any) -> None:
    with pytest.raises(QkovError, match=r"^qkov\.trace: tokens must be token ids .*; got "):
        qkov.trace(VIEW, bad)


# issue 40: calls that ended in an AttributeError, TypeError, RuntimeError or AssertionError
LIBRARY_MISTAKES: dict[str, tuple[Callable[[], Any], str]] = {
    "head_report(m, None)": (
        lambda: qkov.head_report(MODEL, None),
        r"^qkov\.head_report: text must be token ids .*got None$",
    ),
    "head_report(m, 'text')": (
        lambda: qkov.head_report(MODEL, "text"),
        r"^qkov\.head_report: text must be token ids .*got a str",
    ),
    "icl_score(m, 'abc')": (
        lambda: qkov.icl_score(MODEL, "abc"),
        r"^qkov\.icl_score: examples must be token ids .*got a str",
    ),
    "icl_score(m, None)": (
        lambda: qkov.icl_score(MODEL, None),
        r"^qkov\.icl_score: examples must be token ids .*got None$",
    ),
    "icl_score(m, [[1, 2, 3]])": (
        lambda: qkov.icl_score(MODEL, [[1, 2, 3]]),
        r"^qkov\.icl_score: examples of 3 tokens are too short",
    ),
    "text_scores(m, 'abc')": (lambda: qkov.text_scores(MODEL, "abc"), r"^qkov\.text_scores: text must be token ids"),
    "text_scores(m, [[99]])": (
        lambda: qkov.text_scores(MODEL, [[99]]),
        r"^qkov\.text_scores: text: id 99 out of range \[0, 32\)$",
    ),
    "induction_probe(m, length=-5)": (
        lambda: qkov.induction_probe(MODEL, length=-5),
        r"^qkov\.induction_probe: length must be a positive integer, got -5$",
    ),
    "induction_probe(m, batch=0)": (
        lambda: qkov.induction_probe(MODEL, batch=0),
        r"^qkov\.induction_probe: batch must be a positive integer, got 0$",
    ),
    "Transformer(None)": (
        lambda: Transformer(None),  # type: ignore[arg-type]
        r"^qkov\.Transformer expects a config, qkov\.ModelConfig\(\.\.\.\); got None$",
    ),
    "Transformer(ModelConfig)": (
        lambda: Transformer(ModelConfig),  # type: ignore[arg-type]
        r"got the class ModelConfig itself \(call it",
    ),
    "Transformer(huge)": (
        lambda: Transformer(ModelConfig(n_layers=10**5, d_model=10**4, n_heads=4, d_head=2500)),
        r"^qkov\.Transformer: a model of 40,000,023,040,000 parameters needs about .* TiB, more than the .* free",
    ),
    "from_model(dtype='float99')": (
        lambda: Weights.from_model(MODEL, dtype="float99"),  # type: ignore[arg-type]
        r"^qkov\.Weights\.from_model: dtype must be a floating-point torch dtype .*got 'float99'$",
    ),
    "train(None)": (
        lambda: qkov.train(None),  # type: ignore[arg-type]
        r"^qkov\.train: out must be a path \(str or pathlib\.Path\); got None$",
    ),
    "train(path, dict)": (
        lambda: qkov.train("x", {"n_layers": 1}),  # type: ignore[arg-type]
        r"^qkov\.train: model_cfg must be a qkov\.ModelConfig; got a dict$",
    ),
}


@pytest.mark.parametrize("call", LIBRARY_MISTAKES)
def test_library_mistakes_are_one_line_errors_naming_what_was_expected(call: str) -> None:
    run, expected = LIBRARY_MISTAKES[call]
    with pytest.raises(QkovError, match=expected) as err:
        run()
    assert "\n" not in str(err.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is here: the device exists")
def test_a_view_on_a_device_this_machine_lacks_is_one_line() -> None:
    with pytest.raises(QkovError, match=r"^qkov\.Weights\.from_model: device: cuda requested but no CUDA GPU"):
        Weights.from_model(MODEL, device="cuda")


def test_a_dtype_by_name_is_the_dtype() -> None:
    assert Weights.from_model(MODEL, dtype="float64").W_E.dtype == torch.float64  # type: ignore[arg-type]
    assert Weights.from_model(MODEL, dtype="torch.bfloat16").W_E.dtype == torch.bfloat16  # type: ignore[arg-type]
