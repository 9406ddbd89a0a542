"""Gated attention read per head: how much each gate lets through, how sparse it is, whether it
depends on the query token, the OV circuit a query actually applies, and attention sinks.

A gated model (``cfg.gate``, Qiu et al. 2025, arXiv 2505.06708; docs/architectures.md) multiplies each
head's mixed values ``z_h`` at query position ``t`` by ``g_h(t) = sigmoid(qk_in[t] @ W_G[h] + b_G[h])``
(``G = d_head`` values elementwise, one headwise) before ``W_O``. Read from the analysis forward's
``gate`` and ``pattern`` sites (:func:`gate_stats`), per head:

* ``mean`` — the mean gate value (over sequences, positions and, elementwise, channels): the paper's
  measure of how much the gate passes (it reports means well below 1, input-dependent sparsity);
* ``sparsity`` — the fraction of gate values below ``threshold`` (0.1, the paper's);
* ``token_dependence`` — the share of the gate's variance over positions that the query token
  explains: ``sum_v n_v (mean_v - mean)^2 / sum_t (g_t - mean)^2`` (the correlation ratio
  ``eta^2`` of the per-position gate, averaged over channels, against the token at that position;
  ``n_v`` the positions holding token ``v``). 1: the gate is a function of the token alone; 0: the
  token tells nothing. Tokens seen once explain their own position fully, so it reads high on
  small samples: compare heads on one sample;
* ``sink`` — the attention-sink mass: mean attention to position 0 over queries ``t >= 1``
  (:func:`~qkov.analysis.heads.pattern_scores.sink_scores`), for any model, gated or not, so a study
  can compare them ([F]'s "memory management": heads that park attention on the first token to do
  nothing; Qiu et al. report that the gate removes such sinks).

:func:`effective_ov` is the OV circuit a head applies at one query position: the weight-only
``W_OV = W_V W_O`` ignores the gate, which is exact only with the gate frozen at 1; at query
``t`` the head writes ``(A v) diag(g_t) W_O``, so its OV circuit there is ``g_t W_V W_O`` (headwise)
or ``W_V diag(g_t) W_O`` (elementwise). :func:`gate_caveat` says so in a line, for reports of the
weight-only circuits of a gated model.

Shapes: ``L`` layers, ``H`` heads, ``B`` batch, ``T`` positions, ``G`` gate values per head, ``D`` d_model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ...errors import QkovError
from ...model.config import ModelConfig
from ...weights.convert import SourceLike, as_source
from ...weights.parts import WeightSource, check_head
from ..circuits.factored import LowRank
from ..forward.cache import Trace
from ..forward.tracer import trace
from ..shown import TEXT, Shown, num, register, table
from .pattern_scores import sink_scores

__all__ = [
    "effective_ov",
    "gate_caveat",
    "gate_stats",
    "gate_stats_text",
    "GateStats",
    "head_gate_stats",
    "SPARSE_BELOW",
    "token_dependence",
]

SPARSE_BELOW = 0.1
"""A gate value below this counts as closed (Qiu et al.'s sparsity threshold)."""


@dataclass(repr=False)
class GateStats(Shown):
    """Per-head gate statistics and attention-sink mass (module docstring), each ``[L, H]`` (float64).

    ``mean``, ``sparsity`` and ``token_dependence`` are ``None`` for an ungated model; ``sink`` is
    always there. ``gate``: the model's ``cfg.gate``; ``threshold``: the sparsity threshold;
    ``positions``: the query positions the gate statistics average over."""

    gate: str
    sink: Tensor
    mean: Tensor | None = None
    sparsity: Tensor | None = None
    token_dependence: Tensor | None = None
    threshold: float = SPARSE_BELOW
    positions: int = 0

    def to_dict(self) -> dict[str, Any]:
        def rows(t: Tensor | None) -> list[list[float]] | None:
            return None if t is None else t.tolist()

        return {
            "gate": self.gate,
            "threshold": self.threshold,
            "positions": self.positions,
            "sink": rows(self.sink),
            "mean": rows(self.mean),
            "sparsity": rows(self.sparsity),
            "token_dependence": rows(self.token_dependence),
        }


def token_dependence(values: Tensor, tokens: Tensor) -> Tensor:
    """The correlation ratio ``eta^2`` of ``values [N, H]`` against the token ids ``tokens [N]``: the
    share of each column's variance explained by the per-token means, ``[H]`` (float64; 0 where a
    column does not vary)."""
    v = values.double()
    mean = v.mean(0)
    ids, inverse = torch.unique(tokens, return_inverse=True)
    sums = v.new_zeros(len(ids), v.shape[1]).index_add_(0, inverse, v)
    counts = torch.bincount(inverse, minlength=len(ids)).double()[:, None]
    between = (counts * (sums / counts - mean).pow(2)).sum(0)
    total = (v - mean).pow(2).sum(0)
    return torch.where(total > 0, between / total.clamp_min(1e-300), torch.zeros_like(total))


def head_gate_stats(gate: Tensor, tokens: Tensor, threshold: float = SPARSE_BELOW) -> tuple[Tensor, Tensor, Tensor]:
    """One layer's ``(mean, sparsity, token_dependence)``, each ``[H]`` (float64), from its gate site
    ``gate [B, T, H, G]`` and the tokens ``[B, T]`` at those positions."""
    g = gate.double()
    mean = g.mean(dim=(0, 1, 3))
    sparsity = (g < threshold).double().mean(dim=(0, 1, 3))
    per_position = g.mean(-1).reshape(-1, g.shape[2])  # [B T, H]
    return mean, sparsity, token_dependence(per_position, tokens.reshape(-1).to(g.device))


@torch.no_grad()
def gate_stats(source: SourceLike, tokens: Tensor, *, threshold: float = SPARSE_BELOW) -> GateStats:
    """Gate statistics and attention-sink mass of every head on ``tokens [B, T]`` (``T >= 2``): a
    :class:`GateStats`. One pass that records the ``gate`` sites and reads each ``pattern`` as it passes
    (no pattern is kept); any model, gated or not (then only ``sink``).

    Raises:
        QkovError: a model without layers, sequences shorter than 2 tokens, or ``threshold`` outside (0, 1).
    """
    source = as_source(source, where="qkov.gate_stats")
    cfg = source.cfg
    if cfg.n_layers == 0:
        raise QkovError("gate_stats: the model has no attention layers")
    if not 0 < threshold < 1:
        raise QkovError(f"gate_stats: threshold must be in (0, 1), got {threshold!r}")
    tokens = tokens if tokens.dim() == 2 else tokens[None]
    if tokens.shape[-1] < 2:
        raise QkovError("gate_stats: sink mass needs sequences of at least 2 tokens")
    sink = torch.zeros(cfg.n_layers, cfg.n_heads, dtype=torch.float64)

    def watch(layer: int) -> Any:
        def fn(pattern: Tensor, site: Any) -> None:  # observes: the pattern goes on unchanged
            sink[layer] = sink_scores(pattern[None].double())[0].cpu()

        return fn

    gated = cfg.gate != "none"
    out = trace(
        source, tokens, cache=["gate.*"] if gated else [], edits={f"pattern.{l}": watch(l) for l in range(cfg.n_layers)},
        logits=False,
    )  # fmt: skip
    stats = GateStats(cfg.gate, sink, threshold=threshold, positions=tokens.numel())
    if gated:
        parts = [head_gate_stats(out["gate", l], out.tokens, threshold) for l in range(cfg.n_layers)]
        stats.mean, stats.sparsity, stats.token_dependence = (torch.stack(p).cpu() for p in zip(*parts))
    return stats


def effective_ov(source: WeightSource, recording: Trace, layer: int, head: int, batch: int, position: int) -> LowRank:
    """The OV circuit head ``layer.head`` applies at query ``position`` of sequence ``batch`` of
    ``recording`` (a trace of ``source`` that cached ``gate.{layer}``): ``W_V [D, E] diag(g) @ W_O
    [E, D]`` as a :class:`~qkov.analysis.circuits.factored.LowRank` (``g`` the recorded gate there,
    ``E`` values elementwise, one repeated headwise); the weight-only ``W_V W_O`` for an ungated model."""
    check_head(source.cfg, layer, head)
    att = source.attention(layer, head)
    W_V, W_O = att.W_V[0], att.W_O[0]
    if source.cfg.gate == "none":
        return LowRank(W_V, W_O)
    if f"gate.{layer}" not in recording:
        raise QkovError(f"effective_ov: the recording did not cache gate.{layer}")
    g = recording["gate", layer][batch, position, head].to(W_V.dtype)  # [G]
    return LowRank(W_V * g, W_O)


def gate_caveat(cfg: ModelConfig) -> str | None:
    """One line for a report of weight-only OV circuits (copying, V-composition) of a gated model: they
    ignore the input-dependent gate, exact only with it frozen at 1; ``None`` for an ungated model."""
    if getattr(cfg, "gate", "none") == "none":
        return None
    per = "W_V diag(g) W_O" if cfg.gate == "elementwise" else "g W_V W_O"
    return (
        f"note: {cfg.gate} gated attention: each head's write at a query is scaled by its gate g in (0, 1), "
        f"so its OV circuit there is {per}; the weight-only OV circuits and OV-based scores here are the "
        "ungated W_V W_O (exact only with the gate frozen at 1); QK circuits are unaffected (the gate acts "
        "after the softmax); qkov.gate_stats and qkov.effective_ov read the gates"
    )


@register(TEXT, GateStats)
def gate_stats_text(s: GateStats) -> str:
    L, H = s.sink.shape
    head = ["head", "sink"] + ([] if s.mean is None else ["mean gate", f"< {s.threshold:g}", "token eta^2"])
    rows = []
    for l in range(L):
        for h in range(H):
            row = [f"{l}.{h}", num(s.sink[l, h])]
            if s.mean is not None:
                row += [num(s.mean[l, h]), num(s.sparsity[l, h]), num(s.token_dependence[l, h])]  # type: ignore[index]
            rows.append(row)
    title = f"GateStats ({s.gate} gate, {s.positions} positions): per head"
    return f"{title}\n{table(head, rows)}"
