"""The commands that run the model on text: ``qkov paths`` and ``qkov heads``."""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

import torch
from rich.table import Table

from ...analysis.heads.gates import gate_caveat
from ...analysis.heads.report import SCORE_COLUMNS, THRESHOLDS, head_report
from ...analysis.paths.expansion import VIRTUAL_AUTO_MAX, default_batch, paths_batch
from ...analysis.paths.summary import summarize
from ...analysis.heads.probes import default_icl_examples
from ...weights.view import Weights
from ..inputs import analysis_inputs
from ..progress import StageProgress
from ..ranks import rank_device, ranks
from .common import (
    add_device,
    add_diag,
    add_inputs,
    BATCH_HELP,
    ICL_HELP,
    add_source_args,
    console,
    device,
    dump_json,
    load_source,
    count_or_all,
    positive_int,
)

__all__ = ["add_heads", "add_paths", "cmd_heads", "cmd_paths"]


def add_paths(sub: Any) -> None:
    p = sub.add_parser(
        "paths",
        help="logits as direct + single-head + virtual-head paths; the paper's term importance",
        description=(
            "Path expansion (Elhage et al., 2021) of an attention-only model on validation text: with "
            "attention patterns frozen from a real forward pass, the logits split exactly into the direct "
            "path, one term per head and one per virtual head (pairs of heads in increasing layers). Prints "
            "the reconstruction error, the loss after each run of the paper's term-importance procedure and "
            "the marginal loss of each order, and the terms whose removal costs the most loss."
        ),
    )
    add_source_args(p)
    add_inputs(p)
    p.add_argument(
        "--batch",
        type=positive_int,
        help="sequences of n_ctx tokens (default 8, or fewer so they hold at most 2048 tokens and one forward "
        "pass costs at most 0.3 TFLOP: 1 at GPT-2 size). Memory and time grow with it: every head's term is "
        "batch x n_ctx x d_model, and term importance is n_layers + 1 forward passes; a batch that would not "
        "fit in free memory (or --max-memory) is refused before any work",
    )
    p.add_argument("--top", type=positive_int, default=10, help="terms to list per order (default 10)")
    p.add_argument(
        "--virtual-terms",
        type=count_or_all,
        default=VIRTUAL_AUTO_MAX,
        metavar="N|all",
        help=f"virtual heads (pairs of heads in increasing layers) to expand one by one (default "
        f"{VIRTUAL_AUTO_MAX}): all of them when the model has at most N, else the N with the largest upper "
        "bound on their size, and the output states the share of the order-2 term they explain; 0: none. "
        "Each is a pass of one head over the batch: GPT-2 small has 9,504, ~5 s per 1,000 on a 2-core CPU",
    )
    p.add_argument("--float64", action="store_true", help="compute in float64")
    add_device(p)
    p.add_argument("--json", action="store_true", help="print every number as JSON")
    p.set_defaults(func=cmd_paths)


def cmd_paths(args: argparse.Namespace) -> int:
    dev = rank_device(device(args))
    model = load_source(args, "paths", " (its logits are the direct path alone)")
    batch = args.batch or paths_batch(model.cfg)
    inputs = analysis_inputs(args.ckpt, model, text=args.text, tokens=args.tokens, batch=batch)
    tokens = inputs.tokens
    dtype = torch.float64 if args.float64 else torch.float32
    w = Weights.from_model(model, dtype=dtype, device=dev)
    del model  # the view holds what the analysis reads: the training module's copy can go
    tokens = tokens.to(dev)
    t0 = time.perf_counter()
    with ranks(dev) as (split, _), StageProgress() as progress:  # torchrun: the term effects split by terms
        shown = progress if split.main else None
        summary = summarize(w, tokens, top_virtual=args.top, virtual_terms=args.virtual_terms, progress=shown)
    if not split.main:
        return 0
    seconds = time.perf_counter() - t0
    ti, singles, virtual = summary.importance, summary.singles, summary.virtual
    data = {"path": str(args.ckpt), "inputs": inputs.source, **summary.to_dict(), "seconds": seconds}
    if args.json:
        dump_json(data)
        return 0
    con = console()
    con.print(f"inputs: {inputs.source}", highlight=False)
    con.print(
        f"{tokens.shape[0]} x {tokens.shape[1]} tokens; sum of all path terms vs the model's logits: "
        f"max |difference| {data['reconstruction_max_abs_error']:.2e}; {seconds:.1f} s"
    )
    t = Table(title="term importance (the paper's runs; loss in nats)")
    for col in ("run", "what is in", "loss", "order entering", "marginal loss"):
        t.add_column(col, justify="right")
    t.add_row("-", "uniform", f"{ti.uniform_loss:.3f}", "0 (direct path)", f"{ti.marginal_by_order[0]:+.3f}")
    for i, loss in enumerate(ti.run_losses):
        inside = "direct path" if i == 0 else f"orders 0..{i}"
        nxt = f"{i + 1}" if i + 1 < len(ti.run_losses) else "-"
        marg = f"{ti.marginal_by_order[i + 1]:+.3f}" if i + 1 < len(ti.marginal_by_order) else ""
        t.add_row(str(i + 1), inside, f"{loss:.3f}", nxt, marg)
    con.print(t)
    for title, rows in (("single-head terms", singles), ("virtual-head terms (largest by size)", virtual)):
        if not rows:
            continue
        t = Table(title=f"{title}: loss increase when removed")
        for col in ("term", "loss change", "RMS logit"):
            t.add_column(col, justify="right")
        for e in rows[: args.top]:
            t.add_row(e.name, f"{e.loss_change:+.4f}", f"{e.size:.3f}")
        con.print(t)
    if summary.effect_positions is not None:
        con.print(
            f"term effects measured on a seeded sample of {summary.effect_positions:,} of the "
            f"{tokens.shape[0] * (tokens.shape[1] - 1):,} predicted positions (full-vocabulary logits per term)",
            highlight=False,
        )
    cover = summary.coverage
    if cover is not None and not cover.exact:
        con.print(
            f"virtual heads: the {cover.materialised:,} of {cover.pairs:,} with the largest upper bounds were "
            "expanded; "
            f"they explain {cover.explained:.1%} of the order-2 term (squared norm), and none left out can exceed "
            f"{math.ceil(cover.left_bound * 100) / 100:.2f} x the largest expanded one (--virtual-terms sets how many)",
            highlight=False,
        )
    return 0


