"""The residual stream as a bus: how each sublayer reads its input and where its output goes.

The standard transformer sums (``x_{s+1} = x_s + out_s``, ``residual="sum"``: the block body does
that itself and never builds a bus). The other schemes (:data:`~qkov.model.config.RESIDUAL_CHOICES`;
docs/architectures.md has the definitions, the papers and where qkov simplifies):

* ``attnres`` (Attention Residuals, Kimi Team 2026): the sources are ``v_0`` (the embedding stream)
  and every earlier sublayer's output; sublayer ``s`` reads ``sum_i alpha_{i->s} v_i`` with
  ``alpha_{.->s} = softmax_i(w_s . RMSNorm_s(v_i))``: a pseudo-query ``w_s [D]`` and a key gain per
  aggregation point (the final read is point ``S``).
* ``attnres-block``: the same over fewer sources: the embedding, each completed block's summed
  outputs and the current block's partial sum (when not empty).
* ``hyper`` (Hyper-Connections, Zhu et al. 2024): ``n`` streams ``H [n, D]``; sublayer ``s`` reads
  ``A_m^T H`` and writes ``H <- A_r^T H + B^T out``; static ``A_m [n]``, ``A_r [n, n]``, ``B [n]``,
  plus (``hyper_dynamic``) ``s * tanh`` of projections of the RMS-normalised streams.
* ``mhc`` (mHC, DeepSeek 2025): ``H <- H_res H + H_post^T F(H_pre H)`` with ``H_pre = sigmoid(.)``,
  ``H_post = 2 sigmoid(.)``, ``H_res = Sinkhorn-Knopp(exp(.))``, each ``alpha * (RMSNorm(vec H) phi) + b``.

One :class:`BusPass` per forward pass: :meth:`~BusPass.start` with the embedding stream, then per
sublayer :meth:`~BusPass.read` (its input ``[B, T, D]``) and :meth:`~BusPass.write` (its output),
and :meth:`~BusPass.final` (the stream the final normalisation reads). Every routing coefficient passes
through a hook (the analysis forward's sites ``route_attn.l`` / ``route_mlp.l`` / ``route_final``,
``mix_*`` and ``write_*``), so it can be read and frozen. The mixing matrix at a site is ``M [n, n]`` with
``H_new = M H + w out`` (``M = A_r^T`` for hyper-connections, ``H_res`` for mHC).

Parameters (:class:`BusParameters`, on :class:`qkov.Transformer` as ``bus.*``), stacked over
aggregation points ``P = S + 1`` (attnres) or sublayers ``S`` (hyper, mhc):
``query, key_w [P, D]``; ``A_m [S, n]``, ``A_r [S, n, n]``, ``B [S, n]`` and dynamic ``W_m, W_beta [S, D]``,
``W_r [S, D, n]``, ``s_alpha, s_beta [S]``; mHC ``norm_w [S, nD]``, ``phi_pre, phi_post [S, nD, n]``,
``phi_res [S, nD, n*n]``, ``alpha [S, 3]`` (pre, post, res), ``b_pre, b_post [S, n]``, ``b_res [S, n, n]``.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from ..errors import QkovError
from .config import ModelConfig

__all__ = [
    "attention_point",
    "BusParameters",
    "BusPass",
    "bus_shapes",
    "make_pass",
    "point_site",
    "require_sum_residual",
    "route_coefficients",
    "route_name",
    "source_slot",
    "static_routes",
    "sinkhorn",
    "inverse_rms",
    "SOURCES_PER_STREAM",
    "source_count",
]

Hook = Callable[[str, "int | None", Tensor], Tensor]


def point_site(cfg: ModelConfig, s: int) -> tuple[str, int | None]:
    """The sublayer of aggregation point ``s``: ``("attn", l)``, ``("mlp", l)`` or ``("final", None)``."""
    if s >= cfg.sublayers:
        return "final", None
    if cfg.d_mlp is not None and not cfg.parallel:
        return ("attn" if s % 2 == 0 else "mlp"), s // 2
    return "attn", s


def attention_point(cfg: ModelConfig, layer: int) -> int:
    """The sublayer (aggregation point) index of layer ``layer``'s attention: ``2 * layer`` in a sequential
    model with MLPs (attention, then MLP), ``layer`` otherwise; its output is source ``1 +`` that."""
    return 2 * layer if cfg.d_mlp is not None and not cfg.parallel else layer


def source_count(cfg: ModelConfig, s: int) -> int:
    """Sources an AttnRes aggregation point ``s`` reads: ``s + 1`` (``attnres``), or the embedding,
    the completed blocks and a non-empty partial block (``attnres-block``)."""
    if cfg.residual == "attnres-block":
        size = cfg.attnres_block
        return 1 + s // size + (1 if s % size else 0)  # type: ignore[operator]
    return s + 1


def bus_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The bus parameters' shapes (empty for ``residual="sum"``), named as on the model without ``bus.``."""
    S, D, n = cfg.sublayers, cfg.d_model, cfg.n_streams
    if cfg.residual in ("attnres", "attnres-block"):
        return {"query": (S + 1, D), "key_w": (S + 1, D)}
    if cfg.residual == "hyper":
        out = {"A_m": (S, n), "A_r": (S, n, n), "B": (S, n)}
        if cfg.hyper_dynamic:
            out |= {"W_m": (S, D), "W_beta": (S, D), "W_r": (S, D, n), "s_alpha": (S,), "s_beta": (S,)}
        return out
    if cfg.residual == "mhc":
        return {
            "norm_w": (S, n * D), "phi_pre": (S, n * D, n), "phi_post": (S, n * D, n), "phi_res": (S, n * D, n * n),
            "alpha": (S, 3), "b_pre": (S, n), "b_post": (S, n), "b_res": (S, n, n),
        }  # fmt: skip
    return {}


