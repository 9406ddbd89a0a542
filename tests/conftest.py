"""Shared fixtures: a small text corpus, an isolated token cache, seeded random generators."""

from __future__ import annotations

import random
import shutil
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

# A handful of standard-library modules: real Python source, small enough to train on in seconds.
SMALL_CORPUS_MODULES = [
    "abc.py",
    "bisect.py",
    "calendar.py",
    "colorsys.py",
    "copy.py",
    "dataclasses.py",
    "fnmatch.py",
    "fractions.py",
    "functools.py",
    "glob.py",
    "heapq.py",
    "keyword.py",
    "numbers.py",
    "operator.py",
    "queue.py",
    "random.py",
    "shlex.py",
    "string.py",
    "textwrap.py",
    "types.py",
]


@pytest.fixture(autouse=True)
def _seeded_rng() -> None:
    """Every test starts from the same global RNG state, so a test that draws random numbers
    without its own generator is still reproducible (and fails the same way twice)."""
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QKOV_CACHE", str(tmp_path_factory.getbasetemp() / "qkov-cache"))


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = Path(sysconfig.get_paths()["stdlib"])
    out = tmp_path_factory.mktemp("corpus")
    for name in SMALL_CORPUS_MODULES:
        shutil.copy(root / name, out / name)
    return out


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Slow tests (full default training runs) run only when asked for: ``pytest -m slow``."""
    if "slow" in (config.getoption("markexpr") or ""):
        return
    keep = [i for i in items if "slow" not in i.keywords]
    dropped = [i for i in items if "slow" in i.keywords]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep
