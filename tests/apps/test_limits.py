"""Limits honoured and checked in time (issue 24, cases 7, 8 and 10): a config that does not
describe its weights is refused before anything is allocated; an allocation that fails anyway is
one line; messages about too-small corpora and out-of-vocabulary start tokens say what is wrong."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import qkov
from qkov import LazyCheckpoint, ModelConfig, QkovError, Transformer, save_checkpoint
from qkov.apps.cli import main

from helpers import run_main

SMALL = ModelConfig(n_layers=1, n_heads=2, d_model=16, d_head=8, n_ctx=16, d_vocab=32)
LIE = {"n_layers": 100000, "d_model": 4096}  # what the probe's config.json claimed


def _lying_checkpoint(tmp_path: Path, **lie: Any) -> Path:
    ck = tmp_path / "ck"
    save_checkpoint(Transformer(SMALL, seed=0), ck)
    data = json.loads((ck / "config.json").read_text())
    data["model"].update(lie or LIE)
    (ck / "config.json").write_text(json.dumps(data))
    return ck


def _lying_gpt2(tmp_path: Path, name: str, **lie: Any) -> Path:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=32, n_positions=16, bos_token_id=0)
    folder = tmp_path / name
    transformers.GPT2LMHeadModel(cfg).save_pretrained(folder)
    data = json.loads((folder / "config.json").read_text())
    data.update(lie)
    (folder / "config.json").write_text(json.dumps(data))
    return folder


_CHILD = """
import sys, time
t0 = time.perf_counter()
if sys.argv[1] == "cli":
    from qkov.apps.cli import main
    t0 = time.perf_counter()
    rc = main(sys.argv[2:])
else:  # a library loader on a path: its one-line error
    import qkov
    load = {"load": qkov.load, "load_any": qkov.load_any, "LazyCheckpoint": qkov.LazyCheckpoint}[sys.argv[1]]
    t0 = time.perf_counter()
    try:
        load(sys.argv[2])
        rc = 0
    except qkov.QkovError as exc:
        sys.stderr.write(f"qkov: error: {exc}\\n")
        rc = 2
