"""Training: AdamW with warm-up and a "wsd" (or cosine, or constant) schedule, atomic checkpoints, exact resume.

Everything a run needs to continue lives in one file, ``train_state.safetensors``
(:mod:`qkov.training.state`), written atomically: a run killed at any moment resumes from
the last checkpoint and ends exactly where an uninterrupted one would, because batches are
a pure function of ``(seed, step)`` (see :class:`qkov.training.data.Batches`).

:func:`train` is three steps: :func:`prepare` (the configs, the device, the corpus), then
:meth:`Session.build` (model, optimizer, batches, restored state) and :meth:`Session.train`
(the steps, with evaluations and checkpoints). Nothing here prints: progress goes through the one
protocol, ``progress(what, done, total)`` (:mod:`qkov.progress`: the corpus being built, then
``("train", step, steps)``), and what happens to ``callback`` as event dicts (the event log).
"""

from __future__ import annotations

import json
import math
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel

from ..analysis.heads.probes import induction_probe
from ..device import flush_denormals, pick_device, reproducible_blas, settle_vector_math, tune_cpu_allocator
from ..errors import QkovError, QkovWarning
from ..expect import describe, expect_path
from ..io.atomic import atomic_write_text
from ..io import manifest
from ..io.checkpoint import METRICS_FILE, STATE_FILE, checkpoint_files, read_config, read_metrics, save_checkpoint
from ..model.config import ModelConfig
from ..model.ops import next_token_loss
from ..model.transformer import Transformer
from ..progress import Progress, tick
from ..ranks import Ranks
from ..weights.view import Weights
from . import distributed
from .config import TrainConfig, lr_at
from .corpus_size import check_examples
from .footprint import check_training_fits
from .data import Batches, Corpus, load_corpus, val_batches
from .losses import LossModule
from . import environment, rundir, snapshots
from .state import load_state, make_optimizer, read_meta, save_state

__all__ = ["BLAS_NOT_REPRODUCIBLE", "Callback", "Diverged", "evaluate", "Plan", "prepare", "saved_configs", "Session", "train"]

Callback = Callable[[dict[str, Any]], None]


class Diverged(QkovError):
    """Training stopped because the loss stopped being finite (``step``: the step it happened at; the run
    keeps its last checkpoint and training state)."""

    def __init__(self, value: float, step: int) -> None:
        super().__init__(f"train: loss became {value} at step {step}; lower the learning rate")
        self.value, self.step = value, step
BLAS_NOT_REPRODUCIBLE = (
    "MKL computed in this process before qkov was imported, so its reproducible mode is off: a resume "
    "of this run may not be bit-exact (import qkov before computing with torch, or start Python with MKL_CBWR=AUTO)"
)

RESUME_NOT_EXACT = (
    "resume: this process computes differently from the one that wrote the state ({changes}): the run "
    "continues correctly, but its weights will not be the uninterrupted run's bit for bit"
)


@torch.no_grad()
def evaluate(model: Transformer, examples: np.ndarray, device: torch.device, batch: int = 16) -> float:
    """Mean next-token loss of ``model`` on ``examples [n, n_ctx]``, ``batch`` at a time."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(examples), batch):
        toks = torch.from_numpy(examples[i : i + batch]).to(device)
        total += float(next_token_loss(model.unembed(model.stream(toks)), toks)) * len(toks)
        count += len(toks)
    model.train()
    return total / count


# ------------------------------------------------------------------- prepare
@dataclass
class Plan:
    """What a run trains, where and on what: settled before any model exists."""

    out: Path
    model_cfg: ModelConfig
    train_cfg: TrainConfig
    resume: bool
    dist: Ranks
    device: torch.device
    corpus: Corpus
    emit: Callback
    progress: Progress | None = None  # rank 0's: the steps as ("train", step, steps)
    joined: bool = False  # this run joined the process group (and leaves it at the end)


def saved_configs(out: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model and training config dicts of the run in ``out``: from its training state (the
    source of truth, present even when a kill left no ``config.json``), else from ``config.json``."""
    kind = rundir.inspect(out)
    if kind != "resumable":
        why = {
            "foreign": "is not a qkov run",
            "checkpoint": "holds a model but no training state",
        }.get(kind, "holds no complete training state")
        raise QkovError(f"resume: {str(out)!r} {why} ({STATE_FILE}); nothing to resume")
    _, extra = read_meta(out / STATE_FILE)
    if "model_config" in extra:
        return extra["model_config"], extra["train_config"]
    saved = read_config(out)  # a state written before the configs were kept in it
    return saved["model"], saved.get("training", {}).get("config", {})


