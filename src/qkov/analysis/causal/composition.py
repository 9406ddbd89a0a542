"""[F]'s composition made causal: how much of an induction head's behaviour each path from a
previous-token head carries, by path patching (:mod:`qkov.analysis.causal.path_patch`).

[F] reads K-composition off the weights: the previous-token head writes "the token before me"
and the induction head's keys read it. The causal test: noise one path at a time, the writer's
output reaching the reader's key input only (then, separately, its query and its value input),
with the writer's output taken from a corrupted run, and measure what the reader loses:

* **prefix matching** — the reader's attention from each token of the second copy of repeated
  random tokens to the token after its first occurrence ([I]'s prefix-matching score). Clean:
  the repeated tokens; corrupted: random tokens of the same length that do not repeat. Share
  removed = ``(clean - patched) / (clean - corrupted)``.
* **in-context learning** — the ICL score (loss at the late positions minus loss at position 50,
  :func:`~qkov.analysis.heads.probes.icl_windows`) on validation text. Clean: the text; corrupted:
  another sequence of the same text (each example's writer output taken from the next example).
  Share removed = ``(patched - clean) / -clean``: the share of the in-context improvement lost
  (as :meth:`~qkov.analysis.causal.ablation.AblationStudy.icl_removed` measures an ablation's).

A reader whose keys find the earlier occurrence through the writer loses most of its prefix
matching on the K path and little on the Q and V paths. On a routed model the writer's change reaches
the reader scaled by its routing coefficient on the base run (:mod:`qkov.analysis.causal.path_patch`).

**The K path's share of the induction head's effect** (:func:`k_path_share`): on the same repeated random
tokens, noised (base = the repeated tokens, source = the non-repeating ones), the metric is the loss of the
second copy's predictions that induction can make (positions ``L + 1 .. 2L - 1``, each predicting the next
token of the repeat). The induction head's effect is the loss added by noising its whole output (its ``z``
taken from the non-repeating run); the path's, the loss added by noising the path writer -> reader's key
input alone. Share = ``(loss_path - loss_clean) / (loss_head - loss_clean)``: 1 when the reader's whole
contribution to the repeat runs through the keys it reads from the writer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ...weights.parts import WeightSource
from ...weights.convert import SourceLike, as_source
from .metrics import Attention, ICLWindows, Loss
from .contrast import PATCH_BYTES, Contrast, copy_bytes
from .path_patch import input_paths, patch_paths, path_sites
from ..heads.probes import icl_left_out, icl_windows, induction_probe_tokens
from ..shown import TEXT, Shown, register
from ..forward.address import INPUTS, Address, HeadLike, as_head

__all__ = ["composition_paths", "composition_paths_text", "CompositionPaths", "ICL_CHUNK", "k_path_share", "KPathShare"]

ICL_CHUNK = 32  # ICL examples per path-patching pass at most (fewer where their activations exceed PATCH_BYTES)


@dataclass(repr=False)
class CompositionPaths(Shown):
    """Each path writer -> reader's q, k, v: the share of the reader's prefix matching it removes when
    noised, and the share of the in-context improvement (``None`` without text, or without an improvement)."""

    writer: str
    reader: str
    prefix_clean: float
    prefix_corrupted: float
    prefix_removed: dict[str, float]
    icl_clean: float | None = None
    icl_removed: dict[str, float] | None = None
    repeat_length: int = 0
    icl_examples: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CompositionPaths":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})

    def rounded(self, digits: int = 4) -> "CompositionPaths":
        """The same numbers rounded as the report stores them."""
        r = lambda v: v if v is None else round(v, digits)  # noqa: E731
        shares = lambda d: None if d is None else {k: r(v) for k, v in d.items()}  # noqa: E731
        return CompositionPaths(
            self.writer, self.reader, r(self.prefix_clean), r(self.prefix_corrupted), shares(self.prefix_removed),  # type: ignore[arg-type]
            r(self.icl_clean), shares(self.icl_removed), self.repeat_length, self.icl_examples,
        )  # fmt: skip


def _repeated(source: WeightSource, bos: int | None, seed: int, batch: int) -> tuple[Tensor, Tensor, int]:
    length = min(50, (source.cfg.n_ctx - 1) // 2)
    V = source  # the source's vocabulary, and its start token unless bos is given
    clean = induction_probe_tokens(V, length=length, repeats=2, batch=batch, seed=seed, bos=bos)
    corrupted = induction_probe_tokens(V, length=2 * length, repeats=1, batch=batch, seed=seed + 1, bos=bos)
    return clean.to(source.device), corrupted.to(source.device), length


def composition_paths(
    source: SourceLike,
    writer: HeadLike,
    reader: HeadLike,
    *,
    text: Tensor | None = None,
    bos: int | None = None,
    seed: int = 0,
    batch: int = 8,
) -> CompositionPaths:
    """Path-patch ``writer`` -> ``reader``'s q, k and v inputs (see the module docstring); ``text``
    ``[N, T]`` validation examples for the ICL share (at least 2, as long as the ICL score reads:
    :func:`~qkov.analysis.heads.probes.icl_left_out`); ``source``: a model, weights source or path;
    ``bos=None``: its start token; ``writer``, ``reader``: heads (``(layer, head)`` or ``"L.H"``)."""
    source = as_source(source, where="qkov.composition_paths")
    writer, reader = (as_head(h, source.cfg, "composition paths") for h in (writer, reader))
    clean, corrupted, L = _repeated(source, bos, seed, batch)
    m = Attention(layer=reader.layer, head=reader.head, queries=list(range(L + 1, 2 * L + 1)), offset=L - 1)
    got, base, target = input_paths(source, clean, corrupted, sender=writer, receiver=reader, metric=m)
    removed = {inp: (got[inp] - base) / (target - base) for inp in INPUTS}  # noised: base = clean
    out = CompositionPaths(writer.name, reader.name, base, target, removed, repeat_length=L)
    if text is not None and text.shape[0] >= 2 and icl_left_out(text.shape[1], source.cfg.n_ctx) is None:
        out.icl_clean, out.icl_removed = _icl_paths(source, writer, reader, text.to(source.device))
        out.icl_examples = text.shape[0]
    return out


def _icl_paths(source: WeightSource, writer: Address, reader: Address, text: Tensor) -> tuple[float, dict[str, float] | None]:
    """The clean ICL score and, per input, the share of its improvement the noised path removes."""
    _, _, early_at, late_at = icl_windows(text.shape[1])
    text = text[:, : int(late_at[-1]) + 2]
    other = torch.roll(text, 1, dims=0)  # each example's writer output from another example
    sums = {inp: 0.0 for inp in INPUTS}
    clean = 0.0
    N, T = text.shape
    c = source.cfg
    K = len(INPUTS)  # one patched copy per input, each holding every input's per-head copies
    one = K * (copy_bytes(source, text[:1], None) + 2 * K * T * c.n_heads * c.d_model * torch.finfo(source.dtype).bits // 8)
    chunk = max(1, min(ICL_CHUNK, PATCH_BYTES // one))  # examples whose patched pass fits the budget
    for lo in range(0, N, chunk):
        part, corrupted = text[lo : lo + chunk], other[lo : lo + chunk]
        m = ICLWindows(early=early_at.tolist(), late=late_at.tolist(), tokens=part)
        got, base, _ = input_paths(source, part, corrupted, sender=writer, receiver=reader, metric=m)
        for inp in INPUTS:
            sums[inp] += got[inp] * part.shape[0]
        clean += base * part.shape[0]
    clean /= N
    if clean >= 0:
        return clean, None
    return clean, {inp: (sums[inp] / N - clean) / -clean for inp in INPUTS}


@dataclass
class KPathShare:
    """The share of the induction head ``reader``'s effect on the loss of repeated random tokens carried by the
    path from ``writer`` into its keys (:func:`k_path_share`): the losses of the second copy's predictions on the
    repeated tokens (``loss_clean``), on non-repeating ones (``loss_corrupted``), with the reader's output noised
    (``loss_head``) and with the path alone noised (``loss_path``); ``share`` is ``None`` when noising the reader
    changes nothing."""

    writer: str
    reader: str
    loss_clean: float
    loss_corrupted: float
    loss_head: float
    loss_path: float
    share: float | None
    repeat_length: int

    def to_dict(self, digits: int = 5) -> dict[str, Any]:
        """The numbers rounded to ``digits`` as a study stores them."""
        return {k: round(v, digits) if isinstance(v, float) else v for k, v in vars(self).items()}


def k_path_share(
    source: SourceLike, writer: HeadLike, reader: HeadLike, *, bos: int | None = None, seed: int = 0, batch: int = 8
) -> KPathShare:
    """How much of induction head ``reader``'s effect runs through the path from previous-token head ``writer``
    into its keys (see the module docstring): one base and one source run, one pass that noises the reader's
    output and one that noises the path. ``source``: a model, weights source or path; ``bos=None``: its start
    token; ``writer``, ``reader``: heads (``(layer, head)`` or ``"L.H"``), the writer in an earlier layer."""
    source = as_source(source, where="qkov.k_path_share")
    writer, reader = (as_head(h, source.cfg, "k path share") for h in (writer, reader))
    Address.edge(writer, reader).check(source.cfg, "k path share")
    clean, corrupted, L = _repeated(source, bos, seed, batch)
    c = Contrast.of(source, clean, corrupted, metric=Loss(tokens=clean, at=range(L + 1, 2 * L)), direction="noise")
    needs = path_sites(c, [reader], "k", [writer])
    c.ensure([*needs.cache, f"z.{reader.layer}"], base_only=needs.base_only)
    z = c.source_recording[("z", reader.layer)][:, :, reader.head].detach()  # type: ignore[index]

    def noised(value: Tensor, site: Any) -> Tensor:
        value = value.clone()
        value[:, :, reader.head] = z
        return value

    head = float(c.measure(1, {f"z.{reader.layer}": noised})[0])
    path = float(patch_paths(c, receivers=[reader], input="k", senders=[writer]).values[writer.layer, writer.head])
    base = c.clean_value
    share = None if head == base else (path - base) / (head - base)
    return KPathShare(writer.name, reader.name, base, c.corrupted_value, head, path, share, L)


@register(TEXT, CompositionPaths)
def composition_paths_text(c: CompositionPaths) -> str:
    lines = [
        f"paths {c.writer} -> {c.reader} noised one at a time (path patching):",
        f"  {c.reader}'s prefix matching on {c.repeat_length}-token repeats: clean {c.prefix_clean:.3f}, "
        f"non-repeating {c.prefix_corrupted:.3f}",
    ]
    for inp in INPUTS:
        icl = "" if c.icl_removed is None else f", in-context improvement removed {c.icl_removed[inp]:+.0%}"
        lines.append(f"  {c.writer} -> {c.reader} {inp}: prefix matching removed {c.prefix_removed[inp]:+.0%}{icl}")
    if c.icl_clean is not None:
        lines.append(f"  (ICL score on {c.icl_examples} validation examples: {c.icl_clean:+.3f})")
    return "\n".join(lines)
