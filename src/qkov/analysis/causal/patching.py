"""Activation patching and attribution patching: which activations carry the difference between a
clean and a corrupted run (docs/interventions.md has the definitions and their sources).

**Activation patching** (Meng et al. 2022; Wang et al. 2022; as TransformerLens' ``patching``
module): run the *base* tokens with one activation replaced by its value on the *source* tokens,
and measure. ``direction="denoise"`` (the default, TransformerLens' convention) runs the corrupted
tokens and patches in the clean activation; ``"noise"`` runs the clean tokens and patches in the
corrupted one. A sweep patches one site kind at every (layer, position), (layer, head) or
(layer, position, head), batched: each forward pass carries many patched copies of the base
tokens, and starts at the patched layer from the base recording's stream (nothing before the patch
changes), so a sweep costs about half a forward pass per patch, in a few large batches.

**Attribution patching** (Nanda 2023; Syed et al. 2023): the first-order estimate of every such
patch from one backward pass, ``metric(base) + (source - base) . d metric / d activation``,
returned on the same scale so the two can be compared (:func:`agreement`).

Both are built on a :class:`~qkov.analysis.causal.contrast.Contrast` (the two runs, the metric,
the batched patched passes) and return a :class:`~qkov.analysis.causal.result.PatchResult`: the
metric after each patch, the clean and corrupted values, ``normalized()`` (0: the patch changes
nothing, 1: it moves the metric all the way). Each is a sweep of the patching study
(:data:`ACTIVATION_SWEEP`, :data:`ATTRIBUTION_SWEEP`; registered in :mod:`qkov.analysis.causal.studies`).
"""

from __future__ import annotations

import itertools
from typing import Any, Sequence

import torch
from torch import Tensor

from ...errors import QkovError
from ...progress import Progress, tick
from ...weights.convert import SourceLike, as_source
from ..forward.sites import BY_NAME, Address, Sites
from .contrast import PATCH_BYTES, Contrast
from .registry import Needs, Option, StudyRun, Sweep
from .result import PatchResult, agreement

__all__ = [
    "activation_patching",
    "ACTIVATION_SWEEP",
    "attribution_patching",
    "ATTRIBUTION_SWEEP",
    "activation_sites",
    "default_axes",
    "patch_activations",
    "patch_attribution",
    "study_axes",
]


# ------------------------------------------------------------------ what a sweep patches
def default_axes(kind: str) -> tuple[str, ...]:
    """``(layer, pos)`` for stream-shaped kinds, ``(layer, head)`` for per-head kinds."""
    return ("layer", "head") if BY_NAME[kind].head_dim is not None else ("layer", "pos")


def _dims(kind: str, axes: Sequence[str]) -> dict[str, int]:
    """Where each swept axis sits in the site's layout (batch first)."""
    k = BY_NAME[kind]
    if kind == "lse":
        raise QkovError("patching: lse is the log-sum-exp the attention divided by, and nothing reads it back: patch scores or pattern")
    where = {"head": k.head_dim, "pos": 2 if kind in ("pattern", "scores") else 1}
    if axes[0] != "layer" or len(set(axes)) != len(axes) or not set(axes[1:]) <= {"pos", "head"}:
        raise QkovError(f"patching: axes must be 'layer' then any of 'pos', 'head', got {', '.join(axes)}")
    if "head" in axes and k.head_dim is None:
        raise QkovError(f"patching: {kind} has no head index to sweep")
    if k.shape.count("T") == 0 or not k.per_layer:
        raise QkovError(f"patching: {kind} cannot be patched by layer and position (choose a per-layer site)")
    return {a: where[a] for a in axes[1:]}  # type: ignore[misc]


def _swept(c: Contrast, site: str, axes: Any) -> tuple[str, tuple[str, ...], dict[str, int], dict[str, int]]:
    """The kind ``site`` names, the swept axes, their place in its layout, and their sizes."""
    sites = Sites(c.weights.cfg, c.weights.norm)
    kind = sites.resolve((site, 0) if c.weights.cfg.n_layers else site)[0].kind
    axes = tuple(axes or default_axes(kind))
    dims = _dims(kind, axes)
    return kind, axes, dims, {"pos": c.clean.shape[1], "head": sites.heads(kind)}


def _labels(L: int, axes: Sequence[str], sizes: dict[str, int]) -> dict[str, list[str]]:
    return {"layer": [str(l) for l in range(L)], **{a: [str(i) for i in range(sizes[a])] for a in axes[1:]}}


def _setter(clean: Tensor, dims: dict[str, int], chunk: list[tuple[int, ...]], K: int):  # type: ignore[no-untyped-def]
    """An edit putting ``clean`` (the source recording's value of the site) into copy ``k`` at ``chunk[k]``."""
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


# ------------------------------------------------------------------ activation patching
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
    c = Contrast.of(source, clean, corrupted, metric=metric, direction=direction)
    return patch_activations(c, site=site, axes=axes, max_bytes=max_bytes, progress=progress)


