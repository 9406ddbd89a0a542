"""Path patching: the causal effect of one path, sender head -> receiver heads' query, key or value
input (or -> the logits), with everything not on the path held at the base run's values.

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
first receiver's layer from the base run's stream; the runs keep only what the paths need (the
senders' ``z``, the receivers' inputs, the stream where the patched passes start).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

from ...errors import QkovError
from ...weights.parts import WeightSource
from ...weights.convert import SourceLike, as_source
from ..forward.cache import Trace
from ..forward.tracer import trace
from .metrics import Metric, as_metric
from ..forward.cache import final_stream
from .patching import PATCH_BYTES, PatchResult, batched, copy_bytes, pair, reads_from, scalar
from ...progress import Progress, tick
from ..forward.sites import Address
from ..forward.sites import Head

__all__ = [ "input_paths", "INPUTS", "path_patching"]

INPUTS = ("q", "k", "v")


def _check(source: WeightSource, receivers: Sequence[Head] | str, kind: str) -> list[Head]:
    cfg = source.cfg
    if isinstance(receivers, str):
        if receivers != "logits":
            raise QkovError(f"path patching: receivers are heads or 'logits', got {receivers!r}")
        return []
    if kind not in INPUTS:
        raise QkovError(f"path patching: a receiver's input is q, k or v, got {kind!r}")
    heads = [(int(l), int(h)) for l, h in receivers]
    if not heads:
        raise QkovError("path patching: no receivers")
    for l, h in heads:
        if not (0 <= l < cfg.n_layers and 0 <= h < cfg.n_heads):
            raise QkovError(f"path patching: the model has no head {l}.{h}")
    if min(l for l, _ in heads) == 0:
        raise QkovError("path patching: a receiver in layer 0 has no earlier head to receive from")
    return heads


def path_patching(
    source: SourceLike,
    clean: Tensor,
    corrupted: Tensor,
    *,
    receivers: Sequence[Head] | str,
    input: str = "k",
    senders: Sequence[Head] | None = None,
    metric: Any = None,
    direction: str = "denoise",
    max_bytes: int | None = None,
    progress: Progress | None = None,
) -> PatchResult:
    """Patch the path from each sender head (default: every head before the first receiver; every
    head for ``receivers="logits"``) into the ``input`` (``q``, ``k`` or ``v``) of ``receivers``
    (heads ``(layer, head)``), one sender at a time; see the module docstring. Returns the metric per
    sender, ``values [L, H]`` (NaN for heads that are not senders)."""
    source = as_source(source, where="qkov.path_patching")
    heads = _check(source, receivers, input)
    cfg = source.cfg
    L, H = cfg.n_layers, cfg.n_heads
    first = min((l for l, _ in heads), default=L)
    if senders is None:
        senders = [(l, h) for l in range(first) for h in range(H)]
    senders = [(int(l), int(h)) for l, h in senders]
    bad = [f"{l}.{h}" for l, h in senders if not (0 <= l < first and 0 <= h < H)]
    if bad or not senders:
        raise QkovError(f"path patching: senders must be heads before layer {first} (got {', '.join(bad) or 'none'})")
    base, src = pair(source, clean, corrupted, direction)
    m = as_metric(metric, clean)
    T = base.shape[1]
    layers, sender_layers = sorted({l for l, _ in heads}), sorted({l for l, _ in senders})
    start = min(first, reads_from(source, m))
    z = [f"z.{l}" for l in sender_layers]  # a head's output is z @ W_O: the changes come from z, d_head wide
    stream = [f"resid_pre.{start}"] if start < L else []
    cache = [*z, *stream, *(f"{input}_input.{l}" for l in layers), *m.reads] + ([] if heads else [f"resid_post.{L - 1}"])
    base_run = trace(source, base, cache=cache, positions=m.logit_positions(T))
    src_run = trace(source, src, cache=[*z, *m.reads], positions=m.logit_positions(T))
    W_O = {l: source.attention(l).W_O for l in sender_layers}
    # each patched copy also holds the receivers' per-head inputs, edited and normalised
    split = 2 * base.numel() * cfg.n_heads * cfg.d_model * base_run.logits.element_size() * len(layers)
    K_max = max(1, (max_bytes or PATCH_BYTES) // (copy_bytes(source, base, m.logit_positions(T)) + split))
    values = torch.full((L, H), float("nan"), dtype=torch.float64)
    for lo in range(0, len(senders), K_max):
        chunk = senders[lo : lo + K_max]
        delta = torch.stack([(src_run[("z", l)][:, :, h] - base_run[("z", l)][:, :, h]) @ W_O[l][h] for l, h in chunk])
        got = _run_chunk(source, base, base_run, m, heads, input, chunk, delta, start)
        for (l, h), v in zip(chunk, got.tolist()):
            values[l, h] = v
        tick(progress, "path patching", lo + len(chunk), len(senders))
    clean_run, corrupt_run = (src_run, base_run) if direction == "denoise" else (base_run, src_run)
    into = "logits" if not heads else f"{','.join(f'{l}.{h}' for l, h in heads)} {input}"
    labels = {"layer": [str(l) for l in range(L)], "head": [str(h) for h in range(H)]}
    return PatchResult(
        "path", f"sender -> {into}", ("layer", "head"), values, scalar(m, clean_run), scalar(m, corrupt_run),
        direction, m.name, labels,
    )  # fmt: skip


def _run_chunk(
    source: WeightSource,
    base: Tensor,
    base_run: Trace,
    m: Metric,
    heads: list[Head],
    kind: str,
    chunk: list[Head],
    delta: Tensor,
    start: int,
) -> Tensor:
    """The metric for ``len(chunk)`` senders in one batched pass; ``delta [K, B, T, D]`` their changes."""
    K, B = delta.shape[:2]
    L = source.cfg.n_layers
    if not heads:  # -> logits: the final stream of each copy is the base one plus the sender's change
        stream = (final_stream(base_run)[None] + delta).reshape(K * B, *delta.shape[2:])
        out = trace(source, base.repeat(K, 1), start_at=(L, stream), cache=m.reads, positions=m.logit_positions(base.shape[1]))
        return torch.stack([m(out.select(slice(k * B, (k + 1) * B))) for k in range(K)])
    group = source.cfg.n_heads // source.cfg.kv_heads if kind in ("k", "v") else 1
    edits: dict[Any, Any] = {}
    for l2 in sorted({l for l, _ in heads}):
        slots = sorted({h // group for l, h in heads if l == l2})
        before = torch.tensor([l1 < l2 for l1, _ in chunk], device=delta.device)
        d = delta * before[:, None, None, None].to(delta)
        edits[Address(f"{kind}_input", l2)] = _receive(base_run[(f"{kind}_input", l2)], slots, d)
    return batched(source, base, base_run, m, start, edits, K)


def _receive(base_input: Tensor, slots: list[int], delta: Tensor):  # type: ignore[no-untyped-def]
    """An edit of a per-head input ``[K*B, T, n, D]``: receiver slots get the base input plus each
    copy's sender change ``delta [K, B, T, D]``; other slots keep the live value."""
    K, B = delta.shape[:2]

    def receive(value: Tensor, site: Address) -> Tensor:
        out = value.clone().view(K, B, *value.shape[1:])
        for s in slots:
            out[:, :, :, s] = base_input[None, :, :, s] + delta
        return out.view(value.shape)

    return receive


