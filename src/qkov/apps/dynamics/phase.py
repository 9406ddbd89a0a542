"""The tour's phase-change section: [I]'s three dynamic claims judged from ``qkov dynamics`` results,
and the data of the 2-layer and 1-layer runs' curves (window shaded) that the tour page draws;
:func:`svg_dynamics` draws the same curves as static SVG (a notebook display of a dynamics result).
"""

from __future__ import annotations

import html
from typing import Any

from ..claims import Claim

__all__ = ["COLORS", "LABELS", "phase_charts", "phase_claims", "RANDOM_REMOVED", "REMOVED", "svg_dynamics"]

REMOVED = 0.5  # ablating the induction heads must remove most (at least half) of the in-context improvement ...
RANDOM_REMOVED = 0.5  # ... and a typical random set of as many heads (the median over draws) less than half


def _window(dyn: dict[str, Any], key: str) -> dict[str, Any] | None:
    return dyn["reading"]["windows"].get(key)


def _span(w: dict[str, Any] | None) -> str:
    return "none" if w is None else f"{w['start'] / 1e6:.2f}M-{w['end'] / 1e6:.2f}M tokens"


def phase_claims(two: dict[str, Any] | None, one: dict[str, Any] | None) -> list[Claim]:
    """The three claims of the tour's phase-change section (a claim whose run is missing is left out)."""
    out: list[Claim] = []
    if two is not None:
        ind, prev, icl = (_window(two, k) for k in ("induction", "previous_token", "icl"))
        out.append(
            Claim(
                "2-layer: induction heads, the previous-token head and the in-context-learning improvement "
                "appear in the same narrow window of training (the phase change)",
                f"windows: induction {_span(ind)}, previous-token {_span(prev)}, ICL {_span(icl)}",
                bool(two["reading"]["together"]),
                {"induction": ind, "previous_token": prev, "icl": icl},
                "each metric has a window (qkov dynamics: the shortest span climbing 80% of its rise, at least "
                "2.5x steeper than average) and the previous-token and ICL windows overlap the induction window",
            )
        )
    if one is not None:
        ws = {k: _window(one, k) for k in ("induction", "icl")}
        out.append(
            Claim(
                "1-layer: no such window (a one-layer model cannot form induction heads)",
                f"windows: best-head induction score {_span(ws['induction'])}, ICL {_span(ws['icl'])}",
                ws["induction"] is None and ws["icl"] is None,
                ws,
                "the same method finds no window in the induction score nor in the in-context improvement",
            )
        )
    if two is not None:
        out.append(_ablation_claim(two))
    return out


def _ablation_claim(two: dict[str, Any]) -> Claim:
    claim = (
        "2-layer: ablating the induction heads removes most of the in-context-learning advantage; ablating "
        "random heads does not"
    )
    ab = two.get("ablation")
    if ab is None or ab["icl_removed"] is None:
        why = "no induction heads to ablate" if ab is None else "the intact model shows no in-context improvement"
        return Claim(claim, why, False, {"ablation": ab}, "needs induction heads and a negative ICL score")
    removed, rand, mean = ab["icl_removed"], ab.get("random_icl_removed_median"), ab["random_icl_removed"]
    holds = removed >= REMOVED and (rand is None or rand < RANDOM_REMOVED)
    pct = lambda v: "n/a" if v is None else f"{v:.0%}"  # noqa: E731
    return Claim(
        claim,
        f"{ab['mode']} ablation of {', '.join(ab['heads'])}: ICL {ab['intact']['icl']:+.3f} -> "
        f"{ab['ablated']['icl']:+.3f} ({removed:.0%} of the improvement removed); {len(ab['random'])} random "
        f"sets of as many heads ({'; '.join(', '.join(h) for h in ab['random_heads'])}): median {pct(rand)}, "
        f"mean {pct(mean)} removed",
        holds,
        {"icl_removed": removed, "random_icl_removed_median": rand, "random_icl_removed": mean, "heads": ab["heads"]},
        f"the induction heads remove >= {REMOVED:.0%} of the improvement (-ICL) and the median random set "
        f"< {RANDOM_REMOVED:.0%} (a random set that holds the previous-token head, part of the induction circuit, "
        "removes much: the mean is shown too)",
    )


COLORS = {"induction": "#d3562f", "previous_token": "#2a9d5b", "icl": "#3056d3"}
LABELS = {"induction": "induction score", "previous_token": "previous-token score", "icl": "ICL improvement"}


