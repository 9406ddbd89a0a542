"""Activation patching and attribution patching: which activations carry the difference between a
clean and a corrupted run (docs/interventions.md has the definitions and their sources).

**Activation patching** (Meng et al. 2022; Wang et al. 2022; as TransformerLens' ``patching``
module): run the *base* tokens with one activation replaced by its value on the *source* tokens,
and measure. ``direction="denoise"`` (the default, TransformerLens' convention) runs the corrupted
tokens and patches in the clean activation; ``"noise"`` runs the clean tokens and patches in the
corrupted one. A sweep patches one site kind at every (layer, position), (layer, head) or
(layer, position, head), batched: each forward pass carries many patched copies of the base
tokens, and starts at the patched layer from the base run's stream (nothing before the patch
changes), so a sweep costs about half a forward pass per patch, in a few large batches.

**Attribution patching** (Nanda 2023; Syed et al. 2023): the first-order estimate of every such
patch from one backward pass, ``metric(base) + (source - base) . d metric / d activation``,
returned on the same scale so the two can be compared (:func:`agreement`).

Results are :class:`PatchResult`: the metric after each patch, the clean and corrupted values,
``normalized()`` (0: the patch changes nothing, 1: it moves the metric all the way).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import Tensor

from ...errors import QkovError
from ...model.tokens import check_tokens
from ...weights.parts import WeightSource
from ...weights.convert import SourceLike, as_source
from ..forward.cache import Trace
from ..forward.cache import final_stream
from ..forward.tracer import trace
from .metrics import Metric, as_metric
from ...progress import Progress, tick
from ..shown import TEXT, Shown, register
from ..forward.sites import BY_NAME, Address, Sites

__all__ = [
    "activation_patching",
    "agreement",
    "attribution_patching",
    "batched",
    "copy_bytes",
    "default_axes",
    "DIRECTIONS",
    "largest",
    "metric_values",
    "pair",
    "PATCH_BYTES",
    "PatchResult",
    "reads_from",
    "result_text",
    "scalar",
]

DIRECTIONS = ("denoise", "noise")
PATCH_BYTES = 256 * 2**20  # activations of the patched copies held at once (one batch)


@dataclass(repr=False)
class PatchResult(Shown):
    """``values`` (one metric value per patch, shaped by ``axes``; NaN where nothing was patched),
    the metric on the ``clean`` and ``corrupted`` runs, and what was patched."""

    method: str  # "activation", "attribution" or "path"
    site: str  # the kind patched, or "sender -> receivers' input" for a path
    axes: tuple[str, ...]
    values: Tensor
    clean: float
    corrupted: float
    direction: str
    metric: str
    labels: dict[str, list[str]] = field(default_factory=dict)

    @property
    def base(self) -> float:
        """The metric with nothing patched: the corrupted run when denoising, the clean one when noising."""
        return self.corrupted if self.direction == "denoise" else self.clean

    @property
    def target(self) -> float:
        return self.clean if self.direction == "denoise" else self.corrupted

    def normalized(self) -> Tensor:
        """``(value - base) / (target - base)``: 0 where the patch changes nothing, 1 where it moves the
        metric all the way from the base run's value to the source run's."""
        gap = self.target - self.base
        if gap == 0:
            raise QkovError("normalized: the clean and corrupted runs give the same metric; nothing to recover")
        return (self.values - self.base) / gap

    def to_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "site": self.site,
            "axes": list(self.axes),
            "direction": self.direction,
            "metric": self.metric,
            "clean": self.clean,
            "corrupted": self.corrupted,
            "values": _nan_to_none(self.values.tolist()),
            "normalized": _nan_to_none(self.normalized().tolist()) if self.target != self.base else None,
            "labels": self.labels,
        }


def _cell(r: PatchResult, index: tuple[int, ...]) -> str:
    return ", ".join(f"{a} {r.labels[a][i]}" for a, i in zip(r.axes, index))


def largest(r: PatchResult, k: int = 8) -> list[tuple[str, float, float]]:
    """The ``k`` patches that move the metric most: ``(where, value, normalized)``."""
    effect = (r.values - r.base).abs().nan_to_num(-1.0)
    flat = effect.flatten().argsort(descending=True)[:k]
    gap = r.target - r.base
    rows = []
    for i in flat.tolist():
        index = tuple(int(x) for x in torch.unravel_index(torch.tensor(i), r.values.shape))
        v = float(r.values[index])
        if v != v:
            continue
        rows.append((_cell(r, index), v, (v - r.base) / gap if gap else float("nan")))
    return rows


@register(TEXT, PatchResult)
def result_text(r: PatchResult, k: int = 6) -> str:
    """A header and the ``k`` largest effects."""
    lines = [
        f"{r.method} patching of {r.site} by {' x '.join(r.axes)} ({r.direction}; {r.metric}: "
        f"clean {r.clean:.4g}, corrupted {r.corrupted:.4g})"
    ]
    for where, v, n in largest(r, k):
        lines.append(f"  {where:40s} {v:10.4g}   {n:+7.1%} of the way")
    return "\n".join(lines)


def _nan_to_none(x: Any) -> Any:
    if isinstance(x, list):
        return [_nan_to_none(v) for v in x]
    return None if x != x else x


# ------------------------------------------------------------------ shared pieces
def pair(source: WeightSource, clean: Tensor, corrupted: Tensor, direction: str) -> tuple[Tensor, Tensor]:
    """``(base, source)`` tokens for ``direction``, both checked: same shape, valid ids."""
    if direction not in DIRECTIONS:
        raise QkovError(f"patching: direction must be denoise or noise, got {direction!r}")
    clean, corrupted = (check_tokens(t, source.cfg).to(source.device) for t in (clean, corrupted))
    if clean.shape != corrupted.shape:
        raise QkovError(
            f"patching: the clean and corrupted tokens must have the same shape (same number of sequences and "
            f"tokens), got {list(clean.shape)} and {list(corrupted.shape)}"
        )
    return (corrupted, clean) if direction == "denoise" else (clean, corrupted)


def copy_bytes(source: WeightSource, tokens: Tensor, positions: Tensor | None) -> int:
    """Memory one patched copy of ``tokens [B, T]`` takes at its peak: a layer's activations and the
    logits at ``positions`` (every position for ``None``)."""
    c, (B, T) = source.cfg, tokens.shape
    P = T if positions is None else len(positions)
    per = T * (12 * c.d_model + 4 * c.n_heads * T + 3 * (c.d_mlp or 0)) + P * c.d_vocab
    return B * per * torch.empty(0, dtype=source.dtype).element_size()


def batched(
    source: WeightSource, base: Tensor, base_run: Trace, m: Metric, start: int, edits: dict[Any, Any], K: int
) -> Tensor:
    """The metric on ``K`` copies of ``base [B, T]`` in one forward pass with ``edits`` (which patch
    each copy its own way), started at layer ``start`` from the base run's stream: ``[K]``."""
    B, T = base.shape
    L = source.cfg.n_layers
    stream = base_run[("resid_pre", start)] if start < L else final_stream(base_run)
    out = trace(
        source,
        base.repeat(K, 1),
        start_at=(start, stream.repeat(K, 1, 1)),
        edits=edits,
        cache=m.reads,
        positions=m.logit_positions(T),
    )
    return torch.stack([m(out.select(slice(k * B, (k + 1) * B))).detach() for k in range(K)])


