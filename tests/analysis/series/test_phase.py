"""The phase-change methods on series whose answer is known."""

from __future__ import annotations

import numpy as np
import pytest

from qkov.analysis.series import phase as Ph
from qkov.training.snapshots import schedule

STEPS = 5000
T = np.array(schedule(STEPS, 40), dtype=float) * 4096  # the default run's snapshot tokens


def sigmoid(t: np.ndarray, centre: float, width: float) -> np.ndarray:
    return 1 / (1 + np.exp(-(t - centre) / width))


@pytest.mark.parametrize("centre", [4e6, 10e6, 15e6])
def test_a_sharp_rise_is_found_where_it_was_put(centre: float) -> None:
    rng = np.random.default_rng(0)
    y = 0.02 + 0.4 * sigmoid(T, centre, 0.5e6) + rng.normal(0, 0.005, len(T))
    w = Ph.rise_window(T, y, min_rise=0.1)
    assert w is not None
    assert w.start < centre < w.end and w.end - w.start < 4e6, w
    assert abs(w.peak - centre) < 1.5e6 and w.rise == pytest.approx(0.4, abs=0.05) and w.sharpness > 2.5


def test_no_change_a_small_change_or_an_even_rise_gives_no_window() -> None:
    rng = np.random.default_rng(1)
    assert Ph.rise_window(T, 0.3 + rng.normal(0, 0.01, len(T)), min_rise=0.1) is None  # noise only
    assert Ph.rise_window(T, 0.02 + 0.05 * sigmoid(T, 1e7, 5e5), min_rise=0.1) is None  # too small a change
    assert Ph.rise_window(T, 0.4 * T / T[-1], min_rise=0.1) is None  # an even rise: not a phase change
    assert Ph.rise_window(T[:3], [0, 1, 2], min_rise=0.1) is None  # too few snapshots


def test_a_falling_metric_is_passed_negated() -> None:
    icl = -0.15 * sigmoid(T, 9e6, 4e5)  # the ICL score drops when in-context learning appears
    assert Ph.rise_window(T, icl, min_rise=0.05) is None
    w = Ph.rise_window(T, -icl, min_rise=0.05)
    assert w is not None and w.start < 9e6 < w.end


def test_the_loss_bump_is_measured_against_a_fit_outside_the_window() -> None:
    base = 2.2 + 8 / np.log(T[1:])  # a smooth loss curve in log tokens
    bump = 0.05 * np.exp(-(((T[1:] - 9e6) / 6e5) ** 2))
    win = Ph.Window(7.5e6, 1.05e7, 9e6, 0.3, 0.8, 4.0)
    b = Ph.loss_bump(T[1:], base + bump, win)
    assert b is not None and b.seen and b.height == pytest.approx(0.05, abs=0.01) and abs(b.at - 9e6) < 1e6
    flat = Ph.loss_bump(T[1:], base, win)
    assert flat is not None and not flat.seen and abs(flat.height) < 0.01


def test_pca_finds_the_turn_of_a_two_phase_trajectory() -> None:
    rng = np.random.default_rng(2)
    a, b = rng.normal(size=300), rng.normal(size=300)
    s = np.linspace(0, 1, 30)
    X = [np.minimum(x, 0.5) * a + np.maximum(x - 0.5, 0) * b for x in s]  # along a, then along b
    tr = Ph.pca_trajectory(X)
    assert tr is not None and sum(tr.explained) > 0.99
    pts = np.array(tr.components)
    d1, d2 = pts[14] - pts[0], pts[-1] - pts[15]
    cos = abs(d1 @ d2) / np.linalg.norm(d1) / np.linalg.norm(d2)
    assert cos < 0.2  # the two legs are nearly perpendicular, as a and b are