class BusParameters(nn.Module):
    """The bus's learned parameters (see the module docstring), per effective sublayer."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        for name, shape in bus_shapes(cfg).items():
            self.register_parameter(name, nn.Parameter(torch.empty(shape)))

    @torch.no_grad()
    def reset_parameters(self, gen: torch.Generator) -> None:
        """The papers' initialisation: AttnRes pseudo-queries zero (uniform weights) and key gains one;
        hyper-connections ``A_m = e_{s mod n}``, ``A_r = I``, ``B = 1``, dynamic projections zero and
        scales 0.01; mHC gains one, projections normal, scales 0.01, biases zero (docs/architectures.md)."""
        cfg, p = self.cfg, dict(self.named_parameters())
        n, S = cfg.n_streams, cfg.sublayers
        if cfg.residual in ("attnres", "attnres-block"):
            p["query"].zero_()
            p["key_w"].fill_(1.0)
        elif cfg.residual == "hyper":
            p["A_m"].copy_(F.one_hot(torch.arange(S) % n, n).to(p["A_m"].dtype))
            p["A_r"].copy_(torch.eye(n).expand(S, n, n))
            p["B"].fill_(1.0)
            if cfg.hyper_dynamic:
                for k in ("W_m", "W_beta", "W_r"):
                    p[k].zero_()
                p["s_alpha"].fill_(0.01)
                p["s_beta"].fill_(0.01)
        elif cfg.residual == "mhc":
            p["norm_w"].fill_(1.0)
            std = 0.8 / math.sqrt(n * cfg.d_model)
            for k in ("phi_pre", "phi_post", "phi_res"):
                p[k].copy_(torch.randn(p[k].shape, generator=gen) * std)
            p["alpha"].fill_(0.01)
            for k in ("b_pre", "b_post", "b_res"):
                p[k].zero_()

    def tensors(self) -> dict[str, Tensor]:
        """The parameters by name (no copies): what :func:`make_pass` takes."""
        return dict(self.named_parameters())


def sinkhorn(logits: Tensor, iters: int) -> Tensor:
    """Sinkhorn-Knopp of ``exp(logits)`` over the last two dimensions ``[..., n, n]`` as mHC writes it
    (``M_t = T_r(T_c(M_{t-1}))``): ``iters`` rounds of normalising the columns, then the rows (so the rows sum
    to 1 exactly, the columns nearly). The shift by the largest logit changes nothing but the overflow. The
    rounds run on the matrices laid out ``[n, n, ...]``, so each sum adds whole rows of the batch (a sum over
    a last dimension of 4 is many times slower), with their gradient written out (:class:`_Normalise`);
    the result is a view in the input's layout."""
    m = torch.exp(logits - logits.amax(dim=(-2, -1), keepdim=True))
    m = m.movedim((-2, -1), (0, 1)).contiguous()
    return _Normalise.apply(m, iters).movedim((0, 1), (-2, -1))