sys.stderr.write(f"seconds {time.perf_counter() - t0:.3f}\\n")
sys.exit(rc)
"""


def _capped(*argv: object) -> tuple[int, str, float]:
    """Run ``qkov ARGV`` (``"cli", ...``) or a loader (``"load", PATH``) in a child whose address space
    is capped at 8 GiB (the probe's ``ulimit -v``, and what keeps a regression from taking the
    machine's memory): ``(exit status, stderr, seconds the call took after the imports)``."""

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))

    try:
        r = subprocess.run(
            [sys.executable, "-c", _CHILD, *map(str, argv)],
            preexec_fn=cap,
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHONPATH": str(Path(qkov.__file__).parents[1])},
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{argv} still running after 120 s")
    err, _, tail = r.stderr.rstrip().rpartition("\n")
    if not tail.startswith("seconds "):  # it died before reporting: a traceback
        return r.returncode, r.stderr, float("inf")
    return r.returncode, err, float(tail.split()[1])


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qkov: error:") and "Traceback" not in err, err
    return lines[0]


# ------------------------------------------------------------------ case 8: configs checked first
@pytest.mark.parametrize("command", [["info"], ["circuits"], ["circuits", "--lazy"]])
def test_a_lying_qkov_config_is_refused_before_the_model_is_allocated(tmp_path: Path, command: list[str]) -> None:
    ck = _lying_checkpoint(tmp_path)
    rc, err, seconds = _capped("cli", command[0], ck, *command[1:])
    line = _one_line(err)
    assert rc == 2 and seconds < 5, (rc, seconds)
    assert "the config says 100000 layer(s), but the weights hold 1 (block 0)" in line, line


@pytest.mark.parametrize("loader", ["load", "load_any", "LazyCheckpoint"])
def test_a_lying_qkov_config_is_refused_by_every_library_loader(tmp_path: Path, loader: str) -> None:
    rc, err, seconds = _capped(loader, _lying_checkpoint(tmp_path))
    assert rc == 2 and seconds < 5 and "says 100000 layer(s), but the weights hold 1" in _one_line(err)
    wide = _lying_checkpoint(tmp_path / "wide", d_model=4096)  # the right layers, a wrong width
    rc, err, seconds = _capped(loader, wide)
    assert rc == 2 and seconds < 5
    assert "W_E has shape (32, 16) but the config implies (32, 4096)" in _one_line(err)


@pytest.mark.parametrize(
    "lie, needle",
    [
        (dict(n_layer=100000, n_embd=4096), "4096"),  # the probe's lie (refused in one line today too: a guard)
        (dict(n_inner=10**9), r"blocks.0.mlp.W_in has shape (16, 64) but the config implies (16, 1000000000)"),
        (dict(vocab_size=10**10), r"W_E has shape (32, 16) but the config implies (10000000000, 16)"),
    ],
)
def test_a_lying_gpt2_config_is_refused_before_the_model_is_allocated(
    tmp_path: Path, lie: dict[str, int], needle: str
) -> None:
    # n_inner: 64 GB of W_in allocated before any check, today; vocab_size: a 40 GB b_U
    hf = _lying_gpt2(tmp_path, "hf", **lie)
    for argv in (["cli", "circuits", hf], ["cli", "import", hf, "--out", tmp_path / "ck"], ["load_any", hf]):
        rc, err, seconds = _capped(*argv)
        line = _one_line(err)
        assert rc == 2 and seconds < 5 and needle in line, (argv, seconds, line)


@pytest.mark.parametrize(
    "lie, needle",
    [
        (dict(d_mlp=10**9), "blocks.0.mlp.W_in has shape (16, 32) but the config implies (16, 1000000000)"),
        (dict(n_layers=100000, d_model=4096), "the config says 100000 layer(s), but the weights hold 1 (block 0)"),
        (dict(d_model=4096), "W_E has shape (32, 16) but the config implies (32, 4096)"),
    ],
)
def test_a_lying_transformerlens_config_is_refused_before_allocation(
    tmp_path: Path, lie: dict[str, int], needle: str
) -> None:
    from qkov.io.tl import save_tl, tl_config_dict

    cfg = SMALL.replace(d_mlp=32)  # d_mlp 10**9: 64 GB of W_in and W_out allocated before any check, today
    f = tmp_path / "m.safetensors"
    save_tl(Transformer(cfg, seed=0), f)
    (tmp_path / "config.json").write_text(json.dumps({**tl_config_dict(cfg), **lie}))
    rc, err, seconds = _capped("cli", "import", f, "--config", tmp_path / "config.json", "--out", tmp_path / "ck")
    line = _one_line(err)
    assert rc == 2 and seconds < 5 and needle in line, (seconds, line)


def test_an_allocation_failure_is_one_line_and_other_errors_keep_their_traceback(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from qkov.apps.cli import common

    ck = tmp_path / "m"
    save_checkpoint(Transformer(SMALL, seed=0), ck)

    def no_memory(*_a: Any, **_k: Any) -> Any:
        raise RuntimeError(
            "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried "
            "to allocate 2800000000 bytes. Error code 12 (Cannot allocate memory)"
        )

    monkeypatch.setattr(common, "load_any", no_memory)
    rc, _, err = run_main(capsys, "info", ck)
    assert rc == 2 and "out of memory: an allocation of 2.6 GiB failed" in _one_line(err)
    monkeypatch.setattr(common, "load_any", lambda *a, **k: (_ for _ in ()).throw(MemoryError()))
    rc, _, err = run_main(capsys, "info", ck)
    assert rc == 2 and "out of memory" in _one_line(err)
    monkeypatch.setattr(common, "load_any", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("a bug")))
    with pytest.raises(RuntimeError, match="a bug"):
        main(["info", str(ck)])


# ------------------------------------------------------------------ case 10: messages that say what is wrong
TRAIN = ["train", "--layers", "1", "--heads", "2", "--d-model", "16", "--d-head", "8", "--ctx", "128", "--vocab", "512"]
TRAIN += ["--batch", "2", "--steps", "2", "--device", "cpu", "--quiet"]


def _least_total(n_ctx: int, val_fraction: float = 0.05) -> int:
    """The smallest token file whose split by position (the last val_fraction) holds one example each side."""
    n, width = 1, n_ctx - 1
    while not (n - int(n * (1 - val_fraction)) >= width and int(n * (1 - val_fraction)) >= width):
        n += 1
    return n


@pytest.mark.parametrize("size, train, val", [(300, 285, 15), (16, 15, 1)])
def test_a_too_small_token_corpus_says_how_many_tokens_it_holds_and_needs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], size: int, train: int, val: int
) -> None:
    import numpy as np

    corpus = tmp_path / "c.bin"
    np.arange(size, dtype=np.uint16).tofile(corpus)
    rc, _, err = run_main(capsys, *TRAIN, "--corpus", corpus, "--out", tmp_path / "run")
    line = _one_line(err)
    assert rc == 2 and not (tmp_path / "run").exists(), line
    assert f"holds {size} tokens, {train} for training and {val} for validation (its last 5%)" in line, line
    assert "an example of n_ctx 128 is the start token and 127 tokens" in line, line
    assert f"a token file of at least {_least_total(128):,} tokens" in line, line