# --------------------------------------------------------------------------- heads
def add_heads(sub: Any) -> None:
    p = sub.add_parser(
        "heads",
        help="every head's scores (copying, previous-token, induction, sinks, ...) and its roles",
        description=(
            "Head taxonomy: previous-token, self-attention, sink and positional scores on validation text; "
            "prefix-matching (attention to the positions after every earlier occurrence of the current token, "
            "summed), induction, duplicate-token and copying scores on repeated random tokens (Olsson et al. "
            "2022: 25 tokens, not among the 5%% most or 20%% least frequent, repeated 4 times after the start "
            "token, 10 examples; rank copying: where the head's logits place the token it attends to, -1..1); "
            "eigenvalue copying scores from the weights; the in-context learning score (loss at token 500, or "
            "the last position, minus loss at token 50: negative when the model learns in context); "
            "memory-management neurons. Roles come from documented thresholds; induction = prefix matching "
            "and rank copying."
        ),
    )
    add_source_args(p)
    add_inputs(p)
    p.add_argument("--batch", type=positive_int, help=BATCH_HELP)
    p.add_argument("--icl-examples", type=positive_int, help=ICL_HELP)
    p.add_argument("--seed", type=int, default=0, help="seed of the repeated random tokens (default 0)")
    add_diag(p)
    add_device(p)
    p.add_argument("--json", action="store_true", help="print every score as JSON")
    p.set_defaults(func=cmd_heads)


def cmd_heads(args: argparse.Namespace) -> int:
    dev = rank_device(device(args))
    model = load_source(args, "heads")
    n_ctx = model.cfg.n_ctx
    batch, icl_examples = args.batch or default_batch(n_ctx), args.icl_examples or default_icl_examples(model.cfg)
    rows = max(batch, icl_examples)
    inputs = analysis_inputs(args.ckpt, model, text=args.text, tokens=args.tokens, batch=rows, want_corpus=True)
    text, bos = inputs.tokens, model.bos_token_id
    w = Weights.from_model(model, device=dev)
    del model  # the view holds what the analysis reads: the training module's copy can go
    with ranks(dev) as (split, _), StageProgress() as progress:  # torchrun: sequences, heads
        report = head_report(
            w,
            text[:batch],
            bos=bos,
            frequencies=inputs.frequencies,
            seed=args.seed,
            diag_k=args.diag_k or None,
            diag_sample=args.diag_sample,
            icl_text=text[:icl_examples],
            icl=inputs.natural,
            icl_curve=args.json,  # the table shows the score alone: no logits at every position for a curve
            progress=progress if split.main else None,
        )
    if not split.main:
        return 0
    note = gate_caveat(w.cfg)  # the copying and eigenvalue scores read the weight-only OV circuit
    if args.json:
        dump_json({"path": str(args.ckpt), "inputs": inputs.source, **report.to_dict(), **({"gate_note": note} if note else {})})
        return 0
    con = console()
    con.print(f"inputs: {inputs.source}", highlight=False)
    read, every = report.copying_queries or (0, 0)
    if read < every:
        con.print(
            f"copying scores read {read} of the {every} repeated queries per example (a seeded sample: "
            "full-vocabulary logits per head and query)",
            highlight=False,
        )
    cols = SCORE_COLUMNS
    t = Table(title=f"heads of {args.ckpt}")
    t.add_column("head")
    for name, _ in cols:
        t.add_column(name, justify="right")
    t.add_column("roles")
    for row in report.rows():
        cells = ["n/a" if row[key] is None else f"{row[key]:.2f}" for _, key in cols]
        t.add_row(str(row["head"]), *cells, ", ".join(row["roles"]) or "-")
    con.print(t)
    if report.icl is not None:
        con.print(
            f"in-context learning score: {report.icl.score:+.3f} nats "
            f"(loss at token {report.icl.late} minus loss at token {report.icl.early})"
        )
    labels = {key: label for label, key in cols} | {"icl": "in-context learning"}
    for name, why in report.left_out.items():
        con.print(f"{labels.get(name, name)} score left out: {why}", highlight=False)
    if report.memory_neurons:
        con.print(f"memory-management neurons (cos(W_in, W_out) < -0.5): {len(report.memory_neurons)}")
    con.print("thresholds: " + ", ".join(f"{k} {v:g}" for k, v in THRESHOLDS.items()))
    if note:
        con.print(note, highlight=False)
    return 0
