"""``qkov info``: what a model source is, for every source the analyses read."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.table import Table

from ...io.checkpoint import TOKENIZER_FILE, checkpoint_info, training_record
from ...io.sources import source_kind
from ...model.config import ModelConfig
from ...weights.lazy import LazyCheckpoint
from ..origin import FORMATS, UNKNOWN, describe_origin, parameter_count, source_origin
from .common import add_lazy, add_source_args, console, dump_json, lazy, load_source

__all__ = ["add_info", "cmd_info", "print_info"]


def add_info(sub: Any) -> None:
    p = sub.add_parser(
        "info",
        help="describe a model source: config, parameters, start token, tokenizer, training record or origin",
        description=(
            "Describe any source the analyses read: a qkov checkpoint (its training record: steps, tokens, "
            "final losses), a Hugging Face directory, a TransformerLens file or a Hub name (where it came from, "
            "and what its source does not record). A large checkpoint or Hugging Face directory is read from "
            "its headers only (--lazy), without loading the weights."
        ),
    )
    add_source_args(p)
    add_lazy(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_info)


def _source_info(args: argparse.Namespace) -> dict[str, Any]:
    """What ``qkov info --json`` prints: ``path``, ``kind``, ``model`` (the config), ``parameters`` (for a
    Hugging Face directory, what it stores),
    ``bos_token_id``, ``tokenizer`` (whether it has one), ``imported_from`` (``None`` for a model
    ``qkov train`` wrote) and, for an imported model, ``unknown`` (what its source does not
    record); a qkov checkpoint adds its training record (:func:`qkov.io.checkpoint.checkpoint_info`)."""
    kind = source_kind(args.ckpt)
    if lazy(args):  # the headers only: the config, the tensors' shapes, the start token
        ck = LazyCheckpoint(args.ckpt)
        cfg, bos, parameters = ck.cfg, ck.bos_token_id, parameter_count(args.ckpt, ck)
        tokenizer = (Path(args.ckpt) / TOKENIZER_FILE).is_file()
        record = training_record(args.ckpt) if kind == "qkov" else {}
    else:
        model = load_source(args)
        cfg, bos, parameters = model.cfg, model.bos_token_id, parameter_count(args.ckpt, model)
        tokenizer = model.tokenizer is not None
        record = checkpoint_info(args.ckpt, model) if kind == "qkov" else {}
    origin = source_origin(args.ckpt)
    info: dict[str, Any] = {"path": str(args.ckpt), "kind": kind, "model": cfg.to_dict(), "parameters": parameters}
    info.update(record)
    info.update(bos_token_id=bos, tokenizer=bool(tokenizer), imported_from=origin)
    if origin is not None:
        info["unknown"] = list(UNKNOWN)
    return info


def _print(info: dict[str, Any]) -> None:
    kind = info["kind"]
    table = Table(title=f"{FORMATS[kind]} {info['path']}", show_header=False)
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    m = info["model"]
    table.add_row("model", ModelConfig.from_dict(m).describe())
    table.add_row("parameters", f"{info['parameters']:,}")
    table.add_row("start token", str(info["bos_token_id"]))
    table.add_row("tokenizer", "yes" if info["tokenizer"] else "none (analyses read token ids: --tokens)")
    origin = info["imported_from"]
    if origin is not None:
        table.add_row("imported", describe_origin(origin))
        for note in origin.get("warnings", []):
            table.add_row("import warning", note)
        table.add_row("unknown", "; ".join(info["unknown"]))
        console().print(table)
        return
    table.add_row(
        "trained",
        f"{fmt(info['steps'], ',')} / {fmt(info['steps_planned'], ',')} steps, "
        f"{fmt(info['tokens'], ',')} tokens" + ("" if info["complete"] else " (incomplete: --resume)"),
    )
    table.add_row("train loss", fmt(info["train_loss"], ".4f"))
    table.add_row("validation loss", fmt(info["val_loss"], ".4f"))
    if m["n_layers"] >= 2:
        table.add_row(
            "induction score", fmt(info["induction_score"], ".3f") + "  (best layer>=1 head, repeated random tokens)"
        )
    table.add_row("time", f"{fmt(info['wall_s'], '.0f')} s on {info['device'] or '-'}")
    table.add_row("corpus", str(info["corpus"]))
    console().print(table)


def print_info(path: Path) -> None:
    """The table of ``qkov info PATH`` (what ``qkov train`` prints at the end)."""
    _print(_source_info(argparse.Namespace(ckpt=path, config=None, lazy=False)))


def cmd_info(args: argparse.Namespace) -> int:
    info = _source_info(args)
    if args.json:
        dump_json(info)
    else:
        _print(info)
    return 0
