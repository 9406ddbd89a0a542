"""The commands that read weights only: ``qkov circuits`` and ``qkov trigrams``.

Both work on the in-memory view or, for a large qkov checkpoint (or ``--lazy``), on the
memory-mapped one: the analyses are the same functions either way.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from rich.table import Table

from ...analysis.circuits import trigrams
from ...analysis.circuits.rotary import OffsetProfiles
from ...analysis.circuits.report import CircuitsReport, circuits_report
from ...analysis.heads.gates import gate_caveat
from ...errors import QkovError
from ...io.checkpoint import TOKENIZER_FILE, read_tokenizer
from ...model.tokens import text_codec, token_decoder
from ...weights.lazy import LazyCheckpoint
from ...weights.parts import WeightSource
from ...weights.view import Weights
from ..progress import StageProgress
from ..ranks import ranks
from .common import (
    add_device,
    add_diag,
    add_lazy,
    add_source_args,
    diag_caption,
    console,
    device,
    dump_json,
    lazy,
    load_source,
    parse_head,
    positive_int,
)

__all__ = ["add_circuits", "add_trigrams", "cmd_circuits", "cmd_trigrams"]


def _source(
    args: argparse.Namespace, dtype: torch.dtype = torch.float32, dev: torch.device | None = None
) -> tuple[WeightSource, Any, int]:
    """The weight source of ``args.ckpt`` (memory-mapped when :func:`lazy`) on ``dev`` (default
    ``--device``), its tokenizer and start token."""
    dev = device(args) if dev is None else dev
    if lazy(args):
        ck = LazyCheckpoint(args.ckpt, dtype=dtype, device=dev)
        tokenizer = read_tokenizer(args.ckpt / TOKENIZER_FILE, where=f"checkpoint {str(args.ckpt)!r}")
        return ck, tokenizer, ck.bos_token_id
    model = load_source(args)
    return Weights.from_model(model, dtype=dtype, device=dev), model.tokenizer, model.bos_token_id


# ------------------------------------------------------------------------ circuits
def add_circuits(sub: Any) -> None:
    p = sub.add_parser(
        "circuits",
        help="copying and Q/K/V composition scores of every head, from the weights alone",
        description=(
            "Weight-based circuit analysis (Elhage et al., 2021): per head, the eigenvalue copying score "
            "of the full OV circuit W_E W_OV W_U and the rate at which a token's own logit is in the top k "
            "of its OV row (exact over the whole vocabulary); for every pair of heads in increasing layers, "
            "Q-, K- and V-composition scores with the random-matrix baseline subtracted (raw and baseline "
            "shown too); and the residual-stream bandwidth per layer. Rotary models (Pythia, Llama, Mistral, "
            "Qwen2): Q- and K-composition are averaged over an offset set (--offsets), and each head's "
            "offset profile (its expected score at each query-key offset, from the weights alone) is shown."
        ),
    )
    add_source_args(p)
    p.add_argument("--top", type=positive_int, default=5, help="composition pairs to show per kind (default 5)")
    p.add_argument(
        "--offsets",
        type=_offset_list,
        default=None,
        help="rotary models: query-key offsets Q/K composition is averaged over, e.g. 1,2,3 "
        "(default 0,1,2,4,... up to the context or 1024)",
    )
    add_diag(p)
    p.add_argument("--float64", action="store_true", help="compute in float64")
    p.add_argument(
        "--bf16-matmul",
        action="store_true",
        help="composition's large products in bfloat16: ~5x faster on CPUs with AMX (composition of every pair "
        "at Llama-3-8B shape: ~4 min instead of ~11), scores change by ~1e-5",
    )
    add_device(p)
    add_lazy(p)
    p.add_argument("--json", action="store_true", help="print every score as JSON")
    p.set_defaults(func=cmd_circuits)


def cmd_circuits(args: argparse.Namespace) -> int:
    with ranks(device(args)) as (split, dev), StageProgress() as progress:  # torchrun: heads, pairs of layers
        source, _, _ = _source(args, torch.float64 if args.float64 else torch.float32, dev)
        if source.cfg.n_layers == 0:
            raise QkovError("circuits: the model has no attention layers")
        report = circuits_report(
            source,
            diag_k=args.diag_k or None,
            diag_sample=args.diag_sample,
            progress=progress if split.main else None,
            offsets=args.offsets,
            matmul_dtype=torch.bfloat16 if args.bf16_matmul else None,
        )
    if not split.main:
        return 0
    note = gate_caveat(source.cfg)  # weight-only OV circuits ignore a gated model's gates
    if args.json:
        dump_json({"path": str(args.ckpt), **report.to_dict(), **({"gate_note": note} if note else {})})
        return 0
    _print_circuits(report, args.diag_k, args.top, source.cfg.d_vocab)
    if note:
        console().print(note, highlight=False)
    return 0


def _print_circuits(report: CircuitsReport, diag_k: int, top: int, d_vocab: int) -> None:
    con = console()
    caption = diag_caption(report.copying[0].diag_tokens, d_vocab) if diag_k and report.copying else None
    t = Table(title="copying (full OV circuit W_E W_OV W_U)", caption=caption)
    for col in ("head", "eigen score", f"own logit in top {diag_k}" if diag_k else None, "residual eig"):
        if col:
            t.add_column(col, justify="right")
    for h in report.copying:
        row = [f"{h.layer}.{h.head}", f"{h.eigen_score:+.3f}"]
        if diag_k:
            err = f" ± {h.diag_stderr:.1%}" if caption and h.diag_stderr is not None else ""
            row.append(f"{h.diag_topk_rate:.1%}{err}")
        row.append(f"{h.residual_eigen_score:+.3f}")
        t.add_row(*row)
    con.print(t)
    for kind, comp in report.composition.items():
        pairs = comp.pairs()
        if not pairs:
            continue
        b = comp.baseline
        over = "" if comp.offsets is None else f", mean over offsets {','.join(map(str, comp.offsets))}"
        t = Table(
            title=f"{kind.upper()}-composition, strongest {min(top, len(pairs))} of {len(pairs)} "
            f"(baseline {b.mean:.3f} ± {b.std:.3f}{over})"
        )
        for col in ("writer", "reader", "adjusted", "raw", "z"):
            t.add_column(col, justify="right")
        for row in pairs[:top]:
            z = (row["raw"] - b.mean) / b.std if b.std > 0 else float("nan")
            t.add_row(row["writer"], row["reader"], f"{row['adjusted']:+.3f}", f"{row['raw']:.3f}", f"{z:+.1f}")
        con.print(t)
    if report.offsets is not None:
        _print_offsets(report.offsets, 2 * top)
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


def _print_offsets(prof: OffsetProfiles, top: int) -> None:
    """The heads whose weights prefer one query-key offset most (a previous-token head: offset 1)."""
    rows = prof.to_dict()["heads"]
    rows.sort(key=lambda r: -r["height"])
    t = Table(
        title=f"rotary offset profile from the weights, strongest {min(top, len(rows))} of {len(rows)} heads "
        f"(offsets {prof.offsets[0]}..{prof.offsets[-1]})",
        caption="expected score of two random tokens at each offset; height = best minus median (logits)",
    )
    for col in ("head", "preferred offset", "height"):
        t.add_column(col, justify="right")
    for r in rows[:top]:
        t.add_row(r["head"], str(r["peak_offset"]), f"{r['height']:.2f}")
    console().print(t)


def _offset_list(text: str) -> list[int]:
    """``"0,1,2"`` -> ``[0, 1, 2]`` (argparse type; the range is checked against the model later)."""
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected offsets like 0,1,2, got {text!r}") from None
    if not out or min(out) < 0:
        raise argparse.ArgumentTypeError(f"expected non-negative offsets like 0,1,2, got {text!r}")
    return out


# ------------------------------------------------------------------------ trigrams
def add_trigrams(sub: Any) -> None:
    p = sub.add_parser(
        "trigrams",
        help="a head's skip-trigrams [source] ... [destination] -> [output], and the bigram table",
        description=(
            "Skip-trigram table of one head from its QK and OV circuits over the whole vocabulary "
            "(score = centred QK x centred OV; the start token, special and byte-fallback tokens left out unless "
            "--all-tokens), the crossed trigrams a factored "
            "table implies ('skip-trigram bugs'), and the direct path's bigram table. With --source, that "
            "token's top outputs (OV row) and the destinations that attend to it most (QK column)."
        ),
    )
    add_source_args(p)
    p.add_argument("--head", required=True, metavar="L.H", help="the head, e.g. 0.3")
    p.add_argument(
        "--source",
        metavar="TOKEN",
        help="a token string (it must encode to exactly one token); for a model without a tokenizer, a token id",
    )
    p.add_argument("--top", type=positive_int, default=20, help="rows to show (default 20)")
    p.add_argument(
        "--all-tokens",
        action="store_true",
        help="keep special and byte-fallback tokens in the tables (default: only ordinary text tokens; "
        "the start token is always left out)",
    )
    add_device(p)
    add_lazy(p)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_trigrams)


def _source_token(token: str, tokenizer: Any, decode: Any, vocab: int) -> list[int]:
    """``--source``'s one token id: a token string, or (without a tokenizer) an id as ``17`` or ``<17>``."""
    if tokenizer is None:
        digits = token.strip().removeprefix("<").removesuffix(">")
        if not digits.isdigit() or int(digits) >= vocab:
            raise QkovError(
                f"--source {token!r}: this model has no tokenizer, so give a token id in [0, {vocab - 1}] "
                "(e.g. 17 or <17>)"
            )
        return [int(digits)]
    try:
        return [text_codec(tokenizer, 0).single_token(token)]
    except QkovError as exc:
        raise QkovError(f"--source {exc}") from None