WHOLE = ("scores", "pattern")  # sites that hold every query's row: a pass over a suffix forms neither


def activation_sites(kind: str) -> list[str]:
    """What activation patching of ``kind`` reads from the two recordings: the site at every layer, the
    base stream where each patched pass starts, and the keys and values of the positions before a pass's
    first change (:func:`patch_activations` runs the positions from there on only)."""
    return [f"{kind}.*", "resid_pre.*", *([] if kind in WHOLE else ["k.*", "v.*"])]


def _suffix_passes(c: Contrast, kind: str) -> bool:
    """Whether a patched pass of ``kind`` can run the positions from its first change on only, after the base
    run's keys and values of the earlier ones: the metric reads only logits, the stream is one sum, the site
    holds no whole pattern, and the base recording cached the keys and values."""
    base = c.base_recording
    return (
        kind not in WHOLE and not c.metric.reads and c.weights.cfg.residual == "sum"
        and base is not None and ("k", 0) in base and ("v", 0) in base
    )  # fmt: skip


def patch_activations(
    c: Contrast,
    *,
    site: str = "resid_pre",
    axes: Sequence[str] | None = None,
    max_bytes: int = PATCH_BYTES,
    progress: Progress | None = None,
) -> PatchResult:
    """:func:`activation_patching` on the contrast ``c`` (recorded here unless its recordings hold what this reads)."""
    kind, axes, dims, sizes = _swept(c, site, axes)
    c.ensure(activation_sites(kind))
    L = c.weights.cfg.n_layers
    values = torch.full((L, *(sizes[a] for a in axes[1:])), c.base_value, dtype=torch.float64)  # a patch changing nothing
    K_max = c.copies(max_bytes)
    cells = list(itertools.product(*(range(sizes[a]) for a in axes[1:])))
    total, done = L * len(cells), 0
    base = c.base_recording
    assert base is not None
    suffix = _suffix_passes(c, kind)
    keys, vals = (base.stack("k").detach(), base.stack("v").detach()) if suffix else (None, None)
    at = list(dims).index("pos") if "pos" in dims else None
    for l in range(L):
        start = min(l, c.reads_from)
        patched = c.source_recording[(kind, l)].detach()  # type: ignore[index]
        firsts = _first_changes(patched != base[(kind, l)].detach(), kind, dims, cells)
        for since, picked in c.passes(firsts, K_max):
            chunk, own = [cells[i] for i in picked], [firsts[i] for i in picked]
            if suffix and since > 0:  # nothing changes before `since`: run the positions from there on only
                past = (keys[:, :, :since], vals[:, :, :since])  # type: ignore[index]
                moved = chunk if at is None else [(*x[:at], x[at] - since, *x[at + 1 :]) for x in chunk]
                edit = _setter(patched[:, since:], dims, moved, len(chunk))
                stream = base[("resid_pre", start)][:, since:].detach().repeat(len(chunk), 1, 1)
                got = c.measure(
                    len(chunk), {(kind, l): edit}, start=start, stream=stream, since=since, past=past, firsts=own
                )
            else:
                edit = _setter(patched, dims, chunk, len(chunk))
                got = c.measure(len(chunk), {(kind, l): edit}, start=start, since=since, firsts=own)
            for cell, v in zip(chunk, got.tolist()):
                values[(l, *cell)] = v
            done += len(chunk)
            tick(progress, f"patching: {kind}", done, total)
    return c.result("activation", kind, axes, values, _labels(L, axes, sizes))


