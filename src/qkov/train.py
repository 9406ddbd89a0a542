"""Training: AdamW with warm-up and a "wsd" (or cosine, or constant) schedule, atomic checkpoints, exact resume.

Everything a run needs to continue lives in one file, ``train_state.safetensors``
(weights, optimizer moments, RNG state, and the step in its metadata), written
atomically: a run killed at any moment resumes from the last checkpoint and ends
exactly where an uninterrupted run would, because batches are a pure function of
``(seed, step)`` (see :class:`qkov.data.Batches`).

Nothing here prints: progress is reported through the ``callback`` argument.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from .checkpoint import (
    METRICS_FILE,
    STATE_FILE,
    read_config,
    read_metrics,
    save_checkpoint,
    save_tensors,
)
from .config import ModelConfig
from . import distributed as D
from .data import Batches, Corpus, load_corpus, val_batches
from .errors import QkovError
from .fileio import atomic_write_text
from .heads import induction_probe
from .losses import LossModule, lm_loss
from .model import Transformer

Callback = Callable[[dict[str, Any]], None]
SCHEDULES = ("wsd", "cosine", "constant")
PRECISIONS = ("fp32", "bf16")


@dataclass(frozen=True)
class TrainConfig:
    """How to train. Defaults were chosen by measurement (see README, "Default training")."""

    steps: int = 5000
    batch: int = 16
    lr: float = 1e-2
    warmup: int = 100
    schedule: str = "wsd"
    decay_frac: float = 0.2
    min_lr_frac: float = 0.1
    weight_decay: float = 0.05
    beta1: float = 0.9
    beta2: float = 0.98
    grad_clip: float = 1.0
    seed: int = 0
    corpus: str = "stdlib"
    val_fraction: float = 0.05
    eval_interval: int = 100
    eval_examples: int = 32
    ckpt_interval: int = 500
    log_interval: int = 10
    # fp32 by default: bf16 matrix products were measured to delay induction heads on the
    # default model (none by 12.3M tokens vs 10.2M in fp32, val loss 2.73 vs 2.48 there).
    precision: str = "fp32"

    def __post_init__(self) -> None:
        positive = ("steps", "batch", "eval_interval", "eval_examples", "ckpt_interval", "log_interval")
        for name in positive:
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise QkovError(f"train: {name} must be a positive integer, got {v!r}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise QkovError(f"train: lr must be a positive number, got {self.lr!r}")
        if not (self.weight_decay >= 0 and math.isfinite(self.weight_decay)):
            raise QkovError(f"train: weight_decay must be >= 0, got {self.weight_decay!r}")
        if self.warmup < 0:
            raise QkovError(f"train: warmup must be >= 0, got {self.warmup}")
        if self.precision not in PRECISIONS:
            raise QkovError(f"train: precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.schedule not in SCHEDULES:
            raise QkovError(f"train: schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def lr_at(step: int, tc: TrainConfig) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warm-up, then cosine or constant."""
    if step < tc.warmup:
        return tc.lr * (step + 1) / tc.warmup
    if tc.schedule == "constant":
        return tc.lr
    floor = tc.lr * tc.min_lr_frac
    if tc.schedule == "wsd":  # warm-up, stable, then linear decay over the last decay_frac of the run
        start = max(tc.warmup, int(tc.steps * (1 - tc.decay_frac)))
        if step < start:
            return tc.lr
        progress = min(1.0, (step - start) / max(1, tc.steps - start))
        return tc.lr + (floor - tc.lr) * progress
    span = max(1, tc.steps - tc.warmup)
    progress = min(1.0, (step - tc.warmup) / span)
    return floor + (tc.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def pick_device(name: str = "auto") -> torch.device:
    """``auto`` -> cuda if available, else cpu. Unknown or unavailable devices are a user error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise QkovError(f"device: unknown device {name!r} (use auto, cpu, cuda or cuda:N)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise QkovError("device: cuda requested but no CUDA GPU is available")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise QkovError(f"device: {name} requested but only {torch.cuda.device_count()} CUDA GPU(s) are visible")
    if dev.type not in ("cpu", "cuda", "mps"):
        raise QkovError(f"device: unsupported device {name!r}")
    return dev


def tune_cpu_allocator() -> None:
    """Keep freed memory in the process (glibc) instead of returning it to the OS.

    Training allocates the same large buffers every step; with glibc's defaults each
    one is a fresh mmap whose pages fault in again (measured: ~20% of a CPU step).
    A no-op off glibc.
    """
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 30)  # M_MMAP_THRESHOLD: serve up to 1 GiB from the heap
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: keep up to 1 GiB free at the top
    except (OSError, AttributeError):
        pass


@torch.no_grad()
def evaluate(model: Transformer, examples: np.ndarray, device: torch.device, batch: int = 16) -> float:
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(examples), batch):
        toks = torch.from_numpy(examples[i : i + batch]).to(device)
        logits, _ = model._run(toks, None, False)
        total += float(lm_loss(logits, toks)) * len(toks)
        count += len(toks)
    model.train()
    return total / count


class _State:
    """Save and restore everything needed to continue a run exactly."""

    @staticmethod
    def save(path: Path, model: Transformer, opt: torch.optim.Optimizer, step: int, extra: dict[str, Any]) -> None:
        tensors: dict[str, torch.Tensor] = {f"model.{k}": v for k, v in model.state_dict().items()}
        names = {id(p): n for n, p in model.named_parameters()}
        for p, st in opt.state.items():
            for k, v in st.items():
                tensors[f"opt.{names[id(p)]}.{k}"] = v if torch.is_tensor(v) else torch.tensor(v)
        tensors["rng.cpu"] = torch.get_rng_state()
        meta = {"step": str(step), "extra": json.dumps(extra)}
        save_tensors(path, tensors, metadata=meta)

    @staticmethod
    def load(path: Path, model: Transformer, opt: torch.optim.Optimizer) -> tuple[int, dict[str, Any]]:
        from safetensors import safe_open

        try:
            tensors = load_file(str(path))
            with safe_open(str(path), framework="pt") as fh:
                meta = fh.metadata() or {}
            step = int(meta["step"])
            extra = json.loads(meta.get("extra", "{}"))
        except (SafetensorError, OSError, ValueError, KeyError) as exc:
            raise QkovError(f"resume: {str(path)!r} is corrupt ({exc})") from None
        device = model.W_E.device
        model.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")})
        params = dict(model.named_parameters())
        for name, p in params.items():
            st = {}
            for k, v in tensors.items():
                if k.startswith(f"opt.{name}."):
                    key = k[len(f"opt.{name}.") :]
                    st[key] = v if key == "step" else v.to(device)
            if st:
                opt.state[p] = st
        torch.set_rng_state(tensors["rng.cpu"])
        return step, extra


def _make_optimizer(model: Transformer, tc: TrainConfig) -> torch.optim.Optimizer:
    # Decay matrices only; embeddings/unembedding included (they are matrices in this framework),
    # biases and LayerNorm parameters excluded.
    decay = [p for n, p in model.named_parameters() if n.rsplit(".", 1)[-1].startswith("W_")]
    other = [p for n, p in model.named_parameters() if not n.rsplit(".", 1)[-1].startswith("W_")]
    groups = [{"params": decay, "weight_decay": tc.weight_decay}]
    if other:
        groups.append({"params": other, "weight_decay": 0.0})
    # fused=True: one kernel per step for all parameters (measured ~5% of a CPU step faster than foreach)
    return torch.optim.AdamW(groups, lr=tc.lr, betas=(tc.beta1, tc.beta2), fused=True)


def train(
    out: Path | str,
    model_cfg: ModelConfig | None = None,
    train_cfg: TrainConfig | None = None,
    *,
    device: str = "auto",
    resume: bool = False,
    corpus: Corpus | None = None,
    callback: Callback | None = None,
    stop_after: int | None = None,
) -> Transformer:
    """Train a model into the checkpoint directory ``out`` and return it.

    Args:
        out: checkpoint directory (created). It must not hold a run unless ``resume``.
        model_cfg / train_cfg: what to train; with ``resume`` they are read from ``out``.
        resume: continue from ``out/train_state.safetensors``.
        corpus: an already-loaded corpus (else ``train_cfg.corpus`` is loaded, cached).
        callback: receives event dicts: ``{"event": "log"|"eval"|"checkpoint"|"start"|"done", ...}``.
        stop_after: stop (after checkpointing) once this step is reached; for tests and tools.
    """
    out = Path(out)
    dist_info = D.from_env()
    # under torchrun only rank 0 reports, writes checkpoints and metrics
    emit = (callback if dist_info.main else None) or (lambda _e: None)
    state_path = out / STATE_FILE
    if resume:
        if not state_path.is_file():
            raise QkovError(f"resume: {str(out)!r} holds no training state ({STATE_FILE}); nothing to resume")
        saved = read_config(out)
        saved_model = ModelConfig.from_dict(saved["model"])
        saved_train = TrainConfig.from_dict(saved.get("training", {}).get("config", {}))
        if model_cfg is not None and model_cfg != saved_model:
            raise QkovError("resume: the model options differ from the saved run's; resume uses the saved ones")
        if train_cfg is not None and train_cfg != saved_train:
            raise QkovError("resume: the training options differ from the saved run's; resume uses the saved ones")
        model_cfg, train_cfg = saved_model, saved_train
    else:
        if state_path.exists() or (out / "model.safetensors").exists():
            raise QkovError(f"{str(out)!r} already holds a run: pass --resume to continue it, or choose another --out")
        model_cfg = model_cfg or ModelConfig()
        train_cfg = train_cfg or TrainConfig()
    tc = train_cfg
    dist_info, dev = D.setup(pick_device(device))
    if tc.batch % dist_info.world:
        raise QkovError(f"train: the global batch ({tc.batch}) must divide evenly over {dist_info.world} ranks")
    if dev.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist_info.local_world))
        tune_cpu_allocator()
        # Overconfident softmaxes produce denormal floats, which run ~20x slower on x86.
        torch.set_flush_denormal(True)
    precision = tc.precision
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=precision == "bf16")

    sync_cache = corpus is None and dist_info.enabled
    if sync_cache and not dist_info.main:
        D.barrier(dist_info)  # rank 0 builds the token cache first; the others then read it
    if corpus is None:
        corpus = load_corpus(
            tc.corpus,
            vocab_size=model_cfg.d_vocab,
            val_fraction=tc.val_fraction,
            progress=lambda m: emit({"event": "message", "text": m}),
        )
    if corpus.d_vocab > model_cfg.d_vocab:
        raise QkovError(f"corpus vocabulary ({corpus.d_vocab}) exceeds the model's d_vocab ({model_cfg.d_vocab})")
    if sync_cache and dist_info.main:
        D.barrier(dist_info)
    batches = Batches(corpus.train, model_cfg.n_ctx, tc.batch, tc.seed, corpus.bos_token_id)
    val_examples = val_batches(corpus.val, model_cfg.n_ctx, corpus.bos_token_id, tc.eval_examples)

    model = Transformer(model_cfg, seed=tc.seed).to(dev)
    model.bos_token_id = corpus.bos_token_id
    model.tokenizer = corpus.tokenizer()
    model.train()
    opt = _make_optimizer(model, tc)
    step_model: torch.nn.Module = LossModule(model)
    if dist_info.enabled:  # gradients are averaged over ranks: the global batch's mean loss
        from torch.nn.parallel import DistributedDataParallel

        step_model = DistributedDataParallel(step_model, device_ids=[dev.index] if dev.type == "cuda" else None)
    tokens_per_step = tc.batch * model_cfg.n_ctx

    metrics: list[dict[str, Any]] = []
    step = 0
    wall = 0.0
    if resume:
        step, extra = _State.load(state_path, model, opt)
        wall = float(extra.get("wall_s", 0.0))
        metrics = [r for r in read_metrics(out) if r.get("step", 0) <= step]
    else:
        torch.manual_seed(tc.seed)
    if dist_info.main:
        out.mkdir(parents=True, exist_ok=True)
    emit(
        {
            "event": "start",
            "step": step,
            "steps": tc.steps,
            "params": model.num_parameters(),
            "device": str(dev),
            "precision": precision,
            "train_tokens": int(corpus.train.size),
            "resumed": resume,
        }
    )

    last = {k: v for r in metrics for k, v in r.items()}

    def summary() -> dict[str, Any]:
        return {
            "config": tc.to_dict(),
            "step": step,
            "tokens": step * tokens_per_step,
            "train_loss": last.get("train_loss"),
            "val_loss": last.get("val_loss"),
            "induction_score": last.get("induction_score"),
            "wall_s": round(wall, 2),
            "corpus": corpus.source,
            "corpus_stats": corpus.stats,
            "device": str(dev),
            "precision": precision,
        }

    def checkpoint() -> None:
        _State.save(state_path, model, opt, step, {"wall_s": wall})
        atomic_write_text(out / METRICS_FILE, "".join(json.dumps(r) + "\n" for r in metrics))
        save_checkpoint(out, model, training=summary(), tokenizer_json=corpus.tokenizer_json)
        emit({"event": "checkpoint", "step": step})

    def run_eval() -> None:
        row: dict[str, Any] = {
            "step": step,
            "tokens": step * tokens_per_step,
            "val_loss": evaluate(model, val_examples, dev),
        }
        if model_cfg.n_layers >= 2:  # induction heads need two layers
            model.eval()
            probe = induction_probe(model, seed=tc.seed)
            model.train()
            row["induction_score"] = probe.best
            row["repeat_loss"] = probe.loss_by_copy
        metrics.append(row)
        last.update(row)
        emit({"event": "eval", **row})

    loss_acc, n_acc, t_log = 0.0, 0, time.perf_counter()
    while step < tc.steps:
        t0 = time.perf_counter()
        lr = lr_at(step, tc)
        for g in opt.param_groups:
            g["lr"] = lr
        toks = torch.from_numpy(batches.step(step, dist_info.rank, dist_info.world)).to(dev, non_blocking=True)
        with autocast:  # bf16 matrix products, fp32 weights/optimizer; evaluation stays fp32
            loss = step_model(toks)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if tc.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
        opt.step()
        step += 1
        loss_val = float(loss.detach())
        if not math.isfinite(loss_val):
            raise QkovError(f"train: loss became {loss_val} at step {step}; lower --lr")
        wall += time.perf_counter() - t0
        loss_acc += loss_val
        n_acc += 1
        if step % tc.log_interval == 0 or step == tc.steps:
            now = time.perf_counter()
            mean_loss = D.mean_across(dist_info, loss_acc / n_acc, dev)
            row = {
                "step": step,
                "tokens": step * tokens_per_step,
                "train_loss": mean_loss,
                "lr": lr,
                "tokens_per_s": n_acc * tokens_per_step / max(1e-9, now - t_log),
            }
            metrics.append(row)
            last.update(row)
            emit({"event": "log", **row})
            loss_acc, n_acc = 0.0, 0
        if dist_info.main and (step % tc.eval_interval == 0 or step == tc.steps):
            run_eval()
        if dist_info.main and (
            step % tc.ckpt_interval == 0 or step == tc.steps or (stop_after is not None and step >= stop_after)
        ):
            checkpoint()
        if step % tc.log_interval == 0:
            t_log = time.perf_counter()
        if stop_after is not None and step >= stop_after:
            break
    emit({"event": "done", **summary()})
    D.barrier(dist_info)
    D.teardown(dist_info)
    model.eval()
    return model
