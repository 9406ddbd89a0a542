"""``qkov ablate``: remove heads (zero, mean or resample ablation) and measure what the model loses."""

from __future__ import annotations

import argparse
from typing import Any

from rich.table import Table

from ...analysis.causal import ablation as Ab
from ...analysis.causal.sweep import ablation_sweep
from ...analysis.causal.positions import parse_positions
from ...analysis.forward.address import parse_heads
from ...weights.view import Weights
from ..inputs import sample_for
from ..progress import StageProgress
from .common import add_device, add_inputs, add_source_args, console, device, dump_json, load_source, nonneg_int

__all__ = ["add_ablate", "cmd_ablate"]


def add_ablate(sub: Any) -> None:
    p = sub.add_parser(
        "ablate",
        help="remove heads (zero, mean or resample ablation) and measure the loss, ICL score and repeated-token loss",
        description=(
            "Ablate the given heads and print the validation loss, the ICL score and the loss on the first and "
            "second copy of repeated random tokens: intact, ablated, and with as many random other heads "
            "ablated instead. Zero ablation removes a head's output; mean ablation replaces it by its mean "
            "over every position of the validation sample; resample ablation replaces it by its output on "
            "another sequence of the same batch. --positions limits the ablation to some positions."
        ),
    )
    add_source_args(p)
    p.add_argument(
        "--heads",
        required=True,
        help="comma-separated heads as LAYER.HEAD, e.g. 1.0,1.3; or 'all': each head ablated alone, in turn "
        "(one table, several heads per forward pass)",
    )
    p.add_argument("--mode", choices=Ab.MODES, default="mean", help="zero, mean or resample ablation (default mean)")
    p.add_argument(
        "--positions",
        help="ablate at these positions of every sequence only: comma-separated I or A:B as in Python, e.g. "
        "0,50: or -1 (default: every position)",
    )
    p.add_argument("--draws", type=nonneg_int, default=5, help="random head sets for comparison (default 5)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random tokens and head draws (default 0)")
    add_inputs(p)
    add_device(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_ablate)


def cmd_ablate(args: argparse.Namespace) -> int:
    dev = device(args)
    model = load_source(args, "ablate", "nothing to ablate")
    sweep = args.heads.strip() == "all"
    heads = None if sweep else parse_heads(args.heads, model.cfg, "--heads")  # before any work
    positions = None if args.positions is None else parse_positions(args.positions, model.cfg.n_ctx)
    sample = sample_for(args.ckpt, model, text=args.text, tokens=args.tokens, seed=args.seed)
    w = Weights.from_model(model.to(dev))
    if sweep:
        return _sweep(args, w, sample, positions, dev)
    study = Ab.ablation_study(
        w,
        None if sample.text is None else sample.text.to(dev),
        heads,
        icl_text=None if sample.icl_text is None else sample.icl_text.to(dev),
        mode=args.mode,
        draws=args.draws,
        bos=sample.bos,
        seed=args.seed,
        positions=positions,
    )
    data = {**study.to_dict(), "sample": sample.source}
    if args.json:
        dump_json(data)
        return 0
    where = "" if study.positions == "all" else f" at positions {study.positions}"
    table = _measures_table(f"ablating {', '.join(study.heads)} ({study.mode}{where}); text: {sample.source}", study)
    _row(table, "intact", study.intact)
    _row(table, "ablated", study.ablated)
    for hs, m in zip(study.random_heads, study.random):
        _row(table, f"random {', '.join(hs)}", m)
    console().print(table)
    _notes(study)
    return 0


def _measures_table(title: str, study: Any) -> Table:
    """The table of an ablation's measures; the repeated-token columns say the probe's length."""
    table = Table(title=title)
    probe = "repeated" if study.probe_length is None else f"repeated ({study.probe_length} per copy)"
    for col in ("model", "text loss", "ICL score", f"{probe}: 1st copy", "2nd copy"):
        table.add_column(col)
    return table


def _row(table: Table, name: str, m: Ab.Measures) -> None:
    fmt = lambda v, d: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
    table.add_row(name, fmt(m.loss, 4), fmt(m.icl, 4), fmt(m.repeat_first, 3), fmt(m.repeat_second, 3))


def _notes(study: Any) -> None:
    if study.mean_sample:
        console().print(f"mean ablation: each head's mean output over {study.mean_sample}")
    labels = {"icl": "ICL score", "loss": "text loss", "repeated": "repeated-token losses"}
    for name, why in study.left_out.items():
        console().print(f"{labels.get(name, name)} left out: {why}", highlight=False)


def _sweep(args: argparse.Namespace, w: Weights, sample: Any, positions: Any, dev: Any) -> int:
    """``qkov ablate --heads all``: each head alone, one table."""
    with StageProgress() as bar:
        study = ablation_sweep(
            w,
            None if sample.text is None else sample.text.to(dev),
            icl_text=None if sample.icl_text is None else sample.icl_text.to(dev),
            mode=args.mode,
            bos=sample.bos,
            seed=args.seed,
            positions=positions,
            progress=bar,
        )
    if args.json:
        dump_json({**study.to_dict(), "sample": sample.source})
        return 0
    where = "" if study.positions == "all" else f" at positions {study.positions}"
    table = _measures_table(f"each head ablated alone ({study.mode}{where}); text: {sample.source}", study)
    _row(table, "intact", study.intact)
    for name, m in zip(study.heads, study.ablated):
        _row(table, name, m)
    console().print(table)
    _notes(study)
    return 0
