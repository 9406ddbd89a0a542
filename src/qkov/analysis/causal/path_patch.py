"""Path patching: the causal effect of one path, sender head -> receiver heads' query, key or value
input (or -> the logits), with everything not on the path held at the base recording's values.

The definition (Wang et al. 2022, "Interpretability in the Wild", section 3.1 and appendix B;
Goldowsky-Dill et al. 2023, "Localizing Model Behavior with Path Patching"), written for the
residual stream, where it is exact: a receiver head's input is the sum of what every earlier
component wrote. On the path sender -> receiver, the receiver's input is the *base* run's input
plus the sender's *change*, ``head_out(source) - head_out(base)``, and nothing else changes: no
other component sees the sender's change, every other term of the receiver's input keeps its base
value (the receiver's normalisation is recomputed on the patched input, as the model would). The
receivers' outputs then flow on and everything after them is recomputed; the metric is read at
the end. With several receivers, each receives base input plus the sender's change (a later
receiver does not see an earlier receiver's change: both sit on their own path). "-> logits"
adds the change to the final stream only (the direct path to the logits).

``direction="denoise"`` (default): base = corrupted, source = clean (how much the path restores);
``"noise"``: base = clean, source = corrupted (how much the path's corruption removes).
One forward pass carries many senders (one patched copy of the base tokens each), started at the
first receiver's layer from the base recording's stream; the recordings keep only what the paths need (the
senders' ``z``, the stream entering each receiver's layer, which is what its own input copy holds on the base
run, and the stream where the patched passes start).

A routed model (:mod:`qkov.model.bus`: Attention Residuals, hyper-connections, mHC) has no single stream:
a receiver's input is ``sum_j C[p, j] v_j`` over the embedding and earlier outputs, with the coefficients
``C`` of the base run (:func:`~qkov.model.bus.route_coefficients`). On the path sender -> receiver the receiver's
input is the base input plus ``C[p, j] * change`` (the routing frozen at the base run's values, as the sum's
coefficient 1 is; ``j = 1 +`` the sender's sublayer), and the patched copies run from the start. Into the
logits: the final read is point ``S`` (the number of sublayers), so each copy's final stream is the base run's
(``resid_final``) plus ``C[S, j] * change``, and only the final normalisation and the unembedding run on it.

A path is an edge of the model's graph: ``0.1 -> 1.0<k>`` (:class:`~qkov.analysis.forward.address.Address`);
senders and receivers are heads, given as ``(layer, head)``, ``"L.H"`` or addresses.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

from ...model.bus import attention_point, route_coefficients
from ...errors import QkovError
from ...progress import Progress, tick
from ...weights.convert import SourceLike, as_source
from ...weights.parts import WeightSource
from ..forward.address import INPUTS, Address, HeadLike, as_head, parse_heads
from ..forward.cache import final_stream
from ..forward.frozen import sites_of
from ..forward.sites import ROUTE_KINDS
from .contrast import PATCH_BYTES, Contrast
from .registry import Needs, Option, StudyRun, Sweep
from .result import PatchResult

__all__ = ["input_paths", "patch_paths", "path_patching", "path_sites", "PATH_SWEEP", "receivers_of"]

WHERE = "path patching"


def receivers_of(value: Any) -> list[Address] | str:
    """Receivers as written (``"1.0,1.1"``, ``"logits"``) or given (heads, ``"logits"``): ``"logits"``
    or the heads, read by the one head parser (not yet checked against a model)."""
    if isinstance(value, str) and value.strip() == "logits":
        return "logits"
    if isinstance(value, str) and not any(c.isdigit() for c in value):
        raise QkovError(f"{WHERE}: receivers are heads or 'logits', got {value!r}")
    return parse_heads(value, what=WHERE)


def _check(source: WeightSource, receivers: Sequence[HeadLike] | str, kind: str) -> list[Address]:
    if isinstance(receivers, str) and receivers.strip() == "logits":
        return []
    if kind not in INPUTS:
        raise QkovError(f"{WHERE}: a receiver's input is q, k or v, got {kind!r}")
    heads = parse_heads(receivers_of(receivers), source.cfg, WHERE)  # type: ignore[arg-type]
    if min(h.layer for h in heads) == 0:  # type: ignore[type-var]
        raise QkovError(f"{WHERE}: a receiver in layer 0 has no earlier head to receive from")
    return heads


def path_patching(
    source: SourceLike,
    clean: Tensor,
    corrupted: Tensor,
    *,
    receivers: Sequence[HeadLike] | str,
    input: str = "k",
    senders: Sequence[HeadLike] | None = None,
    metric: Any = None,
    direction: str = "denoise",
    max_bytes: int | None = None,
    progress: Progress | None = None,
) -> PatchResult:
    """Patch the path from each sender head (default: every head before the first receiver; every
    head for ``receivers="logits"``) into the ``input`` (``q``, ``k`` or ``v``) of ``receivers``
    (heads: ``(layer, head)``, ``"L.H"``, or ``"1.0,1.3"``), one sender at a time; see the module
    docstring. Returns the metric per sender, ``values [L, H]`` (NaN for heads that are not senders)."""
    source = as_source(source, where="qkov.path_patching")
    _paths(source, receivers, input, senders)  # every argument checked before any work
    c = Contrast.of(source, clean, corrupted, metric=metric, direction=direction)
    return patch_paths(c, receivers=receivers, input=input, senders=senders, max_bytes=max_bytes, progress=progress)


def _paths(
    source: WeightSource, receivers: Sequence[HeadLike] | str, input: str, senders: Sequence[HeadLike] | None
) -> tuple[list[Address], list[Address], int]:
    """The receivers (none: the logits), the senders and the first receiver's layer, checked."""
    heads = _check(source, receivers, input)
    L, H = source.cfg.n_layers, source.cfg.n_heads
    first = min((h.layer for h in heads), default=L)
    given = [(l, h) for l in range(first) for h in range(H)] if senders is None else senders
    sent = [as_head(s, what=WHERE) for s in given]
    bad = [s.name for s in sent if not (0 <= s.layer < first and 0 <= s.head < H)]  # type: ignore[operator]
    if bad or not sent:
        raise QkovError(f"{WHERE}: senders must be heads before layer {first} (got {', '.join(bad) or 'none'})")
    return heads, sent, first