def reads_from(source: WeightSource, m: Metric) -> int:
    """The first layer whose sites the metric reads (``n_layers`` if it reads none): a patched pass
    must start there or earlier."""
    sites = Sites(source.cfg, source.norm)
    layers = [a.layer for a in sites.resolve_all(m.reads) if a.layer is not None]
    return min(layers, default=source.cfg.n_layers)


def metric_values(
    source: WeightSource, base: Tensor, src: Tensor, m: Metric, cache: Sequence[str]
) -> tuple[Trace, Trace]:
    """The base and source runs, caching ``cache`` and what the metric reads."""
    T = base.shape[1]
    want = [*cache, *m.reads]
    return (
        trace(source, base, cache=want, positions=m.logit_positions(T)),
        trace(source, src, cache=want, positions=m.logit_positions(T)),
    )


def scalar(m: Metric, r: Trace) -> float:
    return float(m(r))


# ------------------------------------------------------------------ activation patching
def default_axes(kind: str) -> tuple[str, ...]:
    """``(layer, pos)`` for stream-shaped kinds, ``(layer, head)`` for per-head kinds."""
    return ("layer", "head") if BY_NAME[kind].head_dim is not None else ("layer", "pos")


def _dims(kind: str, axes: Sequence[str]) -> dict[str, int]:
    """Where each swept axis sits in the site's layout (batch first)."""
    k = BY_NAME[kind]
    where = {"head": k.head_dim, "pos": 2 if kind in ("pattern", "scores") else 1}
    if axes[0] != "layer" or len(set(axes)) != len(axes) or not set(axes[1:]) <= {"pos", "head"}:
        raise QkovError(f"patching: axes must be 'layer' then any of 'pos', 'head', got {', '.join(axes)}")
    if "head" in axes and k.head_dim is None:
        raise QkovError(f"patching: {kind} has no head index to sweep")
    if k.shape.count("T") == 0 or not k.per_layer:
        raise QkovError(f"patching: {kind} cannot be patched by layer and position (choose a per-layer site)")
    return {a: where[a] for a in axes[1:]}  # type: ignore[misc]