def _first_changes(changed: Tensor, kind: str, dims: dict[str, int], cells: list[tuple[int, ...]]) -> list[int]:
    """Where each cell's patch first changes the site (``changed``: booleans, the site's layout): the position
    itself for a cell at one position (the sequence length when the values there are equal: no change), else
    the first position where any of the cell's values differ. A value at a position reaches only that position
    and later ones (for the scores and the pattern, the query's)."""
    pos = 2 if kind in ("pattern", "scores") else 1
    T = changed.shape[pos]
    keep = sorted({*dims.values(), pos})
    folded = changed.any(dim=[d for d in range(changed.ndim) if d not in keep]) if len(keep) < changed.ndim else changed
    order = [keep.index(dims[a]) for a in dims] + ([] if pos in dims.values() else [keep.index(pos)])
    by_cell = folded.permute(order).cpu()  # [*swept sizes] (position swept) or [*swept sizes, T]
    if pos in dims.values():
        at = list(dims).index("pos")
        return [cell[at] if bool(by_cell[cell]) else T for cell in cells]
    first = torch.where(by_cell.any(-1), by_cell.int().argmax(-1), T)
    return [int(first[cell]) for cell in cells]


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
    backward pass on the base recording: ``metric(base) + sum((source - base) * grad)`` over the
    dimensions not in ``axes``."""
    source = as_source(source, where="qkov.attribution_patching")
    c = Contrast.of(source, clean, corrupted, metric=metric, direction=direction)
    return patch_attribution(c, site=site, axes=axes)


def patch_attribution(c: Contrast, *, site: str = "head_out", axes: Sequence[str] | None = None) -> PatchResult:
    """:func:`attribution_patching` on the contrast ``c`` (recorded here, with its graph, unless its recordings
    hold the site already; the metric's gradient taken once, :meth:`~qkov.analysis.causal.contrast.Contrast.backward`)."""
    kind, axes, dims, sizes = _swept(c, site, axes)
    c.ensure([f"{kind}.*"], grad=True)
    c.backward()
    base_recording, src_recording = c.base_recording, c.source_recording
    assert base_recording is not None and src_recording is not None
    L = c.weights.cfg.n_layers
    keep = sorted(dims.values())
    rows = []
    for l in range(L):
        a = base_recording[(kind, l)]
        grad = torch.zeros_like(a) if a.grad is None else a.grad  # None: the metric does not depend on it
        effect = (src_recording[(kind, l)] - a.detach()) * grad
        summed = effect.sum(dim=[d for d in range(effect.ndim) if d not in keep])  # [..kept dims in layout order]
        rows.append(_to_axes(summed, [d for d in keep], [dims[x] for x in axes[1:]]))
    shape = (0, *(sizes[a] for a in axes[1:]))
    values = c.base_value + torch.stack(rows).double().cpu() if rows else torch.zeros(shape, dtype=torch.float64)
    return c.result("attribution", kind, axes, values.detach(), _labels(L, axes, sizes))


def _to_axes(x: Tensor, have: list[int], want: list[int]) -> Tensor:
    """``x`` whose dims are the layout dims ``have`` (sorted) permuted into the order ``want``."""
    return x.permute([have.index(d) for d in want]) if want else x


# ------------------------------------------------------------------ as sweeps of the patching study
def study_axes(study: StudyRun) -> list[tuple[str, tuple[str, ...]]]:
    """``(kind, axes)`` of each site the study patches: head kinds by (layer, head), or by (layer,
    position, head) with ``by_pos``; stream kinds by (layer, position)."""
    w = study.contrast.weights
    sites = Sites(w.cfg, w.norm)
    out = []
    for s in study.options["sites"]:
        kind = sites.resolve((s, 0))[0].kind
        axes = default_axes(kind)
        out.append((kind, ("layer", "pos", "head") if study.options["by_pos"] and "head" in axes else axes))
    return out


def _sites(value: Any) -> tuple[str, ...]:
    """Site kinds from ``"resid_pre,head_out"`` or a list of names."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) for s in items):
        raise QkovError(f"sites: expected site kinds such as resid_pre,head_out, got {value!r}")
    return tuple(s.strip() for s in items if s.strip())


def _activation_sweep(study: StudyRun) -> list[PatchResult]:
    c = study.contrast
    return [patch_activations(c, site=kind, axes=axes, progress=study.progress) for kind, axes in study_axes(study)]


def _activation_needs(study: StudyRun) -> Needs:
    return Needs(tuple(s for kind, _ in study_axes(study) for s in activation_sites(kind)))


def _attributed(study: StudyRun) -> list[tuple[str, tuple[str, ...]]]:
    """The head sites attribution patching estimates (those swept by head)."""
    return [(kind, axes) for kind, axes in study_axes(study) if "head" in axes]


def _attribution_sweep(study: StudyRun) -> list[PatchResult]:
    out = []
    for kind, axes in _attributed(study):
        att = patch_attribution(study.contrast, site=kind, axes=axes)
        act = next((r for r in study.results if r.method == "activation" and r.site == kind and r.axes == axes), None)
        if act is not None:
            study.agreement[kind] = agreement(act, att)
        out.append(att)
    return out


ACTIVATION_SWEEP = Sweep(
    "activation",
    "each site kind patched at every (layer, position), or every (layer, head) of a head site",
    _activation_sweep,
    options=(
        Option(
            "sites", ("resid_pre", "head_out"), "comma-separated site kinds to patch by layer (default "
            "resid_pre,head_out; e.g. attn_out, mlp_out, z, pattern, q; docs/interventions.md lists them)",
            read=_sites, flag="--site",
        ),
        Option("by_pos", False, "sweep head sites by position too (layer x pos x head)"),
    ),
    when=lambda o: bool(o["sites"]),
    needs=_activation_needs,
)
ATTRIBUTION_SWEEP = Sweep(
    "attribution",
    "the first-order estimate of the head sites' patches (one backward pass) and its agreement",
    _attribution_sweep,
    options=(Option("attribution", True, "skip attribution patching"),),
    when=lambda o: bool(o["attribution"] and o["sites"]),
    needs=lambda study: Needs(tuple(f"{kind}.*" for kind, _ in _attributed(study)), grad=bool(_attributed(study))),
)
