"""One place makes numbers JSON can carry (qkov.finite): NaN and infinities become null, everywhere
JSON is written (the report, the explorer, every ``--json``), read back by a strict parser."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch

from qkov.finite import finite, json_safe, rounded, to_json


def strict(text: str) -> Any:
    """JSON as a strict parser reads it: NaN, Infinity and -Infinity are refused."""

    def refuse(name: str) -> Any:
        raise ValueError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def test_finite_and_rounded() -> None:
    assert finite(None) is None and finite(math.nan) is None and finite(-math.inf) is None
    assert finite(3) == 3.0 and isinstance(finite(3), float) and finite(torch.tensor(0.25)) == 0.25
    assert rounded(math.pi, 4) == 3.142 and rounded(-123456.7, 2) == -120000.0 and rounded(1e-7 / 3, 3) == 3.33e-8
    assert rounded(math.inf, 4) is None and rounded(None, 4) is None


def test_json_safe_reaches_every_float_and_keeps_the_rest() -> None:
    data = {"a": math.nan, 1: [math.inf, (1.234567, -math.inf)], "n": 7, "s": "nan", "t": True, "z": None}
    assert json_safe(data) == {"a": None, "1": [None, [1.234567, None]], "n": 7, "s": "nan", "t": True, "z": None}
    assert json_safe(data, digits=3)["1"][1][0] == 1.23
    assert strict(to_json(data)) == json_safe(data)
    assert strict(to_json(data, compact=True)) == json_safe(data) and ", " not in to_json(data, compact=True)
    with pytest.raises(ValueError, match="not JSON"):
        strict(json.dumps({"a": math.nan}))  # what a plain json.dumps would have written


def test_every_json_output_goes_through_it(capsys: pytest.CaptureFixture[str]) -> None:
    from qkov.apps.cli.common import dump_json
    from qkov.apps.explore.jobs import encode_result
    from qkov.apps.explore.views_card import r6

    data = {"score": math.nan, "rows": [{"v": math.inf}, {"v": 0.5}]}
    dump_json(data)
    assert strict(capsys.readouterr().out) == {"score": None, "rows": [{"v": None}, {"v": 0.5}]}
    assert strict(encode_result(data).decode()) == {"score": None, "rows": [{"v": None}, {"v": 0.5}]}
    assert r6(math.nan) is None and r6(2 / 3) == 0.666667
