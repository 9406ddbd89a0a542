"""Shared pieces of the command line: the one-line-error parser, option types, the model
argument every analysis takes, and the advice a library error's hint becomes."""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, NoReturn

import torch
from rich.console import Console

from ...analysis.forward.address import as_head
from ...device import pick_device, set_memory_budget
from ...finite import json_safe
from ...errors import QkovError, QkovWarning
from ...io.hf_families import FAMILIES
from ...io.sources import load_any, source_kind
from ...model.config import ModelConfig
from ...model.transformer import Transformer
from ...weights.lazy import LazyCheckpoint, streamable, streams_by_default
from ...weights.view import Weights

__all__ = [
    "add_device",
    "add_diag",
    "add_inputs",
    "add_lazy",
    "add_source_args",
    "BATCH_HELP",
    "console",
    "count_or_all",
    "device",
    "diag_caption",
    "dump_json",
    "error_line",
    "EXIT_USAGE",
    "HINT_ADVICE",
    "ICL_HELP",
    "int_at_least",
    "lazy",
    "load_source",
    "load_view",
    "nonneg_int",
    "out_of_memory_line",
    "parse_head",
    "Parser",
    "positive_float",
    "positive_int",
    "show_warning",
    "streamable",
    "token_count",
]

EXIT_USAGE = 2

HINT_ADVICE = {
    "text": "pass --text FILE",
    "resume": "pass --resume to continue it, or choose another --out",
    "out": "choose another --out",
    "config": "pass --config CONFIG.json",
    "overwrite": "pass --force to replace it, or choose another output directory",
    "batch": "pass a smaller --batch, or a larger --max-memory if more is free",
    "memory": "or pass a larger --max-memory if more is free",
    "size": "pass fewer --layers, a smaller --d-model, --mlp, --vocab or --ctx, or a smaller --batch",
}
"""What the command line adds to a :class:`QkovError` carrying each hint."""


def out_of_memory_line(exc: BaseException, command: str | None = None) -> str | None:
    """The one line for an allocation that failed (CPU allocator, CUDA, Python) in ``command``, ``None`` for
    any other error. Its advice names the flags of that command (``train`` takes no ``--max-memory``)."""
    text = str(exc)
    oom = isinstance(exc, (MemoryError, torch.OutOfMemoryError))
    if not (oom or "DefaultCPUAllocator" in text or "out of memory" in text.lower()):
        return None
    m = re.search(r"allocate (\d+(?:\.\d+)?) ?(bytes|[KMGT]iB)", text)
    size = ""
    if m:
        size = f" {m.group(1)} {m.group(2)}" if m.group(2) != "bytes" else f" {_size(int(m.group(1)))}"
    if command == "train":
        advice = f"{HINT_ADVICE['size']}, or use another --device"
    else:
        advice = (
            "pass --max-memory to have the analyses refuse work that would not fit before they start, analyse less "
            "at once, or use another --device"
        )
    return f"qkov: error: out of memory: an allocation of{size or ' memory'} failed ({advice})\n"


def _size(n: int) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def show_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int, *_: Any) -> None:
    """``warnings.showwarning`` for the command line: a :class:`QkovWarning` as ``qkov: warning: ...``
    on one line; any other warning as Python formats it."""
    if issubclass(category, QkovWarning):
        sys.stderr.write(f"qkov: warning: {message}\n")
    else:
        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno))


def error_line(exc: QkovError) -> str:
    """The one line ``qkov: error: ...`` for a library error, with the command line's advice."""
    advice = f" ({HINT_ADVICE[exc.hint]})" if exc.hint in HINT_ADVICE else ""
    return f"qkov: error: {exc}{advice}\n"


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (``qkov: error: ...``) and exit status 2."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message} (see --help)\n")
        raise SystemExit(EXIT_USAGE)


