"""``qkov report`` (one checkpoint -> an offline HTML page) and ``qkov tour`` (the main job)."""

from __future__ import annotations

import argparse
import shlex
import time
from pathlib import Path
from typing import Any

from rich.table import Table

from ...errors import QkovError
from ...io.sources import source_kind
from ..ranks import rank_device, ranks
from ..report import write_report
from ..report.collect import collect
from ..tour import run_tour
from .common import (
    BATCH_HELP,
    ICL_HELP,
    add_device,
    add_diag,
    add_inputs,
    add_source_args,
    console,
    device,
    positive_int,
)

__all__ = ["add_report", "add_tour", "cmd_report", "cmd_tour"]


def add_report(sub: Any) -> None:
    p = sub.add_parser(
        "report",
        help="write the paper's whole analysis of a checkpoint as one offline HTML page (+ report.json)",
        description=(
            "Analyse a checkpoint and write DIR/index.html (self-contained: opens from disk, no network) and "
            "DIR/report.json (every number in the page): model card and bandwidth audit; per-head scores and "
            "roles, copying vs prefix matching, OV eigenvalues; Q/K/V composition heatmaps; path expansion and "
            "term importance; an attention-pattern viewer on validation text; in-context learning curves; "
            "skip-trigram and bigram tables; the induction circuit's composition paths, path-patched; and, "
            "given --clean and --corrupted, activation and attribution patching of that pair."
        ),
    )
    add_source_args(p)
    p.add_argument("-o", "--out", type=Path, help="output directory (default CKPT/report for a qkov checkpoint)")
    p.add_argument(
        "--force",
        action="store_true",
        help="replace an index.html or report.json in the output directory that qkov did not write",
    )
    add_inputs(p)
    p.add_argument("--batch", type=positive_int, help=BATCH_HELP + "; the path expansion takes at most 2048 tokens")
    p.add_argument("--icl-examples", type=positive_int, help=ICL_HELP)
    p.add_argument("--viewer-tokens", type=positive_int, default=128, help="tokens in the attention viewer")
    p.add_argument("--top", type=positive_int, default=20, help="rows per skip-trigram / bigram table")
    p.add_argument("--clean", type=Path, metavar="FILE", help="a clean input for a patching section (as qkov patch reads it)")
    p.add_argument("--corrupted", type=Path, metavar="FILE", help="the corrupted input of that pair, same shape")
    p.add_argument("--metric", help="the patching metric: loss (default), logit-diff:A,B or prob:T")
    add_diag(p)
    add_device(p)
    p.add_argument("--quiet", action="store_true", help="print only where the report went")
    p.set_defaults(func=cmd_report)


def cmd_report(args: argparse.Namespace) -> int:
    if args.out is None and source_kind(args.ckpt) != "qkov":
        raise QkovError(
            f"report: {str(args.ckpt)!r} is not a local qkov checkpoint directory, so there is no default "
            "output folder: give -o DIR"
        )
    out = args.out or args.ckpt / "report"
    dev = rank_device(device(args))  # a bad device is an error before any work
    con = console()
    t0 = time.perf_counter()

    def progress(stage: str, done: int, total: int) -> None:  # one line as each stage starts
        if not args.quiet and done == 0:
            con.print(f"[dim]… {stage}[/dim]", highlight=False)

    with ranks(dev) as (split, dev):  # torchrun: every section's work split
        (write_report if split.main else _collect_only)(
            args.ckpt,
            out,
            progress=progress if split.main else None,
            batch=args.batch,
            icl_examples=args.icl_examples,
            viewer_tokens=args.viewer_tokens,
            top=args.top,
            device=str(dev),
            text=args.text,
            tokens=args.tokens,
            diag_k=args.diag_k,
            diag_sample=args.diag_sample,
            config=args.config,
            overwrite=args.force,
            clean=args.clean,
            corrupted=args.corrupted,
            metric=args.metric,
        )
    if not split.main:
        return 0
    size = (out / "index.html").stat().st_size
    print(f"wrote {out / 'index.html'} ({size / 1e6:.1f} MB) and report.json in {time.perf_counter() - t0:.1f} s")
    return 0


