"""Every planted bug of scripts/check_tests_bite.py still plants: its text occurs exactly once in its file
and its tests exist. The script itself runs the tests (minutes); this keeps its entries from going stale
when the code they name is rewritten (three had, unnoticed, before this test)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _bugs() -> dict:
    spec = importlib.util.spec_from_file_location("check_tests_bite", ROOT / "scripts" / "check_tests_bite.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.BUGS


def test_every_planted_bug_matches_its_code_once_and_names_real_tests() -> None:
    stale = []
    for name, (where, old, new, tests) in _bugs().items():
        path = ROOT / "src" / "qkov" / where
        count = path.read_text().count(old) if path.exists() else -1
        if count != 1 or old == new:
            stale.append(f"{name}: its text occurs {count} times in {where}")
        for test in tests.split():
            file, _, func = test.partition("::")  # a whole file, or one test in it
            there = (ROOT / file).exists()
            if not there or (func and f"def {func.split('[')[0]}(" not in (ROOT / file).read_text()):
                stale.append(f"{name}: no test {test}")
    assert not stale, "\n".join(stale)