def test_tiny_token_files_are_counted_in_the_singular_and_in_bytes(tmp_path: Path) -> None:
    import numpy as np

    np.save(tmp_path / "one.npy", np.array([3], dtype=np.int64))
    with pytest.raises(QkovError, match=r"holds only 1 token$"):
        qkov.load_corpus(str(tmp_path / "one.npy"))
    (tmp_path / "c3.bin").write_bytes(b"abc")
    with pytest.raises(
        QkovError, match=r"'.*c3.bin' has 3 byte\(s\), not a whole number of token ids: .* 2 bytes each"
    ):
        qkov.load_corpus(str(tmp_path / "c3.bin"))


def test_a_one_token_analysis_input_is_one_short_sequence(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from qkov.training.data import train_tokenizer

    tok = train_tokenizer(["ab ba ab"], 8, alphabet=list("ab "))
    model = Transformer(SMALL.replace(d_vocab=tok.get_vocab_size()), seed=0)
    save_checkpoint(model, tmp_path / "m", tokenizer_json=tok.to_str())
    (tmp_path / "one.txt").write_text("a")
    (tmp_path / "one.ids").write_text("3")
    (tmp_path / "c3.bin").write_bytes(b"\x01\x00\x07")  # one uint16 id (1) and a stray byte
    (tmp_path / "empty.txt").write_text("")
    for flag, name in (("--text", "one.txt"), ("--tokens", "one.ids"), ("--tokens", "c3.bin")):
        rc, out, err = run_main(capsys, "ablate", tmp_path / "m", "--heads", "0.0", flag, tmp_path / name, "--json")
        data = json.loads(out)
        assert rc == 0 and "one sequence of 2 tokens (its own length; the context is 16)" in data["sample"], err
        assert data["intact"]["icl"] is None and "the context is 16" in data["left_out"]["icl"]
    rc, _, err = run_main(capsys, "ablate", tmp_path / "m", "--heads", "0.0", "--text", tmp_path / "empty.txt")
    line = _one_line(err)
    assert rc == 2 and line.endswith("empty.txt' holds no tokens") and "corpus" not in line, line


def _gpt2_dir(tmp_path: Path, vocab: int = 32) -> Path:
    transformers = pytest.importorskip("transformers")
    folder = tmp_path / "gpt2"  # a stock config: bos_token_id 50256, outside a vocabulary of 32
    transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=vocab, n_positions=16)
    ).save_pretrained(folder)
    assert json.loads((folder / "config.json").read_text())["bos_token_id"] == 50256
    return folder