def path_sites(
    c: Contrast, receivers: Sequence[HeadLike] | str, input: str = "k", senders: Sequence[HeadLike] | None = None
) -> Needs:
    """What :func:`patch_paths` reads from the contrast's recordings: the senders' ``z`` (a head's output is
    ``z @ W_O``: the changes come from it, ``d_head`` wide) from both, and from the base one the stream
    where the patched passes start and the stream entering each receiver's layer (a receiver's input is a
    copy of it), or the final stream for the logits."""
    heads, sent, first = _paths(c.weights, receivers, input, senders)
    cfg = c.weights.cfg
    L, start = cfg.n_layers, min(first, c.reads_from)
    z = tuple(f"z.{l}" for l in sorted({s.layer for s in sent}))  # type: ignore[type-var]
    into = tuple(f"resid_pre.{l}" for l in sorted({h.layer for h in heads}))  # type: ignore[type-var]
    if cfg.residual != "sum":  # no stream to start from but the final one; the base run's routing scales each change
        return Needs(z, into + ("resid_final",) * (not heads) + tuple(sites_of(c.weights, ROUTE_KINDS)))
    stream = (f"resid_pre.{start}",) if start < L else ()
    return Needs(z, stream + (into if heads else (f"resid_post.{L - 1}",)))



def patch_paths(
    c: Contrast,
    *,
    receivers: Sequence[HeadLike] | str,
    input: str = "k",
    senders: Sequence[HeadLike] | None = None,
    max_bytes: int | None = None,
    progress: Progress | None = None,
) -> PatchResult:
    """:func:`path_patching` on the contrast ``c`` (recorded here unless its recordings hold :func:`path_sites`)."""
    heads, sent, first = _paths(c.weights, receivers, input, senders)
    cfg = c.weights.cfg
    L, H = cfg.n_layers, cfg.n_heads
    if not heads and c.reads_from < L:  # a site inside the blocks: no path into the logits reaches it
        raise QkovError(
            f"{WHERE}: a path into the logits changes only the logits, and the metric reads "
            f"{', '.join(c.metric.reads)}: choose a metric of the logits"
        )
    needs = path_sites(c, receivers, input, senders)
    c.ensure(needs.cache, base_only=needs.base_only)
    start = min(first, c.reads_from)
    W_O = {l: c.weights.attention(l).W_O for l in {s.layer for s in sent}}
    # each patched copy also holds the receivers' per-head inputs, edited and normalised
    layers = {h.layer for h in heads}
    split = 2 * c.base.numel() * H * cfg.d_model * c.base_recording.logits.element_size() * len(layers)  # type: ignore[union-attr]
    K_max = c.copies(max_bytes or PATCH_BYTES, split)
    values = torch.full((L, H), float("nan"), dtype=torch.float64)
    for s in sent:
        values[s.layer, s.head] = c.base_value  # a sender whose output does not change: the base run's metric
    firsts = [_first_change(c, s) for s in sent]
    passes = c.passes(firsts, K_max)
    done = len(sent) - sum(len(picked) for _, picked in passes)
    for since, picked in passes:
        chunk = [sent[i] for i in picked]
        delta = torch.stack([_change(c, s, W_O[s.layer]) for s in chunk])  # type: ignore[index]
        got = _run_chunk(c, heads, input, chunk, delta, start, since, [firsts[i] for i in picked])
        for s, v in zip(chunk, got.tolist()):
            values[s.layer, s.head] = v
        done += len(chunk)
        tick(progress, WHERE, done, len(sent))
    into = "logits" if not heads else f"{','.join(h.name for h in heads)} {input}"
    labels = {"layer": [str(l) for l in range(L)], "head": [str(h) for h in range(H)]}
    return c.result("path", f"sender -> {into}", ("layer", "head"), values, labels)