def _trigram_data(
    source: WeightSource, tokenizer: Any, bos: int, head: str, top: int, token: str | None, all_tokens: bool = False
) -> dict[str, Any]:
    """Everything ``qkov trigrams`` shows, as JSON-ready data (token strings decoded). ``all_tokens``:
    only the start token is left out (else special and byte-fallback tokens too)."""
    layer, index = parse_head(head, source.cfg)
    decode = token_decoder(tokenizer)
    table = trigrams.TrigramTable(source, layer, index)  # reads W_E and W_U once
    exclude = (bos,) if all_tokens else None
    data: dict[str, Any] = {"head": head, "left_out": table.left_out_note(exclude)}
    if layer > 0:
        data["note"] = (
            f"head {head} is in layer {layer}: this is its one-layer (direct) view, reading the token "
            "embeddings as queries and keys and writing straight to the unembedding; what earlier layers "
            "write into its inputs (e.g. K-composition with a previous-token head) is not in it"
        )
    if token is not None:
        ids = _source_token(token, tokenizer, decode, source.cfg.d_vocab)
        view = table.source_view(ids[0], top=top, exclude=exclude)
        data["source"] = {
            "token": ids[0],
            "string": decode(ids[0]),
            "outputs": [{"token": i, "string": decode(i), "ov": v} for i, v in view.outputs],
            "destinations": [{"token": i, "string": decode(i), "qk": v} for i, v in view.destinations],
        }
    tri = table.top(max(top, 40), exclude=exclude)
    data["trigrams"] = [t.to_dict(decode) for t in tri[:top]]
    bug = trigrams.first_bug(tri)
    if bug is not None:
        data["bug"] = {
            "trigrams": [t.to_dict(decode) for t in bug],
            "crossed": [t.to_dict(decode) for t in table.crossed(*bug)],
        }
    del table  # the bigram table is planned alone: the two are never held at once
    data["bigrams"] = [b.to_dict(decode) for b in trigrams.bigrams(source, top=top, exclude=exclude).bigrams]
    return data


