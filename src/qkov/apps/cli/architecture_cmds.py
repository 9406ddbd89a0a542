"""``qkov architectures``: the 2-layer model trained in each variant of the bus, compared
(:mod:`qkov.apps.architectures`)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from rich.table import Table

from ...errors import QkovError
from ...model.config import NORMALIZATION_CHOICES, ModelConfig
from ..architectures import DEFAULT_VARIANTS, STUDY_STEPS, VARIANTS, run_architectures
from .common import console, positive_int

__all__ = ["add_architectures", "cmd_architectures"]


def add_architectures(sub: Any) -> None:
    p = sub.add_parser(
        "architectures",
        help="train the 2-layer model with each residual scheme / gate / loop and compare them (the bus generalised)",
        description=(
            "Train the paper's 2-layer attention-only model in each variant (Attention Residuals, Block AttnRes, "
            "hyper-connections, mHC, gated attention, looped depth; docs/architectures.md) on the same corpus and "
            "token budget (runs already finished in --out are reused, interrupted ones resume), run qkov dynamics on "
            "each, measure attention sinks and the loss by path order, and write a comparison page (OUT/index.html, "
            "every number in OUT/architectures.json). About 26 minutes on a 2-core CPU with the defaults."
        ),
    )
    p.add_argument("--out", type=Path, default=Path("runs/architectures"), help="output directory (default runs/architectures)")
    p.add_argument(
        "--variants",
        default=",".join(DEFAULT_VARIANTS),
        help=f"comma-separated variants (default {','.join(DEFAULT_VARIANTS)}; known: {', '.join(VARIANTS)})",
    )
    p.add_argument("--steps", type=positive_int, default=STUDY_STEPS, help=f"training steps per variant (default {STUDY_STEPS})")
    p.add_argument(
        "--norm", choices=NORMALIZATION_CHOICES, default="none",
        help="the base model's normalisation (default none, the paper's; rmsnorm / layernorm compare the "
        "schemes on pre-norm models, as their papers train them; a run of another model in --out is refused)",
    )  # fmt: skip
    p.add_argument("--corpus", help="corpus for new runs (default: the built-in stdlib corpus)")
    p.add_argument("--device", default="auto", help="auto (default: cuda if present), cpu, cuda, cuda:N")
    p.add_argument("--quiet", action="store_true", help="no training progress bars")
    p.set_defaults(func=cmd_architectures)


def _variants(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if not names or unknown or len(set(names)) != len(names):
        bad = f"unknown {', '.join(unknown)}" if unknown else "give distinct names"
        raise QkovError(f"--variants: {bad} (known: {', '.join(VARIANTS)})")
    return names


def cmd_architectures(args: argparse.Namespace) -> int:
    names = _variants(args.variants)
    con = console()
    t0 = time.perf_counter()
    rows = run_architectures(
        args.out, variants=names, steps=args.steps, device=args.device, corpus=args.corpus, quiet=args.quiet,
        base=ModelConfig(n_layers=2, normalization=args.norm),
        say=lambda s: con.print(s, highlight=False),
    )  # fmt: skip
    t = Table(title="the 2-layer attention-only model, by variant")
    for col in ("variant", "tokens/s", "val loss", "ICL", "induction", "phase change at", "max sink", "loss by order"):
        t.add_column(col, justify="right")
    for r in rows:
        if r["diverged"] is not None:
            t.add_row(r["variant"], "-", f"diverged at step {r['diverged']:,}", *["-"] * 5)
            continue
        w = r["phase_change"]
        t.add_row(
            r["variant"],
            "-" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:,}",
            "-" if r["val_loss"] is None else f"{r['val_loss']:.4f}",
            "-" if r["icl"] is None else f"{r['icl']:+.3f}",
            "-" if r["induction"] is None else f"{r['induction']:.3f}",
            "-" if w is None else f"{w['peak']:,.0f}",
            f"{r['max_sink']:.3f}",
            " ".join(f"{v:.2f}" for v in r["paths_by_order"]),
        )
    con.print(t)
    con.print(f"architectures done in {time.perf_counter() - t0:.0f} s; comparison page {args.out / 'index.html'}", highlight=False)
    return 0