def _configs(
    out: Path, model_cfg: ModelConfig | None, train_cfg: TrainConfig | None, resume: bool
) -> tuple[ModelConfig, TrainConfig]:
    """The run's configs: the saved ones on resume (refusing different ones), else the given or default."""
    if resume:
        saved_model_d, saved_train_d = saved_configs(out)
        saved_model, saved_train = ModelConfig.from_dict(saved_model_d), TrainConfig.from_dict(saved_train_d)
        if model_cfg is not None and model_cfg != saved_model:
            raise QkovError("resume: the model options differ from the saved run's; resume uses the saved ones")
        if train_cfg is not None and train_cfg != saved_train:
            raise QkovError("resume: the training options differ from the saved run's; resume uses the saved ones")
        return saved_model, saved_train
    kind = rundir.inspect(out)
    if kind == "resumable":
        raise QkovError(
            f"{str(out)!r} already holds a run: resume it, or choose another output directory", hint="resume"
        )
    if kind == "checkpoint":
        raise QkovError(
            f"{str(out)!r} holds a qkov checkpoint without a training state: it cannot be resumed, and qkov "
            "does not train over it; choose another output directory",
            hint="out",
        )
    if kind == "foreign":
        names = rundir.foreign_entries(out)
        what = "is a file" if not out.is_dir() else f"holds files that are not a qkov run ({', '.join(names[:3])})"
        raise QkovError(f"{str(out)!r} {what}: qkov trains only into a new or empty directory", hint="out")
    return model_cfg or ModelConfig(), train_cfg or TrainConfig()


