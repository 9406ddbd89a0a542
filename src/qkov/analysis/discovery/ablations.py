"""What an ablated edge carries: the sender's value on the corrupted prompt, zero, or a mean.

Ablating the edge ``s -> r`` changes receiver ``r``'s input alone, ``x_r -> x_r + (a~_s - a_s)``: every
other reader of ``s`` still sees ``a_s``. The replacement ``a~_s`` (Miller et al. 2024 compare them):

* ``corrupted`` (resample, interchange; EAP, EAP-IG and MIB's default): the sender's output on the
  paired corrupted prompt;
* ``zero``: ``0`` (the head's output ``z W_O`` goes, ``b_V W_O`` included: qkov does not fold value
  biases into ``b_O``);
* ``mean``: the sender's output averaged over the prompts *and positions* of a reference set (the
  task's corrupted prompts, or its clean ones);
* ``mean-position``: averaged over the prompts at each position (EAP-IG's ``mean-positional``;
  prompts of one length).

Senders' outputs are read from a run that cached :func:`sender_sites`: ``resid_pre.0`` (the input),
each layer's ``z`` (a head's output is ``z_h W_O^h``, formed here, ``[S, B, T, D]``) and ``mlp_out``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ...errors import QkovError
from ...progress import Progress, tick
from ...weights.parts import WeightSource
from ..causal.contrast import Contrast
from ..forward.cache import Trace
from ..forward.tracer import trace
from .graph import Graph
from .task import Task

__all__ = [
    "ablated_inputs",
    "Ablation",
    "ABLATIONS",
    "as_ablation",
    "make_ablation",
    "MEANS_OVER",
    "NO_LOGITS",
    "sender_deltas",
    "sender_sites",
    "sender_values",
    "shared_prefix",
    "stream_sites",
]

ABLATIONS = ("corrupted", "zero", "mean", "mean-position")
MEANS_OVER = ("corrupted", "clean")
NO_LOGITS = torch.zeros(0, dtype=torch.long)  # a run for its activations only: no logits unembedded


def sender_sites(graph: Graph) -> list[str]:
    """The sites a run caches to give every sender's output."""
    return ["resid_pre.0", "z.*", *(["mlp_out.*"] if graph.mlp else [])]


def stream_sites(graph: Graph) -> list[str]:
    """The streams a run caches to give every receiver group's input (:func:`ablated_inputs`)."""
    L = graph.cfg.n_layers
    mid = ["resid_mid.*"] if graph.mlp and not graph.cfg.parallel else []
    return ["resid_pre.*", *mid, f"resid_post.{L - 1}"]


def ablated_inputs(recording: Trace, graph: Graph, delta: Tensor) -> dict[str, Tensor]:
    """Each receiver group's input with every edge into it ablated, ``x_r + sum_{s -> r} delta_s``
    (``{"attn.l", "mlp.l", "logits"}: [B, T, D]``; ``x_r`` the recorded run's, cached by
    :func:`stream_sites`: the senders' sum plus the ``b_O`` no edge carries; ``delta [S, B, T, D]``)."""
    L = graph.cfg.n_layers
    out: dict[str, Tensor] = {}
    for l in range(L):
        n = graph.before(graph.attention_receivers(l).start)
        out[f"attn.{l}"] = recording["resid_pre", l] + delta[:n].sum(0)
        if graph.mlp:
            x = recording["resid_pre", l] if graph.cfg.parallel else recording["resid_mid", l]
            out[f"mlp.{l}"] = x + delta[: graph.before(graph.mlp_receiver(l))].sum(0)
    out["logits"] = recording["resid_post", L - 1] + delta.sum(0)
    return out


def sender_values(recording: Trace, source: WeightSource, graph: Graph) -> Tensor:
    """Every sender's output on ``run``, ``[S, B, T, D]``, detached, in sender order."""
    x0 = recording["resid_pre", 0]
    out = x0.new_empty(len(graph.senders), *x0.shape)
    _senders(recording, source, graph, out, subtract=False)
    return out


def _senders(recording: Trace, source: WeightSource, graph: Graph, out: Tensor, *, subtract: bool) -> None:
    """Write (or subtract from ``out``) every sender's output on ``run``, one layer at a time."""

    def put(where: slice | int, v: Tensor) -> None:
        if subtract:
            out[where] -= v
        else:
            out[where] = v

    put(0, recording["resid_pre", 0].detach())
    H = graph.cfg.n_heads
    for l in range(graph.cfg.n_layers):
        h0 = graph.head_sender(l)
        W_O = source.attention(l, expand_kv=False).W_O
        put(slice(h0, h0 + H), torch.einsum("bthe,hed->hbtd", recording["z", l].detach(), W_O))
        if graph.mlp:
            put(graph.mlp_sender(l), recording["mlp_out", l].detach())