def _plan(
    source: WeightSource, clean: Tensor, corrupted: Tensor, site: str, axes: Any, metric: Any, direction: str
) -> tuple[str, tuple[str, ...], dict[str, int], dict[str, int], Tensor, Tensor, Metric]:
    """What a sweep of ``site`` patches: its kind, axes, their place in the layout and sizes, the base
    and source tokens, the metric (every argument checked before any work)."""
    sites = Sites(source.cfg, source.norm)
    kind = sites.resolve((site, 0) if source.cfg.n_layers else site)[0].kind
    axes = tuple(axes or default_axes(kind))
    dims = _dims(kind, axes)
    base, src = pair(source, clean, corrupted, direction)
    sizes = {"pos": base.shape[1], "head": sites.heads(kind)}
    return kind, axes, dims, sizes, base, src, as_metric(metric, clean)


def _labels(L: int, axes: Sequence[str], sizes: dict[str, int]) -> dict[str, list[str]]:
    return {"layer": [str(l) for l in range(L)], **{a: [str(i) for i in range(sizes[a])] for a in axes[1:]}}


def _setter(clean: Tensor, dims: dict[str, int], chunk: list[tuple[int, ...]], K: int):  # type: ignore[no-untyped-def]
    """An edit putting ``clean`` (the source run's value of the site) into copy ``k`` at ``chunk[k]``."""
    shape = clean.shape
    order = list(dims)
    mask = torch.zeros([K, 1, *(shape[d] if d in dims.values() else 1 for d in range(1, len(shape)))], dtype=torch.bool)
    zeros = torch.zeros(K, dtype=torch.long)
    index = [torch.arange(K), zeros]
    for d in range(1, len(shape)):
        axis = next((a for a in order if dims[a] == d), None)
        index.append(torch.tensor([c[order.index(axis)] for c in chunk]) if axis else zeros)
    mask[tuple(index)] = True
    mask = mask.to(clean.device)

    def patch(value: Tensor, site: Address) -> Tensor:
        v = value.view(K, *shape)
        return torch.where(mask, clean[None], v).view(value.shape)

    return patch


