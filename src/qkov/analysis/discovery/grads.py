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


def _grad(run: Trace, kind: str, layer: int | None) -> Tensor:
    x = run[(kind, layer)] if layer is not None else run[kind]
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


def fast_grads(run: Trace, source: WeightSource, graph: Graph) -> Grads:
    """``grads(l)``: the metric's gradient ``[r, B, T, D]`` at layer ``l``'s receivers (its query, key,
    value inputs and MLP; ``l = n_layers``: the logits), from a run that cached :func:`fast_sites`."""
    cfg, kind = graph.cfg, source.norm

    def grads(l: int) -> Tensor:
        if l == cfg.n_layers:
            return _grad(run, "resid_post", l - 1)[None]
        att = source.attention(l, expand_kv=False)
        x = run["resid_pre", l].detach()
        T = x.shape[1]
        s_v = None if kind == "none" else run["attn_scale", l].detach()
        x_qk, s_qk = x, s_v
        if cfg.positional == "shortformer":
            x_qk = x + source.pos()[:T]  # type: ignore[index]
            s_qk = None if kind == "none" else run["qk_scale", l].detach()
        g = {k: _grad(run, k, l) for k in "qkv"}  # [B, T, n, E]
        if cfg.positional == "rotary":
            cos, sin = rotary.tables(cfg, T, x.device, x.dtype)
            for k in "qk":  # back through the rotation: rotate by minus the angle
                g[k] = rotary.rotate(g[k].transpose(1, 2), cos, -sin).transpose(1, 2)
        parts = []
        for k, W, xin, s in (("q", att.W_Q, x_qk, s_qk), ("k", att.W_K, x_qk, s_qk), ("v", att.W_V, x, s_v)):
            gy = torch.einsum("bthe,hde->bthd", g[k], W)
            parts.append(norm_vjp(xin[:, :, None], None if s is None else s[:, :, None], gy, kind, att.ln_w))
        out = torch.cat(parts, dim=2).permute(2, 0, 1, 3)
        return torch.cat([out, _grad(run, "mlp_input", l)[None]]) if graph.mlp else out

    return grads


def split_grads(run: Trace, graph: Graph) -> Grads:
    """``grads(l)`` as :func:`fast_grads`, read from the per-head input copies of a run that cached
    :func:`split_sites`."""
    cfg = graph.cfg

    def grads(l: int) -> Tensor:
        if l == cfg.n_layers:
            return _grad(run, "resid_post", l - 1)[None]
        out = torch.cat([_grad(run, f"{k}_input", l) for k in "qkv"], dim=2).permute(2, 0, 1, 3)
        return torch.cat([out, _grad(run, "mlp_input", l)[None]]) if graph.mlp else out

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
