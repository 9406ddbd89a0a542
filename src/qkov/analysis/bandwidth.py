"""The residual stream as a communication channel: how many computational dimensions write
into and read from its ``d_model`` dimensions (the bandwidth audit), and how much heads'
write subspaces overlap (principal angles)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..model.config import ModelConfig
from ..weights.convert import SourceLike, as_source
from .factored import serial_linalg


@dataclass
class LayerBandwidth:
    layer: int
    own: int  # this layer's computational dimensions: n_heads * d_head + d_mlp
    before: int  # sum over earlier layers
    after: int  # sum over later layers
    d_model: int

    def to_dict(self) -> dict[str, Any]:
        return {**vars(self), "before_ratio": self.before / self.d_model, "after_ratio": self.after / self.d_model}


def bandwidth(cfg: ModelConfig) -> list[LayerBandwidth]:
    """Computational dimensions that communicate through the ``d_model``-wide stream, per layer."""
    own = cfg.n_heads * cfg.d_head + (cfg.d_mlp or 0)
    return [
        LayerBandwidth(layer=l, own=own, before=own * l, after=own * (cfg.n_layers - 1 - l), d_model=cfg.d_model)
        for l in range(cfg.n_layers)
    ]


@dataclass
class WriteOverlap:
    """Overlap of heads' write spaces (row spaces of ``W_O``): mean squared cosine of principal angles."""

    labels: list[str]
    overlap: Tensor  # [n, n], 1 on the diagonal; d_head / d_model expected for random subspaces
    cosines: Tensor  # [n, n, d_head] principal-angle cosines, largest first
    random_expectation: float

    def to_dict(self) -> dict[str, Any]:
        return {"labels": self.labels, "overlap": self.overlap.tolist(), "random_expectation": self.random_expectation}


def write_overlap(source: SourceLike) -> WriteOverlap:
    """Principal angles between every pair of heads' write subspaces in the residual stream."""
    source = as_source(source, where="qkov.write_overlap")
    c = source.cfg
    W_O = torch.stack([source.attention(l).W_O for l in range(c.n_layers)])
    L, H, E, D = W_O.shape
    flat = W_O.reshape(L * H, E, D).transpose(-1, -2)  # [n, D, E] columns span the write space
    with serial_linalg():
        q, _ = torch.linalg.qr(flat)
        cos = torch.linalg.svdvals(torch.einsum("ade,bdf->abef", q, q))  # [n, n, E]
    labels = [f"{l}.{h}" for l in range(L) for h in range(H)]
    return WriteOverlap(labels, cos.pow(2).mean(-1), cos, random_expectation=min(1.0, E / D))
