"""``qkov patch``: activation, attribution and path patching between a clean and a corrupted input."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.table import Table

from ...analysis.causal.studies import patch_study
from ...analysis.causal.patching import DIRECTIONS, PatchResult, largest
from ...analysis.causal.path_patch import INPUTS
from ...errors import QkovError
from ...weights.view import Weights
from ..inputs import patching_inputs
from ..progress import StageProgress
from .common import add_device, add_source_args, console, device, dump_json, load_source, parse_head

GRID_COLUMNS = 16  # a (layer x head) result with at most this many columns prints as a grid


def add_patch(sub: Any) -> None:
    p = sub.add_parser(
        "patch",
        help="activation, attribution and path patching between a clean and a corrupted input",
        description=(
            "Run the corrupted input with one activation at a time taken from the clean run (denoising; "
            "--direction noise does the reverse) and measure the metric: the residual stream by layer and "
            "position, every head's output by layer and head, and their first-order estimate from one "
            "backward pass (attribution patching) with its agreement. --receivers adds path patching: "
            "every earlier head's path into those heads' query, key or value input (or into the logits). "
            "Inputs are a text file (one sequence per line, each started with the start token) or token "
            "ids (.npy, .bin, or a text of integers); clean and corrupted must have the same shape."
        ),
    )
    add_source_args(p)
    p.add_argument("--clean", required=True, type=Path, metavar="FILE", help="the clean input: text or token ids")
    p.add_argument("--corrupted", required=True, type=Path, metavar="FILE", help="the corrupted input, same shape")
    p.add_argument(
        "--metric",
        default="loss",
        help="loss (default: the loss on the clean tokens), logit-diff:A,B (last position) or prob:T; tokens "
        "as ids or as strings of one token, spaces included ('logit-diff: Mary, John')",
    )
    p.add_argument(
        "--site",
        default="resid_pre,head_out",
        help="comma-separated site kinds to patch by layer (default resid_pre,head_out; e.g. attn_out, "
        "mlp_out, z, pattern, q; docs/interventions.md lists them)",
    )
    p.add_argument("--by-pos", action="store_true", help="sweep head sites by position too (layer x pos x head)")
    p.add_argument("--receivers", help="path patching into these heads (LAYER.HEAD, comma-separated) or 'logits'")
    p.add_argument("--input", choices=INPUTS, default="k", help="the receivers' input the paths enter (default k)")
    p.add_argument("--direction", choices=DIRECTIONS, default="denoise", help="denoise (default) or noise")
    p.add_argument("--no-attribution", action="store_true", help="skip attribution patching")
    add_device(p, memory=False)  # patching's chunks are fixed in size: no budget it could honour
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.set_defaults(func=cmd_patch)


def cmd_patch(args: argparse.Namespace) -> int:
    dev = device(args)
    model = load_source(args, "patch", ": nothing to patch")
    given = patching_inputs(model, args.clean, args.corrupted, args.metric, dev)
    receivers = _receivers(args.receivers, model.cfg)
    sites = [s.strip() for s in args.site.split(",") if s.strip()]
    if not sites and receivers is None:
        raise QkovError("nothing to patch: give --site or --receivers")
    w = Weights.from_model(model.to(dev))
    clean = given.clean
    with StageProgress() as progress:
        study = patch_study(
            w, clean, given.corrupted, metric=given.metric, sites=sites, by_pos=args.by_pos,
            receivers=receivers, input=args.input, direction=args.direction,
            attribution=not args.no_attribution, decode=given.decode, progress=progress,
        )  # fmt: skip
    if args.json:
        dump_json({"clean": str(args.clean), "corrupted": str(args.corrupted), **study.to_dict()})
        return 0
    con = console()
    con.print(f"clean {args.clean}, corrupted {args.corrupted}: {clean.shape[0]} x {clean.shape[1]} tokens")
    for r in study.results:
        agree = study.agreement.get(r.site) if r.method == "attribution" else None
        con.print(
            f"\n[bold]{r.method} patching[/bold] of {r.site} by {' x '.join(r.axes)} ({r.direction}); {r.metric}: "
            f"clean {r.clean:.4g}, corrupted {r.corrupted:.4g}"
            + ("" if agree is None else f"; agreement with activation patching r = {agree:.3f}")
        )
        if abs(r.target - r.base) < 1e-3 * max(1.0, abs(r.clean)):
            con.print(f"the clean and corrupted runs give almost the same metric ({r.target - r.base:+.2g}): shares are unstable")
        con.print(_table(r))
    return 0


def _receivers(text: str | None, cfg: Any) -> Any:
    if text is None:
        return None
    if text.strip() == "logits":
        return "logits"
    return [parse_head(h.strip(), cfg) for h in text.split(",") if h.strip()]


def _table(r: PatchResult) -> Table:
    """A (layer x head) grid of the share of the way each patch moves the metric, or the largest effects."""
    if r.axes == ("layer", "head") and r.values.shape[1] <= GRID_COLUMNS and r.target != r.base:
        t = Table(caption="share of the way from the base run's metric to the source run's, %")
        t.add_column("layer")
        for h in range(r.values.shape[1]):
            t.add_column(f"head {h}", justify="right")
        for l, row in enumerate(r.normalized().tolist()):
            t.add_row(str(l), *("-" if v != v else f"{100 * v:.0f}" for v in row))
        return t
    t = Table(caption="the patches that move the metric most")
    for col in ("where", "metric", "share of the way"):
        t.add_column(col)
    for where, v, n in largest(r, 12):
        t.add_row(where, f"{v:.4g}", "-" if n != n else f"{n:+.1%}")
    return t