def test_a_start_token_outside_the_vocabulary_is_a_warning_and_recorded(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from qkov.errors import QkovWarning

    hf = _gpt2_dir(tmp_path)
    capsys.readouterr()
    rc, out, err = run_main(capsys, "import", hf, "--out", tmp_path / "ck")
    assert rc == 0 and out.startswith("imported"), err
    warning = "bos_token_id 50256 in config.json is not a token of its vocabulary of 32: start token 0 is used instead"
    assert err.strip().splitlines() == [f"qkov: warning: Hugging Face model {str(hf)!r}: {warning}"], err
    config = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert config["tokenizer"]["bos_token_id"] == 0
    assert config["training"]["imported_from"]["warnings"] == [f"Hugging Face model {str(hf)!r}: {warning}"]
    with pytest.warns(QkovWarning, match="bos_token_id 50256 .* start token 0 is used"):
        assert qkov.load_any(hf).bos_token_id == 0
    fine = _gpt2_dir(tmp_path / "fine", vocab=50257)  # the released GPT-2's vocabulary holds 50256
    with __import__("warnings").catch_warnings():
        __import__("warnings").simplefilter("error", QkovWarning)
        assert qkov.load_any(fine).bos_token_id == 50256


def test_a_streamed_directory_warns_of_its_start_token_too(tmp_path: Path) -> None:
    from hf_models import save

    from qkov.errors import QkovWarning

    folder = save("llama-gqa-bias", tmp_path / "llama")
    data = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**data, "bos_token_id": 5000}))
    with pytest.warns(QkovWarning, match="bos_token_id 5000 in config.json is not a token of its vocabulary of 96"):
        assert LazyCheckpoint(folder).bos_token_id == 0