class _Normalise(torch.autograd.Function):
    """The Sinkhorn rounds on positive ``m [n, n, ...]``: ``iters`` times the columns (``dim 0``), then the rows
    (``dim 1``) divided by their sums. Each step ``y = x / c``, ``c = sum x``, has the gradient
    ``dx = (dy - sum(dy * y)) / c``: four operations a step instead of autograd's eight."""

    @staticmethod
    def forward(ctx: Any, m: Tensor, iters: int) -> Tensor:
        kept = []
        for _ in range(iters):
            for dim in (0, 1):
                c = m.sum(dim=dim, keepdim=True)
                m = m / c
                kept += [m, c]
        ctx.save_for_backward(*kept)
        return m

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        kept, grad = ctx.saved_tensors, grad.contiguous()  # it comes in the caller's layout
        for k in range(len(kept) // 2 - 1, -1, -1):
            y, c = kept[2 * k], kept[2 * k + 1]
            grad = (grad - (grad * y).sum(dim=k % 2, keepdim=True)) / c
        return grad, None


def inverse_rms(x: Tensor, eps: float) -> Tensor:
    """``1 / sqrt(mean(x^2) + eps)`` over the last dimension ``[...]``: RMSNorm's divisor. The bus applies it
    to a projection instead of to the stream, ``RMSNorm(x; g) @ W = (x @ (g W)) * inverse_rms(x)``, so the
    normalised stream (as wide as all the streams) is never built."""
    return torch.rsqrt(x.pow(2).mean(-1) + eps)


SOURCES_PER_STREAM = 4
"""Static hyper-connections read their sources one by one while there are at most this many per stream
(:class:`StreamsPass`); a read of ``J`` sources costs about ``J`` passes over ``[B, T, D]``, a write and a
read of ``n`` built streams about ``6 n``."""


def _weighted(c: Tensor, sources: list[Tensor]) -> Tensor:
    """``sum_j c[j] sources[j]``, in source order (sources ``[B, T, D]``; ``c [J, ...]``, each ``c[j]``
    broadcasting against them: ``[J]`` or ``[J, B, T, 1]``)."""
    out = c[0] * sources[0]
    for j in range(1, len(sources)):
        out = torch.addcmul(out, c[j], sources[j])
    return out


def _shared(value: Tensor) -> Tensor | None:
    """``value [B, T, ...]``'s one entry when it is the same tensor broadcast over batch and position (static
    coefficients, unedited: stride 0 there), else ``None``."""
    return value[0, 0] if value.stride(0) == 0 and value.stride(1) == 0 else None


class BusPass:
    """One forward pass through the bus (see the module docstring); ``hook(kind, layer, value)`` passes
    every routing coefficient through a site."""

    def __init__(self, cfg: ModelConfig, params: Mapping[str, Tensor], hook: Hook) -> None:
        self.cfg, self.p, self.hook = cfg, params, hook

    def at(self, what: str, s: int, value: Tensor) -> Tensor:
        """``value`` through the site ``{what}_{attn|mlp}.l`` of sublayer ``s`` (``{what}_final`` at the end)."""
        part, layer = point_site(self.cfg, s)
        return self.hook(f"{what}_{part}", layer, value)

    def start(self, x0: Tensor) -> None:
        raise NotImplementedError

    def read(self, s: int) -> Tensor:
        raise NotImplementedError

    def write(self, s: int, outs: list[Tensor]) -> None:
        """Sublayer ``s``'s output: ``outs`` summed in order (a parallel block's attention, then MLP)."""
        raise NotImplementedError

    def final(self) -> Tensor:
        """The stream the final normalisation reads, ``[B, T, D]``."""
        raise NotImplementedError


class AttnResPass(BusPass):
    """Attention Residuals, whole (every output a source) or in blocks."""

    def start(self, x0: Tensor) -> None:
        self.sources: list[Tensor] = [x0]
        self.scales: list[Tensor] = []  # each finished source's RMS divisor [B, T], computed when first read
        self.partial: Tensor | None = None

    def current(self) -> tuple[list[Tensor], list[Tensor]]:
        """The sources the next aggregation point reads and their RMS divisors ``[B, T]``."""
        eps = self.cfg.ln_eps
        self.scales += [inverse_rms(v, eps) for v in self.sources[len(self.scales) :]]
        if self.partial is None:
            return self.sources, self.scales
        return [*self.sources, self.partial], [*self.scales, inverse_rms(self.partial, eps)]

    def weights(self, s: int, sources: list[Tensor], scales: list[Tensor]) -> Tensor:
        """``alpha [B, T, R]``: the softmax over sources of ``w_s . RMSNorm_s(v_i)``, computed as
        ``(v_i @ (g_s * w_s)) / rms(v_i)`` (the same number; no normalised copy of the sources)."""
        u = self.p["key_w"][s] * self.p["query"][s]
        logits = torch.stack([(v @ u) * r for v, r in zip(sources, scales)], dim=-1)
        return torch.softmax(logits, dim=-1)

    def read(self, s: int) -> Tensor:
        sources, scales = self.current()
        alpha = self.at("route", s, self.weights(s, sources, scales))
        return _weighted(alpha.movedim(-1, 0)[..., None], sources)  # source by source: no stacked copy

    def write(self, s: int, outs: list[Tensor]) -> None:
        out = outs[0]
        for o in outs[1:]:
            out = out + o
        if self.cfg.residual == "attnres":
            self.sources.append(out)
            return
        self.partial = out if self.partial is None else self.partial + out
        if (s + 1) % self.cfg.attnres_block == 0:  # type: ignore[operator]  # the block is complete
            self.sources.append(self.partial)
            self.partial = None

    def final(self) -> Tensor:
        return self.read(self.cfg.sublayers)


class StreamsPass(BusPass):
    """Hyper-connections and mHC: ``n`` streams, read by weights, mixed, written.

    The streams are held in one of three forms (the same numbers, to float rounding; ``form``):

    * ``"sources"``, while every coefficient is shared by all positions (static hyper-connections, unedited):
      the sources ``v_j`` (the embedding stream, then each sublayer's output) and each stream's coefficients
      over them, ``G [n, J]``, so ``H = G V``. A read sums the sources with ``r G``, a write appends its output
      and sets ``G <- [M G | w]``: nothing of width ``n x d_model`` is ever built. A read costs one pass per
      source, so past :data:`SOURCES_PER_STREAM` sources per stream the streams are built once and held
    * ``"rows"``: stream-major ``[n, B*T*D]``, each read, mix and write one matrix product over the streams;
    * ``"tokens"`` (per-position coefficients, from the first that differs by position on): token-major
      ``H [B, T, n, D]``, each position's products batched; the write ``H <- M H + w out`` is one product
      ``[M | w] @ [H ; out]``.

    The outputs of a parallel block (attention, then MLP) are added one after the other, as the sum adds
    them, so that one identity stream is the standard model bit for bit."""

    def start(self, x0: Tensor) -> None:
        n, (B, T, D) = self.cfg.n_streams, x0.shape
        self.size = (B, T, D)
        self.form = "sources" if self.static else "tokens"
        self.sources, self.G = [x0], x0.new_ones(n, 1)
        self.H = x0[:, :, None, :].repeat(1, 1, n, 1) if self.form == "tokens" else x0
        self.pending: tuple[Tensor, Tensor] | None = None

    @property
    def static(self) -> bool:
        """Whether the coefficients are the same at every position (before any edit)."""
        return False

    def hold(self, form: str) -> None:
        """Hold the streams as ``form`` from now on: ``"rows"`` (too many sources) or ``"tokens"`` (a coefficient
        differs by position); never back."""
        if self.form == form or self.form == "tokens":
            return
        B, T, D = self.size
        if self.form == "sources":  # each stream summed in source order, as the reads sum them
            self.H = torch.stack([_weighted(g, self.sources) for g in self.G]).view(-1, B * T * D)
            self.sources, self.G = [], self.G[:, :0]
        if form == "tokens":
            self.H = self.H.view(-1, B, T, D).permute(1, 2, 0, 3).contiguous()
        self.form = form

    def coefficients(self, s: int) -> tuple[Tensor, Tensor, Tensor]:
        """Read weights ``[B, T, n]``, mixing ``M [B, T, n, n]`` (``H_new = M H``) and write weights ``[B, T, n]``."""
        raise NotImplementedError

    def gather(self, r: Tensor) -> Tensor:
        """The streams read with weights ``r [B, T, n]``: ``[B, T, D]``."""
        shared = _shared(r) if self.form != "tokens" else None
        if shared is not None and self.form == "sources":
            return _weighted(shared @ self.G, self.sources)
        if shared is not None:
            return (shared @ self.H).view(self.size)
        self.hold("tokens")
        return (r.contiguous()[..., None, :] @ self.H).squeeze(-2)

    def read(self, s: int) -> Tensor:
        r, M, w = self.coefficients(s)
        r = self.at("route", s, r)
        self.pending = (self.at("mix", s, M), self.at("write", s, w))
        return self.gather(r)

    def write(self, s: int, outs: list[Tensor]) -> None:
        M, w = self.pending  # type: ignore[misc]
        self.pending = None
        Ms, ws = (_shared(M), _shared(w)) if self.form != "tokens" else (None, None)
        if Ms is None or ws is None:
            self.hold("tokens")
        elif len(self.sources) + len(outs) > SOURCES_PER_STREAM * self.cfg.n_streams:
            self.hold("rows")
        if self.form == "sources":
            self.G = torch.cat([Ms @ self.G, ws[:, None].expand(-1, len(outs))], 1)  # type: ignore[operator, index]
            self.sources += outs
            return
        if self.form == "rows":
            H = torch.cat([Ms, ws[:, None]], 1) @ torch.cat([self.H, outs[0].reshape(1, -1)], 0)  # type: ignore[list-item, index]
            for o in outs[1:]:
                H = H + ws[:, None] * o.reshape(1, -1)  # type: ignore[index]
            self.H = H
            return
        H = torch.cat([M, w[..., None]], -1) @ torch.cat([self.H, outs[0][:, :, None, :]], -2)
        for o in outs[1:]:
            H = H + w[..., None] * o[:, :, None, :]
        self.H = H

    def final(self) -> Tensor:
        B, T, _ = self.size
        ones = self.G.new_ones(self.cfg.n_streams).expand(B, T, -1)
        return self.gather(self.hook("route_final", None, ones))


class HyperPass(StreamsPass):
    """Hyper-connections (static, or with the dynamic terms)."""

    @property
    def static(self) -> bool:
        return not self.cfg.hyper_dynamic

    def coefficients(self, s: int) -> tuple[Tensor, Tensor, Tensor]:
        p, n, (B, T, _) = self.p, self.cfg.n_streams, self.size
        A_m, A_r, Bw = p["A_m"][s], p["A_r"][s], p["B"][s]
        if not self.cfg.hyper_dynamic:
            return A_m.expand(B, T, n), A_r.transpose(0, 1).expand(B, T, n, n), Bw.expand(B, T, n)
        self.hold("tokens")
        # RMSNorm(H) @ [W_m | W_r | W_beta], as one product of the unnormalised streams, then scaled
        W = torch.cat([p["W_m"][s][:, None], p["W_r"][s], p["W_beta"][s][:, None]], dim=1)  # [D, n + 2]
        t = torch.tanh((self.H @ W) * inverse_rms(self.H, self.cfg.ln_eps)[..., None])  # [B, T, n, n + 2]
        A_m = A_m + p["s_alpha"][s] * t[..., 0]
        A_r = A_r + p["s_alpha"][s] * t[..., 1 : n + 1]  # [B, T, n (from), n (to)]
        Bw = Bw + p["s_beta"][s] * t[..., n + 1]
        return A_m, A_r.transpose(-1, -2), Bw


class MHCPass(StreamsPass):
    """Manifold-constrained hyper-connections."""

    def coefficients(self, s: int) -> tuple[Tensor, Tensor, Tensor]:
        p, n, (B, T, D) = self.p, self.cfg.n_streams, self.size
        self.hold("tokens")
        flat = self.H.view(B, T, n * D)
        # RMSNorm(vec H; norm_w) @ [phi_pre | phi_post | phi_res], as one product of vec H, then scaled
        phi = torch.cat([p["phi_pre"][s], p["phi_post"][s], p["phi_res"][s]], dim=1) * p["norm_w"][s][:, None]
        proj = (flat @ phi) * inverse_rms(flat, self.cfg.ln_eps)[..., None]  # [B, T, 2n + n^2]
        a = p["alpha"][s]
        pre = torch.sigmoid(a[0] * proj[..., :n] + p["b_pre"][s])
        post = 2 * torch.sigmoid(a[1] * proj[..., n : 2 * n] + p["b_post"][s])
        res = a[2] * proj[..., 2 * n :].reshape(B, T, n, n) + p["b_res"][s]
        return pre, sinkhorn(res, self.cfg.sinkhorn_iters), post


def make_pass(cfg: ModelConfig, params: Mapping[str, Tensor], hook: Hook) -> BusPass:
    """The bus of a routed model (``cfg.residual`` other than ``sum``) for one forward pass."""
    kind = {"attnres": AttnResPass, "attnres-block": AttnResPass, "hyper": HyperPass, "mhc": MHCPass}[cfg.residual]
    return kind(cfg, params, hook)


def source_slot(cfg: ModelConfig, j: int, p: int) -> int:
    """The AttnRes source that carries source ``j`` (0 the embedding, ``1 + s`` sublayer ``s``'s output) at
    aggregation point ``p``: ``j`` itself (``attnres``), or the completed block holding it / the partial block
    (``attnres-block``)."""
    if cfg.residual != "attnres-block" or j == 0:
        return j
    size, block = cfg.attnres_block, (j - 1) // cfg.attnres_block  # type: ignore[operator]
    return 1 + block if (block + 1) * size <= p else 1 + p // size  # type: ignore[operator]


def route_name(cfg: ModelConfig, what: str, p: int) -> str:
    """The site of point ``p``'s ``route`` / ``mix`` / ``write`` coefficients (``route_attn.1``, ``route_final``)."""
    part, layer = point_site(cfg, p)
    return f"{what}_{part}" if layer is None else f"{what}_{part}.{layer}"


def route_coefficients(cfg: ModelConfig, routes: Mapping[str, Tensor]) -> Tensor:
    """``C [P, J, B, T]`` (``P = J = S + 1``): how much of source ``j`` (0 the embedding stream, ``1 + s``
    sublayer ``s``'s output) aggregation point ``p``'s input holds with the routing held at ``routes`` (site
    name -> value, as recorded: ``route_*`` and for streams ``mix_*``, ``write_*``); zero for ``j > p``.
    AttnRes: the softmax weight of the source holding ``j``. Streams: each source's weight in each stream,
    carried through every later mixing ``M`` (``g <- M g``, a new output entering with the write weights)
    and read with the read weights (``route_final``: the final read). Raises ``KeyError`` naming a missing site."""
    S = cfg.sublayers
    first = routes[route_name(cfg, "route", 0)]
    B, T = first.shape[:2]
    C = first.new_zeros(S + 1, S + 1, B, T)
    if cfg.residual in ("attnres", "attnres-block"):
        for p in range(S + 1):
            alpha = routes[route_name(cfg, "route", p)]
            for j in range(p + 1):
                C[p, j] = alpha[..., source_slot(cfg, j, p)]
        return C
    g = [first.new_ones(B, T, cfg.n_streams)]  # per source: its weight in each stream
    for p in range(S + 1):
        r = routes[route_name(cfg, "route", p)]
        for j, gj in enumerate(g):
            C[p, j] = (r * gj).sum(-1)
        if p < S:
            M, w = routes[route_name(cfg, "mix", p)], routes[route_name(cfg, "write", p)]
            g = [(M @ gj[..., None])[..., 0] for gj in g] + [w]
    return C


def static_routes(cfg: ModelConfig, params: Mapping[str, Tensor]) -> dict[str, Tensor] | None:
    """The routing of static hyper-connections (the same for every text) as ``[1, 1, ...]`` site values, or
    ``None`` where the routing depends on the input (AttnRes, dynamic hyper-connections, mHC)."""
    if cfg.residual != "hyper" or cfg.hyper_dynamic:
        return None
    out: dict[str, Tensor] = {}
    for s in range(cfg.sublayers):
        out[route_name(cfg, "route", s)] = params["A_m"][s][None, None]
        out[route_name(cfg, "mix", s)] = params["A_r"][s].transpose(0, 1)[None, None]
        out[route_name(cfg, "write", s)] = params["B"][s][None, None]
    out["route_final"] = params["A_m"].new_ones(1, 1, cfg.n_streams)
    return out


def require_sum_residual(cfg: ModelConfig, what: str) -> None:
    """Refuse (one line) ``what``, an analysis written for the additive stream ``x_{l+1} = x_l + out_l``,
    on a routed model (``residual`` other than ``sum``)."""
    if cfg.residual != "sum":
        raise QkovError(
            f"{what} assumes the additive residual stream (x + out); this model routes it ({cfg.residual_text}): "
            "docs/architectures.md lists what works on routed models"
        )
