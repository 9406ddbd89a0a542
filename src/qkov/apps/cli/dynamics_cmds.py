"""``qkov dynamics``: a series of snapshots -> the phase change (:mod:`qkov.apps.dynamics`)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from rich.table import Table

from ...analysis.causal import ablation as Ab
from ...errors import QkovError
from ...io.sources import source_kind
from ...ranks import Ranks
from ..dynamics.study import DynamicsResult, write_dynamics
from ..progress import StageProgress
from .common import add_device, add_inputs, console, device, dump_json, nonneg_int

__all__ = ["add_dynamics", "cmd_dynamics"]


def add_dynamics(sub: Any) -> None:
    p = sub.add_parser(
        "dynamics",
        help="measure every snapshot of a training run (or a list of checkpoints) and find the phase change",
        description=(
            "Measure each snapshot of one model on the same tokens (validation loss and per-token losses, ICL "
            "score, every head's previous-token / prefix-matching / induction / eigenvalue-copying score, the "
            "strongest K-composition pair, repeated-token loss on the 1st and 2nd copy), find the window where "
            "the induction score, the previous-token score and the in-context improvement rise fastest, the "
            "loss bump and the per-token-loss trajectory, and ablate the last snapshot's induction heads. "
            "Writes OUT/dynamics.json and OUT/index.html (offline). Under torchrun the snapshots are split "
            "over the ranks."
        ),
    )
    p.add_argument(
        "sources",
        nargs="+",
        metavar="SOURCE",
        help="a qkov run with snapshots; or checkpoints (paths or a quoted glob); or a Hugging Face Hub "
        "name with --revisions",
    )
    p.add_argument("--revisions", help="comma-separated Hub revisions of SOURCE, e.g. step1000,step2000 (Pythia)")
    p.add_argument(
        "--tokens-per-step",
        type=nonneg_int,
        help="tokens per training step, to put checkpoints that record only a step on a token axis (Pythia: 2097152)",
    )
    p.add_argument("-o", "--out", type=Path, help="output directory (default RUN/dynamics for a qkov run)")
    p.add_argument("--force", action="store_true", help="replace outputs in OUT that qkov did not write")
    add_inputs(p)
    p.add_argument("--mode", choices=Ab.MODES, default="mean", help="ablation of the induction heads (default mean)")
    p.add_argument("--draws", type=nonneg_int, default=5, help="random head sets ablated for comparison (default 5)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random tokens and head draws (default 0)")
    add_device(p)
    p.add_argument("--json", action="store_true", help="print the result as JSON instead of a summary")
    p.set_defaults(func=cmd_dynamics)


def cmd_dynamics(args: argparse.Namespace) -> int:
    one_run = len(args.sources) == 1 and not args.revisions and Path(args.sources[0]).is_dir()
    if args.out is None and not (one_run and source_kind(args.sources[0]) == "qkov"):
        raise QkovError("dynamics: give -o DIR (the default, RUN/dynamics, exists only for one qkov run)")
    out = args.out or Path(args.sources[0]) / "dynamics"
    device(args)
    revisions = [r.strip() for r in args.revisions.split(",") if r.strip()] if args.revisions else None
    if args.revisions is not None and not revisions:
        raise QkovError("dynamics: --revisions names no revision")
    t0 = time.perf_counter()
    with StageProgress() as progress:
        result = write_dynamics(
            out,
            args.sources,
            overwrite=args.force,
            revisions=revisions,
            tokens_per_step=args.tokens_per_step,
            text=args.text,
            tokens=args.tokens,
            mode=args.mode,
            draws=args.draws,
            seed=args.seed,
            device=args.device,
            progress=progress,
        )
    if not Ranks.from_env().main:  # every rank has the result; rank 0 prints it
        return 0
    if args.json:
        dump_json(result.to_dict())
        return 0
    _print_summary(result, out, time.perf_counter() - t0)
    return 0


def _print_summary(result: DynamicsResult, out: Path, seconds: float) -> None:
    con = console()
    table = Table(title=f"dynamics of {result.description}: {len(result.snapshots)} snapshots")
    for col in ("metric", f"window ({result.axis})", "fastest at", "rise", "sharpness"):
        table.add_column(col)
    for key, name in (
        ("induction", "induction score"),
        ("previous_token", "previous-token score"),
        ("icl", "in-context improvement"),
    ):
        w = result.reading.windows.get(key)
        if w is None:
            table.add_row(name, "no window", "-", "-", "-")
        else:
            table.add_row(
                name, f"{w.start:,.0f} - {w.end:,.0f}", f"{w.peak:,.0f}", f"{w.rise:.3f}", f"{w.sharpness:.1f}"
            )
    con.print(table)
    bump = result.reading.bump
    if bump is not None:
        con.print(
            f"loss bump: {bump.height:+.4f} nats over the fit at {bump.at:,.0f} "
            f"({'seen' if bump.seen else 'within the noise'}, fit RMS {bump.noise:.4f})"
        )
    ab = result.ablation
    if ab is not None:
        removed, rand, med = ab.icl_removed(), ab.random_icl_removed(), ab.random_icl_removed("median")
        fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
        con.print(
            f"ablating {', '.join(ab.heads)} ({ab.mode}): share of the in-context improvement removed "
            f"{fmt(removed)} (random sets of as many heads: median {fmt(med)}, mean {fmt(rand)})"
        )
    con.print(f"wrote {out / 'index.html'} and dynamics.json in {seconds:.0f} s")