def prepare(
    out: Path,
    model_cfg: ModelConfig | None,
    train_cfg: TrainConfig | None,
    *,
    device: str,
    resume: bool,
    corpus: Corpus | None,
    callback: Callback | None,
    progress: Progress | None = None,
) -> Plan:
    """Settle the configs, join the process group under torchrun, tune the CPU, load the corpus."""
    dist_info = Ranks.from_env()
    # under torchrun only rank 0 reports, writes checkpoints and metrics
    emit: Callback = (callback if dist_info.main else None) or (lambda _e: None)
    progress = progress if dist_info.main else None
    model_cfg, tc = _configs(out, model_cfg, train_cfg, resume)
    joined = distributed.joining()  # a group a script joined itself stays joined after the run
    dist_info, dev = distributed.setup(pick_device(device))
    if tc.batch % dist_info.world:
        raise QkovError(f"train: the global batch ({tc.batch}) must divide evenly over {dist_info.world} ranks")
    check_training_fits(model_cfg, tc.batch // dist_info.world, dev, tc.precision)  # before the model or corpus
    if dev.type == "cpu":
        torch.set_num_threads(dist_info.threads)
        tune_cpu_allocator()
        flush_denormals()  # in every thread: overconfident softmaxes produce denormals, ~20x slower on x86
        settle_vector_math()  # MKL's vector-math kernels chosen on one thread, before any step (qkov.device)
        if reproducible_blas() is False:
            emit({"event": "message", "text": BLAS_NOT_REPRODUCIBLE})
    sync_cache = corpus is None and dist_info.enabled
    if sync_cache and not dist_info.main:
        distributed.barrier(dist_info)  # rank 0 builds the token cache first; the others then read it
    if corpus is None:
        corpus = load_corpus(tc.corpus, vocab_size=model_cfg.d_vocab, val_fraction=tc.val_fraction, progress=progress)
    if corpus.d_vocab > model_cfg.d_vocab:
        raise QkovError(f"corpus vocabulary ({corpus.d_vocab}) exceeds the model's d_vocab ({model_cfg.d_vocab})")
    if corpus.vocab_trained and corpus.d_vocab < model_cfg.d_vocab:
        raise QkovError(
            f"the tokenizer trained on this corpus reaches only {corpus.d_vocab} tokens, fewer than the "
            f"{model_cfg.d_vocab} asked for: ask for at most {corpus.d_vocab}"
        )
    if sync_cache and dist_info.main:
        distributed.barrier(dist_info)
    check_examples(corpus, model_cfg.n_ctx)  # one example of each split, before any output exists (every rank)
    return Plan(out, model_cfg, tc, resume, dist_info, dev, corpus, emit, progress, joined)


# --------------------------------------------------------------- build and run
@dataclass
class Session:
    """A run in progress: the model, its optimizer, its data, and what it has logged."""

    plan: Plan
    model: Transformer
    opt: torch.optim.Optimizer
    step_model: torch.nn.Module  # the loss as a module (wrapped in DistributedDataParallel under torchrun)
    batches: Batches
    val_examples: np.ndarray
    step: int = 0
    wall: float = 0.0
    metrics: list[dict[str, Any]] = field(default_factory=list)
    last: dict[str, Any] = field(default_factory=dict)  # the latest value of every metric
    loss_acc: float = 0.0  # the open log window: summed losses of the steps since the last log row
    n_acc: int = 0
    snapshot_steps: frozenset[int] = frozenset()  # steps whose weights are kept (training.snapshots)
    environment: dict[str, Any] = field(default_factory=dict)  # what a bit-exact resume depends on (kept in the state)

    @classmethod
    def build(cls, plan: Plan) -> "Session":
        """Model, optimizer and batches; on resume, the saved weights, moments, RNG and log."""
        tc, cfg, corpus, dev = plan.train_cfg, plan.model_cfg, plan.corpus, plan.device
        batches = Batches(corpus.train, cfg.n_ctx, tc.batch, tc.seed, corpus.bos_token_id)
        val_examples = val_batches(corpus.val, cfg.n_ctx, corpus.bos_token_id, tc.eval_examples)
        model = Transformer(cfg, seed=tc.seed).to(dev)
        model.bos_token_id = corpus.bos_token_id
        model.tokenizer = corpus.tokenizer()
        model.train()
        opt = make_optimizer(model, tc.lr, (tc.beta1, tc.beta2), tc.weight_decay)
        step_model: torch.nn.Module = LossModule(model)
        if plan.dist.enabled:  # gradients are averaged over ranks: the global batch's mean loss
            step_model = DistributedDataParallel(step_model, device_ids=[dev.index] if dev.type == "cuda" else None)
        snaps = frozenset(snapshots.schedule(tc.steps, tc.snapshots))
        session = cls(plan, model, opt, step_model, batches, val_examples, snapshot_steps=snaps)
        session.environment = environment.record(dev, plan.dist.world, tc.precision)
        if plan.resume:
            session.step, extra = load_state(plan.out / STATE_FILE, model, opt)
            changed = environment.differences(extra.get("environment", {}), session.environment)
            if changed:
                warnings.warn(RESUME_NOT_EXACT.format(changes="; ".join(changed)), QkovWarning, stacklevel=2)
            session.wall = float(extra.get("wall_s", 0.0))
            session.loss_acc, session.n_acc = float(extra.get("loss_acc", 0.0)), int(extra.get("n_acc", 0))
            if "metrics" in extra:  # the log as of the state: rows written after it are redone
                session.metrics = extra["metrics"]
            else:  # a state written before the log was kept in it
                session.metrics = [r for r in read_metrics(plan.out) if r.get("step", 0) <= session.step]
            if plan.dist.main:  # snapshots written after the state are written again, equal
                snapshots.drop_after(plan.out, session.step)
        else:
            torch.manual_seed(tc.seed)
        session.last = {k: v for r in session.metrics for k, v in r.items()}
        return session

    @property
    def tokens_per_step(self) -> int:
        return self.plan.train_cfg.batch * self.plan.model_cfg.n_ctx

    def summary(self) -> dict[str, Any]:
        """The training record stored in the checkpoint's ``config.json``."""
        p = self.plan
        return {
            "config": p.train_cfg.to_dict(),
            "step": self.step,
            "tokens": self.step * self.tokens_per_step,
            "train_loss": self.last.get("train_loss"),
            "val_loss": self.last.get("val_loss"),
            "induction_score": self.last.get("induction_score"),
            "wall_s": round(self.wall, 2),
            "corpus": p.corpus.source,
            "corpus_stats": p.corpus.stats,
            "device": str(p.device),
            "precision": p.train_cfg.precision,
        }

    def log(self, row: dict[str, Any], event: str) -> None:
        self.metrics.append(row)
        self.last.update(row)
        self.plan.emit({"event": event, **row})

    def checkpoint(self) -> None:
        """Write the training state (first: everything else is derived from it), the log, the model;
        their names recorded in the run's manifest first (one manifest write, at the first checkpoint)."""
        out, p = self.plan.out, self.plan
        tokenizer_json = p.corpus.tokenizer_json
        has_tokenizer = tokenizer_json is not None or self.model.tokenizer is not None
        manifest.record(out, [STATE_FILE, METRICS_FILE, *checkpoint_files(has_tokenizer)])
        extra = {
            "wall_s": self.wall,
            "loss_acc": self.loss_acc,
            "n_acc": self.n_acc,
            "model_config": p.model_cfg.to_dict(),
            "train_config": p.train_cfg.to_dict(),
            "metrics": self.metrics,
            "environment": self.environment,
        }
        save_state(out / STATE_FILE, self.model, self.opt, self.step, extra)
        atomic_write_text(out / METRICS_FILE, "".join(json.dumps(r) + "\n" for r in self.metrics))
        save_checkpoint(self.model, out, training=self.summary(), tokenizer_json=tokenizer_json)
        self.plan.emit({"event": "checkpoint", "step": self.step})

    def snapshot(self) -> None:
        """Keep this step's weights if the schedule asks for them (before any checkpoint of the same
        step: a kill between the two then leaves a state from which the snapshot is redone)."""
        if self.step in self.snapshot_steps and self.plan.dist.main:
            snapshots.write(self.plan.out, self.model, self.step, self.step * self.tokens_per_step)

    def evaluate(self) -> None:
        """Validation loss, and for two layers or more the induction probe (repeated random tokens)."""
        dev = self.plan.device
        row: dict[str, Any] = {
            "step": self.step,
            "tokens": self.step * self.tokens_per_step,
            "val_loss": evaluate(self.model, self.val_examples, dev),
        }
        if self.plan.model_cfg.unrolled().n_layers >= 2:  # induction heads need two (effective) layers
            probe = induction_probe(
                Weights.from_model(self.model), bos=self.model.bos_token_id, seed=self.plan.train_cfg.seed
            )
            row["induction_score"] = probe.best
            row["repeat_loss"] = probe.loss_by_copy
        self.log(row, "eval")

    def train_step(self, autocast: torch.autocast) -> float:
        """One optimizer step on this rank's share of the global batch; returns its loss."""
        tc, dist_info = self.plan.train_cfg, self.plan.dist
        lr = lr_at(self.step, tc)
        for g in self.opt.param_groups:
            g["lr"] = lr
        toks = torch.from_numpy(self.batches.step(self.step, dist_info.rank, dist_info.world))
        with autocast:  # bf16 matrix products, fp32 weights/optimizer; evaluation stays fp32
            loss = self.step_model(toks.to(self.plan.device, non_blocking=True))
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        if tc.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), tc.grad_clip)
        self.opt.step()
        self.step += 1
        value = float(loss.detach())
        if not math.isfinite(value):
            raise Diverged(value, self.step)
        return value

    def train(self, stop_after: int | None = None) -> None:
        """Train to ``train_cfg.steps`` (or ``stop_after``), logging, evaluating and checkpointing."""
        p, tc = self.plan, self.plan.train_cfg
        autocast = torch.autocast(p.device.type, dtype=torch.bfloat16, enabled=tc.precision == "bf16")
        t_log, n_timed = time.perf_counter(), 0
        if self.step >= tc.steps and p.dist.main:  # a kill after the final state: write what derives from it
            self.checkpoint()
        if self.step == 0:
            self.snapshot()  # the initial weights
        while self.step < tc.steps:
            t0 = time.perf_counter()
            self.loss_acc += self.train_step(autocast)
            self.n_acc += 1
            n_timed += 1
            self.wall += time.perf_counter() - t0
            step, last_step = self.step, self.step == tc.steps
            tick(p.progress, "train", step, tc.steps)
            if step % tc.log_interval == 0 or last_step:
                now = time.perf_counter()
                row = {
                    "step": step,
                    "tokens": step * self.tokens_per_step,
                    "train_loss": distributed.mean_across(p.dist, self.loss_acc / self.n_acc, p.device),
                    "lr": lr_at(step - 1, tc),
                    "tokens_per_s": n_timed * self.tokens_per_step / max(1e-9, now - t_log),
                }
                self.log(row, "log")
                self.loss_acc, self.n_acc, n_timed = 0.0, 0, 0
            stopping = stop_after is not None and step >= stop_after
            self.snapshot()
            if p.dist.main and (step % tc.eval_interval == 0 or last_step):
                self.evaluate()
            if p.dist.main and (step % tc.ckpt_interval == 0 or last_step or stopping):
                self.checkpoint()
            if step % tc.log_interval == 0:
                t_log = time.perf_counter()
            if stopping:
                break