def _change(c: Contrast, sender: Address, W_O: Tensor) -> Tensor:
    """What ``sender`` writes on the source recording minus what it writes on the base recording ``[B, T, D]``."""
    l, h = sender.layer, sender.head
    z = (c.source_recording[("z", l)][:, :, h] - c.base_recording[("z", l)][:, :, h]).detach()  # type: ignore[index]
    return z @ W_O[h]


def _first_change(c: Contrast, sender: Address) -> int:
    """The first position where ``sender``'s ``z`` differs between the two recordings (its output, ``z @ W_O``,
    cannot differ earlier); the sequence length when it never does."""
    l, h = sender.layer, sender.head
    differs = (c.source_recording[("z", l)][:, :, h] != c.base_recording[("z", l)][:, :, h]).any(0).any(-1)  # type: ignore[index]
    return int(differs.int().argmax()) if bool(differs.any()) else len(differs)


def _run_chunk(
    c: Contrast, heads: list[Address], kind: str, chunk: list[Address], delta: Tensor, start: int, since: int = 0,
    firsts: list[int] | None = None,
) -> Tensor:  # fmt: skip
    """The metric for ``len(chunk)`` senders in one batched pass; ``delta [K, B, T, D]`` their changes, none
    before position ``since`` (nor, for each sender, before its ``firsts`` entry)."""
    K, cfg = delta.shape[0], c.weights.cfg
    C = _routing(c)
    if not heads:  # -> logits: the final stream of each copy is the base one plus the sender's change
        final = final_stream(c.base_recording).detach()  # type: ignore[arg-type]
        d = _reach(cfg, C, cfg.sublayers, chunk, delta)
        stream = (final[None] + d).reshape(K * delta.shape[1], *delta.shape[2:])
        return c.measure(K, start=cfg.n_layers, stream=stream, since=since, firsts=firsts)
    edits: dict[Any, Any] = {}
    for l2 in sorted({h.layer for h in heads}):
        slots = sorted({h._replace(input=kind).input_site(cfg).head for h in heads if h.layer == l2})
        before = torch.tensor([s.layer < l2 for s in chunk], device=delta.device)  # type: ignore[operator]
        d = _reach(cfg, C, attention_point(cfg, l2), chunk, delta * before[:, None, None, None].to(delta))  # type: ignore[arg-type]
        edits[Address(f"{kind}_input", l2)] = _receive(_base_stream(c, l2), slots, d)
    return c.measure(K, edits, start=start, since=since, firsts=firsts)


def _routing(c: Contrast) -> Tensor | None:
    """A routed model's coefficients ``C [P, J, B, T]`` with the routing of the base recording
    (:func:`~qkov.model.bus.route_coefficients`); ``None`` for the sum, where every coefficient is 1."""
    cfg = c.weights.cfg
    return None if cfg.residual == "sum" else route_coefficients(cfg, c.base_recording.cache)  # type: ignore[union-attr]


