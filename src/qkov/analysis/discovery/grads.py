"""The gradient of the metric at every receiver's own input, and its product with every sender's change.

Attribution scores an edge ``s -> r`` by ``(a~_s - a_s) . dm/dx_r``, summed over positions and
``d_model``, where ``x_r`` is receiver ``r``'s own copy of the stream (a head's query, key or value
input, an MLP's input, the final stream) and the gradient runs through ``r``'s normalisation, its
divisor included (Syed et al. 2023; Hanna et al. 2024; AutoCircuit).

Two ways to read those gradients from a differentiable run (``trace(..., grad=True)``, then a backward
pass), with the same values (tested):

* **fast** (:func:`fast_sites`): from the gradients at the queries, keys and values ``[B, T, H, E]``,
  each head's input gradient is ``J^T (g W^T)``: the gradient at the pre-rotary projection mapped back
  through the head's weights and through the normalisation's Jacobian ``J`` (symmetric; written out in
  :func:`norm_vjp`). No per-head copy of the stream is held, so a pass costs what a plain backward does;
* **split** (:func:`split_sites`): the per-head input copies ``q_input/k_input/v_input`` are in the pass
  (so they can be edited) and their own gradients are read.

MLP receivers read ``mlp_input``'s gradient, the logits ``resid_post`` of the last layer. Then
:func:`accumulate` multiplies: for each receiver layer, ``delta [n, B*T*D] @ G [B*T*D, r]`` for the
``n`` senders before it (``[T, n, r]`` per position), never a ``[edges, B, T, D]`` tensor.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from ...model import rotary
from ...model.ops import centre
from ...weights.parts import WeightSource
from ..forward.cache import Trace
from .graph import Graph

__all__ = ["accumulate", "fast_grads", "fast_sites", "norm_vjp", "split_grads", "split_sites"]

Grads = Callable[[int], Tensor]


def fast_sites(graph: Graph, norm: str) -> list[str]:
    """What a run caches for :func:`fast_grads`."""
    cfg, L = graph.cfg, graph.cfg.n_layers
    sites = ["q.*", "k.*", "v.*", "resid_pre.*", f"resid_post.{L - 1}"]
    if norm != "none":
        sites += ["attn_scale.*"] + (["qk_scale.*"] if cfg.positional == "shortformer" else [])
    return sites + (["mlp_input.*"] if graph.mlp else [])


def split_sites(graph: Graph) -> list[str]:
    """What a run caches for :func:`split_grads` (the per-head copies: ``H`` times a layer's stream)."""
    L = graph.cfg.n_layers
    return ["q_input.*", "k_input.*", "v_input.*", f"resid_post.{L - 1}"] + (["mlp_input.*"] if graph.mlp else [])


def _grad(recording: Trace, kind: str, layer: int | None) -> Tensor:
    x = recording[(kind, layer)] if layer is not None else recording[kind]
    return torch.zeros_like(x) if x.grad is None else x.grad  # None: the metric does not depend on it


def norm_vjp(x: Tensor, s: Tensor | None, g: Tensor, kind: str, w: Tensor | None = None) -> Tensor:
    """``J^T g``: the gradient at a normalisation's input ``x [..., D]`` of a gradient ``g [..., D]`` at
    its output, with divisor ``s [..., 1]`` (``kind`` a weights view's norm; ``w`` the gain a
    ``layernorm`` / ``rmsnorm`` view keeps). For ``n = centre(x) / s``,
    ``J = (I - 11^T/D - n n^T/D) / s`` (no centring term for the RMS norms)."""
    if kind == "none":
        return g
    if w is not None and kind in ("layernorm", "rmsnorm"):
        g = g * w
    rms = kind in ("scale", "rmsnorm")
    n = (x if rms else centre(x)) / s
    out = g - n * (n * g).mean(-1, keepdim=True)
    return (out if rms else out - g.mean(-1, keepdim=True)) / s


def fast_grads(recording: Trace, source: WeightSource, graph: Graph, offset: int = 0) -> Grads:
    """``grads(l)``: the metric's gradient ``[r, B, T, D]`` at layer ``l``'s receivers (its query, key,
    value inputs and MLP; ``l = n_layers``: the logits), from a run that cached :func:`fast_sites` (of
    positions ``offset ..``: a pass over a suffix).

    A head's input gradient is ``J^T (g W^T)`` (:func:`norm_vjp`), written without forming ``J``: with
    ``g`` divided by the divisor ``s`` and the gain folded into ``W``, it is ``g W^T - (g . mean_d W) 1 -
    (g . u) n / D`` where ``n`` is the normalised input and ``u = n W`` the head's pre-bias projection,
    which the forward already computed (the cached query, key or value minus its biases)."""
    cfg, kind = graph.cfg, source.norm
    rms, normed = kind in ("scale", "rmsnorm"), kind != "none"

    def grads(l: int) -> Tensor:
        if l == cfg.n_layers:
            return _grad(recording, "resid_post", l - 1)[None]
        att = source.attention(l, expand_kv=False)
        x = recording["resid_pre", l].detach()
        B, T, D = x.shape
        out = x.new_empty(len(graph.attention_receivers(l)) + int(graph.mlp), B, T, D)
        s_v = recording["attn_scale", l].detach() if normed else None
        x_qk, s_qk = x, s_v
        if cfg.positional == "shortformer":
            x_qk = x + source.pos()[offset : offset + T]  # type: ignore[index]
            s_qk = recording["qk_scale", l].detach() if normed else None
        turn = None
        if cfg.positional == "rotary":
            cos, sin = rotary.tables(cfg, offset + T, x.device, x.dtype)
            turn = (cos[offset:], sin[offset:])
        off = 0
        qk, v_in = (x_qk, s_qk), (x, s_v)
        kinds = (("q", att.W_Q, att.b_Q, *qk), ("k", att.W_K, att.b_K, *qk), ("v", att.W_V, att.b_V, *v_in))
        for k, W, b, xin, s in kinds:
            g, val = _grad(recording, k, l), recording[k, l].detach()  # [B, T, n, E]
            if turn is not None and k != "v":  # back through the rotation R: R^T for the gradient, R^-1 for the value
                g, val = (rotary.rotate(t.transpose(1, 2), turn[0], -turn[1]).transpose(1, 2) for t in (g, val))
                val = val / _turn_norm(turn, val.shape[-1])[None, :, None]
            n = W.shape[0]
            Wg = W if att.ln_w is None or kind not in ("layernorm", "rmsnorm") else W * att.ln_w[None, :, None]
            if s is not None:
                g = g / s[:, :, :, None]
            dst = out[off : off + n]
            torch.bmm(g.permute(2, 0, 1, 3).reshape(n, B * T, -1), Wg.transpose(1, 2), out=dst.view(n, B * T, D))
            if normed:
                u = val - b[None, None] - (att.ln_b @ W if kind == "layernorm" and att.ln_b is not None else 0)
                nrm = (xin if rms else centre(xin)) / s  # type: ignore[operator]
                dst.addcmul_(((g * u).sum(-1) / D).permute(2, 0, 1)[..., None], nrm[None], value=-1)
                if not rms:
                    dst.sub_(torch.einsum("bthe,he->hbt", g, Wg.mean(1))[..., None])
            off += n
        if graph.mlp:
            out[off] = _grad(recording, "mlp_input", l)
        return out

    return grads


def _turn_norm(turn: tuple[Tensor, Tensor], E: int) -> Tensor:
    """``[T, E]``: ``cos^2 + sin^2`` of the rotary tables on the rotated dimensions, 1 on the others: the
    tables are rounded, so ``R^-1 = R^T / (cos^2 + sin^2)``, not ``R^T`` (about 1e-7 apart)."""
    cos, sin = turn
    f = cos * cos + sin * sin
    return torch.cat([f, f.new_ones(f.shape[0], E - f.shape[1])], dim=-1)


def split_grads(recording: Trace, graph: Graph) -> Grads:
    """``grads(l)`` as :func:`fast_grads`, read from the per-head input copies of a run that cached
    :func:`split_sites`."""
    cfg = graph.cfg

    def grads(l: int) -> Tensor:
        if l == cfg.n_layers:
            return _grad(recording, "resid_post", l - 1)[None]
        out = torch.cat([_grad(recording, f"{k}_input", l) for k in "qkv"], dim=2).permute(2, 0, 1, 3)
        return torch.cat([out, _grad(recording, "mlp_input", l)[None]]) if graph.mlp else out

    return grads


def accumulate(scores: Tensor, delta: Tensor, grads: Grads, graph: Graph, weight: float = 1.0) -> None:
    """``scores [S, R]`` (or ``[T, S, R]`` per position) ``+= weight * delta . grad`` for every edge:
    ``delta [S, B, T, D]`` the senders' changes, ``grads(l)`` the receivers' gradients of layer ``l``."""
    L = graph.cfg.n_layers
    for l in range(L + 1):
        G = grads(l).to(delta.dtype)
        rs = (
            [graph.logits_receiver]
            if l == L
            else [*graph.attention_receivers(l), *([graph.mlp_receiver(l)] if graph.mlp else [])]
        )
        start = 0
        while start < len(rs):  # receivers with the same senders (a layer's q/k/v; its MLP) in one product
            n = graph.before(rs[start])
            stop = start
            while stop < len(rs) and graph.before(rs[stop]) == n:
                stop += 1
            _contract(scores, delta[:n], G[start:stop], rs[start], stop - start, weight)
            start = stop


def _contract(scores: Tensor, delta: Tensor, G: Tensor, r0: int, r: int, weight: float) -> None:
    """``scores[:n, r0:r0+r] += weight * delta [n, B, T, D] . G [r, B, T, D]`` (summed over B, T, D; per
    position for a ``[T, S, R]`` score)."""
    n = delta.shape[0]
    if scores.ndim == 2:
        prod = delta.reshape(n, -1) @ G.reshape(r, -1).T  # [n, r]
        scores[:n, r0 : r0 + r] += weight * prod.to(scores.dtype)
        return
    T = delta.shape[2]
    d = delta.permute(2, 0, 1, 3).reshape(T, n, -1)  # [T, n, B*D]
    g = G.permute(2, 1, 3, 0).reshape(T, -1, r)  # [T, B*D, r]
    scores[:, :n, r0 : r0 + r] += weight * torch.bmm(d, g).to(scores.dtype)
