"""Path expansion through a routed residual stream (``residual`` other than ``sum``: :mod:`qkov.model.bus`).

With the routing frozen at a run's values (AttnRes weights, hyper-connection / mHC read, mixing and write
weights; as patterns and normalisation divisors are), every sublayer's input is a linear combination of
the embedding stream and the earlier sublayers' outputs, with one scalar per position and pair:

    input_p = sum_j C[p, j] v_j,   v_0 = the embedding stream, v_{1+s} = sublayer s's output,

and the final stream is point ``p = S``. :func:`routing_coefficients` computes ``C`` from a recording
(:func:`qkov.model.bus.route_coefficients`). The expansion (:func:`expand_routed`, what :func:`qkov.analysis.paths.expand` runs
for a routed model) then splits the logits as :class:`~qkov.analysis.paths.expansion.Expansion` does for the
sum: order ``k`` (paths through ``k`` heads), ``bias``, ``mlp`` (frozen MLP outputs as sources) and each
head's order-1 term, every path carrying the product of the routing coefficients along it. Virtual-head
terms need the additive stream and are refused.

Shapes: ``P = S + 1`` aggregation points, ``J = S + 1`` sources, ``B`` batch, ``T`` positions, ``D`` d_model.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch import Tensor

from ...errors import QkovError
from ...model.bus import attention_point, route_coefficients
from ...progress import Progress, tick
from ...weights.parts import WeightSource
from ..forward.cache import Trace
from ...model.ops import write_heads
from ..forward.frozen import frozen_values, gated, head_terms

__all__ = ["expand_routed", "heads_write", "routed_runs", "routing_coefficients"]


def heads_write(source: WeightSource, real: Trace, layer: int, x: Tensor, *, value_bias: bool = True) -> Tensor:
    """The sum over heads of what layer ``layer``'s heads write ``[B, T, D]`` (``b_V`` in unless
    ``value_bias=False``, ``b_O`` out) when they read the stream ``x [B, T, D]``, the recording's patterns
    and divisors (and a gated model's gates) frozen: one product of the concatenated head outputs with ``W_O``."""
    v = frozen_values(source, real, layer, x, value_bias=value_bias)
    return write_heads(gated(real, layer, real["pattern", layer] @ v), source.attention(layer, expand_kv=False).W_O)


def routing_coefficients(cfg: Any, recording: Trace) -> Tensor:
    """``C [P, J, B, T]``: how much of source ``j`` the input of point ``p`` holds (see the module docstring;
    :func:`qkov.model.bus.route_coefficients`); zero for a source written at or after ``p``.
    ``recording`` caches the route (and mix, write) sites: a :func:`~qkov.analysis.forward.frozen.frozen_recording`."""
    try:
        return route_coefficients(cfg, recording.cache)
    except KeyError as exc:
        raise QkovError(f"routed paths: the recording must cache the routing ({exc.args[0]} is missing)") from None


def _gather(C: Tensor, p: int, sources: list[dict[Any, Tensor]], bucket: Any) -> Tensor | None:
    """The part of point ``p``'s input that comes from ``bucket`` (``None`` when nothing does)."""
    parts = [C[p, j][..., None] * src[bucket] for j, src in enumerate(sources) if bucket in src]
    return None if not parts else sum(parts[1:], parts[0])


def expand_routed(
    source: WeightSource,
    recording: Trace,
    x0: Tensor,
    *,
    per_head: bool = True,
    progress: Progress | None = None,
) -> tuple[list[Tensor], Tensor, Tensor, dict[tuple[int, int], Tensor]]:
    """Final-stream terms of a routed model: ``orders`` (``L + 1`` tensors ``[B, T, D]``), ``bias``, ``mlp``
    and (``per_head``) each head's order-1 term, from a frozen ``recording`` and the embedding stream
    ``x0 [B, T, D]``; :func:`qkov.analysis.paths.expand` wraps them in an ``Expansion``."""
    cfg = source.cfg
    C = routing_coefficients(cfg, recording)
    L, S = cfg.n_layers, cfg.sublayers
    sequential = cfg.d_mlp is not None and not cfg.parallel
    sources: list[dict[Any, Tensor]] = [{0: x0}]  # per source: its terms by bucket (order k, "bias", "mlp")
    head_outs: dict[tuple[int, int], tuple[int, Tensor]] = {}
    for l in range(L):
        s = attention_point(cfg, l)
        att = source.attention(l)
        out: dict[Any, Tensor] = {"bias": torch.einsum("he,hed->d", att.b_V, att.W_O) + att.b_O + torch.zeros_like(x0)}
        for bucket in [k for k in range(l + 1)] + ["bias", "mlp"]:
            x = _gather(C, s, sources, bucket)
            if x is None:
                continue
            key = bucket + 1 if isinstance(bucket, int) else bucket
            if bucket == 0 and per_head:
                terms = head_terms(source, recording, l, x)  # [H, B, T, D]
                head_outs.update({(l, h): (s, terms[h]) for h in range(cfg.n_heads)})
                written = terms.sum(0)
            else:
                written = heads_write(source, recording, l, x, value_bias=False)
            out[key] = out[key] + written if key in out else written
        if cfg.d_mlp is not None and not sequential:  # a parallel block writes its MLP output with the heads
            out["mlp"] = out["mlp"] + recording["mlp_out", l] if "mlp" in out else recording["mlp_out", l]
        sources.append(out)
        if sequential:
            sources.append({"mlp": recording["mlp_out", l]})
        tick(progress, "paths: expansion", l + 1, L)
    zero = torch.zeros_like(x0)
    finals = {b: _gather(C, S, sources, b) for b in [*range(L + 1), "bias", "mlp"]}
    final = {b: zero if t is None else t for b, t in finals.items()}
    heads = {key: C[S, s + 1][..., None] * term for key, (s, term) in head_outs.items()}
    return [final[k] for k in range(L + 1)], final["bias"], final["mlp"], heads


def routed_runs(source: WeightSource, real: Trace, x0: Tensor) -> Iterator[Tensor]:
    """The final streams ``[B, T, D]`` of the paper's term-importance runs (:func:`~qkov.analysis.paths.term_importance`)
    on a routed model: run ``i`` lets the heads of layers below ``i`` add what they computed on run ``i - 1``
    (zeros on run 0), everything else (patterns, divisors, MLP outputs, the routes) frozen."""
    cfg = source.cfg
    C, L, S = routing_coefficients(cfg, real), cfg.n_layers, cfg.sublayers
    sequential = cfg.d_mlp is not None and not cfg.parallel
    prev = [torch.zeros_like(x0) for _ in range(L)]
    for i in range(L + 1):
        live, outs = list(prev), [x0]
        for l in range(L):
            s = attention_point(cfg, l)
            if l >= i:  # below, the layer reads what it read on run i: its output is prev[l]
                live[l] = heads_write(source, real, l, _mix(C, s, outs))
            add = source.attention(l, expand_kv=False).b_O
            outs.append(prev[l] + (add if cfg.d_mlp is None or sequential else add + real["mlp_out", l]))
            if sequential:
                outs.append(real["mlp_out", l])
        yield _mix(C, S, outs)
        prev = live


def _mix(C: Tensor, p: int, outs: list[Tensor]) -> Tensor:
    """Point ``p``'s input from the sources ``outs`` (each ``[B, T, D]``) and the coefficients ``C``."""
    x = C[p, 0][..., None] * outs[0]
    for j in range(1, len(outs)):
        x = x + C[p, j][..., None] * outs[j]
    return x
