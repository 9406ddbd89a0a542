"""Term importance (the paper's procedure) and the language-model loss the path analyses compare.

:func:`term_importance` runs the procedure of [F] (docs/conventions.md, "Term importance"): run 0
is the real forward pass; run 1 freezes its patterns, normalisation divisors and MLP outputs and
zeroes every head's output; run n lets each head add the output it computed on run n-1. A head's
output on run n depends only on the outputs of run n-1 in earlier layers, so layer ``l``'s output
is the same on every run after run ``l + 1`` (layer 0 reads only the embedding): it is computed
once per run on which it can still change (``L (L + 1) / 2`` layer evaluations instead of
``L (L + 1)``), from the same tensors the literal procedure would use. Only each layer's sum
over heads is kept (``[B, T, D]``, not ``[B, T, H, D]``), and the frozen pieces (embedding, MLP
outputs, ``b_O``) are read from run 0 instead of recomputed. A test checks it against the literal
procedure run through :func:`~qkov.analysis.forward.tracer.trace` with the recording frozen
(:func:`~qkov.analysis.forward.frozen.frozen_edits`) and each head's ``head_out`` written.

:func:`loss` is the mean next-token loss in nats. Term differences are small, so it must not
lose digits: each position's ``logsumexp`` is taken around its maximum (the exponentials are at
most 1, summed per position) and the per-position losses are combined in float64, without a
float64 copy of the ``[positions, V]`` logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ...model.ops import embed, normalize, stream_start
from ...weights.parts import WeightSource
from ...weights.convert import SourceLike, as_source
from ..forward.cache import Trace
from .routed import heads_write, routed_runs
from ...progress import Progress, tick
from ..forward.frozen import frozen_recording

__all__ = ["heads_write", "lm_loss", "loss", "rms", "term_importance", "TermImportance"]


def lm_loss(logits: Tensor, target: Tensor, *, overwrite: bool = False) -> float:
    """Mean cross-entropy (nats) of ``logits [n, V]`` against ``target [n]``: per-position
    ``max + log(sum(exp(logit - max))) - logit[target]``, the per-position values in float64.
    ``overwrite``: use ``logits`` itself as the scratch space (else one ``[n, V]`` tensor is made)."""
    m = logits.amax(-1, keepdim=True)
    picked = logits.gather(-1, target[:, None].to(logits.device))[:, 0]
    sums = torch.sub(logits, m, out=logits if overwrite else None).exp_().sum(-1)
    return float((m[:, 0].double() + sums.double().log() - picked.double()).mean())


def rms(x: Tensor) -> float:
    """Root mean square of every entry of ``x [..., V]`` (row sums of squares combined in float64)."""
    rows = torch.linalg.vector_norm(x.reshape(-1, x.shape[-1]), dim=-1).double()
    return math.sqrt(float(rows.pow(2).sum()) / x.numel())


def loss(logits: Tensor, tokens: Tensor, *, overwrite: bool = False) -> float:
    """Mean next-token loss in nats of ``logits [B, T, V]`` for ``tokens [B, T]`` (:func:`lm_loss`;
    ``overwrite``: ``logits`` may be used as its scratch space)."""
    V = logits.shape[-1]
    return lm_loss(logits[:, :-1].reshape(-1, V), tokens[:, 1:].reshape(-1), overwrite=overwrite)


@dataclass
class TermImportance:
    """Loss (nats) after each run of the paper's procedure and the marginal loss of each order."""

    run_losses: list[float]  # run 1 (heads zeroed) .. run L+1 (everything)
    full_loss: float  # the model's own loss
    uniform_loss: float  # log(d_vocab)

    @property
    def marginal_by_order(self) -> list[float]:
        """Order 0 = uniform - run 1 (the direct path); order n = run n - run n+1."""
        out = [self.uniform_loss - self.run_losses[0]]
        out += [self.run_losses[i] - self.run_losses[i + 1] for i in range(len(self.run_losses) - 1)]
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_losses": self.run_losses,
            "full_loss": self.full_loss,
            "uniform_loss": self.uniform_loss,
            "marginal_by_order": self.marginal_by_order,
        }


def _logits(source: WeightSource, real: Trace, x: Tensor, out: Tensor | None) -> Tensor:
    """``[B, T, V]`` logits of the final stream ``x`` with the final divisor frozen (into ``out``, if given)."""
    unemb = source.unembed()
    s = real.divisor("final")
    final = x if source.norm == "none" else normalize(x, source.norm, 0.0, scale=s, w=unemb.ln_w, b=unemb.ln_b)[0]
    B, T, D = final.shape
    if out is None:
        out = final.new_empty(B, T, unemb.W_U.shape[1])
    torch.addmm(unemb.b_U, final.reshape(B * T, D), unemb.W_U, out=out.view(B * T, -1))
    return out


@torch.no_grad()
def term_importance(
    source: SourceLike, tokens: Tensor, *, progress: Progress | None = None, recording: Trace | None = None
) -> TermImportance:
    """The paper's procedure ([F]; docs/conventions.md, "Term importance"; the module docstring).

    Run 0 is the real forward pass, which fixes the patterns, normalisation divisors and MLP
    outputs. Run 1: all of those frozen, every head's output replaced by zeros. Run n: each
    head adds the output it computed on run n-1. After ``n_layers + 1`` runs every order is in
    and the logits equal the model's. Order n first enters on run n+1. ``recording``: run 0 (a
    :func:`frozen_recording` of ``tokens``), if made already.
    """
    source = as_source(source, where="qkov.term_importance")
    real = frozen_recording(source, tokens) if recording is None else recording
    toks, c = real.tokens, source.cfg
    emb, pos = embed(toks, source.embed(), source.pos())
    x0 = stream_start(emb, None if pos is None else pos.expand(*toks.shape, -1), c.positional)
    losses, buffer = [], None  # one [B, T, V] buffer serves every run's logits
    if c.residual != "sum":  # a routed model: the same runs through the frozen routes
        for i, x in enumerate(routed_runs(source, real, x0)):
            buffer = _logits(source, real, x, buffer)
            losses.append(loss(buffer, toks, overwrite=True))
            tick(progress, "paths: term importance", i + 1, c.n_layers + 1)
        return TermImportance(losses, loss(real.logits, toks), math.log(c.d_vocab))
    fixed = []  # what each layer adds besides its heads' outputs: b_O and the frozen MLP output
    for l in range(c.n_layers):
        add = source.attention(l, expand_kv=False).b_O
        fixed.append(add if c.d_mlp is None else add + real["mlp_out", l])
    prev = [torch.zeros_like(x0) for _ in range(c.n_layers)]  # each layer's heads' outputs on the last run
    for i in range(c.n_layers + 1):  # run i + 1 reads the outputs of run i
        x, live = x0, list(prev)
        for l in range(c.n_layers):
            if l >= i:  # below, the layer reads what it read on run i: its output is prev[l]
                live[l] = heads_write(source, real, l, x)
            x = x + prev[l] + fixed[l]
        buffer = _logits(source, real, x, buffer)
        losses.append(loss(buffer, toks, overwrite=True))
        prev = live
        tick(progress, "paths: term importance", i + 1, c.n_layers + 1)
    return TermImportance(losses, loss(real.logits, toks), math.log(c.d_vocab))
