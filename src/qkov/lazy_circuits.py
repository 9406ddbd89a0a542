"""Weight-based circuit analysis of a checkpoint streamed layer by layer (:class:`qkov.lazy.LazyCheckpoint`).

The same numbers as :mod:`qkov.circuits` (tested to float tolerance), computed while
holding only what each needs:

* **copying** — ``W_U @ W_E [d_model, d_model]`` is accumulated over blocks of the
  vocabulary, then each layer is read in turn and its heads' ``d_head x d_head`` twins
  ``W_O (W_U W_E) W_V`` give the eigenvalues. Peak: one ``[d_model, d_model]`` matrix and
  one layer's attention. The diagonal top-k rate needs the whole ``W_E`` and ``W_U``
  (every row of the full OV circuit); they are read once and held only then.
* **composition** — a writer head enters every score through ``S @ W_O`` (``S^T S =
  W_V^T W_V``, ``[d_head, d_model]``), a reader through ``A @ S_B^T`` (``[d_model,
  d_head]``): see :func:`qkov.circuits.composition_raw`. The writer factors of a block of
  layers are held (at most ``max_bytes``, at least one layer) while the later layers stream
  past, one at a time; a model whose writer factors exceed ``max_bytes`` takes several
  passes over the file. MLP weights, ``W_E`` and ``W_U`` are never read.
* **virtual weights** read the two components involved; **skip-trigrams** and full
  circuits of one head read ``W_E``, ``W_pos``, ``W_U`` and that head
  (:meth:`LazyCheckpoint.head_weights`).

``progress(stage, done, total)``, when given, is called after each unit of work.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor

from . import circuits as C
from .errors import QkovError
from .factored import DEFAULT_MAX_BYTES, LowRank, serial_linalg
from .lazy import LazyCheckpoint

Progress = Callable[[str, int, int], None]
DEFAULT_WRITER_BYTES = 1 << 30  # composition: writer factors held per pass


def _tick(progress: Progress | None, stage: str, done: int, total: int) -> None:
    if progress is not None:
        progress(stage, done, total)


def copying_scores(
    ck: LazyCheckpoint,
    *,
    diag_k: int | None = 5,
    max_bytes: int = DEFAULT_MAX_BYTES,
    progress: Progress | None = None,
) -> list[C.HeadCopying]:
    """Per head: eigenvalue copying score, diagonal top-k rate (when ``diag_k``), residual score.

    As :func:`qkov.circuits.copying_scores`, one layer in memory at a time.
    """
    cfg = ck.cfg
    if diag_k:  # the whole vocabulary is needed anyway: read W_E and W_U once
        W_E, (W_U, _) = ck.embed(), ck.unembed()
        G = W_U @ W_E
    else:
        G = ck.unembed_embed()
    out = []
    for layer in range(cfg.n_layers):
        att = ck.attention(layer)
        with serial_linalg():
            eig = C.eigen_copying_score(torch.linalg.eigvals(att.W_O @ G @ att.W_V))  # [H]
            res = C.eigen_copying_score(torch.linalg.eigvals(att.W_O @ att.W_V))
        for head in range(cfg.n_heads):
            rate = None
            if diag_k:
                f = LowRank(W_E @ att.W_V[head], att.W_O[head] @ W_U)
                rate = float((f.diag_rank(max_bytes=max_bytes) < diag_k).float().mean())
            out.append(C.HeadCopying(layer, head, float(eig[head]), rate, float(res[head])))
        _tick(progress, "copying", layer + 1, cfg.n_layers)
    return out


def composition_raw(
    ck: LazyCheckpoint,
    kinds: tuple[str, ...] = ("q", "k", "v"),
    *,
    max_bytes: int = DEFAULT_WRITER_BYTES,
    progress: Progress | None = None,
) -> dict[str, Tensor]:
    """Raw composition scores ``{kind: [L, H, L, H]}`` as :func:`qkov.circuits.composition_raw`
    (NaN where the reader layer is not after the writer layer), streaming the layers."""
    for kind in kinds:
        if kind not in ("q", "k", "v"):
            raise QkovError(f"composition kind must be q, k or v, got {kind!r}")
    cfg = ck.cfg
    L, H, D, E = cfg.n_layers, cfg.n_heads, cfg.d_model, cfg.d_head
    opts = dict(dtype=ck.dtype, device=ck.device)
    out = {k: torch.full((L, H, L, H), float("nan"), **opts) for k in kinds}  # type: ignore[arg-type]
    if L < 2:
        return out
    ov_norm = torch.zeros(L, H, **opts)  # type: ignore[arg-type]
    r_norm = {k: torch.zeros(L, H, **opts) for k in kinds}  # type: ignore[arg-type]
    per_layer = H * E * D * torch.empty(0, dtype=ck.dtype).element_size()
    block = max(1, min(L - 1, max_bytes // per_layer))
    starts = range(0, L - 1, block)
    total, done = sum(L - a for a in starts), 0
    for a in starts:
        b = min(L - 1, a + block)  # writers a .. b-1 held; readers a+1 .. L-1 stream past
        left: dict[int, Tensor] = {}
        for l2 in range(a, L):
            att = ck.attention(l2)
            if l2 < b:
                left[l2] = C._absorb_left(att.W_V, att.W_O)  # [H, r, D]
                ov_norm[l2] = LowRank(att.W_V, att.W_O).norm()
            if l2 > a:
                for kind in kinds:
                    RA, RB = C._composition_factors(att, kind)  # type: ignore[arg-type]
                    right = C._absorb_right(RA, RB)  # [H, D, r]
                    r_norm[kind][l2] = LowRank(RA, RB).norm()
                    for l1 in range(a, min(b, l2)):
                        num = C._absorbed_pair_norms(left[l1], right)  # [H, H]
                        out[kind][l1, :, l2, :] = num / (ov_norm[l1][:, None] * r_norm[kind][l2][None])
            del att
            done += 1
            _tick(progress, "composition", done, total)
    return out


def composition_scores(
    ck: LazyCheckpoint,
    kinds: tuple[str, ...] = ("q", "k", "v"),
    *,
    baseline_samples: int = 256,
    seed: int = 0,
    max_bytes: int = DEFAULT_WRITER_BYTES,
    progress: Progress | None = None,
) -> dict[str, C.Composition]:
    """:func:`composition_raw` with the random-matrix baseline of :func:`qkov.circuits.composition_baseline`."""
    raw = composition_raw(ck, kinds, max_bytes=max_bytes, progress=progress)
    d, e = ck.cfg.d_model, ck.cfg.d_head
    return {
        k: C.Composition(k, r, C.composition_baseline(d, e, k, samples=baseline_samples, seed=seed))  # type: ignore[arg-type]
        for k, r in raw.items()
    }


def analyse(
    ck: LazyCheckpoint,
    *,
    diag_k: int | None = 5,
    max_bytes: int = DEFAULT_MAX_BYTES,
    writer_bytes: int = DEFAULT_WRITER_BYTES,
    progress: Progress | None = None,
) -> C.CircuitsReport:
    """:func:`qkov.circuits.analyse` on a streamed checkpoint: copying, Q/K/V composition, bandwidth."""
    return C.CircuitsReport(
        copying=copying_scores(ck, diag_k=diag_k, max_bytes=max_bytes, progress=progress),
        composition=composition_scores(ck, max_bytes=writer_bytes, progress=progress),
        bandwidth=C.bandwidth(ck),  # type: ignore[arg-type]  # reads only .cfg
    )


def virtual_weights(ck: LazyCheckpoint, writer: C.Component, reader: C.Component) -> C.LowRank:
    """:func:`qkov.circuits.virtual_weights` reading only the two components involved."""
    wk, *wi = writer
    rk, *ri = reader
    if wk not in ("embed", "pos", "head", "mlp"):
        raise QkovError(f"unknown writer {writer!r}")
    r_order = {"q": 2 * ri[0], "k": 2 * ri[0], "v": 2 * ri[0], "mlp": 2 * ri[0] + 1}.get(rk) if ri else None
    if rk == "unembed":
        r_order = math.inf
    elif r_order is None:
        raise QkovError(f"unknown reader {reader!r}")
    if C._order(wk, wi[0] if wi else 0) >= r_order:
        raise QkovError(f"{reader!r} does not come after {writer!r}: no virtual weight")
    if wk == "embed":
        out = ck.embed()
    elif wk == "pos":
        if (pos := ck.pos()) is None:
            raise QkovError("this model has no positional embedding")
        out = pos
    elif wk == "head":
        out = ck.attention(wi[0], wi[1]).W_O[0]
    else:
        out = ck.mlp(wi[0])[2]
    if rk in ("q", "k", "v"):
        inp = getattr(ck.attention(ri[0], ri[1]), f"W_{rk.upper()}")[0]
    elif rk == "mlp":
        inp = ck.mlp(ri[0])[0]
    else:
        inp = ck.unembed()[0]
    return LowRank(out, inp)