def activation_patching(
    source: SourceLike,
    clean: Tensor,
    corrupted: Tensor,
    *,
    site: str = "resid_pre",
    axes: Sequence[str] | None = None,
    metric: Any = None,
    direction: str = "denoise",
    max_bytes: int = PATCH_BYTES,
    progress: Progress | None = None,
) -> PatchResult:
    """Patch ``site`` (a per-layer kind: ``resid_pre``, ``attn_out``, ``head_out``, ``z``, ``q``,
    ``pattern``, ...) at every combination of ``axes`` (default :func:`default_axes`; TransformerLens'
    ``get_act_patch_attn_head_out_by_pos`` is ``site="z", axes=("layer", "pos", "head")``) and
    measure ``metric`` (:mod:`qkov.analysis.causal.metrics`; default the loss on the clean tokens).
    ``clean``/``corrupted`` ``[B, T]``: the same shape. See the module docstring."""
    source = as_source(source, where="qkov.activation_patching")
    kind, axes, dims, sizes, base, src, m = _plan(source, clean, corrupted, site, axes, metric, direction)
    base_run, src_run = metric_values(source, base, src, m, [f"{kind}.*", "resid_pre.*"])
    L = source.cfg.n_layers
    values = torch.full((L, *(sizes[a] for a in axes[1:])), float("nan"), dtype=torch.float64)
    K_max = max(1, max_bytes // copy_bytes(source, base, m.logit_positions(base.shape[1])))
    cells = list(itertools.product(*(range(sizes[a]) for a in axes[1:])))
    total, done = L * len(cells), 0
    for l in range(L):
        start = min(l, reads_from(source, m))
        for lo in range(0, len(cells), K_max):
            chunk = cells[lo : lo + K_max]
            edit = _setter(src_run[(kind, l)], dims, chunk, len(chunk))
            got = batched(source, base, base_run, m, start, {(kind, l): edit}, len(chunk))
            for c, v in zip(chunk, got.tolist()):
                values[(l, *c)] = v
            done += len(chunk)
            tick(progress, f"patching: {kind}", done, total)
    clean_run, corrupt_run = (src_run, base_run) if direction == "denoise" else (base_run, src_run)
    labels = _labels(L, axes, sizes)
    return PatchResult(
        "activation", kind, axes, values, scalar(m, clean_run), scalar(m, corrupt_run), direction, m.name, labels
    )


# ------------------------------------------------------------------ attribution patching
def attribution_patching(
    source: SourceLike,
    clean: Tensor,
    corrupted: Tensor,
    *,
    site: str = "head_out",
    axes: Sequence[str] | None = None,
    metric: Any = None,
    direction: str = "denoise",
) -> PatchResult:
    """The first-order estimate of :func:`activation_patching` with the same arguments, from one
    backward pass on the base run: ``metric(base) + sum((source - base) * grad)`` over the
    dimensions not in ``axes``."""
    source = as_source(source, where="qkov.attribution_patching")
    kind, axes, dims, sizes, base, src, m = _plan(source, clean, corrupted, site, axes, metric, direction)
    T = base.shape[1]
    want = [f"{kind}.*", *m.reads]
    base_run = trace(source, base, cache=want, positions=m.logit_positions(T), grad=True)
    base_value = m(base_run)
    base_value.backward()
    src_run = trace(source, src, cache=want, positions=m.logit_positions(T))
    L = source.cfg.n_layers
    keep = sorted(dims.values())
    rows = []
    for l in range(L):
        a = base_run[(kind, l)]
        grad = torch.zeros_like(a) if a.grad is None else a.grad  # None: the metric does not depend on it
        effect = (src_run[(kind, l)] - a.detach()) * grad
        summed = effect.sum(dim=[d for d in range(effect.ndim) if d not in keep])  # [..kept dims in layout order]
        rows.append(_to_axes(summed, [d for d in keep], [dims[x] for x in axes[1:]]))
    values = float(base_value.detach()) + torch.stack(rows).double().cpu() if rows else torch.zeros(0)
    other = float(m(src_run))
    b = float(base_value.detach())
    clean_v, corrupt_v = (other, b) if direction == "denoise" else (b, other)
    labels = _labels(L, axes, sizes)
    return PatchResult("attribution", kind, axes, values.detach(), clean_v, corrupt_v, direction, m.name, labels)


def _to_axes(x: Tensor, have: list[int], want: list[int]) -> Tensor:
    """``x`` whose dims are the layout dims ``have`` (sorted) permuted into the order ``want``."""
    return x.permute([have.index(d) for d in want]) if want else x


def agreement(a: PatchResult, b: PatchResult) -> float:
    """The Pearson correlation of two results' values over the patches both have (NaN-free)."""
    x, y = a.values.flatten().double(), b.values.flatten().double()
    if x.shape != y.shape:
        raise QkovError("agreement: the two results patch different things")
    ok = ~(x.isnan() | y.isnan())
    x, y = x[ok] - x[ok].mean(), y[ok] - y[ok].mean()
    den = float(x.norm() * y.norm())
    return float((x * y).sum()) / den if den > 0 else float("nan")