@dataclass
class Ablation:
    """An ablation ``kind`` (one of :data:`ABLATIONS`) made ready: ``means`` ``[S, D]`` (``mean``) or
    ``[S, T, D]`` (``mean-position``), taken over the task's ``over`` prompts (``corrupted`` or ``clean``)."""

    kind: str
    means: Tensor | None = None
    over: str = "corrupted"

    @property
    def needs_corrupted(self) -> bool:
        return self.kind == "corrupted"

    def describe(self) -> str:
        if self.kind in ("corrupted", "zero"):
            return {"corrupted": "the corrupted prompt's values", "zero": "zero"}[self.kind]
        per = " at each position" if self.kind == "mean-position" else " over prompts and positions"
        return f"the mean over the {self.over} prompts{per}"

    def values(self, clean: Tensor, corrupted: Tensor | None) -> Tensor:
        """``a~ [S, B, T, D]`` for a batch whose clean sender values are ``clean`` (and corrupted ones
        ``corrupted``, for ``corrupted``): a new tensor."""
        if self.kind == "corrupted":
            assert corrupted is not None
            return corrupted.clone()
        if self.kind == "zero":
            return torch.zeros_like(clean)
        m = self.means.to(clean)  # type: ignore[union-attr]
        return (m[:, None, None] if m.ndim == 2 else m[:, None]).expand_as(clean).clone()


def sender_deltas(
    ablation: Ablation, clean: Trace, corrupted: Trace | None, source: WeightSource, graph: Graph
) -> Tensor:
    """``a~ - a [S, B, T, D]``: each sender's ablated output minus its output on the run ``clean``
    (``corrupted``: the run the ``corrupted`` ablation reads), in one buffer."""
    if ablation.kind == "corrupted":
        if corrupted is None:
            raise QkovError("the corrupted ablation needs the corrupted run")
        out = sender_values(corrupted, source, graph)
    else:
        x0 = clean["resid_pre", 0]
        shape = (len(graph.senders), *x0.shape)
        out = x0.new_zeros(shape) if ablation.kind == "zero" else ablation.values(x0.new_empty(shape), None)
    _senders(clean, source, graph, out, subtract=True)
    return out


def make_ablation(
    source: WeightSource,
    graph: Graph,
    task: Task,
    kind: str,
    *,
    over: str = "corrupted",
    batch: int = 32,
    progress: Progress | None = None,
) -> Ablation:
    """The ablation ``kind`` for ``task``: for the means, one pass over the task's ``over`` prompts."""
    if kind not in ABLATIONS:
        raise QkovError(f"ablation: expected one of {', '.join(ABLATIONS)}, got {kind!r}")
    if over not in MEANS_OVER:
        raise QkovError(f"ablation: means are taken over the corrupted or the clean prompts, got {over!r}")
    if kind in ("corrupted", "zero"):
        return Ablation(kind)
    if kind == "mean-position":
        task.single_length("a mean per position")
    total: Tensor | None = None
    count = 0
    batches = list(task.batches(batch))
    for i, b in enumerate(batches):
        recording = trace(
            source, b.corrupted if over == "corrupted" else b.clean, cache=sender_sites(graph), positions=NO_LOGITS
        )
        v = sender_values(recording, source, graph).double()  # [S, B, T, D]
        part = v.sum(1) if kind == "mean-position" else v.sum((1, 2))
        total = part if total is None else total + part
        count += v.shape[1] * (1 if kind == "mean-position" else v.shape[2])
        tick(progress, "ablation: means", i + 1, len(batches))
    assert total is not None
    return Ablation(kind, (total / count).to(source.dtype), over)


def as_ablation(source: WeightSource, graph: Graph, task: Task, ablation: Any, **kw: Any) -> Ablation:
    """``ablation`` (a name or an :class:`Ablation`) made ready for ``task``."""
    return ablation if isinstance(ablation, Ablation) else make_ablation(source, graph, task, ablation, **kw)


def shared_prefix(c: Contrast, ablation: Ablation) -> int:
    """How many first positions no ablation of edges can change on the contrast (a circuit's masked pass,
    an edge's exact patching): under the ``corrupted`` ablation, the positions before the first where a
    clean and its corrupted prompt differ (there every sender's replacement is its value: the model is
    causal), up to the first position the metric reads; 0 under the other ablations (or when the metric
    reads sites)."""
    T = c.base.shape[1]
    if ablation.kind != "corrupted" or c.positions is None or c.metric.reads or T < 2:
        return 0
    differs = (c.clean != c.corrupted).any(0).nonzero()[:, 0]
    first = int(differs[0]) if len(differs) else T
    return max(0, min(first, int(c.positions.min())))
