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


def test_rounded_array_is_rounded_entry_for_entry() -> None:
    """The array form gives every entry the float :func:`rounded` gives (ties of the decimal, tiny, huge, zero
    with its sign, values whose scaling by 10^d is inexact, float32 probabilities), and NaN where it gives None."""
    import numpy as np

    from qkov.finite import rounded_array

    rng = np.random.default_rng(0)
    values = np.concatenate([
        rng.standard_normal(20000) * 10.0 ** rng.integers(-40, 40, 20000),
        rng.random(20000).astype(np.float32).astype(np.float64),
        np.round(rng.random(20000), 4),  # decimal ties at 3 digits, most not exact in binary
        np.array([0.0, -0.0, 0.1235, 0.1245, 2.5, 0.125, 999.5, 0.9995, 0.09999999999999999, 5e-324, 1e308, -1e23]),
        np.array([math.nan, math.inf, -math.inf]),
    ])  # fmt: skip
    for digits in (1, 3, 4):
        got = rounded_array(values.reshape(-1, 3), digits).ravel().tolist()
        for g, v in zip(got, values.tolist()):
            want = rounded(v, digits)
            if want is None:
                assert math.isnan(g), v
            else:
                assert g == want and math.copysign(1, g) == math.copysign(1, want), (v, digits, g, want)


def test_indented_json_reads_back_the_same_with_flat_lists_on_one_line() -> None:
    data = {"a": {"b": [1, 2.5, math.nan], "c": [], "d": {}, "e": [{"x": "é"}, [1, [2]]]}, 3: (1.5, None), "s": "x"}
    text = to_json(data, indent=1)
    assert strict(text) == json.loads(json.dumps(json_safe(data), indent=1))
    assert '\n  "b": [1, 2.5, null],\n' in text and "é" in text and text.startswith('{\n "a": {\n')


def test_every_json_output_goes_through_it(capsys: pytest.CaptureFixture[str]) -> None:
    from qkov.apps.cli.common import dump_json
    from qkov.apps.explore.jobs import encode_result
    from qkov.apps.explore.views_card import r6

    data = {"score": math.nan, "rows": [{"v": math.inf}, {"v": 0.5}]}
    dump_json(data)
    assert strict(capsys.readouterr().out) == {"score": None, "rows": [{"v": None}, {"v": 0.5}]}
    assert strict(encode_result(data).decode()) == {"score": None, "rows": [{"v": None}, {"v": 0.5}]}
    assert r6(math.nan) is None and r6(2 / 3) == 0.666667