def cmd_trigrams(args: argparse.Namespace) -> int:
    with ranks(device(args)) as (split, dev):  # torchrun: one head's table is one unit, rank 0's
        source, tokenizer, bos = _source(args, dev=dev)  # without a tokenizer, tokens show as <id>
        parse_head(args.head, source.cfg)  # a bad head is every rank's error
        if not split.main:
            return 0
        found = _trigram_data(source, tokenizer, bos, args.head, args.top, args.source, args.all_tokens)
        data = {"path": str(args.ckpt), **found}
    if args.json:
        dump_json(data)
        return 0
    _print_trigrams(data, args.head)
    return 0


def _print_trigrams(data: dict[str, Any], head: str) -> None:
    con = console()
    if "note" in data:
        con.print(f"note: {data['note']}", highlight=False)
    if data.get("left_out"):
        con.print(f"tokens: {data['left_out']} (--all-tokens keeps them)", highlight=False)
    if "source" in data:
        src = data["source"]
        t = Table(title=f"head {head}, source {src['string']!r}")
        for col in ("top outputs (OV row)", "centred logit", "top destinations (QK column)", "centred score"):
            t.add_column(col, justify="right")
        for o, d in zip(src["outputs"], src["destinations"]):
            t.add_row(repr(o["string"]), f"{o['ov']:.2f}", repr(d["string"]), f"{d['qk']:.2f}")
        con.print(t)
    t = Table(title=f"head {head}: skip-trigrams [source] ... [destination] -> [output]")
    for col in ("source", "destination", "output", "qk", "ov", "score"):
        t.add_column(col, justify="right")
    for r in data["trigrams"]:
        cells = (repr(r["source_str"]), repr(r["destination_str"]), repr(r["output_str"]))
        t.add_row(*cells, f"{r['qk']:.2f}", f"{r['ov']:.2f}", f"{r['score']:.1f}")
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