def int_at_least(lo: int, what: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    return parse


positive_int = int_at_least(1, "a positive integer")
nonneg_int = int_at_least(0, "an integer >= 0")


def count_or_all(text: str) -> int | None:
    """An integer >= 0, or ``all`` (``None``: no limit)."""
    if text.strip().lower() == "all":
        return None
    try:
        return int_at_least(0, "an integer >= 0 or 'all'")(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0 or 'all', got {text!r}") from None


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def token_count(text: str) -> int:
    """``20M``, ``500k``, ``1.5e6`` -> an integer token count."""
    t = text.strip().lower()
    scale = 1
    if t and t[-1] in "kmb":
        scale = {"k": 10**3, "m": 10**6, "b": 10**9}[t[-1]]
        t = t[:-1]
    try:
        value = float(t) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a token count like 8M or 500k, got {text!r}") from None
    if not (value >= 1 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a positive token count, got {text!r}")
    return int(value)


def console() -> Console:
    """A console for tables: the terminal's width, or 160 columns when output is piped."""
    con = Console()
    return con if con.is_terminal else Console(width=160)


# ----------------------------------------------------------------- the model argument
def add_source_args(p: argparse.ArgumentParser) -> None:
    """The model argument of the analysis commands: any source, and the config a bare TransformerLens file needs."""
    p.add_argument(
        "ckpt",
        type=Path,
        metavar="SOURCE",
        help="a qkov checkpoint, Hugging Face directory (GPT-2, Pythia, Llama, Mistral, Qwen2), TransformerLens file "
        "(.pt/.pth/.safetensors), Hub name",
    )
    p.add_argument("--config", type=Path, help="TransformerLens config JSON, for a state-dict file that carries none")


def load_source(args: argparse.Namespace, command: str | None = None, why: str = "") -> Transformer:
    """The model of ``args.ckpt`` (any source the analyses read). With ``command``: a one-line
    error for a model without attention layers (``why`` appended)."""
    model = load_any(args.ckpt, config=getattr(args, "config", None))
    if command is not None and model.cfg.n_layers == 0:
        raise QkovError(f"{command}: the model has no attention layers{why}")
    return model


def load_view(args: argparse.Namespace, command: str, why: str, dev: torch.device) -> Weights:
    """The folded weights view of ``args.ckpt`` on ``dev``, read once: a qkov checkpoint or a Hugging Face
    directory of a family qkov streams (:func:`streamable`) is read layer by layer from its memory map straight
    into the view, no model beside it; any other source is loaded and its view made, the model then dropped.
    A one-line error for a model without attention layers (``command`` and ``why`` in it)."""
    if streamable(args.ckpt):
        w = Weights.from_source(LazyCheckpoint(args.ckpt, device=dev))
    else:
        model = load_source(args)
        w = Weights.from_model(model, device=dev)
        del model  # the view holds what the analysis reads
    if w.cfg.n_layers == 0:
        raise QkovError(f"{command}: the model has no attention layers{why}")
    return w


def add_inputs(p: argparse.ArgumentParser) -> None:
    """``--text FILE`` or ``--tokens FILE``: what an analysis that runs the model reads."""
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--text",
        type=Path,
        help="a text file to analyse, cut into context-length windows, or one sequence of its own length when "
        "shorter (scores that need longer sequences are left out, with the reason); default: the validation "
        "split of a qkov checkpoint's training corpus; with no corpus and no tokenizer, seeded random tokens, "
        "and the output says so",
    )
    g.add_argument(
        "--tokens",
        type=Path,
        metavar="FILE",
        help="token ids to analyse: .npy (1-D stream or 2-D [sequences, positions]), a raw uint16 .bin, or "
        "whitespace-separated integers (a model without a tokenizer needs no text)",
    )


BATCH_HELP = (
    "sequences of n_ctx tokens for the pattern-based scores (default 8, or fewer so they hold at most 2048 "
    "tokens: 2 at GPT-2's 1024); scored a few sequences and one layer at a time, so memory does not grow "
    "with it; time does (~10 s per 1024-token sequence at GPT-2 size on a 2-core CPU)"
)
ICL_HELP = (
    "validation sequences for the in-context-learning score, each read up to token 501 (default 256, or "
    "fewer so their forward passes stay within ~2 TFLOP, at least 16: 16 at GPT-2 size, ~1 s each on a "
    "2-core CPU)"
)


def add_diag(p: argparse.ArgumentParser) -> None:
    """``--diag-k`` and ``--diag-sample``: the own-logit-in-top-k copying rate and its cost."""
    p.add_argument(
        "--diag-k",
        type=nonneg_int,
        default=5,
        help="k of the copying rate 'own logit in the top k of its full-OV row' (default 5; 0 = skip)",
    )
    p.add_argument(
        "--diag-sample",
        type=positive_int,
        metavar="N",
        help="tokens that rate is measured on (default: every token up to a vocabulary of 8192, exact; else "
        "a seeded sample of 1024, shown with its standard error). N >= the vocabulary is exact, which costs "
        "vocab^2 x d_head per head: minutes per head at GPT-2's 50,257 tokens on a laptop CPU",
    )


def diag_caption(n: int | None, d_vocab: int) -> str | None:
    """What the copying rate was measured on, when it was an estimate."""
    if n is None or n >= d_vocab:
        return None
    return (
        f"own-logit-in-top-k rate estimated on a seeded sample of {n:,} of {d_vocab:,} tokens "
        "(± one standard error; --diag-sample N sets the sample, N >= the vocabulary is exact and slow)"
    )


def add_device(p: argparse.ArgumentParser, *, memory: bool = True) -> None:
    """``--device``, and ``--max-memory`` for a command whose analyses plan their memory against it
    (``memory=False``: a command that cannot honour a budget does not offer one)."""
    p.add_argument(
        "--device", default="auto", help="where to compute: auto (default; cuda if available), cpu, cuda or cuda:N"
    )
    if not memory:
        return
    p.add_argument(
        "--max-memory",
        type=_memory_size,
        metavar="SIZE",
        help="what the analysis may allocate beyond the weights, e.g. 4GiB or 500MiB (default: the memory free on "
        "the device); chunked work is split to fit, and work whose smallest part would not fit is refused before "
        "it starts, naming what reduces it",
    )


def _memory_size(text: str) -> int:
    """``4GiB``, ``500MiB``, ``2G``, ``1.5GB`` or a number of bytes -> bytes (K, M, G and T are
    powers of 1024 with or without ``iB``/``B``)."""
    units = {None: 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(?:([kmgt])(?:i?b)?|b)?\s*", text.lower())
    value = int(float(m.group(1)) * units[m.group(2)]) if m else 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a memory size such as 4GiB or 500MiB, got {text!r}")
    return value


def device(args: argparse.Namespace) -> torch.device:
    """The ``--device`` as a torch device, checked before any work (one-line error if unusable); sets
    the memory budget of ``--max-memory``."""
    set_memory_budget(getattr(args, "max_memory", None))
    return pick_device(args.device)


def add_lazy(p: argparse.ArgumentParser, note: str = "MLP weights are never read") -> None:
    """``--lazy``; ``note`` ends its help (what the command reads of the model, or how)."""
    p.add_argument(
        "--lazy",
        action="store_true",
        help="read the weights layer by layer from a memory map instead of loading the model: a qkov "
        f"checkpoint or a Pythia/Llama/Mistral/Qwen2 directory (automatic when the weights are over 1 GiB; {note})",
    )


def lazy(args: argparse.Namespace) -> bool:
    """``--lazy``, or automatically when the weights (``model.safetensors``, or a Hugging Face
    directory's shards) are larger than ``AUTO_LAZY_BYTES``
    (:func:`~qkov.weights.lazy.streams_by_default`)."""
    if not streamable(args.ckpt):
        if args.lazy and source_kind(args.ckpt) == "hf":
            raise QkovError(
                f"--lazy reads {', '.join(FAMILIES)} Hugging Face directories; import GPT-2 first (qkov import)"
            )
        if args.lazy:
            raise QkovError(
                "--lazy reads qkov checkpoints and Hugging Face directories: convert the model first with qkov import"
            )
        return False
    return bool(args.lazy) or streams_by_default(args.ckpt)


def parse_head(text: str, cfg: ModelConfig, flag: str = "--head") -> tuple[int, int]:
    """``--head L.H`` -> ``(layer, head)``, checked against the model (the one head parser); errors name
    ``flag``, the option the user typed."""
    head = as_head(text, cfg, flag)
    return head.layer, head.head  # type: ignore[return-value]


def dump_json(data: dict[str, Any]) -> None:
    """Print ``data`` as indented, strict JSON (the ``--json`` output of every command): a NaN or an
    infinity is ``null`` (:func:`qkov.finite.json_safe`), as in every JSON file qkov writes."""
    print(json.dumps(json_safe(data), indent=2, allow_nan=False))