def _reach(cfg: Any, C: Tensor | None, p: int, senders: list[Address], delta: Tensor) -> Tensor:
    """The senders' changes ``delta [K, B, T, D]`` as aggregation point ``p`` receives them (a receiver layer's
    attention, or the final read ``S``): each scaled by ``C[p, 1 + s]``, how much of its sublayer ``s`` reaches
    point ``p`` per position; unchanged for the sum (``C`` ``None``)."""
    if C is None:
        return delta
    reach = torch.stack([C[p, 1 + attention_point(cfg, s.layer)] for s in senders])  # type: ignore[arg-type]
    return delta * reach[..., None].to(delta)


def _base_stream(c: Contrast, layer: int) -> Tensor:
    """The base run's stream entering ``layer`` ``[B, T, D]``: what each head's own input copy
    (``q_input``, ``k_input``, ``v_input``) holds on a run that edits none."""
    return c.base_recording[("resid_pre", layer)].detach()  # type: ignore[index]


def _receive(base: Tensor, slots: list[int], delta: Tensor):  # type: ignore[no-untyped-def]
    """An edit of a per-head input ``[K*B, T, n, D]``: receiver slots get the base stream ``base [B, T, D]``
    plus each copy's sender change ``delta [K, B, T, D]``; other slots keep the live value."""
    K, B = delta.shape[:2]

    def receive(value: Tensor, site: Address) -> Tensor:
        out = value.clone().view(K, B, *value.shape[1:])
        for s in slots:
            out[:, :, :, s] = base[None] + delta
        return out.view(value.shape)

    return receive


def input_paths(
    source: WeightSource,
    clean: Tensor,
    corrupted: Tensor,
    *,
    sender: HeadLike,
    receiver: HeadLike,
    metric: Any,
    direction: str = "noise",
    inputs: Sequence[str] = INPUTS,
) -> tuple[dict[str, float], float, float]:
    """One sender's path into each of ``receiver``'s ``inputs``, each patched alone (the definition of
    :func:`path_patching`), from one base recording, one source recording and one pass of ``len(inputs)`` copies:
    ``({input: metric}, metric on clean, metric on corrupted)``."""
    cfg = source.cfg
    (r,) = _check(source, [receiver], inputs[0])
    s = as_head(sender, cfg, WHERE)
    Address.edge(s, r).check(cfg, WHERE)
    c = Contrast.of(source, clean, corrupted, metric=metric, direction=direction)
    l1, l2 = s.layer, r.layer
    start = min(l2, c.reads_from)  # type: ignore[type-var]
    # the sum starts the copies from the stream there; a routed model runs them from the start (its routing kept)
    stream = sites_of(source, ROUTE_KINDS) if cfg.residual != "sum" else [f"resid_pre.{start}"]
    c.record([f"z.{l1}"], base_only=[*stream, f"resid_pre.{l2}"])
    change = _change(c, s, source.attention(l1).W_O)[None]  # type: ignore[arg-type]
    change = _reach(cfg, _routing(c), attention_point(cfg, l2), [s], change)[0]  # type: ignore[arg-type]
    K, edits = len(inputs), {}
    for k, inp in enumerate(inputs):
        only = torch.zeros(K, 1, 1, 1, dtype=change.dtype, device=change.device)
        only[k] = 1  # copy k carries the change into this input; the others keep the base input
        site = Address.edge(s, r, inp).input_site(cfg)
        edits[site._replace(head=None)] = _receive(_base_stream(c, l2), [site.head], change[None] * only)  # type: ignore[arg-type,list-item]
    got = c.measure(K, edits, start=start).tolist()
    return dict(zip(inputs, got)), c.clean_value, c.corrupted_value


# ------------------------------------------------------------------ as a sweep of the patching study
def _path_sweep(study: StudyRun) -> list[PatchResult]:
    o = study.options
    return [patch_paths(study.contrast, receivers=o["receivers"], input=o["input"], progress=study.progress)]


PATH_SWEEP = Sweep(
    "path",
    "every earlier head's path into the receivers' query, key or value input (or into the logits)",
    _path_sweep,
    options=(
        Option(
            "receivers", None, "path patching into these heads (LAYER.HEAD, comma-separated) or 'logits'",
            read=receivers_of,
        ),
        Option("input", "k", "the receivers' input the paths enter (default k)", read=str, choices=INPUTS),
    ),
    when=lambda o: o["receivers"] is not None,
    needs=lambda study: path_sites(study.contrast, study.options["receivers"], study.options["input"]),
)
