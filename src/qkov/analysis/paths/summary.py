"""The paths report (``qkov paths``): the expansion, term importance and term effects of one batch
of text in one :class:`PathSummary`, and the memory it holds at its peak (:func:`expansion_bytes`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ...device import check_fits
from ...weights.parts import WeightSource
from .importance import TermImportance, term_importance
from ...errors import QkovError
from ..forward.cache import Trace
from ..forward.frozen import frozen_edits, frozen_recording
from ...progress import Progress
from ..shown import Shown
from .effects import TermEffect
from .virtual import VirtualCoverage, select_virtual
from ..shown import TEXT, num, register, table
from .expansion import expand, virtual_pairs, VIRTUAL_AUTO_MAX
from .effects import effect_positions, term_effects

__all__ = ["expansion_bytes", "paths_text", "PathSummary", "summarize"]


@dataclass(repr=False)
class PathSummary(Shown):
    """What ``qkov paths`` and the report show: exactness, term importance, the terms that matter."""

    shape: list[int]  # [batch, seq] of the tokens
    reconstruction_error: float  # max |sum of all terms - the model's logits|
    importance: TermImportance
    singles: list[TermEffect]  # every single-head term, by loss change
    virtual: list[TermEffect]  # the largest virtual-head terms, by loss change
    coverage: VirtualCoverage | None = None  # which virtual heads were materialised; None: none were
    effect_positions: int | None = None  # positions the term effects were measured on (None: every one)

    def to_dict(self) -> dict[str, Any]:
        return {
            "tokens": self.shape,
            "reconstruction_max_abs_error": self.reconstruction_error,
            "term_importance": self.importance.to_dict(),
            "single_head_terms": [e.to_dict() for e in self.singles],
            "virtual_head_terms": [e.to_dict() for e in self.virtual],
            "virtual_coverage": None if self.coverage is None else self.coverage.to_dict(),
            "effect_positions": self.effect_positions,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "PathSummary":
        """The summary from its :meth:`to_dict` form."""
        ti = d["term_importance"]
        importance = TermImportance(ti["run_losses"], ti["full_loss"], ti["uniform_loss"])
        singles = [TermEffect(e["name"], e["loss_change"], e["size"]) for e in d["single_head_terms"]]
        virtual = [TermEffect(e["name"], e["loss_change"], e["size"]) for e in d["virtual_head_terms"]]
        cover = d.get("virtual_coverage")
        coverage = None if cover is None else VirtualCoverage.from_dict(cover)
        shape, err, sampled = d["tokens"], d["reconstruction_max_abs_error"], d.get("effect_positions")
        return cls(shape, err, importance, singles, virtual, coverage, sampled)


@torch.no_grad()
def summarize(
    source: WeightSource,
    tokens: Tensor,
    *,
    top_virtual: int = 10,
    virtual_terms: int | None = VIRTUAL_AUTO_MAX,
    progress: Progress | None = None,
    recording: Trace | None = None,
) -> PathSummary:
    """Expand ``tokens [B, T]``, run the paper's term importance and measure the effect of each
    single-head and the ``top_virtual`` largest virtual-head terms (on every position, or on a
    seeded sample of them when their logits would exceed :data:`EFFECT_LOGITS`: 333 positions at
    GPT-2's vocabulary; :attr:`PathSummary.effect_positions` says which).

    ``virtual_terms``: how many virtual heads (pairs of heads in increasing layers, each a pass
    of its reader head over the batch) to materialise: all of them when the model has at most
    that many (``None``: always all), else that many chosen by an upper bound on their size
    (:mod:`qkov.analysis.paths.virtual`), with the share of the order-2 term they explain stated in
    :attr:`PathSummary.coverage`; 0 materialises none. Only the ``top_virtual`` largest are held.
    Refuses (one-line :class:`QkovError`) a batch whose terms would not fit in free memory
    (:func:`expansion_bytes`), before any work.

    ``recording``: a pass over ``tokens`` already made that cached what the expansion freezes
    (:func:`~qkov.analysis.forward.frozen.frozen_sites`; :func:`~qkov.analysis.forward.frozen.frozen_recording`),
    used instead of running one (the report records its text once for several sections).
    Raises:
        QkovError: the recording is not of ``tokens`` (or lacks a frozen site), or the batch does not fit.
    """
    do_virtual = virtual_pairs(source) > 0 and virtual_terms != 0 and source.cfg.residual == "sum"  # routed: none
    tokens = tokens[None] if tokens.ndim == 1 else tokens
    B, T = tokens.shape
    need = expansion_bytes(source, B, T, virtual=top_virtual + 1 if do_virtual else 0)
    check_fits(
        need, source.device, f"paths: the expansion of {B} x {T} tokens", "analyse fewer sequences", hint="batch"
    )
    if recording is not None:
        if not torch.equal(recording.tokens.to(tokens.device), tokens):
            raise QkovError("paths: the recording must be a pass over the tokens analysed")
        frozen_edits(recording)  # it must hold what the expansion freezes (a one-line error if not)
    real = recording or frozen_recording(source, tokens)  # one recording serves term importance and the expansion
    importance = term_importance(source, tokens, progress=progress, recording=real)
    exp = expand(source, tokens, progress=progress, recording=real)
    coverage = None
    if do_virtual:
        exp.virtual, coverage = select_virtual(
            source, exp.recording, exp.heads, exp.orders[2], most=virtual_terms, keep=top_virtual, progress=progress
        )
    positions = effect_positions(exp)
    effects = term_effects(exp, top_virtual=top_virtual, positions=positions, progress=progress)
    singles, virt = effects.singles, effects.virtual
    sampled = None if positions is None else len(positions)
    return PathSummary(list(tokens.shape), exp.reconstruction_error(), importance, singles, virt, coverage, sampled)


def expansion_bytes(source: WeightSource, batch: int, seq: int, *, virtual: int = 0) -> int:
    """Memory :func:`~qkov.analysis.paths.summary.summarize` holds at its peak, about: every head's term and the orders
    (``[batch, seq, d_model]`` each), ``virtual`` kept virtual-head terms, the frozen patterns,
    the per-head outputs of term importance and three ``[batch, seq, d_vocab]`` logits."""
    c = source.cfg
    size = torch.finfo(source.dtype).bits // 8
    term = batch * seq * c.d_model
    terms = (c.n_layers + 4 + 3 * c.n_layers * c.n_heads + virtual + 2 * c.n_heads) * term
    patterns = c.n_layers * batch * c.n_heads * seq * seq
    return (terms + patterns + 3 * batch * seq * c.d_vocab) * size


@register(TEXT, PathSummary)
def paths_text(p: PathSummary) -> str:
    ti = p.importance
    runs = ["uniform", *(["direct path"] + [f"orders 0..{i}" for i in range(1, len(ti.run_losses))])]
    losses = [ti.uniform_loss, *ti.run_losses]
    terms = lambda effects: [[e.name, num(e.loss_change, 4), num(e.size)] for e in effects]  # noqa: E731
    lines = [
        f"PathSummary on {p.shape[0]} x {p.shape[1]} tokens: the terms sum to the logits to "
        f"{p.reconstruction_error:.2e} (max |difference|); model loss {num(ti.full_loss)} nats",
        "loss by run:  " + "  ".join(f"{r} {num(v)}" for r, v in zip(runs, losses)),
        "marginal loss reduction by order:  " + "  ".join(num(v) for v in ti.marginal_by_order),
        "single-head terms (loss increase when removed):",
        table(["term", "loss_change", "rms_logit"], terms(p.singles)),
    ]
    if p.virtual:
        lines.append("virtual-head terms:")
        lines.append(table(["term", "loss_change", "rms_logit"], terms(p.virtual)))
    return "\n".join(lines)
