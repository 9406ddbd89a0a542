"""Same seed, same bits: a CPU that computes the same way in every process, and a resume that says
when it cannot.

Every float32 matrix product on an x86 CPU is an MKL ``sgemm``; MKL promises bitwise equal
results from one run to the next only in its conditional numerical reproducibility (CNR) mode,
which is off unless asked for, and which it takes only before its first computation. Importing
qkov asks for it (:func:`qkov.device.reproducible_blas`); a run in a process where MKL computed
before qkov was imported says that its resume may not be exact. ``exp``, ``log``, ``sqrt``... of a
large tensor are MKL vector math, whose first concurrent call could compute one thread's part with
a low-accuracy kernel: importing qkov (and training) makes each function's first call on one thread
(:func:`qkov.device.settle_vector_math`). Training flushes denormal floats in every thread
(:func:`qkov.device.flush_denormals`), also in the worker threads of a process that computed before
training. The same training in several fresh processes, under load, must give the same bits; a
state records what its bits depend on (:mod:`qkov.training.environment`) and a resume that cannot
repeat them says so. ``benchmarks/bench_kills.py`` measures kills at random moments and fresh runs;
``benchmarks/vml_race.py`` counts the vector-math race with and without the warm-up.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import qkov
from qkov.device import VECTOR_MATH
from qkov.errors import QkovWarning
from qkov.training import rundir
from qkov.training.loop import BLAS_NOT_REPRODUCIBLE

from helpers import ROOT, TINY, tiny_train, train_flags

CBWR_BRANCH_OFF, CBWR_AUTO = 1, 2  # mkl_cbwr.h


def _mkl_mode_getter() -> str | None:
    """Python source that prints MKL's CNR mode, or None where torch has no MKL service functions."""
    lib = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    if not torch.backends.mkl.is_available() or not lib.is_file():
        return None
    try:
        ctypes.CDLL(str(lib)).mkl_serv_cbwr_get
    except (OSError, AttributeError):
        return None
    return f"import ctypes; print(ctypes.CDLL({str(lib)!r}).mkl_serv_cbwr_get(-1))"


GETTER = _mkl_mode_getter()
needs_mkl = pytest.mark.skipif(GETTER is None, reason="torch here has no MKL (nothing to make reproducible)")

# A million floats whose product with 1e-10 is a denormal: torch splits the product over its
# threads (the first half to the main thread), so the denormals left in each half say whether
# that thread flushes them.
DENORMAL_PROBE = (
    "import numpy as np, torch; x = torch.from_numpy(np.full(1 << 20, 1e-30, dtype=np.float32)); "
    "kept = lambda: ((x * 1e-10) != 0).reshape(2, -1).sum(1).tolist()"
)