def _collect_only(ckpt: Path, out: Path, *, overwrite: bool, **options: Any) -> None:
    """A rank other than 0: its share of the report's work, nothing written."""
    collect(ckpt, **options)


def add_tour(sub: Any) -> None:
    p = sub.add_parser(
        "tour",
        help="the main job: train the 0/1/2-layer models, report on each, print the paper's claims vs measured",
        description=(
            "Train the paper's 0-, 1- and 2-layer attention-only models on the built-in corpus with the default "
            "settings (runs already finished in --out are reused; interrupted ones resume), write a report for "
            "each and a comparison page (OUT/index.html), and print the paper's claims beside what was measured. "
            "About 15 minutes on a 2-core CPU; a GPU is used when present (--device auto)."
        ),
    )
    p.add_argument("--out", type=Path, default=Path("runs/tour"), help="output directory (default runs/tour)")
    p.add_argument("--device", default="auto", help="auto (default: cuda if present), cpu, cuda, cuda:N")
    p.add_argument(
        "--layers",
        default="0,1,2",
        help="comma-separated layer counts to train (default 0,1,2)",
    )
    p.add_argument("--steps", type=positive_int, help="training steps per model (default: qkov train's default)")
    p.add_argument("--corpus", help="corpus for new runs (default: the built-in stdlib corpus)")
    p.add_argument("--quiet", action="store_true", help="no training progress bars")
    p.set_defaults(func=cmd_tour)


def _parse_layers(text: str) -> list[int]:
    try:
        layers = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise QkovError(f"--layers: expected comma-separated integers like 0,1,2, got {text!r}") from None
    if not layers or any(n < 0 for n in layers) or len(set(layers)) != len(layers):
        raise QkovError(f"--layers: expected distinct layer counts >= 0, got {text!r}")
    return layers


def cmd_tour(args: argparse.Namespace) -> int:
    layers = _parse_layers(args.layers)
    con = console()
    t0 = time.perf_counter()
    table, models = run_tour(
        args.out,
        layers=layers,
        device=args.device,
        steps=args.steps,
        corpus=args.corpus,
        quiet=args.quiet,
        say=lambda s: con.print(s, highlight=False),
    )
    t = Table(title="models")
    for col in ("model", "val loss", "ICL score", "loss 1st/2nd repeat", "max prefix matching", "copying heads"):
        t.add_column(col, justify="right")
    for m in models:
        t.add_row(
            f"{m['layers']}-layer",
            f"{m['val_loss']:.4f}",
            "-" if m["icl"] is None else f"{m['icl']:+.3f}",
            f"{m['repeat_first']:.2f} / {m['repeat_second']:.2f}",
            "-" if m["max_prefix_matching"] is None else f"{m['max_prefix_matching']:.3f}",
            f"{m['copying_heads']} / {m['heads']}",
        )
    con.print(t)
    t = Table(title="the paper's claims, measured on these models", show_lines=True)
    t.add_column("claim (paper)", max_width=40)
    t.add_column("measured here", max_width=60)
    t.add_column("")
    t.add_column("verdict rule", max_width=44)
    mark = {True: "[green]agrees[/green]", False: "[red]differs[/red]", None: "compare"}
    for c in table:
        t.add_row(c.claim, c.measured, mark[c.holds], c.rule)
    con.print(t)
    con.print(
        f"tour done in {time.perf_counter() - t0:.0f} s; comparison page {args.out / 'index.html'}, reports in "
        + ", ".join(str(args.out / f"qkov-{n}l" / "report" / "index.html") for n in layers),
        highlight=False,
    )
    deepest = args.out / f"qkov-{max(layers)}l"
    con.print(f"explore the {max(layers)}-layer model in a browser: qkov explore {shlex.quote(str(deepest))}", highlight=False)
    return 0
