"""The induction-head phase change ([I]), found from a series of snapshots by stated methods.

**Window** (:func:`rise_window`). A metric ``y`` measured at snapshots ``t`` (tokens seen) is
smoothed (running median of 3, then a 1-2-1 running mean). Its *rise* ``R`` is the largest
increase of the smoothed curve, ``max over i <= j of s_j - s_i``. With ``R`` below the metric's
``min_rise`` there is no window (the metric never changed by a meaningful amount). Otherwise the
window is the shortest span of tokens over which the smoothed curve (linear between snapshots)
climbs ``share * R`` (default 80%): the part of training where the metric rises fastest. A rise
spread evenly over training is not a phase change: the window must also be ``sharpness`` times
steeper than the rise averaged over the whole series (default 2.5; a window that covers 80% of
a linear rise has sharpness 1). A decreasing metric (a loss, the ICL score) is passed negated.

**Loss bump** (:func:`loss_bump`). [I] sees the phase change as a bump in the loss curve. The
validation loss is fitted, in ``log t``, by a quadratic through the snapshots *outside* the
window and within a neighbourhood of it (from a quarter of its start to twice its end); the
bump is the largest excess of the loss over that fit inside the window, and counts as seen
when it is positive and above twice the fit's residual RMS.

**Trajectory** (:func:`pca_trajectory`). Each snapshot's per-token losses on a fixed validation
sample form a vector; the vectors are centred over snapshots and projected on their first
principal components ([I]'s figure: the trajectory turns at the phase change).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Sequence

import numpy as np

__all__ = [
    "Bump",
    "loss_bump",
    "pca_trajectory",
    "rise_window",
    "SHARE",
    "SHARPNESS",
    "smooth",
    "Trajectory",
    "Window",
]

SHARE = 0.8
SHARPNESS = 2.5


@dataclass
class Window:
    """Where a metric rises fastest: ``start``..``end`` in tokens, ``peak`` the steepest snapshot step."""

    start: float
    end: float
    peak: float
    rise: float  # R: the largest increase of the smoothed metric
    share: float  # the part of R the window climbs
    sharpness: float  # the window's slope over the whole series' mean slope (of R)

    def overlaps(self, other: "Window") -> bool:
        return self.start <= other.end and other.start <= self.end

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def smooth(y: Sequence[float]) -> np.ndarray:
    """Running median of 3, then a 1-2-1 running mean; the ends keep their own values' weight."""
    a = np.asarray(y, dtype=np.float64)
    if len(a) < 3:
        return a.copy()
    med = a.copy()
    med[1:-1] = np.median(np.stack([a[:-2], a[1:-1], a[2:]]), axis=0)
    out = med.copy()
    out[1:-1] = (med[:-2] + 2 * med[1:-1] + med[2:]) / 4
    return out


def _largest_rise(s: np.ndarray) -> float:
    low, best = s[0], 0.0
    for v in s[1:]:
        best = max(best, v - low)
        low = min(low, v)
    return best


def _cross(t: np.ndarray, s: np.ndarray, i: int, level: float, forward: bool) -> float | None:
    """Tokens where the piecewise-linear curve first reaches ``level`` going from snapshot ``i``
    forwards (rising to ``level``) or backwards (falling to ``level``)."""
    rng = range(i, len(s) - 1) if forward else range(i, 0, -1)
    for k in rng:
        a, b = (k, k + 1) if forward else (k, k - 1)
        if (s[b] >= level) if forward else (s[b] <= level):
            if s[b] == s[a]:
                return float(t[b])
            f = (level - s[a]) / (s[b] - s[a])
            return float(t[a] + min(1.0, max(0.0, f)) * (t[b] - t[a]))
    return None


