"""The residual stream's bandwidth per scheme (:mod:`qkov.model.bus`): how wide the bus is, and how much
the subspaces the sublayers write into one stream overlap.

[F] calls the residual stream a communication channel whose width ``d_model`` every layer shares, so
writers crowd each other's subspaces. A routed model changes that: hyper-connections and mHC carry
``n_streams`` copies (``n x d_model`` numbers per position), AttnRes keeps every output (or every block
sum) as its own source, beside the embedding's (``S + 1`` sources at the final read). :func:`bus_bandwidth` reports, per stream (the one stream of the sum; each stream of
hyper-connections / mHC; each AttnRes source read at the final aggregation point), the sublayers that write
into it with their weights and the **write overlap**: the write-weighted mean, over pairs of writers ``a, b``,
of ``||Q_a^T Q_b||_F^2 / min(r_a, r_b)``, ``Q`` an orthonormal basis of a writer's output space (the row
space of an attention layer's stacked ``W_O [H d_head, D]`` or an MLP's ``W_out [d_mlp, D]``, rank ``r``):
0 when the writers use orthogonal subspaces, 1 when one holds the other. The embedding is not counted (it
usually spans the whole stream). Write weights: 1 for the sum and AttnRes (a block sums its outputs),
``|B|`` for static hyper-connections, the mean ``|write|`` over a text otherwise; later mixing is not
followed (a stream's weight is where the output is written).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ...errors import QkovError
from ...model.bus import route_name, static_routes
from ...weights.convert import SourceLike, as_source
from ...weights.parts import WeightSource
from ..forward.tracer import trace
from ..shown import TEXT, Shown, num, register, table

__all__ = ["BusBandwidth", "bus_bandwidth", "stream_overlap"]


@dataclass(repr=False, eq=False)
class BusBandwidth(Shown):
    """``residual`` the scheme; ``streams`` x ``d_model`` = ``width`` numbers per position; per stream,
    ``writers`` (``attn.l`` / ``mlp.l`` with their write weight) and ``overlap`` (see the module docstring)."""

    residual: str
    streams: int
    d_model: int
    width: int
    overlap: list[float] = field(default_factory=list)
    writers: list[dict[str, float]] = field(default_factory=list)

    def to_dict(self) -> dict[str, object]:
        return {"residual": self.residual, "streams": self.streams, "d_model": self.d_model, "width": self.width,
                "overlap": self.overlap, "writers": self.writers}  # fmt: skip


def stream_overlap(bases: list[Tensor], weights: list[float]) -> float:
    """The write-weighted mean pairwise overlap ``||Q_a^T Q_b||_F^2 / min(r_a, r_b)`` of orthonormal bases
    ``Q [D, r]`` (0 with fewer than two writers of non-zero weight)."""
    total, norm = 0.0, 0.0
    for a in range(len(bases)):
        for b in range(a + 1, len(bases)):
            w = weights[a] * weights[b]
            r = min(bases[a].shape[1], bases[b].shape[1])
            if w == 0 or r == 0:
                continue
            total += w * float((bases[a].T @ bases[b]).pow(2).sum()) / r
            norm += w
    return total / norm if norm else 0.0


def _basis(W: Tensor) -> Tensor:
    """An orthonormal basis ``[D, r]`` of the row space of ``W [n, D]``."""
    _, s, Vh = torch.linalg.svd(W.double(), full_matrices=False)
    keep = s > s.max() * 1e-6 if len(s) and s.max() > 0 else torch.zeros_like(s, dtype=torch.bool)
    return Vh[keep].T


def _writers(source: WeightSource) -> list[tuple[str, Tensor]]:
    """Every sublayer in bus order with its output basis (a parallel block: attention and MLP together)."""
    cfg, out = source.cfg, []
    for l in range(cfg.n_layers):
        W_O = source.attention(l, expand_kv=False).W_O.reshape(-1, cfg.d_model)
        mlp = source.mlp(l)
        if mlp is not None and cfg.parallel:
            out.append((f"block.{l}", _basis(torch.cat([W_O, mlp.W_out]))))
            continue
        out.append((f"attn.{l}", _basis(W_O)))
        if mlp is not None:
            out.append((f"mlp.{l}", _basis(mlp.W_out)))
    return out


def _stream_weights(source: WeightSource, tokens: Tensor | None) -> Tensor:
    """``[S, n]``: each sublayer's write weight into each stream (see the module docstring)."""
    cfg, S = source.cfg, source.cfg.sublayers
    if cfg.residual == "sum":
        return torch.ones(S, 1)
    if cfg.residual in ("attnres", "attnres-block"):  # source 0, the embedding, has no sublayer writing it
        size = cfg.attnres_block if cfg.residual == "attnres-block" else 1
        blocks = torch.nn.functional.one_hot(torch.arange(S) // size, -(-S // size)).double()  # type: ignore[operator]
        return torch.cat([torch.zeros(S, 1, dtype=blocks.dtype), blocks], 1)
    routes = static_routes(cfg, source.bus)  # type: ignore[attr-defined]
    if routes is None:
        if tokens is None:
            raise QkovError(f"bandwidth: the write weights of residual {cfg.residual_text} depend on the text: give tokens")
        routes = trace(source, tokens, cache=[route_name(cfg, "write", s) for s in range(S)]).cache
    return torch.stack([routes[route_name(cfg, "write", s)].abs().mean(dim=(0, 1)) for s in range(S)]).double().cpu()


def bus_bandwidth(source: SourceLike, tokens: Tensor | None = None) -> BusBandwidth:
    """The bus width and each stream's write overlap (see the module docstring); ``tokens [B, T]`` for a
    scheme whose write weights depend on the text (dynamic hyper-connections, mHC)."""
    source = as_source(source, where="qkov.bus_bandwidth")
    cfg = source.cfg
    weights = _stream_weights(source, tokens)
    writers = _writers(source)
    n = weights.shape[1]
    overlap, named = [], []
    for i in range(n):
        w = [float(x) for x in weights[:, i]]
        overlap.append(stream_overlap([b for _, b in writers], w))
        named.append({name: wi for (name, _), wi in zip(writers, w) if wi})
    return BusBandwidth(cfg.residual, n, cfg.d_model, n * cfg.d_model, overlap, named)


@register(TEXT, BusBandwidth)
def bus_bandwidth_text(b: BusBandwidth) -> str:
    rows = [[str(i), num(o), ", ".join(f"{k} {num(v)}" for k, v in w.items())] for i, (o, w) in enumerate(zip(b.overlap, b.writers))]
    head = f"BusBandwidth of residual {b.residual}: {b.streams} stream(s) x d_model {b.d_model} = {b.width} numbers per position"
    return head + "\n" + table(["stream", "write overlap", "writers (weight)"], rows)
