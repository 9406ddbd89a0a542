"""Head ablation ([I]'s causal evidence): remove heads' outputs and measure what the model loses.

Ablation is an edit of the analysis forward (:func:`ablation_edits`), at every position or at
chosen ones (:mod:`qkov.analysis.causal.positions`). A head's output is ``z @ W_O`` (``z`` its
attention-weighted values), so each mode edits the head's ``z``: **zero** sets it to zero (the
head writes nothing); **mean** sets it to its mean over every position of a stated sample of text
(:func:`z_means`; the head then writes its mean output, a constant vector); **resample** takes it
from another sequence of the same batch (a seeded derangement: each sequence gets the head's
output on a different input, at the same position). Everything downstream (later heads'
patterns, MLPs, logits) is recomputed by the ordinary forward.

:func:`ablation_study` sets the model beside the ablated one and beside ablations of the same
number of other heads drawn at random (seeded): validation loss, the ICL score and the loss on
the first and second copy of repeated random tokens.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import Tensor

from ...device import check_fits, tune_allocator_for
from ...errors import QkovError
from ...weights.parts import WeightSource
from ...weights.convert import SourceLike, as_source, source_bos
from ..budget import fit_chunk, item, keeps_streams, pass_bytes
from ..forward.edits import per_position
from ..forward.tiled_nll import pass_nll
from ..forward.tracer import trace
from .positions import PositionSpec, describe_positions, resolve_positions
from ..heads.probes import ICL_LATE, icl_chunk, icl_left_out, icl_score, icl_windows, induction_probe, induction_probe_tokens
from ..shown import TEXT, Shown, register
from ..forward.address import Address, HeadLike, parse_heads

__all__ = [
    "ablation_budget",
    "ablation_edits",
    "ablation_study",
    "AblationStudy",
    "Chunks",
    "derangement",
    "icl_examples",
    "kept_streams",
    "Measures",
    "measures",
    "measures_left_out",
    "MODES",
    "PROBE_LENGTH",
    "probe_plan",
    "random_sets",
    "sequence_losses",
    "ablation_text",
    "z_means",
]

MODES = ("zero", "mean", "resample")
PROBE_LENGTH = 50  # tokens per copy of the repeated-token probe the measures run (fewer on a short context)


def z_means(source: SourceLike, tokens: Tensor, heads: Sequence[HeadLike], *, chunk: int | None = None) -> Tensor:
    """Each head's ``z`` averaged over every position of ``tokens [B, T]``: ``[len(heads), d_head]``
    (its mean output is this times its ``W_O``); ``chunk`` sequences per forward pass (default all). The sums
    are taken in float64 as each layer's ``z`` is computed (nothing is kept), and the pass stops after the
    last layer read."""
    source = as_source(source, where="qkov.z_means")
    heads = [(a.layer, a.head) for a in parse_heads(heads, source.cfg, "ablate")]
    total = torch.zeros(len(heads), source.cfg.d_head, dtype=torch.float64, device=source.device)

    def summed(layer: int) -> Callable[[Tensor, Any], Tensor]:
        rows = [i for i, (l, _) in enumerate(heads) if l == layer]
        cols = torch.tensor([heads[i][1] for i in rows], device=source.device)

        def add(z: Tensor, site: Any) -> Tensor:  # z [B, T, H, E]: observed, unchanged
            total[rows] += z.index_select(2, cols).double().sum(dim=(0, 1))
            return z

        return add

    edits = {("z", layer): summed(layer) for layer in sorted({l for l, _ in heads})}
    chunk = chunk or tokens.shape[0]
    for lo in range(0, tokens.shape[0], chunk):
        trace(source, tokens[lo : lo + chunk], edits=edits, logits=False)
    return (total / (tokens.shape[0] * tokens.shape[1])).to(source.dtype)


def sequence_losses(
    source: WeightSource,
    text: Tensor,
    *,
    chunk: int | None = None,
    edits: dict[Any, Any] | None = None,
    keep: list[Tensor] | None = None,
    start: tuple[int, list[Tensor]] | None = None,
) -> Tensor:
    """Next-token losses ``[B, T - 1]`` of ``text [B, T]`` (with ``edits``), ``chunk`` sequences per forward
    pass (default all: one pass). ``keep``: a list that receives each pass's stream entering every layer
    (``[n_layers, chunk, T, d_model]``). ``start``: ``(layer, streams)``, each pass from ``layer`` on, from its
    stream there in ``streams`` (so kept, same ``chunk``; for edits of that layer and later: the same losses)."""
    chunk = chunk or text.shape[0]
    parts = []
    for i, lo in enumerate(range(0, text.shape[0], chunk)):
        at = None if start is None or not start[0] else (start[0], start[1][i][start[0]])
        parts.append(pass_nll(source, text[lo : lo + chunk], edits=edits, start_at=at, keep=keep))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


@dataclass(frozen=True)
class Chunks:
    """Sequences per forward pass that fit the memory budget (``None``: all at once, or the
    analysis's own default): of the validation text, of the ICL examples, of the mean's sample."""

    text: int | None = None
    icl: int | None = None
    mean: int | None = None


def ablation_budget(
    source: WeightSource,
    text: Tensor | None,
    icl_text: Tensor | None,
    mode: str,
    *,
    bos: int | None = None,
    seed: int = 0,
    where: str = "ablate",
    probe_length: int | None = PROBE_LENGTH,
) -> Chunks:
    """How :func:`ablation_study` splits its forward passes to fit the memory budget
    (:func:`qkov.device.memory_budget`): every pass whole when it fits, else as few sequences at
    once as fit. Refuses (one-line :class:`QkovError`, before any work) when a pass that cannot be
    split does not fit: the repeated-token probe, one sequence (a resample ablation: the whole
    batch, whose sequences swap outputs), two ICL examples. ``where`` begins the message."""
    what, advice = f"{where}: a forward pass of", "analyse fewer or shorter sequences"
    c, it = source.cfg, item(source)

    def split(tokens: Tensor, one: int, name: str, least: int = 1) -> int | None:
        B = tokens.shape[0]
        n = fit_chunk(source, B, one, (least - 1) * one, f"{what} {name}", advice, hint="memory")
        return None if n >= B else max(least, n)

    own = getattr(source, "bos_token_id", None)  # a planned source may carry none: only the probe's shape counts here
    probe = _probe_tokens(source, bos if bos is not None else (0 if own is None else own), seed, probe_length)
    need = pass_bytes(source, *probe.shape, loss=True)  # its induction attention read at its entries: no pattern kept
    if probe_length is not None:
        check_fits(need, source.device, f"{what} the repeated-token probe", advice, hint="memory")
    mean = text_chunk = icl = None
    if mode == "mean":
        on = text if text is not None else probe
        T = on.shape[1]
        mean = split(on, pass_bytes(source, 1, T, logits=0), f"one {T}-token sequence (the mean)")  # z summed, no logits
    if text is not None and mode == "resample":  # its sequences swap outputs: the batch is one pass
        need = pass_bytes(source, *text.shape, tiled=True)
        check_fits(need, source.device, f"{what} {text.shape[0]} x {text.shape[1]} tokens", advice, hint="memory")
    elif text is not None:
        T = text.shape[1]
        text_chunk = split(text, pass_bytes(source, 1, T, tiled=True), f"one {T}-token sequence")
    ex = icl_examples(icl_text, c.n_ctx)
    if ex is not None:
        T = ex.shape[1]
        width = len(torch.cat(icl_windows(T)[2:]).unique())  # the positions the score unembeds
        own = icl_chunk(c, T, width, it)  # icl_score's own chunk
        least = 2 if mode == "resample" else 1
        one = pass_bytes(source, 1, T, logits=width, loss=True)
        icl = split(ex[:own], one, f"{least} {T}-token ICL example(s)", least)
    return Chunks(text_chunk, icl, mean)


def derangement(n: int, seed: int) -> Tensor:
    """A seeded permutation of ``range(n)`` that moves every element (``n >= 2``)."""
    if n < 2:
        raise QkovError("resample ablation needs at least 2 sequences in a batch (it takes each head's output from another)")
    gen = torch.Generator().manual_seed(seed)
    while True:
        perm = torch.randperm(n, generator=gen)
        if bool((perm != torch.arange(n)).all()):
            return perm


def ablation_edits(
    heads: Sequence[HeadLike] | str,
    mode: str = "zero",
    *,
    positions: PositionSpec = None,
    means: Tensor | None = None,
    seed: int = 0,
) -> dict[Address, Callable[[Tensor, Address], Tensor]]:
    """Edits that ablate ``heads`` (``mode`` zero, mean or resample) at ``positions`` (default every
    position): pass them to :func:`~qkov.analysis.forward.tracer.trace` or any analysis taking ``edits``.
    ``heads``: ``(layer, head)`` pairs, addresses or ``"1.0,1.3"``. ``means [len(heads), d_head]``
    (from :func:`z_means`) for mean ablation."""
    heads = parse_heads(heads, what="ablate")
    if mode not in MODES:
        raise QkovError(f"ablate: mode must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "mean" and (means is None or means.shape[0] != len(heads)):
        raise QkovError("ablate: mean ablation needs one mean z per head (z_means)")
    edits = {}
    for i, a in enumerate(heads):
        mean = None if means is None else means[i]
        edits[Address("z", a.layer, a.head)] = _ablate(mode, positions, mean, seed)
    return edits


def _ablate(mode: str, positions: PositionSpec, mean: Tensor | None, seed: int) -> Callable[[Tensor, Address], Tensor]:
    def edit(z: Tensor, site: Address) -> Tensor:  # one head's z [B, T, E]
        if mode == "zero":
            new = torch.zeros_like(z)
        elif mode == "mean":
            new = mean.to(z).expand_as(z)  # type: ignore[union-attr]
        else:
            new = z[derangement(z.shape[0], seed).to(z.device)]
        at = resolve_positions(positions, z.shape[1], z.device)
        if at is None:
            return new
        out = z.clone()
        out[:, at] = new[:, at]
        return out

    return per_position(edit) if positions is None else edit  # every position: each on its own


@dataclass
class Measures:
    """What an ablation is judged by; ``None`` where the text does not allow it."""

    loss: float | None  # mean next-token loss on the text
    icl: float | None  # ICL score (loss late minus loss at token 50; negative = learns in context)
    repeat_first: float | None  # loss on the first copy of repeated random tokens (None: no probe)
    repeat_second: float | None  # ... and on the second copy (an induction head makes it far lower)


def measures(
    source: WeightSource,
    text: Tensor | None,
    icl_text: Tensor | None,
    *,
    bos: int | None = None,
    seed: int = 0,
    edits: dict[Any, Any] | None = None,
    chunks: Chunks = Chunks(),
    probe_length: int | None = PROBE_LENGTH,
    keep: Mapping[str, list[Tensor]] | None = None,
    start: tuple[int, Mapping[str, list[Tensor]]] | None = None,
) -> Measures:
    """Loss on ``text [B, T]``, ICL score on ``icl_text [N, T]`` (``None``: not measured) and the
    repeated-token losses (:func:`~qkov.analysis.heads.probes.induction_probe`, seeded), every forward
    pass with ``edits``, the text and ICL examples ``chunks`` sequences at a time; ``bos=None``: the
    source's start token; ``probe_length`` tokens per copy of the probe (``None``: no probe). ``keep``, ``start``:
    the passes over an input named there (``"text"``, ``"icl"``) keep their streams in its list, or start from
    the kept ones (:func:`sequence_losses`, :func:`~qkov.analysis.heads.probes.icl_score`)."""
    source = as_source(source, where="qkov.analysis.causal.ablation.measures")
    kept = dict(keep or {})
    at = {name: (start[0], streams) for name, streams in start[1].items()} if start is not None else {}
    nll = None if text is None else sequence_losses(
        source, text, chunk=chunks.text, edits=edits, keep=kept.get("text"), start=at.get("text")
    )  # fmt: skip
    loss = None if nll is None else float(nll.mean())
    icl = None
    if icl_text is not None and icl_left_out(icl_text.shape[1], source.cfg.n_ctx) is None:
        icl = icl_score(
            source, icl_text, curve=False, edits=edits, chunk=chunks.icl, keep=kept.get("icl"), start=at.get("icl")
        ).score
    if probe_length is None:
        return Measures(loss, icl, None, None)
    probe = induction_probe(source, bos=bos, seed=seed, edits=edits, length=probe_length)
    return Measures(loss, icl, probe.loss_by_copy[0], probe.loss_by_copy[1])


@dataclass(repr=False)
class AblationStudy(Shown):
    """The intact model, the ablated one, and random ablations of as many other heads."""

    heads: list[str]
    mode: str
    mean_sample: str | None  # what the mean ablation averaged over
    intact: Measures
    ablated: Measures
    random_heads: list[list[str]] = field(default_factory=list)
    random: list[Measures] = field(default_factory=list)
    positions: str = "all"  # where the heads were ablated (every position, or a spec such as "50:")
    left_out: dict[str, str] = field(default_factory=dict)  # measure ("loss", "icl", "repeated") -> why it is None
    probe_length: int | None = PROBE_LENGTH  # tokens per copy of the repeated-token probe

    def icl_removed(self, which: Measures | None = None) -> float | None:
        """Share of the intact model's in-context improvement (``-icl``) that the ablation removes:
        ``(icl_ablated - icl_intact) / -icl_intact``; ``None`` without an improvement to remove."""
        m = which or self.ablated
        if self.intact.icl is None or m.icl is None or self.intact.icl >= 0:
            return None
        return (m.icl - self.intact.icl) / -self.intact.icl

    def random_icl_removed(self, statistic: str = "mean") -> float | None:
        """The mean (or ``"median"``) of :meth:`icl_removed` over the random ablations."""
        vals = sorted(v for v in (self.icl_removed(m) for m in self.random) if v is not None)
        if not vals:
            return None
        if statistic == "median":
            mid = len(vals) // 2
            return vals[mid] if len(vals) % 2 else (vals[mid - 1] + vals[mid]) / 2
        return sum(vals) / len(vals)

    def to_dict(self) -> dict[str, Any]:
        return {
            "heads": self.heads,
            "mode": self.mode,
            "positions": self.positions,
            "probe_length": self.probe_length,
            "mean_sample": self.mean_sample,
            "intact": asdict(self.intact),
            "ablated": asdict(self.ablated),
            "random_heads": self.random_heads,
            "random": [asdict(m) for m in self.random],
            "icl_removed": self.icl_removed(),
            "random_icl_removed": self.random_icl_removed(),
            "random_icl_removed_median": self.random_icl_removed("median"),
            "left_out": dict(self.left_out),
        }


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


@register(TEXT, AblationStudy)
def ablation_text(s: AblationStudy) -> str:
    rows = [("intact", s.intact), ("ablated", s.ablated)]
    rows += [(f"random {', '.join(h)}", m) for h, m in zip(s.random_heads, s.random)]
    lines = [
        f"ablating {', '.join(s.heads)} ({s.mode}{'' if s.positions == 'all' else ', positions ' + s.positions}):",
        f"  {'':24s} {'loss':>8s} {'ICL':>8s} {'rep 1st':>8s} {'rep 2nd':>8s}",
    ]
    for name, m in rows:
        lines.append(
            f"  {name[:24]:24s} {_fmt(m.loss, '8.4f')} {_fmt(m.icl, '+8.4f')} "
            f"{_fmt(m.repeat_first, '8.3f')} {_fmt(m.repeat_second, '8.3f')}"
        )
    removed, med = _fmt(s.icl_removed(), ".0%"), _fmt(s.random_icl_removed("median"), ".0%")
    lines.append(f"  in-context improvement removed: {removed} (random heads: median {med}, ")
    lines[-1] += f"mean {_fmt(s.random_icl_removed(), '.0%')})"
    lines += [f"  {name} left out: {why}" for name, why in s.left_out.items()]
    return "\n".join(lines)


def ablation_study(
    w: SourceLike,
    /,
    text: Tensor | None = None,
    heads: Sequence[HeadLike] | str | None = None,
    *,
    icl_text: Tensor | None = None,
    mode: str = "mean",
    draws: int = 5,
    bos: int | None = None,
    seed: int = 0,
    positions: PositionSpec = None,
) -> AblationStudy:
    """Ablate ``heads`` (at ``positions`` of every sequence; default all) and ``draws`` seeded random
    sets of as many other heads; measure each.

    ``w``: a model, weights source or path (:func:`~qkov.weights.as_source`). ``text [B, T]`` is the
    validation sample (loss, and the mean of mean ablation; ``None``: mean ablation averages over the
    repeated random tokens of the probe and the loss is left out). ``bos=None``: the source's start
    token. ``heads``: ``(layer, head)`` pairs, addresses or ``"1.0,1.3"``. ``text`` and ``heads`` may
    also be named (``text=..., heads=...``).
    """
    if heads is None:
        raise QkovError("qkov.ablation_study: which heads? ablation_study(source, text, heads=[(layer, head), ...])")
    w = as_source(w, where="qkov.ablation_study")
    heads = parse_heads(heads, w.cfg, "ablate")
    bos = source_bos("qkov.ablation_study", w, bos)
    if mode not in MODES:
        raise QkovError(f"ablate: mode must be one of {', '.join(MODES)}, got {mode!r}")
    length, why = probe_plan(w.cfg.n_ctx, positions)
    chunks = ablation_budget(w, text, icl_text, mode, bos=bos, seed=seed, probe_length=length)  # before any work
    tune_allocator_for(w)
    mean_on = text if text is not None else _probe_tokens(w, bos, seed, length)
    sample = None
    if mode == "mean":
        sample = (
            f"every position of {mean_on.shape[0]} validation sequences of {mean_on.shape[1]} tokens"
            if text is not None
            else f"every position of {mean_on.shape[0]} sequences of repeated random tokens"
        )

    every = [Address.of_head(l, h) for l in range(w.cfg.n_layers) for h in range(w.cfg.n_heads)]
    picks = random_sets([a for a in every if a not in heads], len(heads), draws, seed)
    mean_of: dict[Address, Tensor] = {}
    if mode == "mean":  # every head's mean from one pass over the sample (the numbers of a pass per set)
        union = list(dict.fromkeys([*heads, *(a for pick in picks for a in pick)]))
        mean_of = dict(zip(union, z_means(w, mean_on, union, chunk=chunks.mean)))

    kept: dict[str, list[Tensor]] = {  # the intact runs' streams, chunk by chunk, to start from
        name: [] for name in kept_streams(w, text=text, icl=icl_examples(icl_text, w.cfg.n_ctx))
    }

    def measure(hs: list[Address]) -> Measures:
        means = torch.stack([mean_of[a] for a in hs]) if mode == "mean" else None
        edits = ablation_edits(hs, mode, positions=positions, means=means, seed=seed)
        start = (min(a.layer for a in hs), kept) if kept else None  # type: ignore[type-var]
        return measures(w, text, icl_text, bos=bos, seed=seed, edits=edits, chunks=chunks, probe_length=length, start=start)

    intact = measures(w, text, icl_text, bos=bos, seed=seed, chunks=chunks, probe_length=length, keep=kept)
    study = AblationStudy([a.name for a in heads], mode, sample, intact, measure(heads))
    study.positions, study.probe_length = describe_positions(positions), length
    study.left_out = measures_left_out(w.cfg.n_ctx, text, icl_text) | ({} if why is None else {"repeated": why})
    for pick in picks:
        study.random_heads.append([a.name for a in pick])
        study.random.append(measure(pick))
    return study


def icl_examples(icl_text: Tensor | None, n_ctx: int) -> Tensor | None:
    """The ICL examples as :func:`measures` reads them (up to position :data:`ICL_LATE` + 1), or ``None`` where
    the score is left out (:func:`~qkov.analysis.heads.probes.icl_left_out`)."""
    if icl_text is None or icl_left_out(icl_text.shape[1], n_ctx) is not None:
        return None
    return icl_text[:, : ICL_LATE + 2]


def kept_streams(source: WeightSource, **inputs: Tensor | None) -> dict[str, Tensor]:
    """The ``inputs`` (by name, in order; ``None`` ones left out) whose intact runs keep their streams entering
    every layer, as many as :func:`~qkov.analysis.budget.keeps_streams` allows together."""
    kept: dict[str, Tensor] = {}
    for name, tokens in inputs.items():
        if tokens is not None and keeps_streams(source, *kept.values(), tokens):
            kept[name] = tokens
    return kept


def measures_left_out(n_ctx: int, text: Tensor | None, icl_text: Tensor | None) -> dict[str, str]:
    """Why :func:`measures` leaves the loss or the ICL score out (``{"loss": why, "icl": why}``, only
    those left out): no natural text, or text shorter than the ICL score reads
    (:func:`~qkov.analysis.heads.probes.icl_left_out`)."""
    none = "no natural text given (random tokens have no language to predict)"
    out = {} if text is not None else {"loss": none}
    missing = none if text is None else "no ICL examples given (icl_text)"
    reason = missing if icl_text is None else icl_left_out(icl_text.shape[1], n_ctx)
    return out if reason is None else {**out, "icl": reason}


def random_sets(others: list[Any], k: int, draws: int, seed: int) -> list[list[Any]]:
    """Up to ``draws`` distinct seeded sets of ``k`` heads (or any sortable items) from ``others`` (all
    of them when fewer exist)."""
    if len(others) < k or k == 0:
        return []
    total = math.comb(len(others), k)
    rng = random.Random(seed)
    if total <= max(draws, 1000):
        every = [list(c) for c in itertools.combinations(others, k)]
        return [sorted(c) for c in rng.sample(every, min(draws, total))]
    seen: set[tuple[Any, ...]] = set()
    while len(seen) < draws:
        seen.add(tuple(sorted(rng.sample(others, k))))
    return [list(c) for c in sorted(seen)]


def probe_plan(n_ctx: int, positions: PositionSpec) -> tuple[int | None, str | None]:
    """Tokens per copy of the repeated-token probe an ablation at ``positions`` runs, and why the
    repeated-token losses are left out (``None``: they are measured).

    :data:`PROBE_LENGTH` (or the longest probe the context holds); when the positions cannot change
    that probe's losses (an ablation acts at its positions and after; the last loss counted is
    predicted at position ``2 * length - 1``: ``--positions 100:`` on a 1 + 50 + 50-token probe), the
    longest probe the context holds, if they can change its; else no probe."""
    longest = (n_ctx - 1) // 2
    if longest < 2:
        return None, f"a context of {n_ctx} tokens holds no repeated-token probe"

    def reaches(length: int) -> bool:
        try:
            at = resolve_positions(positions, 1 + 2 * length)
        except QkovError:  # an index beyond the probe
            return False
        return at is None or bool((at <= 2 * length - 1).any())

    for length in dict.fromkeys([min(PROBE_LENGTH, longest), longest]):
        if reaches(length):
            return length, None
    return None, (
        f"the ablated positions ({describe_positions(positions)}) lie after every loss of the longest "
        f"repeated-token probe the context holds (1 + 2 x {longest} tokens; its last loss is predicted at "
        f"position {2 * longest - 1})"
    )


def _probe_tokens(w: WeightSource, bos: int, seed: int, length: int | None = None) -> Tensor:
    cfg = w.cfg
    length = min(PROBE_LENGTH if length is None else length, (cfg.n_ctx - 1) // 2)  # as induction_probe caps it
    vocab = w if getattr(w, "tokenizer", None) is not None else cfg.d_vocab  # its ordinary tokens, where it has them
    return induction_probe_tokens(vocab, length=length, repeats=2, batch=8, seed=seed, bos=bos)