def rise_window(
    tokens: Sequence[float],
    values: Sequence[float | None],
    *,
    min_rise: float,
    share: float = SHARE,
    sharpness: float = SHARPNESS,
) -> Window | None:
    """The window where ``values`` rise fastest (see the module docstring), or ``None``."""
    pairs = [(float(t), float(v)) for t, v in zip(tokens, values) if v is not None and np.isfinite(v)]
    if len(pairs) < 4:
        return None
    t = np.array([p[0] for p in pairs])
    s = smooth([p[1] for p in pairs])
    R = _largest_rise(s)
    if R < min_rise:
        return None
    need = share * R
    best: tuple[float, float] | None = None
    for i in range(len(s)):  # spans starting at a snapshot, and spans ending at one
        end = _cross(t, s, i, s[i] + need, forward=True)
        if end is not None and (best is None or end - t[i] < best[1] - best[0]):
            best = (float(t[i]), end)
        start = _cross(t, s, i, s[i] - need, forward=False)
        if start is not None and (best is None or t[i] - start < best[1] - best[0]):
            best = (start, float(t[i]))
    if best is None or best[1] <= best[0]:
        return None
    slope = need / (best[1] - best[0])
    mean_slope = R / (t[-1] - t[0])
    sharp = slope / mean_slope
    if sharp < sharpness:
        return None
    inside = [k for k in range(len(s) - 1) if t[k] >= best[0] - 1e-9 and t[k + 1] <= best[1] + 1e-9]
    steps = [(s[k + 1] - s[k]) / (t[k + 1] - t[k]) for k in range(len(s) - 1)]
    k = max(inside or range(len(steps)), key=lambda j: steps[j])
    return Window(best[0], best[1], float((t[k] + t[k + 1]) / 2), float(R), share, float(sharp))


@dataclass
class Bump:
    """The loss's largest excess over a smooth fit inside the window (see the module docstring)."""

    height: float  # nats above the fit
    at: float  # tokens
    noise: float  # residual RMS of the fit outside the window
    seen: bool
    fit_tokens: list[float]  # where the fit is drawn ...
    fit: list[float]  # ... and its values

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def loss_bump(
    tokens: Sequence[float], loss: Sequence[float | None], window: Window, *, until: float | None = None
) -> Bump | None:
    """The bump of the loss curve in ``window``; ``until``: ignore snapshots after these tokens
    (the learning-rate decay at the end of a run bends the curve for another reason)."""
    lo, hi = window.start / 4, window.end * 2
    pts = [
        (float(t), float(v))
        for t, v in zip(tokens, loss)
        if v is not None and t > 0 and lo <= t <= hi and (until is None or t <= until)
    ]
    fit_pts = [(t, v) for t, v in pts if not window.start <= t <= window.end]
    in_pts = [(t, v) for t, v in pts if window.start <= t <= window.end]
    if len(fit_pts) < 4 or not in_pts:
        return None
    x = np.log([p[0] for p in fit_pts])
    coef = np.polyfit(x, [p[1] for p in fit_pts], 2)
    noise = float(np.sqrt(np.mean((np.polyval(coef, x) - [p[1] for p in fit_pts]) ** 2)))
    excess = [(v - float(np.polyval(coef, np.log(t))), t) for t, v in in_pts]
    height, at = max(excess)
    grid = [p[0] for p in pts]
    fit = [float(np.polyval(coef, np.log(g))) for g in grid]
    return Bump(height, at, noise, bool(height > 0 and height > 2 * noise), grid, fit)


@dataclass
class Trajectory:
    """Per-token-loss vectors projected on their first principal components."""

    components: list[list[float]]  # [snapshot][component]
    explained: list[float]  # variance share of each component

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def pca_trajectory(per_token: Sequence[Sequence[float]], k: int = 2) -> Trajectory | None:
    """Project ``per_token [snapshots, tokens]`` (centred over snapshots) on its top ``k`` components."""
    X = np.asarray(per_token, dtype=np.float64)
    if X.ndim != 2 or X.shape[0] < 3 or X.shape[1] < 2:
        return None
    X = X - X.mean(axis=0, keepdims=True)
    U, S, _ = np.linalg.svd(X, full_matrices=False)
    total = float((S**2).sum()) or 1.0
    k = min(k, len(S))
    proj = U[:, :k] * S[:k]
    return Trajectory(proj.tolist(), [float(v**2 / total) for v in S[:k]])
