"""What a bit-exact resume needs beyond the saved state: a CPU that computes the same way each time.

Every float32 matrix product on an x86 CPU is an MKL ``sgemm``; MKL promises bitwise equal
results from one run to the next only in its conditional numerical reproducibility (CNR) mode,
which is off unless asked for, and which it takes only before its first computation. Importing
qkov asks for it (:func:`qkov.device.reproducible_blas`); a run in a process where MKL computed
before qkov was imported says that its resume may not be exact. Training flushes denormal floats
in every thread (:func:`qkov.device.flush_denormals`), also in the worker threads of a process
that computed before training. ``benchmarks/bench_kills.py`` measures the whole property:
thousands of kills, each resume compared bit for bit with the uninterrupted run.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from qkov.training.loop import BLAS_NOT_REPRODUCIBLE

from helpers import TINY, tiny_train

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