def input_paths(
    source: WeightSource,
    clean: Tensor,
    corrupted: Tensor,
    *,
    sender: Head,
    receiver: Head,
    metric: Any,
    direction: str = "noise",
    inputs: Sequence[str] = INPUTS,
) -> tuple[dict[str, float], float, float]:
    """One sender's path into each of ``receiver``'s ``inputs``, each patched alone (the definition of
    :func:`path_patching`), from one base run, one source run and one pass of ``len(inputs)`` copies:
    ``({input: metric}, metric on clean, metric on corrupted)``."""
    (l1, h1), (l2, h2) = sender, receiver
    _check(source, [receiver], inputs[0])
    if not l1 < l2:
        raise QkovError(f"path patching: the sender {l1}.{h1} must come before the receiver {l2}.{h2}")
    base, src = pair(source, clean, corrupted, direction)
    m = as_metric(metric, clean)
    T = base.shape[1]
    start = min(l2, reads_from(source, m))
    cache = [f"z.{l1}", f"resid_pre.{start}", *(f"{i}_input.{l2}" for i in inputs), *m.reads]
    base_run = trace(source, base, cache=cache, positions=m.logit_positions(T))
    src_run = trace(source, src, cache=[f"z.{l1}", *m.reads], positions=m.logit_positions(T))
    change = (src_run[("z", l1)][:, :, h1] - base_run[("z", l1)][:, :, h1]) @ source.attention(l1).W_O[h1]
    K, edits = len(inputs), {}
    for k, inp in enumerate(inputs):
        group = source.cfg.n_heads // source.cfg.kv_heads if inp in ("k", "v") else 1
        only = torch.zeros(K, 1, 1, 1, dtype=change.dtype, device=change.device)
        only[k] = 1  # copy k carries the change into this input; the others keep the base input
        edits[Address(f"{inp}_input", l2)] = _receive(base_run[(f"{inp}_input", l2)], [h2 // group], change[None] * only)
    got = batched(source, base, base_run, m, start, edits, K).tolist()
    clean_run, corrupt_run = (src_run, base_run) if direction == "denoise" else (base_run, src_run)
    return dict(zip(inputs, got)), scalar(m, clean_run), scalar(m, corrupt_run)