def train(
    out: Path | str,
    model_cfg: ModelConfig | None = None,
    train_cfg: TrainConfig | None = None,
    *,
    device: str = "auto",
    resume: bool = False,
    corpus: Corpus | None = None,
    callback: Callback | None = None,
    progress: Progress | None = None,
    stop_after: int | None = None,
) -> Transformer:
    """Train a model into the checkpoint directory ``out`` and return it (in eval mode).

    Args:
        out: checkpoint directory (created). It must not hold a run unless ``resume``.
        model_cfg: the model to train (read from ``out`` with ``resume``).
        train_cfg: how to train it (read from ``out`` with ``resume``).
        device: ``auto`` (cuda if available), ``cpu``, ``cuda`` or ``cuda:N``.
        resume: continue from ``out/train_state.safetensors``.
        corpus: an already-loaded corpus (else ``train_cfg.corpus`` is loaded, cached).
        callback: the event log: receives event dicts, ``{"event": "start"|"message"|"log"|"eval"|"checkpoint"|"done",
            ...}``.
        progress: ``progress(what, done, total)`` (:class:`qkov.Progress`): the corpus being built (its
            stages, as :func:`~qkov.training.data.load_corpus` reports them), then ``("train", step, steps)``
            when training starts and after every step. Under torchrun, rank 0 alone reports (both).
        stop_after: stop (after checkpointing) once this step is reached; for tests and tools.
    """
    expect_path("qkov.train", out, "out")
    for name, value, kind in (("model_cfg", model_cfg, ModelConfig), ("train_cfg", train_cfg, TrainConfig)):
        if value is not None and not isinstance(value, kind):
            raise QkovError(f"qkov.train: {name} must be a qkov.{kind.__name__}; got {describe(value)}")
    plan = prepare(
        Path(out), model_cfg, train_cfg, device=device, resume=resume, corpus=corpus, callback=callback, progress=progress
    )
    if not plan.dist.main:
        return _train(plan, stop_after)
    with rundir.lock(plan.out):  # only rank 0 writes: it alone holds the directory's lock
        if not plan.resume:
            _configs(plan.out, plan.model_cfg, plan.train_cfg, False)  # again, now that no one else writes
        # clears a failed start's recorded files, adopts a pre-manifest run, refuses foreign files
        rundir.begin(plan.out, resume=plan.resume)
        return _train(plan, stop_after)


def _train(plan: Plan, stop_after: int | None) -> Transformer:
    session = Session.build(plan)
    plan.emit(
        {
            "event": "start",
            "step": session.step,
            "steps": plan.train_cfg.steps,
            "params": session.model.num_parameters(),
            "device": str(plan.device),
            "precision": plan.train_cfg.precision,
            "train_tokens": int(plan.corpus.train.size),
            "resumed": plan.resume,
        }
    )
    tick(plan.progress, "train", session.step, plan.train_cfg.steps)
    session.train(stop_after)
    plan.emit({"event": "done", **session.summary()})
    distributed.barrier(plan.dist)
    if plan.joined:
        distributed.teardown(plan.dist)
    return session.model.eval()
