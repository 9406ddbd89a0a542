"""Small builders shared by the tests: tiny training flags and configs, non-trivial biases."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from qkov import ModelConfig, TrainConfig, Transformer, trace
from qkov.apps.cli import main

ROOT = Path(__file__).resolve().parents[1]  # the repository

# the tiny model most tests train: seconds on a CPU
TINY = ModelConfig(n_layers=2, n_heads=2, d_model=32, d_head=16, d_vocab=300, n_ctx=32)
TINY_FLAGS: dict[str, object] = dict(
    layers=2, heads=2, d_model=32, d_head=16, ctx=32, vocab=300, batch=4, steps=20, device="cpu", quiet=True
)

# a GPT-2-like small model: pre-norm LayerNorm, MLPs, biases
LN_MLP = ModelConfig(
    n_layers=2, n_heads=2, d_model=16, d_head=8, d_vocab=30, n_ctx=12, normalization="layernorm", d_mlp=32, bias=True
)


def train_flags(**opts: object) -> list[str]:
    """``qkov train`` flags: the tiny model's, overridden by ``opts``.

    ``d_model=64`` becomes ``--d-model 64``; ``True`` gives a bare flag; ``None`` drops one.
    """
    flags: list[str] = []
    for key, value in {**TINY_FLAGS, **opts}.items():
        if value is None or value is False:
            continue
        flags.append("--" + key.replace("_", "-"))
        if value is not True:
            flags.append(str(value))
    return flags


# a Llama-like small model: rotary positions, RMSNorm, grouped-query attention, a gated SiLU MLP
MODERN = ModelConfig(
    n_layers=2,
    n_heads=4,
    d_model=16,
    d_head=4,
    d_vocab=30,
    n_ctx=12,
    positional="rotary",
    rotary_base=100.0,
    normalization="rmsnorm",
    d_mlp=24,
    act_fn="silu",
    gated_mlp=True,
    bias=True,
    n_kv_heads=2,
)


def tiny_train(corpus: Path, **kw: object) -> TrainConfig:
    """A TrainConfig for the tiny model on ``corpus``; ``kw`` overrides."""
    base: dict[str, object] = dict(
        steps=40,
        batch=4,
        lr=3e-3,
        warmup=5,
        corpus=str(corpus),
        eval_interval=10,
        ckpt_interval=10,
        log_interval=5,
        eval_examples=4,
    )
    base.update(kw)
    return TrainConfig(**base)  # type: ignore[arg-type]


def perturb_non_matrices(model: Transformer, scale: float) -> Transformer:
    """Add ``scale`` x N(0, 1) to every bias and LayerNorm parameter (init leaves them trivial).

    Any module whose matrices are named ``W_*`` works (TransformerLens models too)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.rsplit(".", 1)[-1].startswith("W_"):
                p.add_(torch.randn_like(p) * scale)
    return model


def run_main(capsys: Any, *argv: object) -> tuple[int, str, str]:
    """Run ``qkov ARGV`` in this process: ``(exit code, stdout, stderr)`` (``capsys``: pytest's fixture)."""
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as exc:  # argparse's own errors
        rc = int(exc.code)
    out = capsys.readouterr()
    return rc, out.out, out.err


def torchrun(
    args: list[str], env: dict[str, str], nproc: int = 2, *, script: bool = False
) -> "subprocess.CompletedProcess[str]":
    """``qkov ARGS`` under torchrun: ``nproc`` local processes (gloo on CPU); with ``script``, ``ARGS``
    is a Python script and its arguments."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    run = args if script else ["-m", "qkov", *args]
    return subprocess.run([*cmd, *run], env=env, capture_output=True, text=True, timeout=600)


def own_patterns(model: Transformer, ids: torch.Tensor) -> list[torch.Tensor]:
    """Each layer's attention pattern ``[B, H, T, T]`` recomputed from the training model's own pass, not
    through qkov's analysis forward: a forward pre-hook on each attention module takes the stream it reads,
    adds shortformer positions, applies the block's own first norm module and the module's query/key
    projections, then softmax(q k / sqrt(d_head)) with the causal mask (models without rotary positions)."""
    assert model.cfg.positional != "rotary", "a reference for models without rotary positions"
    got: list[torch.Tensor] = []

    def hook_of(block: Any) -> Any:
        def hook(attn: Any, inputs: tuple[Any, ...]) -> None:
            x = inputs[-1]  # the residual stream the block's attention reads
            if model.cfg.positional == "shortformer":
                x = x + model.W_pos[: x.shape[-2]]
            if block.ln1 is not None:
                x = block.ln1(x)
            q, k, _ = attn.qkv(x, x)
            group = q.shape[1] // k.shape[1]
            k = k.repeat_interleave(group, dim=1)
            s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
            T = s.shape[-1]
            got.append(s.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf")).softmax(-1))

        return hook

    hooks = [b.attn.register_forward_pre_hook(hook_of(b)) for b in model.blocks]
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in hooks:
            h.remove()
    return got


def one_patch(w: Any, base: torch.Tensor, src: torch.Tensor, kind: str, layer: int, index: tuple, metric: Any) -> float:
    """One patch, written out (the reference the batched sweeps are checked against): the base run with
    the site's value at ``index`` (an indexing tuple after the batch) taken from the source run, every
    position unembedded."""
    source = trace(w, src, cache=[(kind, layer)])[kind, layer]

    def edit(v: torch.Tensor, site: Any) -> torch.Tensor:
        v = v.clone()
        v[(slice(None), *index)] = source[(slice(None), *index)]
        return v

    return float(metric(trace(w, base, edits={(kind, layer): edit})))
