"""``qkov train``."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any


from ...errors import QkovError
from ...model.config import GATE_CHOICES, NORMALIZATION_CHOICES, POSITIONAL_CHOICES, RESIDUAL_CHOICES, ModelConfig
from ...training.config import SCHEDULES, TrainConfig
from ...ranks import Ranks
from ...training.loop import saved_configs, train
from ...training.snapshots import parse_spec
from ..progress import TrainProgress
from .info_cmds import print_info
from .common import nonneg_int, positive_float, positive_int, token_count

__all__ = ["add_train", "cmd_train", "MODEL_FLAGS", "TRAIN_FLAGS"]


# --------------------------------------------------------------------------- train
def _snapshot_spec(text: str) -> int | tuple[int, ...]:
    try:
        return parse_spec(text)
    except QkovError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("snapshots: ")) from None


MODEL_FLAGS = {  # flag dest -> ModelConfig field
    "layers": "n_layers",
    "heads": "n_heads",
    "d_model": "d_model",
    "d_head": "d_head",
    "ctx": "n_ctx",
    "vocab": "d_vocab",
    "positional": "positional",
    "norm": "normalization",
    "mlp": "d_mlp",
    "gate": "gate",
    "loop": "loop",
    "residual": "residual",
    "streams": "n_streams",
    "attnres_block": "attnres_block",
    "hyper_dynamic": "hyper_dynamic",
    "sinkhorn_iters": "sinkhorn_iters",
}
TRAIN_FLAGS = {  # flag dest -> TrainConfig field
    "batch": "batch",
    "lr": "lr",
    "warmup": "warmup",
    "schedule": "schedule",
    "steps": "steps",
    "seed": "seed",
    "corpus": "corpus",
    "eval_interval": "eval_interval",
    "ckpt_interval": "ckpt_interval",
    "weight_decay": "weight_decay",
    "precision": "precision",
    "snapshots": "snapshots",
}


def _add_bus_flags(a: Any) -> None:
    """The flags of the bus generalised (docs/architectures.md): gates, loops, residual schemes."""
    a.add_argument(
        "--gate", choices=GATE_CHOICES,
        help="gated attention (Qiu et al. 2025): a sigmoid gate of the query position on each head's output, "
        "one per channel (elementwise) or per head (headwise); default none (docs/architectures.md)",
    )  # fmt: skip
    a.add_argument(
        "--loop", type=positive_int, metavar="K",
        help="looped depth: the --layers blocks applied K times, sharing their weights (default 1)",
    )  # fmt: skip
    a.add_argument(
        "--residual", choices=RESIDUAL_CHOICES,
        help="how sublayers read and write the stream (docs/architectures.md; default sum)",
    )  # fmt: skip
    a.add_argument("--streams", type=positive_int, metavar="N", help="streams of --residual hyper or mhc (default 1)")
    a.add_argument("--attnres-block", type=positive_int, metavar="S", help="sublayers per block of --residual attnres-block")
    a.add_argument(
        "--hyper-dynamic", action="store_const", const=True, help="--residual hyper: add the dynamic hyper-connection terms"
    )
    a.add_argument("--sinkhorn-iters", type=positive_int, metavar="K", help="--residual mhc: Sinkhorn iterations (default 20)")


def add_train(sub: Any) -> None:
    d, t = ModelConfig(), TrainConfig()
    p = sub.add_parser(
        "train",
        help="train a model on the built-in corpus (or your files) into a checkpoint directory",
        description=(
            "Train a decoder-only transformer (attention-only by default) and write a checkpoint "
            "directory: model.safetensors, config.json, tokenizer.json, metrics.jsonl, and the "
            "training state that --resume continues from. Defaults: the paper-style 2-layer "
            "attention-only model, chosen so that induction heads form in minutes on a 2-core CPU."
        ),
    )
    a = p.add_argument_group("model")
    a.add_argument("--layers", type=nonneg_int, help=f"attention layers; 0 = bigram model (default {d.n_layers})")
    a.add_argument("--heads", type=positive_int, help=f"heads per layer (default {d.n_heads})")
    a.add_argument("--d-model", type=positive_int, help=f"residual stream width (default {d.d_model})")
    a.add_argument("--d-head", type=positive_int, help=f"width of each head (default {d.d_head})")
    a.add_argument(
        "--ctx",
        type=positive_int,
        help=f"context length in tokens, at least 2 (default {d.n_ctx}); a step's attention work grows with "
        "batch x ctx^2, the rest with batch x ctx (the first step's time is reported when it is slow)",
    )
    a.add_argument("--vocab", type=positive_int, help=f"BPE vocabulary size (default {d.d_vocab})")
    a.add_argument("--positional", choices=POSITIONAL_CHOICES, help="shortformer (default): positions enter Q/K only")
    a.add_argument("--norm", choices=NORMALIZATION_CHOICES, help="normalization (default none)")
    a.add_argument("--mlp", type=positive_int, metavar="WIDTH", help="add an MLP of this width to every layer")
    _add_bus_flags(a)
    o = p.add_argument_group("training")
    o.add_argument(
        "--batch", type=positive_int, help=f"sequences per step, the global batch under torchrun (default {t.batch})"
    )
    o.add_argument("--lr", type=positive_float, help=f"peak learning rate (default {t.lr:g})")
    o.add_argument("--warmup", type=nonneg_int, help=f"linear warm-up steps (default {t.warmup})")
    o.add_argument("--schedule", choices=SCHEDULES, help=f"after warm-up (default {t.schedule})")
    o.add_argument("--weight-decay", type=float, help=f"AdamW weight decay (default {t.weight_decay:g})")
    budget = o.add_mutually_exclusive_group()
    budget.add_argument("--steps", type=positive_int, help=f"optimizer steps (default {t.steps})")
    budget.add_argument("--tokens", type=token_count, help="token budget instead of --steps, e.g. 8M")
    o.add_argument("--seed", type=int, help=f"seed for weights and data order (default {t.seed})")
    o.add_argument(
        "--corpus",
        help="'stdlib' (default: this Python's standard library), a directory, a glob, a text file, "
        "or a pre-tokenised .npy/.bin file",
    )
    o.add_argument("--eval-interval", type=positive_int, help=f"steps between evaluations (default {t.eval_interval})")
    o.add_argument("--ckpt-interval", type=positive_int, help=f"steps between checkpoints (default {t.ckpt_interval})")
    o.add_argument(
        "--precision",
        choices=("fp32", "bf16"),
        help="matrix products in training (default fp32). bf16 (autocast; weights, optimizer and "
        "evaluation stay fp32) is ~1.4x faster for wide models on CPUs with AMX and on GPUs, but was "
        "measured to delay induction heads on the default model",
    )
    o.add_argument(
        "--snapshots",
        type=_snapshot_spec,
        metavar="N|none|STEP,...",
        help=f"weight-only snapshots for 'qkov dynamics' in OUT/snapshots: a count (default {t.snapshots}, "
        "log-spaced, dense early), 'none', or comma-separated steps",
    )
    p.add_argument("--device", default="auto", help="auto (default: cuda if present), cpu, cuda, cuda:N")
    p.add_argument("--out", type=Path, default=None, help="checkpoint directory (default runs/qkov-<layers>l)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    p.add_argument("--quiet", action="store_true", help="no progress output; print only the final summary")
    p.set_defaults(func=cmd_train)


def cmd_train(args: argparse.Namespace) -> int:
    model_over = {f: getattr(args, k) for k, f in MODEL_FLAGS.items() if getattr(args, k) is not None}
    train_over = {f: getattr(args, k) for k, f in TRAIN_FLAGS.items() if getattr(args, k) is not None}
    out: Path = args.out or Path("runs") / f"qkov-{model_over.get('n_layers', ModelConfig().n_layers)}l"
    if args.resume:
        if args.out is None:
            raise QkovError("--resume needs --out DIR, the run to continue")
        if model_over or train_over or args.tokens is not None:
            _check_resume_flags(out, model_over, train_over)
        model_cfg, train_cfg = None, None
    else:
        model_cfg = ModelConfig(**model_over)
        if args.tokens is not None:
            batch = train_over.get("batch", TrainConfig().batch)
            train_over["steps"] = max(1, math.ceil(args.tokens / (batch * model_cfg.n_ctx)))
        train_cfg = TrainConfig(**train_over)
    main_rank = Ranks.from_env().main  # under torchrun only rank 0 shows progress and the summary
    with TrainProgress(quiet=args.quiet or not main_rank) as progress:
        train(out, model_cfg, train_cfg, device=args.device, resume=args.resume, callback=progress.event, progress=progress)
    if main_rank:
        print_info(out)
    return 0


def _check_resume_flags(out: Path, model_over: dict[str, Any], train_over: dict[str, Any]) -> None:
    saved_model, saved_train = saved_configs(out)
    # a field the run's config predates has its default (a run saved before gates existed has gate "none")
    saved_model = {**ModelConfig().to_dict(), **saved_model}
    for field, value in model_over.items():
        if saved_model.get(field) != value:
            raise QkovError(
                f"--resume continues the saved run, which has {field}={saved_model.get(field)!r}, not {value!r}"
            )
    for field, value in train_over.items():
        saved = saved_train.get(field)
        if (tuple(saved) if isinstance(saved, list) else saved) != value:
            raise QkovError(
                f"--resume continues the saved run, which has {field}={saved_train.get(field)!r}, not {value!r}"
            )
