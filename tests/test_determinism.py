"""What a bit-exact resume needs beyond the saved state: a CPU BLAS that repeats itself.

Every float32 matrix product on an x86 CPU is an MKL ``sgemm``; MKL promises bitwise equal
results from one run to the next only in its conditional numerical reproducibility (CNR) mode,
which is off unless asked for, and which it takes only before its first computation. Importing
qkov asks for it (:func:`qkov.device.reproducible_blas`); a run in a process where MKL computed
before qkov was imported says that its resume may not be exact. ``benchmarks/bench_kills.py``
measures the whole property: thousands of kills, each resume compared bit for bit.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

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


def _python(code: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout.strip().splitlines()[-1]


GETTER = _mkl_mode_getter()
needs_mkl = pytest.mark.skipif(GETTER is None, reason="torch here has no MKL (nothing to make reproducible)")


@needs_mkl
def test_importing_qkov_switches_mkl_to_its_reproducible_mode() -> None:
    assert GETTER is not None
    assert _python(f"import torch; {GETTER}") == str(CBWR_BRANCH_OFF), "MKL's default: CNR off"
    assert _python(f"import qkov; {GETTER}") == str(CBWR_AUTO)
    # the mode holds through training (nothing switches it back)
    assert _python(f"import qkov, torch; torch.ones(64, 64) @ torch.ones(64, 64); {GETTER}") == str(CBWR_AUTO)


@needs_mkl
def test_a_run_where_mkl_computed_before_qkov_was_imported_says_its_resume_may_not_be_exact(
    tmp_path: Path, small_corpus: Path
) -> None:
    train = (
        "import json, qkov; from qkov import ModelConfig, TrainConfig; said = []; "
        f"qkov.train({str(tmp_path)!r} + '/' + NAME, ModelConfig.from_dict({TINY.to_dict()!r}), "
        f"TrainConfig.from_dict({tiny_train(small_corpus, steps=1).to_dict()!r}), device='cpu', "
        "callback=lambda e: said.append(e.get('text')) if e['event'] == 'message' else None); "
        "print(json.dumps(said))"
    )
    late = json.loads(_python("import torch; torch.ones(64, 64) @ torch.ones(64, 64); NAME = 'late'; " + train))
    assert BLAS_NOT_REPRODUCIBLE in late
    first = json.loads(_python("NAME = 'first'; " + train))
    assert BLAS_NOT_REPRODUCIBLE not in first
