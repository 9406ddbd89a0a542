"""Edge attribution: every edge's effect on the metric, estimated from gradients, all edges at once.

Scores are in the sign and on the scale of exact edge patching: the estimated change
``m(edge ablated) - m(clean)``, averaged over the prompt pairs (:class:`~.scores.EdgeScores`). For
an edge ``s -> r`` with sender change ``delta_s = a~_s - a_s`` (:mod:`.ablations`) and the metric's
gradient at receiver ``r``'s own input (:mod:`.grads`):

* ``eap`` -- **edge attribution patching** (Syed, Rager and Conmy 2023): the first-order Taylor term at
  the clean run, ``delta_s . dm/dx_r``. One clean forward and backward and one corrupted forward, every
  edge from the same three passes; exact where the model is linear in the edge.
* ``eap-ig`` -- **EAP with integrated gradients over the inputs** (Hanna, Pezzelle and Belinkov 2024,
  "EAP-IG-inputs", MIB's recommended default): the input embedding moved from the corrupted prompt's to
  the clean one's, ``e(a) = e_corr + a (e_clean - e_corr)`` at ``a = k/m``, ``k = 0 .. m-1`` (their code's
  points: the corrupted end included, the clean end not), the gradients averaged:
  ``delta_s . (1/m) sum_k dm/dx_r |_{e(a_k)}``. The corrupted ablation only.
* ``eap-ig-activations`` -- Hanna et al.'s other variant: one node group at a time (the input, each
  attention layer's heads, each MLP) has its output set to ``a clean + (1 - a) ablated`` at ``a = k/m``,
  ``k = 1 .. m``, and every step's gradient at every receiver is averaged over groups and steps. Here the
  interpolation runs to the ablated value for every ablation (their code interpolates a mean ablation to
  zero).
* ``ieg`` -- AutoCircuit's **integrated edge gradients** (Miller et al. 2024; ``integrated_grad_samples``):
  every edge at once carried ``a`` of the way to its ablated value, ``x_r -> x_r + a sum_s (a~_s -
  a_s(current))`` at ``a = k/m``, ``k = 0 .. m`` (both ends: ``m + 1`` points), and
  ``(1/(m+1)) sum_k (a~_s - a_s(a_k)) . dm/dx_r |_{a_k}``, the senders read from each interpolated pass.
  AutoCircuit reports the sum over points and batches of the gradient of ``-m``: ``-(m + 1) * batches``
  times this.

Summed over ``k`` and divided as written, ``sum_e ieg(e)`` tends to ``m(empty) - m(clean)`` as ``m``
grows (completeness, tested).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

from ...errors import QkovError
from ...weights.parts import WeightSource
from ..causal.contrast import Contrast
from ..forward.cache import Trace
from ..forward.tracer import trace
from .ablations import Ablation, ablated_inputs, sender_deltas, sender_sites, sender_values, shared_prefix, stream_sites
from .grads import accumulate, fast_grads, fast_sites, split_grads, split_sites
from .graph import Graph
from .task import AnswerMetric, TaskBatch

__all__ = ["ATTRIBUTION", "attribution_batch", "batch_size"]

ATTRIBUTION = ("eap", "eap-ig", "eap-ig-activations", "ieg")
WHERE = "edge attribution"
_Batch = Callable[..., tuple[float, float]]


def batch_size(source: WeightSource, graph: Graph, T: int, max_bytes: int = 2 << 30) -> int:
    """Prompt pairs per attribution pass within ``max_bytes``: every sender's change ``[S, T, D]`` and a
    backward pass's activations per prompt."""
    c = source.cfg
    per_token = c.d_model * (len(graph.senders) + 16 * c.n_layers + 2 * c.n_heads) + 3 * (c.d_mlp or 0) * c.n_layers
    per = T * per_token * torch.empty(0, dtype=source.dtype).element_size()
    return max(1, int(max_bytes // per))


def attribution_batch(
    method: str,
    source: WeightSource,
    graph: Graph,
    b: TaskBatch,
    metric: AnswerMetric,
    ablation: Ablation,
    scores: Tensor,
    *,
    weight: float,
    steps: int,
) -> tuple[float, float]:
    """Add ``weight`` times one batch's scores by ``method`` (:data:`ATTRIBUTION`) to ``scores [S, R]``
    (``[T, S, R]`` per position); returns the metric on the batch's clean and corrupted runs."""
    score = {"eap": _eap, "eap-ig": _eap_ig_inputs, "eap-ig-activations": _eap_ig_activations, "ieg": _ieg}[method]
    return score(source, graph, b, metric, ablation, scores, weight=weight, steps=steps)


class _Runs:
    """A batch's runs, from the first position an ablation can change on (:func:`~.ablations.shared_prefix`;
    the clean run's keys and values before it): no edge's change, and no point between the clean and
    the corrupted run, differs from the clean run there, so no score reads those positions. The metric
    reads each run's logits at their positions; :attr:`f` the first position run."""

    def __init__(self, source: WeightSource, b: TaskBatch, metric: AnswerMetric, ablation: Ablation) -> None:
        self.source, self.metric = source, metric
        c = Contrast.of(source, b.clean, b.corrupted, metric=metric, direction="noise", where=WHERE)
        self.f = shared_prefix(c, ablation)
        self.past = None
        if self.f:
            before = trace(source, b.clean[:, : self.f], cache=["k.*", "v.*"], logits=False)
            self.past = (before.stack("k"), before.stack("v"))

    def run(self, tokens: Tensor, cache: list[str], edits: dict[str, Any] | None = None, grad: bool = False) -> Trace:
        """``tokens`` run from :attr:`f` on (their sites hold those positions), caching ``cache``; with
        ``grad``, differentiable and after the backward pass of the metric."""
        at = self.metric.logit_positions(tokens.shape[1])
        rec = trace(
            self.source, tokens[:, self.f :], cache=cache, edits=edits, grad=grad,
            positions=None if at is None else at - self.f, past=self.past,
        )  # fmt: skip
        if self.f:  # the metric reads the logits at their positions in the whole prompts
            rec = Trace(tokens, rec.logits, rec.cache, rec.source, at, rec.stacks)
        if grad:
            with torch.enable_grad():  # whatever the caller's mode: the recording kept its graph
                self.metric(rec).backward()
        return rec

    def value(self, rec: Trace) -> float:
        return float(self.metric(rec).detach())

    def plain(self, b: TaskBatch, graph: Graph, cache: list[str] | None = None) -> tuple[Trace, Trace]:
        """Both runs, no gradient, caching the senders (and ``cache``)."""
        sites = [*sender_sites(graph), *(cache or [])]
        return self.run(b.clean, sites), self.run(b.corrupted, sites)


def _eap(source, graph, b, metric, ablation, scores, *, weight, steps) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    runs = _Runs(source, b, metric, ablation)
    clean = runs.run(b.clean, [*sender_sites(graph), *fast_sites(graph, source.norm)], grad=True)
    corrupted = runs.run(b.corrupted, sender_sites(graph))
    delta = sender_deltas(ablation, clean, corrupted, source, graph)
    accumulate(_from(scores, runs.f), delta, fast_grads(clean, source, graph, runs.f), graph, weight)
    return runs.value(clean), runs.value(corrupted)


def _from(scores: Tensor, f: int) -> Tensor:
    """The scores of the positions from ``f`` on (per-position scores ``[T, S, R]``; else all of them)."""
    return scores[f:] if scores.ndim == 3 else scores


def _input_edit(x: Tensor) -> Callable[[Tensor, Any], Tensor]:
    """Replace the input stream by ``x``, a fresh leaf the rest of the pass differentiates through."""
    return lambda value, site: x.clone().requires_grad_(True)


def _eap_ig_inputs(source, graph, b, metric, ablation, scores, *, weight, steps) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    if ablation.kind != "corrupted":
        raise QkovError(
            f"{WHERE}: eap-ig moves the input from the corrupted prompt to the clean one; "
            "it needs the corrupted ablation"
        )
    runs = _Runs(source, b, metric, ablation)
    clean, corrupted = runs.plain(b, graph)
    e_clean, e_corr = clean["resid_pre", 0], corrupted["resid_pre", 0]
    delta = sender_deltas(ablation, clean, corrupted, source, graph)
    for k in range(steps):
        x = e_corr + (k / steps) * (e_clean - e_corr)
        recording = runs.run(b.clean, fast_sites(graph, source.norm), {"resid_pre.0": _input_edit(x)}, grad=True)
        accumulate(_from(scores, runs.f), delta, fast_grads(recording, source, graph, runs.f), graph, weight / steps)
    return runs.value(clean), runs.value(corrupted)


def _eap_ig_activations(source, graph, b, metric, ablation, scores, *, weight, steps) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    L = graph.cfg.n_layers
    runs = _Runs(source, b, metric, ablation)
    clean, corrupted = runs.plain(b, graph, ["attn_out.*"])
    delta = sender_deltas(ablation, clean, corrupted, source, graph)
    groups: list[tuple[str, Tensor, Tensor]] = [("resid_pre.0", clean["resid_pre", 0], delta[0])]
    for l in range(L):
        h0 = graph.head_sender(l)
        groups.append((f"attn_out.{l}", clean["attn_out", l], delta[h0 : h0 + graph.cfg.n_heads].sum(0)))
        if graph.mlp:
            groups.append((f"mlp_out.{l}", clean["mlp_out", l], delta[graph.mlp_sender(l)]))
    total = len(groups) * steps
    for site, out, change in groups:
        for k in range(1, steps + 1):
            x = out + (1 - k / steps) * change  # a clean + (1 - a) ablated
            edit = _input_edit(x) if site == "resid_pre.0" else (lambda v, s, x=x: x)
            recording = runs.run(b.clean, fast_sites(graph, source.norm), {site: edit}, grad=True)
            accumulate(_from(scores, runs.f), delta, fast_grads(recording, source, graph, runs.f), graph, weight / total)
    return runs.value(clean), runs.value(corrupted)


def _ieg(source, graph, b, metric, ablation, scores, *, weight, steps) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    runs = _Runs(source, b, metric, ablation)
    c_run, k_run = runs.plain(b, graph, stream_sites(graph))
    clean = sender_values(c_run, source, graph)
    ablated = ablation.values(clean, sender_values(k_run, source, graph) if ablation.needs_corrupted else None)
    target = ablated_inputs(c_run, graph, ablated - clean)
    for k in range(steps + 1):
        a = k / steps if steps else 0.0
        edits = _interpolate(graph, target, a)
        recording = runs.run(b.clean, [*sender_sites(graph), *split_sites(graph)], edits, grad=True)
        delta = ablated - sender_values(recording, source, graph)
        accumulate(_from(scores, runs.f), delta, split_grads(recording, graph), graph, weight / (steps + 1))
    return runs.value(c_run), runs.value(k_run)


def _interpolate(graph: Graph, target: dict[str, Tensor], a: float) -> dict[str, Any]:
    """Edits moving every receiver's input ``a`` of the way to its fully ablated value."""

    def toward(t: Tensor, split: bool):  # type: ignore[no-untyped-def]
        goal = t[:, :, None] if split else t
        return lambda value, site: value + a * (goal - value)

    edits: dict[str, Any] = {}
    for l in range(graph.cfg.n_layers):
        for kind in "qkv":
            edits[f"{kind}_input.{l}"] = toward(target[f"attn.{l}"], True)
        if graph.mlp:
            edits[f"mlp_input.{l}"] = toward(target[f"mlp.{l}"], False)
    edits[f"resid_post.{graph.cfg.n_layers - 1}"] = toward(target["logits"], False)
    return edits