def _python(code: str, cache: Path | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
    if cache is not None:
        env["QKOV_CACHE"] = str(cache)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout.strip().splitlines()[-1]


def _train_one_step(prelude: str, out: Path, corpus: Path) -> dict[str, Any]:
    """In a new process: ``prelude``, then one training step; what training said, and the denormals
    each thread keeps afterwards."""
    code = (
        f"{DENORMAL_PROBE}; {prelude + '; ' if prelude else ''}"
        "import json, qkov; from qkov import ModelConfig, TrainConfig; said = []; "
        f"qkov.train({str(out)!r}, ModelConfig.from_dict({TINY.to_dict()!r}), "
        f"TrainConfig.from_dict({tiny_train(corpus, steps=1).to_dict()!r}), device='cpu', "
        "callback=lambda e: said.append(e.get('text')) if e['event'] == 'message' else None); "
        "print(json.dumps({'said': said, 'kept': kept(), 'threads': torch.get_num_threads()}))"
    )
    return json.loads(_python(code, out.parent / "qkov-cache"))


@pytest.fixture(scope="module")
def computed_first(tmp_path_factory: pytest.TempPathFactory, small_corpus: Path) -> dict[str, Any]:
    """A run in a process that multiplied matrices and ran parallel work before importing qkov."""
    prelude = "torch.ones(64, 64) @ torch.ones(64, 64); x * 1.0"
    return _train_one_step(prelude, tmp_path_factory.mktemp("late") / "run", small_corpus)


@needs_mkl
def test_importing_qkov_switches_mkl_to_its_reproducible_mode() -> None:
    assert GETTER is not None
    assert _python(f"import torch; {GETTER}") == str(CBWR_BRANCH_OFF), "MKL's default: CNR off"
    assert _python(f"import qkov; {GETTER}") == str(CBWR_AUTO)
    # the mode holds through computation (nothing switches it back)
    assert _python(f"import qkov, torch; torch.ones(64, 64) @ torch.ones(64, 64); {GETTER}") == str(CBWR_AUTO)


@needs_mkl
def test_a_run_where_mkl_computed_before_qkov_was_imported_says_its_resume_may_not_be_exact(
    computed_first: dict[str, Any], tmp_path: Path, small_corpus: Path
) -> None:
    assert BLAS_NOT_REPRODUCIBLE in computed_first["said"]
    assert BLAS_NOT_REPRODUCIBLE not in _train_one_step("", tmp_path / "run", small_corpus)["said"]


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one thread: no worker threads to disagree")
def test_training_flushes_denormals_in_every_thread_even_if_torch_started_its_threads_before(
    computed_first: dict[str, Any],
) -> None:
    assert computed_first["threads"] >= 2
    assert computed_first["kept"] == [0, 0], "main thread, worker thread: denormals each keeps after training"


# ------------------------------------------------------------------ the same bits in every process
def _tensors_of(run: Path) -> dict[str, torch.Tensor]:
    """Every tensor a run wrote: its training state, model and snapshots."""
    out = {f"state/{k}": v for k, v in load_file(str(run / "train_state.safetensors")).items()}
    out.update({f"model/{k}": v for k, v in load_file(str(run / "model.safetensors")).items()})
    for snap in sorted((run / "snapshots").glob("*.safetensors")):
        out.update({f"{snap.name}/{k}": v for k, v in load_file(str(snap)).items()})
    return out


def _differ(a: Path, b: Path) -> list[str]:
    ta, tb = _tensors_of(a), _tensors_of(b)
    assert ta.keys() == tb.keys()
    return [k for k in ta if not torch.equal(ta[k], tb[k])]


FRESH_FLAGS = dict(steps=12, ckpt_interval=6, eval_interval=6, snapshots="1,2,6")


def test_the_same_training_in_fresh_processes_under_load_gives_the_same_bits(
    tmp_path: Path, small_corpus: Path
) -> None:
    """Six fresh ``python -m qkov train`` of one seed, three at a time beside a process that keeps a
    core busy (the first step's loss is where MKL's vector math used to pick its kernel): every
    tensor of every state, model and snapshot equal."""
    flags = [*train_flags(corpus=small_corpus, **FRESH_FLAGS)]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    env.pop("MKL_CBWR", None)

    def start(out: Path) -> subprocess.Popen[str]:
        argv = [sys.executable, "-m", "qkov", "train", *flags, "--out", str(out)]
        return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)

    first = start(tmp_path / "r0")  # alone: it fills the token cache the others read
    assert first.wait(timeout=600) == 0, first.stderr.read() if first.stderr else ""
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        for wave in ((1, 2, 3), (4, 5, 6)):
            procs = {i: start(tmp_path / f"r{i}") for i in wave}
            for i, proc in procs.items():
                _, err = proc.communicate(timeout=600)
                assert proc.returncode == 0, (i, err[-2000:])
    finally:
        busy.kill()
        busy.wait()
    odd = {i: _differ(tmp_path / "r0", tmp_path / f"r{i}") for i in range(1, 7)}
    assert not any(odd.values()), {i: d[:4] for i, d in odd.items() if d}


OPS_BY_MKL = """
import json, sys, torch
x = torch.linspace(0.013, 0.987, 40000)
out = {}
for name in sys.argv[1].split(","):
    fn = getattr(torch, name)
    for dtype in (torch.float32, torch.float64):
        out[f"{name}/{dtype}"] = fn(x.to(dtype)).double().sum().item()
print(json.dumps(out))
"""
CANDIDATES = (
    "exp exp2 expm1 log log2 log10 log1p sqrt rsqrt sin cos tan asin acos atan sinh cosh tanh asinh atanh erf erfc "
    "erfinv sigmoid lgamma digamma abs trunc ceil floor round reciprocal neg"
).split()


