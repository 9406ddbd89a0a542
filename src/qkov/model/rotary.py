"""Rotary positions, defined once: frequencies, the rotation of queries and keys, and the
relative rotation ``R_delta`` the weight-only circuits use.

Layout ("rotate half", as GPT-NeoX, Llama, Mistral and Qwen2 store their weights): of a head's
``d_head`` dimensions the first ``r = rotary_width`` rotate, the rest pass through. Dimension
``m`` and ``m + r/2`` (``m < r/2``) form a plane that turns by the angle ``p * w_m`` at position
``p``, with ``w_m = base^(-2m / r)`` (optionally rescaled, below)::

    rotate(x, p)[m]       = x[m] cos(p w_m) - x[m + r/2] sin(p w_m)
    rotate(x, p)[m + r/2] = x[m + r/2] cos(p w_m) + x[m] sin(p w_m)

so ``rotate(x, p) = x R(p)`` for a block rotation ``R(p)`` (row convention), and a query at
position ``i`` and a key at position ``j`` score ``q R(i) R(j)^T k^T = q R(i - j) k^T``: the score
depends on the offset ``delta = i - j`` only (:func:`relative_rotation`).

The frequencies and angles are computed in float32 and the cos/sin tables then cast to the
model's dtype, as those families' reference implementations do, so an imported model computes
what it computed where it was trained (a float64 analysis keeps float32 angles).

Rescalings (``rope_scaling``): ``linear`` divides every frequency by ``factor``; ``llama3``
(Llama 3.1) divides the low frequencies (wavelength above ``original / low_freq_factor``) by
``factor``, keeps the high ones (wavelength below ``original / high_freq_factor``) and blends
linearly in ``original / wavelength`` between the two.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .config import ModelConfig

__all__ = ["angles", "frequencies", "relative_rotation", "rotate", "tables"]


def frequencies(cfg: ModelConfig) -> Tensor:
    """The angular frequencies ``w_m`` of the ``rotary_width / 2`` planes, float32 ``[r/2]``."""
    r = cfg.rotary_width
    inv = 1.0 / (float(cfg.rotary_base) ** (torch.arange(0, r, 2, dtype=torch.int64).float() / r))
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv / factor
    # llama3: by wavelength, low frequencies divided by factor, high kept, a linear blend between
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    original = float(scaling["original_max_position_embeddings"])
    wavelength = 2 * math.pi / inv
    scaled = torch.where(wavelength > original / low, inv / factor, inv)
    blend = (original / wavelength - low) / (high - low)
    smoothed = (1 - blend) * scaled / factor + blend * scaled
    middle = ~(wavelength < original / high) * ~(wavelength > original / low)
    return torch.where(middle, smoothed, scaled)


def angles(cfg: ModelConfig, positions: Tensor) -> Tensor:
    """``positions [...]`` (integers, may be negative offsets) -> float32 angles ``[..., r/2]``."""
    w = frequencies(cfg).to(positions.device)
    return positions.float()[..., None] * w


def tables(cfg: ModelConfig, seq: int, device: torch.device | str | None, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``cos, sin [seq, r]`` for positions ``0 .. seq-1`` (each plane's value repeated on both of its
    dimensions), computed in float32 and cast to ``dtype``."""
    a = angles(cfg, torch.arange(seq, device=device))
    a = torch.cat([a, a], dim=-1)
    return a.cos().to(dtype), a.sin().to(dtype)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Queries or keys ``x [..., T, E]`` rotated by their position (``cos, sin [T, r]`` from
    :func:`tables`); dimensions ``r ..`` pass through."""
    r = cos.shape[-1]
    if r == 0:
        return x
    rot, rest = x[..., :r], x[..., r:]
    half = r // 2
    turned = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    out = rot * cos + turned * sin
    return out if rest.shape[-1] == 0 else torch.cat([out, rest], dim=-1)


def relative_rotation(cfg: ModelConfig, delta: int | Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """``R_delta [..., E, E]``: the block rotation with ``q R_delta k^T`` the score of a query ``delta``
    positions after its key (before the ``1/sqrt(d_head)`` scale); the identity on the dimensions that
    do not rotate. ``delta`` an int or an integer tensor ``[n]`` (then ``[n, E, E]``).

    Its angles are float32 like the forward's; the forward rotates query and key separately, so
    they agree to float32 rounding of the angles (about 1e-7 relative), not bit for bit.
    """
    d = torch.as_tensor(delta)
    a = angles(cfg, d).to(dtype)  # [..., r/2]
    E, r = cfg.d_head, cfg.rotary_width
    half = r // 2
    R = torch.eye(E, dtype=dtype).expand(*d.shape, E, E).clone()
    if r == 0:
        return R
    c, s = a.cos(), a.sin()
    idx = torch.arange(half)
    # row convention: out[m] = x[m] c - x[m+h] s ; out[m+h] = x[m+h] c + x[m] s  ->  R[m, m] = c,
    # R[m+h, m] = -s, R[m, m+h] = s, R[m+h, m+h] = c
    R[..., idx, idx] = c
    R[..., idx + half, idx + half] = c
    R[..., idx + half, idx] = -s
    R[..., idx, idx + half] = s
    return R