def svg_dynamics(dyn: dict[str, Any], *, title: str, icl_top: float = 0.2, width: int = 560, height: int = 300) -> str:
    """The run's induction and previous-token scores (attention, on 0..1) and its in-context
    improvement (``max(0, -ICL)``, on 0..``icl_top`` nats) over tokens, with the induction window
    shaded, as inline SVG. Fixed scales, so that charts of different runs compare."""
    snaps = dyn["snapshots"]
    xs = [s["at"] for s in snaps]
    L, R, T, B = 50, 170, 30, 40
    x_hi = max(xs) or 1.0
    fx = lambda x: L + (width - L - R) * x / x_hi  # noqa: E731
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-size="12">']
    parts.append(f'<text x="{(width - R + L) / 2}" y="18" text-anchor="middle">{html.escape(title)}</text>')
    w = _window(dyn, "induction")
    if w is not None:
        x0, x1 = fx(w["start"]), fx(w["end"])
        parts.append(
            f'<rect class="window" x="{x0:.1f}" y="{T}" width="{max(1.0, x1 - x0):.1f}" '
            f'height="{height - T - B}" fill="#d3562f" opacity="0.12"/>'
        )
    parts.append(f'<line x1="{L}" y1="{height - B}" x2="{width - R}" y2="{height - B}" stroke="#999"/>')
    parts.append(f'<line x1="{L}" y1="{T}" x2="{L}" y2="{height - B}" stroke="#999"/>')
    for frac in (0.0, 0.5, 1.0):
        tick = f"{frac * x_hi / 1e6:.0f}M"
        parts.append(f'<text x="{fx(frac * x_hi):.1f}" y="{height - B + 15}" text-anchor="middle">{tick}</text>')
        y = T + (height - T - B) * (1 - frac)
        parts.append(f'<text x="{L - 6}" y="{y + 4:.1f}" text-anchor="end">{frac:g}</text>')
    parts.append(f'<text x="{(L + width - R) / 2}" y="{height - 6}" text-anchor="middle">tokens seen</text>')
    row = 0
    for key, field, top in (
        ("induction", "induction", 1.0),
        ("previous_token", "previous_token", 1.0),
        ("icl", "icl_improvement", icl_top),
    ):
        ys = [s.get(field) for s in snaps]
        vals = [y for y in ys if y is not None]
        if not vals:
            continue
        fy = lambda y: T + (height - T - B) * (1 - min(1.0, max(0.0, y / top)))  # noqa: E731
        pts = " ".join(f"{fx(x):.1f},{fy(y):.1f}" for x, y in zip(xs, ys) if y is not None)
        c = COLORS[key]
        scale = "0 .. 1 (left axis)" if top == 1.0 else f"0 .. {top:.2f} nats"
        parts.append(f'<polyline fill="none" stroke="{c}" stroke-width="1.5" points="{pts}"/>')
        parts.append(f'<text x="{width - R + 8}" y="{T + 30 * row + 10}" fill="{c}">{LABELS[key]}</text>')
        parts.append(f'<text x="{width - R + 8}" y="{T + 30 * row + 24}" fill="{c}">{scale}</text>')
        row += 1
    parts.append("</svg>")
    return "".join(parts)


def phase_charts(runs: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The data of the section's charts, one per run (the 2-layer first), as the tour page draws
    them: each run's detectors over tokens seen, its induction window, the link to its dynamics
    page; ``icl_top`` is the in-context improvement's scale, one for every chart."""
    icl = [s.get("icl_improvement") or 0.0 for d in runs.values() for s in d["snapshots"]]
    charts = []
    for n in sorted(runs, reverse=True):
        dyn = runs[n]
        w = _window(dyn, "induction")
        snaps = dyn["snapshots"]
        charts.append(
            {
                "layers": n,
                "link": f"qkov-{n}l/dynamics/index.html",
                "window": None if w is None else {"start": w["start"], "end": w["end"]},
                "span": _span(w),
                "axis": dyn.get("axis", "tokens"),
                "at": [s["at"] for s in snaps],
                **{key: [s.get(key) for s in snaps] for key in ("induction", "previous_token", "icl_improvement")},
            }
        )
    return {"icl_top": max(0.2, max(icl, default=0.0)), "runs": charts}
