"""``qkov circuit``: find the circuit of a task (edge attribution, a circuit chosen from it, checked by running
it: faithfulness, its curve, ROC AUC against a ground truth, an optional ACDC pass). The library's
:func:`qkov.analysis.discovery.find_circuit` does the work; this prints it."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rich.table import Table

from ...analysis.discovery import (
    ABLATIONS, BUILT_IN_TASKS, METHODS, METRICS, TARGET, VARIANTS, find_circuit, load_task, mib_graph,
    read_ground_truth,
)  # fmt: skip
from ...errors import QkovError
from ...io.atomic import atomic_write_text
from ...weights.lazy import LazyCheckpoint
from ...weights.view import Weights
from ..progress import StageProgress
from .common import (
    add_device, add_lazy, add_source_args, console, device, dump_json, int_at_least, lazy, load_source, positive_float,
)  # fmt: skip

__all__ = ["add_circuit", "cmd_circuit"]


def add_circuit(sub: Any) -> None:
    p = sub.add_parser(
        "circuit",
        help="find the circuit of a task: edge attribution, faithfulness, ROC AUC",
        description=(
            "Score every edge of the model's graph on a task (each sender into every later receiver: the input, "
            "heads and MLPs into each head's query, key and value input, each MLP and the logits; GPT-2 small has "
            "32,491), choose a circuit from the scores and check it by running the model with every other edge "
            "ablated: its faithfulness, the faithfulness curve at MIB's edge fractions (CPR, CMD), ROC AUC against "
            "a ground-truth circuit. A task is clean/corrupted prompt pairs with answers: a file (AutoCircuit's "
            f"JSON, EAP-IG's CSV) or a built-in one ({', '.join(BUILT_IN_TASKS)}). docs/discovery.md has the "
            "definitions."
        ),
    )
    add_source_args(p)
    add_lazy(p, "gradients too: the backward pass reads each layer again, one at a time")
    p.add_argument("--task", required=True, metavar="FILE|" + "|".join(BUILT_IN_TASKS),
                   help="the task: AutoCircuit's JSON, EAP-IG's CSV, or induction (repeated random tokens, any "
                   "model) or ioi (Wang et al.'s templates, a GPT-2-style tokenizer)")  # fmt: skip
    p.add_argument("--method", choices=METHODS, default="eap",
                   help="eap (default: one forward and backward), eap-ig (integrated gradients over the input, MIB's "
                   "default), eap-ig-activations, ieg (AutoCircuit's integrated edge gradients) or exact (each edge "
                   "patched alone)")  # fmt: skip
    size = p.add_mutually_exclusive_group()
    size.add_argument(
        "--edges", type=int_at_least(1, "--edges"), metavar="N", help="the circuit: the N edges ranked first"
    )
    size.add_argument("--faithfulness", type=positive_float, metavar="F",
                      help=f"the circuit: the smallest top-n circuit of faithfulness F (default {TARGET})")  # fmt: skip
    size.add_argument(
        "--threshold", type=positive_float, metavar="T", help="the circuit: every edge scoring at least T"
    )
    p.add_argument(
        "--greedy", action="store_true", help="with --edges: grow the circuit from the logits instead of top-n"
    )
    p.add_argument("--by-importance", action="store_true",
                   help="rank edges by importance (positive: carries the clean behaviour), not |score|")  # fmt: skip
    p.add_argument("--ablation", choices=ABLATIONS, default="corrupted",
                   help="what an ablated edge carries: the corrupted prompt's value (default), zero, the mean over the "
                   "corrupted prompts and positions, or the mean at each position")  # fmt: skip
    p.add_argument("--per-position", action="store_true", help="one edge per position (prompts of one length)")
    p.add_argument(
        "--steps",
        type=int_at_least(1, "--steps"),
        metavar="M",
        help="integration steps of eap-ig, eap-ig-activations, ieg (default 5)",
    )
    p.add_argument("--metric", choices=METRICS, help="replace the task's metric (default: logit-diff)")
    p.add_argument("--prompts", type=int_at_least(1, "--prompts"), metavar="N",
                   help="prompt pairs: of a built-in task (default 32), the first N of a file")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="the built-in tasks' seed (default 0)")
    p.add_argument("--variant", choices=VARIANTS, default=VARIANTS[0],
                   help="how a circuit runs: every other edge ablated on the clean prompts (default), its own edges "
                   "ablated, or patched into the corrupted prompts")  # fmt: skip
    p.add_argument("--no-curve", dest="curve", action="store_false", help="skip the faithfulness curve")
    p.add_argument("--ground-truth", type=Path, metavar="FILE",
                   help="a known circuit (edges or nodes; JSON list, MIB graph, or one per line; qkov's, EAP-IG's or "
                   "AutoCircuit's names): edge- and node-level ROC AUC")  # fmt: skip
    p.add_argument(
        "--acdc", type=positive_float, metavar="TAU", help="refine the circuit by an ACDC pass at KL threshold TAU"
    )
    p.add_argument("--acdc-seconds", type=positive_float, metavar="S", help="stop the ACDC pass after S seconds")
    p.add_argument(
        "--batch", type=int_at_least(1, "--batch"), metavar="N", help="prompt pairs per pass (default: what fits)"
    )
    p.add_argument(
        "--out", type=Path, metavar="FILE", help="write the circuit, its checks and every edge's score as JSON"
    )
    p.add_argument(
        "--mib", type=Path, metavar="FILE", help="write the scores and the circuit in MIB's submission shape"
    )
    add_device(p, memory=False)
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.set_defaults(func=cmd_circuit)


def cmd_circuit(args: argparse.Namespace) -> int:
    dev = device(args)
    if lazy(args):  # a model larger than memory: read layer by layer, gradients included
        w: Any = LazyCheckpoint(args.ckpt, device=dev)
        if w.cfg.n_layers == 0:
            raise QkovError("circuit: the model has no attention layers: no heads to find a circuit among")
    else:
        w = Weights.from_model(load_source(args, "circuit", ": no heads to find a circuit among").to(dev))
    task = load_task(
        args.task if args.task in BUILT_IN_TASKS else Path(args.task),
        w,
        metric=args.metric,
        n=args.prompts,
        seed=args.seed,
    )
    truth = read_ground_truth(args.ground_truth) if args.ground_truth else None
    with StageProgress() as progress:
        found = find_circuit(
            w, task, method=args.method, ablation=args.ablation, steps=args.steps, edges=args.edges,
            faithfulness=args.faithfulness, threshold=args.threshold, how="greedy" if args.greedy else "top",
            absolute=not args.by_importance, per_position=args.per_position, variant=args.variant, curve=args.curve,
            ground_truth=truth, acdc_tau=args.acdc, acdc_seconds=args.acdc_seconds, batch=args.batch, progress=progress,
        )  # fmt: skip
    data = found.to_dict()
    if args.out:
        atomic_write_text(args.out, json.dumps(data))
    if args.mib:
        circuit = found.acdc.circuit if found.acdc is not None else found.circuit
        atomic_write_text(args.mib, json.dumps(mib_graph(found.scores, circuit)))
    if args.json:
        dump_json(data)
        return 0
    _print(found, args)
    return 0


def _print(found: Any, args: argparse.Namespace) -> None:
    con = console()
    f, s = found.faithfulness, found.scores
    con.print(found.task)
    con.print(f"graph: {s.graph.summary()}")
    con.print(
        f"{s.method} scores ({s.ablation} ablation); {f.metric}: clean {s.clean:.4g}, every edge ablated {f.empty:.4g}"
    )
    con.print(
        f"[bold]circuit[/bold]: {found.circuit.n_edges} edges ({found.circuit.how}), {f.metric} {f.values[0]:.4g}: "
        f"faithfulness {f.faithfulness[0]:.3f} ({f.variant})"
    )
    t = Table(caption="the circuit's edges by |score| (the estimated change of the metric when each is ablated)")
    t.add_column("edge")
    t.add_column("score", justify="right")
    rank = s.scores.abs().amax(0) if s.per_position else s.scores.abs()
    chosen = sorted(found.circuit.union.nonzero()[:, 0].tolist(), key=lambda i: -float(rank[i].nan_to_num(0)))
    for i in chosen[:20]:
        t.add_row(s.graph.names[i], f"{float(s.scores[..., i].sum()):+.4g}")
    if len(chosen) > 20:
        t.add_row(f"... {len(chosen) - 20} more", "")
    con.print(t)
    if found.curve is not None:
        c = found.curve
        ct = Table(
            caption=f"faithfulness curve (MIB's fractions): CPR {c.cpr:.3f} (higher is better), "
            f"CMD {c.cmd:.3f} (lower is better)"
        )
        for col in ("edges %", "edges by importance", "faithfulness", "edges by |score|", "faithfulness "):
            ct.add_column(col, justify="right")
        for p, n1, f1, n2, f2 in zip(
            c.fractions, c.signed.edges, c.signed.faithfulness, c.absolute.edges, c.absolute.faithfulness
        ):
            ct.add_row(f"{100 * p:g}", str(n1), f"{f1:.3f}", str(n2), f"{f2:.3f}")
        con.print(ct)
    if found.roc is not None:
        r = found.roc
        edge = "" if r.edge_auc is None else f"edge {r.edge_auc:.4f} ({r.true_edges} true edges), "
        con.print(
            f"ROC AUC against {args.ground_truth}: {edge}node {r.node_auc:.4f} ({r.true_nodes} true heads and MLPs)"
        )
    if found.acdc is not None:
        a = found.acdc
        end = "finished" if a.finished else f"stopped after {a.visited} of {a.total} edges"
        con.print(
            f"ACDC pass (KL threshold {a.tau:g}): {a.start} -> {a.circuit.n_edges} edges, KL {a.kl:.4g}; "
            f"{end}, {a.seconds:.1f} s"
        )
    if args.out:
        con.print(f"wrote {args.out}")
    if args.mib:
        con.print(f"wrote {args.mib} (MIB's submission shape)")
