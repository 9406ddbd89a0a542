"""The analysis commands: ``qkov circuits``, ``paths``, ``heads``, ``trigrams``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from ..errors import QkovError

from .common import console, _nonneg_int, _positive_int
from ..inputs import analysis_text
from .interop_cmds import add_source_args, load_source


# ------------------------------------------------------------------------ circuits
def _load_with_attention(args: argparse.Namespace, command: str, why: str = "", device: Any = "cpu") -> Any:
    """Load ``args.ckpt`` (any source) for an analysis that needs attention layers (one-line error otherwise)."""
    model = load_source(args.ckpt, args.config).to(device)
    if model.cfg.n_layers == 0:
        raise QkovError(f"{command}: the model has no attention layers{why}")
    return model


def _add_device(p: Any) -> None:
    p.add_argument(
        "--device", default="auto", help="where to compute: auto (default; cuda if available), cpu, cuda or cuda:N"
    )


def _device(args: argparse.Namespace) -> Any:
    """The ``--device`` as a torch device, checked before any work (one-line error if unusable)."""
    from ..train import pick_device

    return pick_device(args.device)


def _lazy(args: argparse.Namespace) -> bool:
    """``--lazy``, or automatically when ``model.safetensors`` is larger than ``AUTO_LAZY_BYTES``."""
    from ..lazy import AUTO_LAZY_BYTES

    from ..interop import source_kind

    if source_kind(args.ckpt) != "qkov":
        if args.lazy:
            raise QkovError("--lazy reads qkov checkpoints: convert the model first with qkov import")
        return False
    weights = args.ckpt / "model.safetensors"
    return bool(args.lazy) or (weights.is_file() and weights.stat().st_size > AUTO_LAZY_BYTES)


def _add_lazy(p: Any) -> None:
    p.add_argument(
        "--lazy",
        action="store_true",
        help="read the weights layer by layer from a memory map instead of loading the model "
        "(automatic when model.safetensors is over 1 GiB; MLP weights are never read)",
    )


def _add_circuits(sub: Any) -> None:
    p = sub.add_parser(
        "circuits",
        help="copying and Q/K/V composition scores of every head, from the weights alone",
        description=(
            "Weight-based circuit analysis (Elhage et al., 2021): per head, the eigenvalue copying score "
            "of the full OV circuit W_E W_OV W_U and the rate at which a token's own logit is in the top k "
            "of its OV row (exact over the whole vocabulary); for every pair of heads in increasing layers, "
            "Q-, K- and V-composition scores with the random-matrix baseline subtracted (raw and baseline "
            "shown too); and the residual-stream bandwidth per layer."
        ),
    )
    add_source_args(p)
    p.add_argument("--top", type=_positive_int, default=5, help="composition pairs to show per kind (default 5)")
    p.add_argument("--diag-k", type=_nonneg_int, default=5, help="k of the diagonal top-k copying rate; 0 = skip")
    p.add_argument("--float64", action="store_true", help="compute in float64")
    _add_device(p)
    _add_lazy(p)
    p.add_argument("--json", action="store_true", help="print every score as JSON")
    p.set_defaults(func=_cmd_circuits)


def _cmd_circuits(args: argparse.Namespace) -> int:
    import torch

    from ..circuits import analyse
    from ..weights import Weights

    dev = _device(args)
    dtype = torch.float64 if args.float64 else torch.float32
    if _lazy(args):
        from ..lazy import LazyCheckpoint
        from ..lazy_circuits import analyse as analyse_lazy
        from ..progress import StageProgress

        ck = LazyCheckpoint(args.ckpt, dtype=dtype, device=dev)
        if ck.cfg.n_layers == 0:
            raise QkovError("circuits: the model has no attention layers")
        with StageProgress() as progress:
            report = analyse_lazy(ck, diag_k=args.diag_k or None, progress=progress)
    else:
        model = _load_with_attention(args, "circuits")
        report = analyse(Weights.from_model(model, dtype=dtype, device=dev), diag_k=args.diag_k or None)
    data = report.to_dict()
    if args.json:
        print(json.dumps({"path": str(args.ckpt), **data}, indent=2))
        return 0
    from rich.table import Table

    con = console()
    t = Table(title="copying (full OV circuit W_E W_OV W_U)")
    for col in ("head", "eigen score", f"own logit in top {args.diag_k}" if args.diag_k else None, "residual eig"):
        if col:
            t.add_column(col, justify="right")
    for h in report.copying:
        row = [f"{h.layer}.{h.head}", f"{h.eigen_score:+.3f}"]
        if args.diag_k:
            row.append(f"{h.diag_topk_rate:.1%}")
        row.append(f"{h.residual_eigen_score:+.3f}")
        t.add_row(*row)
    con.print(t)
    for kind, comp in report.composition.items():
        pairs = comp.pairs()
        if not pairs:
            continue
        b = comp.baseline
        t = Table(
            title=f"{kind.upper()}-composition, strongest {min(args.top, len(pairs))} of {len(pairs)} "
            f"(baseline {b.mean:.3f} ± {b.std:.3f})"
        )
        for col in ("writer", "reader", "adjusted", "raw", "z"):
            t.add_column(col, justify="right")
        for row in pairs[: args.top]:
            z = (row["raw"] - b.mean) / b.std if b.std > 0 else float("nan")
            t.add_row(row["writer"], row["reader"], f"{row['adjusted']:+.3f}", f"{row['raw']:.3f}", f"{z:+.1f}")
        con.print(t)
    t = Table(title="residual-stream bandwidth (computational dimensions / d_model)")
    for col in ("layer", "own", "before", "after", "before/d_model", "after/d_model"):
        t.add_column(col, justify="right")
    for bw in report.bandwidth:
        d = bw.to_dict()
        t.add_row(
            str(bw.layer),
            str(bw.own),
            str(bw.before),
            str(bw.after),
            f"{d['before_ratio']:.2f}",
            f"{d['after_ratio']:.2f}",
        )
    con.print(t)
    return 0


# --------------------------------------------------------------------------- paths
def _add_paths(sub: Any) -> None:
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
    p.add_argument(
        "--text",
        type=Path,
        help="a text file to analyse (default: the validation split of the checkpoint's training corpus)",
    )
    p.add_argument("--batch", type=_positive_int, default=8, help="sequences of n_ctx tokens (default 8)")
    p.add_argument("--top", type=_positive_int, default=10, help="terms to list per order (default 10)")
    p.add_argument("--float64", action="store_true", help="compute in float64")
    _add_device(p)
    p.add_argument("--json", action="store_true", help="print every number as JSON")
    p.set_defaults(func=_cmd_paths)


def _cmd_paths(args: argparse.Namespace) -> int:
    import time

    import torch

    from .. import paths as P
    from ..weights import Weights

    dev = _device(args)
    model = _load_with_attention(args, "paths", " (its logits are the direct path alone)")
    tokens, _ = analysis_text(args.ckpt, model, args.text, args.batch)
    dtype = torch.float64 if args.float64 else torch.float32
    w = Weights.from_model(model, dtype=dtype, device=dev)
    tokens = tokens.to(dev)
    t0 = time.perf_counter()
    summary = P.summarize(w, tokens, top_virtual=args.top)
    seconds = time.perf_counter() - t0
    ti, singles, virtual = summary.importance, summary.singles, summary.virtual
    data = {"path": str(args.ckpt), **summary.to_dict(), "seconds": seconds}
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    from rich.table import Table

    con = console()
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
    return 0


# --------------------------------------------------------------------------- heads
def _add_heads(sub: Any) -> None:
    p = sub.add_parser(
        "heads",
        help="every head's scores (copying, previous-token, induction, sinks, ...) and its roles",
        description=(
            "Head taxonomy: previous-token, self-attention, sink and positional scores on validation text; "
            "prefix-matching, induction, duplicate-token and copying scores on repeated random tokens "
            "(Olsson et al. 2022: 25 tokens, not among the 5%% most or 20%% least frequent, repeated 4 times "
            "after the start token, 10 examples); eigenvalue copying scores from the weights; the in-context "
            "learning score; memory-management neurons. Roles come from documented thresholds."
        ),
    )
    add_source_args(p)
    p.add_argument("--text", type=Path, help="a text file (default: the validation split of the training corpus)")
    p.add_argument("--batch", type=_positive_int, default=8, help="sequences of validation text (default 8)")
    p.add_argument(
        "--icl-examples",
        type=_positive_int,
        default=256,
        help="validation sequences for the in-context-learning score (default 256)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the repeated random tokens (default 0)")
    p.add_argument("--diag-k", type=_nonneg_int, default=5, help="k of the diagonal top-k copying rate; 0 = skip")
    _add_device(p)
    p.add_argument("--json", action="store_true", help="print every score as JSON")
    p.set_defaults(func=_cmd_heads)


def _cmd_heads(args: argparse.Namespace) -> int:
    from ..heads import THRESHOLDS, head_report

    model = _load_with_attention(args, "heads", device=_device(args))
    text, freqs = analysis_text(args.ckpt, model, args.text, max(args.batch, args.icl_examples), want_corpus=True)
    report = head_report(
        model,
        text[: args.batch],
        frequencies=freqs,
        seed=args.seed,
        diag_k=args.diag_k or None,
        icl_text=text[: args.icl_examples],
    )
    if args.json:
        print(json.dumps({"path": str(args.ckpt), **report.to_dict()}, indent=2))
        return 0
    from rich.table import Table

    con = console()
    cols = [
        ("prev", "previous_token"),
        ("self", "self_attention"),
        ("sink", "sink"),
        ("pos", "positional_fraction"),
        ("prefix", "prefix_matching"),
        ("induct", "induction"),
        ("dup", "duplicate_token"),
        ("copy[I]", "copying"),
        ("eig", "eigen_copying"),
        ("res eig", "residual_eigen"),
    ]
    t = Table(title=f"heads of {args.ckpt}")
    t.add_column("head")
    for name, _ in cols:
        t.add_column(name, justify="right")
    t.add_column("roles")
    for row in report.rows():
        t.add_row(str(row["head"]), *[f"{row[key]:.2f}" for _, key in cols], ", ".join(row["roles"]) or "-")
    con.print(t)
    if report.icl is not None:
        con.print(
            f"in-context learning score: {report.icl.score:+.3f} nats "
            f"(loss at token {report.icl.late} minus loss at token {report.icl.early})"
        )
    if report.memory_neurons:
        con.print(f"memory-management neurons (cos(W_in, W_out) < -0.5): {len(report.memory_neurons)}")
    con.print("thresholds: " + ", ".join(f"{k} {v:g}" for k, v in THRESHOLDS.items()))
    return 0


# ------------------------------------------------------------------------ trigrams
def _add_trigrams(sub: Any) -> None:
    p = sub.add_parser(
        "trigrams",
        help="a head's skip-trigrams [source] ... [destination] -> [output], and the bigram table",
        description=(
            "Skip-trigram table of one head from its QK and OV circuits over the whole vocabulary "
            "(score = centred QK x centred OV; the start token excluded), the crossed trigrams a factored "
            "table implies ('skip-trigram bugs'), and the direct path's bigram table. With --source, that "
            "token's top outputs (OV row) and the destinations that attend to it most (QK column)."
        ),
    )
    add_source_args(p)
    p.add_argument("--head", required=True, metavar="L.H", help="the head, e.g. 0.3")
    p.add_argument("--source", metavar="TOKEN", help="a token string (it must encode to exactly one token)")
    p.add_argument("--top", type=_positive_int, default=20, help="rows to show (default 20)")
    _add_device(p)
    _add_lazy(p)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_trigrams)


def _parse_head(text: str, model: Any) -> tuple[int, int]:
    try:
        l_text, h_text = text.split(".")
        layer, head = int(l_text), int(h_text)
    except ValueError:
        raise QkovError(f"--head: expected LAYER.HEAD like 0.3, got {text!r}") from None
    if not (0 <= layer < model.cfg.n_layers and 0 <= head < model.cfg.n_heads):
        raise QkovError(f"--head {text}: the model has {model.cfg.n_layers} layers x {model.cfg.n_heads} heads")
    return layer, head


def _cmd_trigrams(args: argparse.Namespace) -> int:
    from .. import trigrams as T
    from ..checkpoint import TOKENIZER_FILE, read_tokenizer
    from ..weights import Weights

    dev = _device(args)
    lazy = _lazy(args)
    if lazy:  # only W_E, W_pos, W_U and the one head are read
        from ..lazy import LazyCheckpoint

        source: Any = LazyCheckpoint(args.ckpt, device=dev)
        tokenizer = read_tokenizer(args.ckpt / TOKENIZER_FILE, where=f"checkpoint {str(args.ckpt)!r}")
    else:
        source = load_source(args.ckpt, args.config)
        tokenizer = source.tokenizer
    if tokenizer is None:
        raise QkovError("trigrams: the checkpoint has no tokenizer to show tokens with")
    layer, head = _parse_head(args.head, source)
    if lazy:
        w, layer, head = source.head_weights(layer, head), 0, 0  # a one-head view: the head is 0.0 there
    else:
        w = Weights.from_model(source, device=dev)
    bos = source.bos_token_id
    decode = lambda i: tokenizer.decode([i], skip_special_tokens=False)  # noqa: E731
    data: dict[str, Any] = {"path": str(args.ckpt), "head": args.head}
    if args.source is not None:
        ids = tokenizer.encode(args.source).ids
        if len(ids) != 1:
            raise QkovError(
                f"--source {args.source!r} encodes to {len(ids)} tokens {[decode(i) for i in ids]}; give one token"
            )
        view = T.source_view(w, layer, head, ids[0], top=args.top, exclude=(bos,))
        data["source"] = {
            "token": ids[0],
            "string": decode(ids[0]),
            "outputs": [{"token": i, "string": decode(i), "ov": v} for i, v in view.outputs],
            "destinations": [{"token": i, "string": decode(i), "qk": v} for i, v in view.destinations],
        }
    tri = T.skip_trigrams(w, layer, head, top=max(args.top, 40), exclude=(bos,))
    data["trigrams"] = [t.to_dict(decode) for t in tri[: args.top]]
    bug = T.first_bug(w, layer, head, tri)
    if bug is not None:
        data["bug"] = {
            "trigrams": [t.to_dict(decode) for t in bug],
            "crossed": [t.to_dict(decode) for t in T.crossed_trigrams(w, layer, head, *bug)],
        }
    data["bigrams"] = [b.to_dict(decode) for b in T.bigrams(w, top=args.top, exclude=(bos,))]
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    from rich.table import Table

    con = console()
    if "source" in data:
        src = data["source"]
        t = Table(title=f"head {args.head}, source {src['string']!r}")
        for col in ("top outputs (OV row)", "centred logit", "top destinations (QK column)", "centred score"):
            t.add_column(col, justify="right")
        for o, d in zip(src["outputs"], src["destinations"]):
            t.add_row(repr(o["string"]), f"{o['ov']:.2f}", repr(d["string"]), f"{d['qk']:.2f}")
        con.print(t)
    t = Table(title=f"head {args.head}: skip-trigrams [source] ... [destination] -> [output]")
    for col in ("source", "destination", "output", "qk", "ov", "score"):
        t.add_column(col, justify="right")
    for r in data["trigrams"]:
        t.add_row(
            repr(r["source_str"]),
            repr(r["destination_str"]),
            repr(r["output_str"]),
            f"{r['qk']:.2f}",
            f"{r['ov']:.2f}",
            f"{r['score']:.1f}",
        )
    con.print(t)
    if "bug" in data:
        a, b = data["bug"]["trigrams"]
        c1, c2 = data["bug"]["crossed"]
        fmt = lambda r: f"{r['source_str']!r} ... {r['destination_str']!r} -> {r['output_str']!r} ({r['score']:.1f})"  # noqa: E731
        con.print(f"skip-trigram bug: {fmt(a)} and {fmt(b)} imply {fmt(c1)} and {fmt(c2)}", highlight=False)
    t = Table(title="bigrams (direct path W_E W_U, centred per row)")
    for col in ("token", "next", "logit"):
        t.add_column(col, justify="right")
    for r in data["bigrams"]:
        t.add_row(repr(r["token_str"]), repr(r["next_str"]), f"{r['logit']:.2f}")
    con.print(t)
    return 0
