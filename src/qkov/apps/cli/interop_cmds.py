"""``qkov import`` and ``qkov export``: Hugging Face GPT-2 directories <-> qkov checkpoints."""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path
from typing import Any

from ...errors import QkovError, QkovWarning
from ...io.checkpoint import save_checkpoint
from ...io.hf import gpt2_export, save_hf
from ...io.sources import hf_model_type, source_kind
from ...io.tl import save_tl, tl_config_dict
from .common import add_source_args, load_source

__all__ = ["add_export", "add_import", "cmd_export", "cmd_import", "SOURCES_HELP", "TARGETS"]

TARGETS = ("transformer-lens", "hf")
SOURCES_HELP = (
    "a qkov checkpoint, a Hugging Face directory (save_pretrained: GPT-2, GPT-NeoX/Pythia, Llama, Mistral, "
    "Qwen2), a TransformerLens "
    "state-dict file (.pt/.pth/.safetensors) or a Hugging Face Hub name"
)


def _check_out(out: Path) -> None:
    """Refuse to write over anything: a new file, or a new or empty directory (no mixing with old files)."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise QkovError(f"--out {str(out)!r} already exists" + (" and is not empty" if out.is_dir() else ""))


def add_import(sub: Any) -> None:
    p = sub.add_parser(
        "import",
        help="turn a TransformerLens file, Hugging Face directory (GPT-2, Pythia/GPT-NeoX, Llama, Mistral, Qwen2) "
        "or Hub name into a qkov checkpoint",
        description=(
            "Convert a model into a qkov checkpoint that every qkov command reads. SOURCE is "
            + SOURCES_HELP
            + ". Torch files are read with weights_only=True (no code is unpickled); "
            "a Hub name needs a network or the local Hugging Face cache. Conversions are exact or refused "
            "with the reason (e.g. a rope scaling qkov does not implement, TransformerLens' LayerNorm with "
            "shortformer positions). Analyses read Hugging Face directories directly too, memory-mapped."
        ),
    )
    add_source_args(p)
    p.add_argument("--out", type=Path, required=True, help="new checkpoint directory")
    p.set_defaults(func=cmd_import)


def cmd_import(args: argparse.Namespace) -> int:
    _check_out(args.out)
    kind = source_kind(args.ckpt)
    with warnings.catch_warnings(record=True) as caught:  # what the import chose for the user is recorded too
        warnings.simplefilter("always", QkovWarning)
        model = load_source(args)
    for w in caught:
        warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    origin: dict[str, Any] = {"format": kind, "path": str(args.ckpt)}
    family = hf_model_type(args.ckpt) if kind == "hf" else None
    if family is not None:  # the report card and qkov info name it
        origin["family"] = family
    notes = [str(w.message) for w in caught if issubclass(w.category, QkovWarning)]
    if notes:
        origin["warnings"] = notes
    save_checkpoint(model, args.out, training={"imported_from": origin})
    c = model.cfg
    print(
        f"imported {args.ckpt} ({kind}) -> {args.out}: {c.describe()}, {model.num_parameters():,} parameters"
        + ("" if model.tokenizer is not None else " (no tokenizer: token ids only)")
    )
    return 0


def add_export(sub: Any) -> None:
    p = sub.add_parser(
        "export",
        help="write a qkov checkpoint as a TransformerLens state dict + config, or a Hugging Face GPT-2 directory",
        description=(
            "--to transformer-lens: one file, .safetensors (config JSON in its metadata under "
            "transformer_lens_config) or .pt (a dict with 'config' and 'state_dict'; torch.load(weights_only=True) "
            "reads it); open it with HookedTransformer(HookedTransformerConfig(**config)).load_state_dict(...). "
            "Needs transformer-lens installed. --to hf: a directory that transformers' "
            "GPT2LMHeadModel.from_pretrained loads; only for models GPT-2 can express (LayerNorm, MLPs, standard "
            "positions, n_heads * d_head = d_model, no unembedding bias)."
        ),
    )
    p.add_argument("ckpt", type=Path, metavar="CKPT", help="qkov checkpoint (or any source qkov import reads)")
    p.add_argument("--to", dest="fmt", choices=TARGETS, required=True, help="target format")
    p.add_argument("--out", type=Path, required=True, help="new file (transformer-lens) or directory (hf)")
    p.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    model = load_source(args)
    if args.fmt == "hf":
        gpt2_export(model)  # refuse an inexpressible model before creating --out
        _check_out(args.out)
        save_hf(model, args.out)
        print(f"exported {args.ckpt} -> {args.out} (Hugging Face GPT-2: GPT2LMHeadModel.from_pretrained)")
    else:
        tl_config_dict(model.cfg)
        _check_out(args.out)
        save_tl(model, args.out)
        print(f"exported {args.ckpt} -> {args.out} (TransformerLens state dict + config)")
    return 0
