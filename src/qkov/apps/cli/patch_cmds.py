"""``qkov patch``: the registered sweeps of a patching study (activation, attribution and path patching,
and any sweep registered since) between a clean and a corrupted input. Each sweep's options are flags
here, made from their one declaration (:mod:`qkov.analysis.causal.registry`)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.table import Table

from ...analysis.causal.contrast import DIRECTIONS
from ...analysis.causal.registry import SWEEPS, Option, study_options
from ...analysis.causal.result import PatchResult, largest
from ...analysis.causal.studies import patch_study
from ..inputs import patching_inputs
from ..progress import StageProgress
from .common import add_device, add_source_args, console, device, dump_json, load_view

__all__ = ["add_patch", "cmd_patch", "GRID_COLUMNS", "GRID_LABEL"]

GRID_COLUMNS = 16  # a two-axis result with at most this many columns prints as a grid ...
GRID_LABEL = 4  # ... when each column's label is at most this long (heads and layers, not token positions)


def add_patch(sub: Any) -> None:
    sweeps = "; ".join(f"{s.name}: {s.summary}" for s in SWEEPS.values())
    p = sub.add_parser(
        "patch",
        help="activation, attribution and path patching between a clean and a corrupted input",
        description=(
            "Run the corrupted input with one activation at a time taken from the clean run (denoising; "
            "--direction noise does the reverse) and measure the metric: the residual stream by layer and "
            "position, every head's output by layer and head, and their first-order estimate from one "
            "backward pass (attribution patching) with its agreement. --receivers adds path patching: "
            "every earlier head's path into those heads' query, key or value input (or into the logits). "
            f"The sweeps: {sweeps}. "
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
        "as ids or as words of one token, with or without their leading space ('logit-diff:Tim,Lily')",
    )
    for opt in study_options().values():
        _add_option(p, opt)
    p.add_argument("--direction", choices=DIRECTIONS, default="denoise", help="denoise (default) or noise")
    add_device(p, memory=False)  # patching's chunks are fixed in size: no budget it could honour
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.set_defaults(func=cmd_patch)


def _add_option(p: argparse.ArgumentParser, opt: Option) -> None:
    """``opt`` as a flag: a switch (``--by-pos``, ``--no-attribution``) or a value read by the option."""
    dest = f"opt_{opt.name}"
    if opt.switch:
        p.add_argument(opt.cli_flag, dest=dest, action="store_false" if opt.default else "store_true", help=opt.help)
    else:
        choices = opt.choices or None
        metavar = opt.metavar or (None if choices else opt.cli_flag.lstrip("-").replace("-", "_").upper())
        p.add_argument(opt.cli_flag, dest=dest, default=None, choices=choices, metavar=metavar, help=opt.help)


def cmd_patch(args: argparse.Namespace) -> int:
    dev = device(args)
    w = load_view(args, "patch", ": nothing to patch", dev)  # read once: the view, no model beside it
    given = patching_inputs(w, args.clean, args.corrupted, args.metric, dev)
    options = {name: _flag_value(opt, getattr(args, f"opt_{name}")) for name, opt in study_options().items()}
    clean = given.clean
    with StageProgress() as progress:
        study = patch_study(
            w, clean, given.corrupted, metric=given.metric, direction=args.direction, decode=given.decode,
            progress=progress, **options,
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


def _flag_value(opt: Option, given: Any) -> Any:
    """A flag's value as the option reads it (a switch is already a bool; an absent flag: the default)."""
    if opt.switch:
        return given
    return opt.default if given is None else opt.value(given)


def _table(r: PatchResult) -> Table:
    """A grid (first axis by second) of the share of the way each patch moves the metric, or the largest effects."""
    rows, cols = (r.axes + ("", ""))[:2]
    narrow = len(r.axes) == 2 and all(len(label) <= GRID_LABEL for label in r.labels[cols])
    if narrow and r.values.shape[1] <= GRID_COLUMNS and r.target != r.base:
        t = Table(caption="share of the way from the base run's metric to the source run's, %")
        t.add_column(rows)
        for label in r.labels[cols]:
            t.add_column(f"{cols} {label}", justify="right")
        for label, row in zip(r.labels[rows], r.normalized().tolist()):
            t.add_row(label, *("-" if v != v else f"{100 * v:.0f}" for v in row))
        return t
    t = Table(caption="the patches that move the metric most")
    for col in ("where", "metric", "share of the way"):
        t.add_column(col)
    for where, v, n in largest(r, 12):
        t.add_row(where, f"{v:.4g}", "-" if n != n else f"{n:+.1%}")
    return t