@needs_mkl
def test_every_unary_op_mkl_computes_is_settled_when_qkov_is_imported() -> None:
    """The ops whose results change when MKL is made to use other instructions (so MKL computes them)
    are all among the functions :func:`qkov.device.settle_vector_math` calls first on one thread."""
    def run(isa: str | None) -> dict[str, float]:
        env = {k: v for k, v in os.environ.items() if k not in ("MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR")}
        if isa:
            env["MKL_ENABLE_INSTRUCTIONS"] = isa
        argv = [sys.executable, "-c", OPS_BY_MKL, ",".join(CANDIDATES)]
        res = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
        assert res.returncode == 0, res.stderr[-2000:]
        return json.loads(res.stdout)

    base = run(None)
    by_mkl = {key.split("/")[0] for isa in ("SSE4_2", "AVX2") for key, v in run(isa).items() if v != base[key]}
    assert {"exp", "log"} <= by_mkl  # the probe finds MKL at all
    assert by_mkl <= set(VECTOR_MATH), sorted(by_mkl - set(VECTOR_MATH))


# ------------------------------------------------------------------ what a resume can promise
def _rewrite_environment(state: Path, **changes: Any) -> None:
    with safe_open(str(state), "pt") as fh:
        meta = dict(fh.metadata())
    extra = json.loads(meta["extra"])
    extra["environment"] = {**extra["environment"], **changes}
    meta["extra"] = json.dumps(extra)
    save_file(load_file(str(state)), str(state), metadata=meta)


def test_a_state_records_what_its_bits_depend_on_and_a_resume_elsewhere_says_so(
    tmp_path: Path, small_corpus: Path
) -> None:
    run = tmp_path / "run"
    cfg = tiny_train(small_corpus, steps=8, ckpt_interval=4, eval_interval=4, snapshots=0)
    qkov.train(run, TINY, cfg, device="cpu", stop_after=4)
    with safe_open(str(run / "train_state.safetensors"), "pt") as fh:
        env = json.loads(fh.metadata()["extra"])["environment"]
    assert env["torch"] == torch.__version__ and env["threads"] == torch.get_num_threads()
    assert env["device"] == "cpu" and env["precision"] == "fp32" and env["world"] == 1
    assert env["cpu_capability"] == torch.backends.cpu.get_cpu_capability() and "numpy" in env
    with warnings.catch_warnings():
        warnings.simplefilter("error", QkovWarning)  # the same process's resume: nothing to say
        qkov.train(run, device="cpu", resume=True, stop_after=6)
    _rewrite_environment(run / "train_state.safetensors", threads=99, torch="0.0.1")
    with pytest.warns(QkovWarning, match=r"^resume: .*threads 99, now \d+.*not be the uninterrupted run's bit for bit"):
        qkov.train(run, device="cpu", resume=True)
    with safe_open(str(run / "train_state.safetensors"), "pt") as fh:  # the next state is this process's
        assert json.loads(fh.metadata()["extra"])["environment"]["threads"] == torch.get_num_threads()


def _cli(args: list[str], fault: str | None = None) -> int:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    env.pop("QKOV_FAULT", None)
    if fault:
        env["QKOV_FAULT"] = fault
    res = subprocess.run([sys.executable, "-m", "qkov", *args], capture_output=True, text=True, env=env, timeout=600)
    return res.returncode


@pytest.mark.parametrize("kills", [(7, 1), (12, 2, 1), (3, 9, 2)])
def test_a_run_killed_again_and_again_ends_as_the_uninterrupted_one(
    tmp_path: Path, small_corpus: Path, kills: tuple[int, ...]
) -> None:
    """Killed at atomic write ``k`` of each process in turn (a resumed process counts its own writes;
    (7, 1): the second process dies before its first checkpoint, so a third computes its steps again),
    resumed or restarted each time: the same bits as the run never killed, fresh processes throughout."""
    flags = train_flags(corpus=small_corpus, **{**FRESH_FLAGS, "ckpt_interval": 4})
    assert _cli(["train", *flags, "--out", str(tmp_path / "full")]) == 0
    out = tmp_path / "killed"
    for i, k in enumerate(kills):
        again = ["--resume", "--out", str(out)] if rundir.inspect(out) == "resumable" else [*flags, "--out", str(out)]
        assert _cli(["train", *again], fault=f"kill:{k}") == 137, (i, k)
    assert _cli(["train", "--resume", "--out", str(out)]) == 0
    assert not _differ(tmp_path / "full", out)