# ------------------------------------------------------------------ case 7: --max-memory honoured by every command
@pytest.fixture(scope="module")
def trained(small_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny run with a corpus (natural validation text) and snapshots (a series for dynamics)."""
    from helpers import TINY, tiny_train

    out = tmp_path_factory.mktemp("limits") / "run"
    qkov.train(out, TINY, tiny_train(small_corpus, steps=20, snapshots=4), device="cpu")
    return out


def _commands(run: Path, out: Path) -> dict[str, list[object]]:
    return {
        "circuits": ["circuits", run, "--json"],
        "trigrams": ["trigrams", run, "--head", "1.0", "--json"],
        "ablate": ["ablate", run, "--heads", "1.0", "--json"],
        "dynamics": ["dynamics", run, "-o", out, "--force", "--json"],
    }


def _stable(text: str) -> Any:
    """A command's JSON without its timings (the only fields that change run to run)."""
    data = json.loads(text)
    data.pop("timings", None)
    for snap in data.get("snapshots", []):
        snap.pop("seconds", None)
    return data


@pytest.mark.parametrize("command", ["circuits", "trigrams", "ablate", "dynamics"])
def test_max_memory_is_honoured_a_tiny_budget_refused_a_generous_one_changes_nothing(
    trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    argv = _commands(trained, tmp_path / "dyn")[command]
    rc, out, err = run_main(capsys, *argv, "--max-memory", "1k")
    line = _one_line(err)
    assert rc == 2 and out == "", (rc, out)
    assert line.startswith(f"qkov: error: {command}: ") and "more than the 1.0 KiB memory budget" in line, line
    assert "(or pass a larger --max-memory if more is free)" in line, line
    if command == "dynamics":
        assert not (tmp_path / "dyn" / "dynamics.json").exists()  # refused before any work
    rc, plain, err = run_main(capsys, *argv)
    assert rc == 0, err
    rc, generous, err = run_main(capsys, *argv, "--max-memory", "1T")
    assert rc == 0, err
    assert _stable(generous) == _stable(plain)


def _least_budget(fits: Any, lo: int = 1, hi: int = 1 << 34) -> int:
    """The smallest budget under which ``fits()`` (a plan) does not refuse, by bisection."""
    import qkov.device as D

    while lo < hi:
        mid = (lo + hi) // 2
        D.set_memory_budget(mid)
        try:
            fits()
            hi = mid
        except QkovError:
            lo = mid + 1
        finally:
            D.set_memory_budget(None)
    return lo


def test_a_tight_budget_splits_the_ablation_passes_and_measures_the_same(
    trained: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from qkov.analysis.causal import ablation as Ab
    from qkov.apps.inputs import sample_for
    import qkov.device as D

    model = qkov.load(trained)
    w = qkov.Weights.from_model(model)
    sample = sample_for(trained, model, text=None, tokens=None, seed=0)
    assert sample.text is not None and sample.text.shape[0] > 2

    def plan() -> Ab.Chunks:
        return Ab.ablation_budget(w, sample.text, sample.icl_text, "mean", bos=sample.bos)

    least = _least_budget(plan)
    D.set_memory_budget(least)
    try:
        tight = plan()
    finally:
        D.set_memory_budget(None)
    # the text's passes split; the mean's pass holds no logits (z summed as it goes, nothing unembedded): at
    # this budget its sequences all fit at once (its chunks are tested in test_ablation.py)
    assert tight.text is not None and tight.text < sample.text.shape[0], tight
    assert plan() == Ab.Chunks()  # without a budget (and memory free) every pass is whole
    rc, plain, _ = run_main(capsys, "ablate", trained, "--heads", "1.0", "--json")
    rc2, split, err = run_main(capsys, "ablate", trained, "--heads", "1.0", "--json", "--max-memory", least)
    assert rc == rc2 == 0, err
    a, b = json.loads(plain), json.loads(split)
    for key in ("intact", "ablated"):
        for measure, value in a[key].items():
            if value is None:  # left out (the ICL score on a context shorter than it reads), on both sides
                assert b[key][measure] is None and measure in a["left_out"], (key, measure)
                continue
            assert value == pytest.approx(b[key][measure], rel=1e-5, abs=1e-6), (key, measure)
    rc, _, err = run_main(capsys, "ablate", trained, "--heads", "1.0", "--max-memory", least - 1)
    assert rc == 2 and "memory budget" in _one_line(err)


def test_a_tight_budget_narrows_the_trigram_search_and_finds_the_same_trigrams(
    trained: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from qkov.analysis.circuits import trigrams as T
    import qkov.device as D

    w = qkov.Weights.from_model(qkov.load(trained))
    least = _least_budget(lambda: T._search_budget(w, 1, 0))
    D.set_memory_budget(least)
    try:
        batch, max_bytes = T._search_budget(w, 1, 0)
    finally:
        D.set_memory_budget(None)
    assert batch < T.SEARCH_BATCH, batch
    rc, plain, _ = run_main(capsys, "trigrams", trained, "--head", "1.0", "--json")
    rc2, tight, err = run_main(capsys, "trigrams", trained, "--head", "1.0", "--json", "--max-memory", least)
    assert rc == rc2 == 0, err
    a, b = json.loads(plain)["trigrams"], json.loads(tight)["trigrams"]
    assert [(t["source"], t["destination"], t["output"]) for t in a] == [
        (t["source"], t["destination"], t["output"]) for t in b
    ]
    assert [t["score"] for t in a] == pytest.approx([t["score"] for t in b], rel=1e-5)


def test_patch_does_not_offer_a_budget_it_cannot_honour(
    trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "a.txt").write_text("def f(x):\n    return x\n")
    (tmp_path / "b.txt").write_text("def g(y):\n    return y\n")
    rc, _, err = run_main(
        capsys, "patch", trained, "--clean", tmp_path / "a.txt", "--corrupted", tmp_path / "b.txt", "--max-memory", "1k"
    )
    assert rc == 2 and "unrecognized arguments: --max-memory 1k" in _one_line(err)
