"""A contrast: a clean and a corrupted input, and what every patching method needs from them.

Every causal method here compares two runs. :class:`Contrast` holds them once: the clean and
corrupted tokens (checked: valid ids, the same shape), the ``direction`` (``"denoise"``: the
corrupted tokens are the *base* run, patched with values from the clean *source* run;
``"noise"``: the other way round), the metric, both runs (each caching what the method asks and
what the metric reads) and the metric's value on each (:meth:`Contrast.ensure` records only when the
recordings lack a site asked: the sweeps of one study share one base and one source run; and
:meth:`Contrast.backward` takes the metric's gradient once for every method that reads it). It also runs the patched passes
(:meth:`Contrast.measure`): many patched copies of the base tokens in one forward pass, started at a
layer from the base recording's stream, one metric value per copy, and wraps the values in a
:class:`~qkov.analysis.causal.result.PatchResult` (:meth:`Contrast.result`).

The swap between (clean, corrupted) and (base, source) is written once
(:func:`~qkov.analysis.causal.result.by_direction`, which :meth:`Contrast.swap` and a result's
``base``/``target`` read).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import Tensor

from ...device import tune_allocator_for
from ...errors import QkovError
from ...model.tokens import check_tokens
from ...weights.convert import SourceLike, as_source
from ...weights.parts import WeightSource
from ..forward.cache import Trace, final_stream
from ..forward.sites import Sites
from ..forward.tracer import trace
from .metrics import Metric, as_metric
from .result import PatchResult, by_direction

__all__ = ["Contrast", "copy_bytes", "DIRECTIONS", "PATCH_BYTES"]

DIRECTIONS = ("denoise", "noise")
PATCH_BYTES = 256 * 2**20  # activations of the patched copies held at once (one batch)


def copy_bytes(source: WeightSource, tokens: Tensor, positions: Tensor | None) -> int:
    """Memory one patched copy of ``tokens [B, T]`` takes at its peak: a layer's activations and the
    logits at ``positions`` (every position for ``None``)."""
    c, (B, T) = source.cfg, tokens.shape
    P = T if positions is None else len(positions)
    per = T * (12 * c.d_model + 4 * c.n_heads * T + 3 * (c.d_mlp or 0)) + P * c.d_vocab
    return B * per * torch.empty(0, dtype=source.dtype).element_size()


@dataclass
class Contrast:
    """The clean and corrupted tokens ``[B, T]`` (on the weights' device), the ``direction``, the
    ``metric``; after :meth:`record`, the ``base_recording`` and ``source_recording`` and the metric on the clean
    and corrupted runs (``clean_value``, ``corrupted_value``)."""

    weights: WeightSource
    clean: Tensor
    corrupted: Tensor
    direction: str
    metric: Metric
    base_recording: Trace | None = None
    source_recording: Trace | None = None
    clean_value: float = math.nan
    corrupted_value: float = math.nan
    held: tuple[frozenset[Any], frozenset[Any], bool] | None = field(default=None, repr=False)  # what record() kept
    backed: bool = field(default=False, repr=False)  # the metric's gradient is in the base recording
    kept_terms: tuple[Trace, Tensor | None] | None = field(default=None, repr=False)  # the base run's metric terms

    @classmethod
    def of(
        cls,
        source: SourceLike,
        clean: Any,
        corrupted: Any,
        *,
        metric: Any = None,
        direction: str = "denoise",
        where: str = "patching",
    ) -> Contrast:
        """The contrast of ``clean`` and ``corrupted`` (``[B, T]`` token ids, the same shape) on
        ``source`` (a model, weights source or path), every argument checked before any work:
        ``metric`` (default: the loss on the clean tokens, :func:`~qkov.analysis.causal.metrics.as_metric`)
        and ``direction`` (``"denoise"`` or ``"noise"``); ``where`` begins the error messages."""
        w = as_source(source, where="qkov.Contrast.of")
        if direction not in DIRECTIONS:
            raise QkovError(f"{where}: direction must be denoise or noise, got {direction!r}")
        clean, corrupted = (check_tokens(t, w.cfg).to(w.device) for t in (clean, corrupted))
        if clean.shape != corrupted.shape:
            raise QkovError(
                f"{where}: the clean and corrupted tokens must have the same shape (same number of sequences and "
                f"tokens), got {list(clean.shape)} and {list(corrupted.shape)}"
            )
        return cls(w, clean, corrupted, direction, as_metric(metric, clean))

    # ------------------------------------------------------------------ the one swap
    def swap(self, clean: Any, corrupted: Any) -> tuple[Any, Any]:
        """``(clean, corrupted)`` in the order ``(base, source)``; the same call turns ``(base, source)``
        back into ``(clean, corrupted)``."""
        return by_direction(self.direction, clean, corrupted)

    @property
    def base(self) -> Tensor:
        """The tokens the patched passes run: the corrupted ones when denoising, the clean ones when noising."""
        return self.swap(self.clean, self.corrupted)[0]

    @property
    def source(self) -> Tensor:
        """The tokens the patched-in values come from."""
        return self.swap(self.clean, self.corrupted)[1]

    @property
    def base_value(self) -> float:
        """The metric with nothing patched."""
        return self.swap(self.clean_value, self.corrupted_value)[0]

    @property
    def positions(self) -> Tensor | None:
        """The logit positions the metric reads (``None``: every one)."""
        return self.metric.logit_positions(self.clean.shape[1])

    # ------------------------------------------------------------------ the two runs
    def record(self, cache: Sequence[Any] = (), *, base_only: Sequence[Any] = (), grad: bool = False) -> Contrast:
        """Run the base and source tokens, caching ``cache`` and what the metric reads (``base_only``:
        sites only the base recording caches; ``grad``: the base recording keeps its graph, for a backward pass),
        and measure the metric on both. Returns ``self``."""
        reads = list(self.metric.reads)
        self.base_recording = trace(
            self.weights, self.base, cache=[*cache, *base_only, *reads], positions=self.positions, grad=grad
        )
        self.source_recording = trace(self.weights, self.source, cache=[*cache, *reads], positions=self.positions)
        base, src = (self._value(r) for r in (self.base_recording, self.source_recording))
        self.clean_value, self.corrupted_value = self.swap(base, src)
        self.held, self.backed = (self._names([*cache, *reads]), self._names(base_only), grad), False
        return self

    def _value(self, recording: Trace) -> float:
        """The metric on a recording: for a sum over positions, its terms summed in float64, as the patched
        passes sum them (:meth:`measure`), so a patch that changes nothing gives the base value exactly."""
        if not self.metric.reads:
            terms = (
                self._base_terms() if recording is self.base_recording
                else self.metric.position_terms(recording.logits.detach(), self._every(), recording.tokens)
            )  # fmt: skip
            if terms is not None:
                return float(terms.sum(1).mean())
        return float(self.metric(recording).detach())

    def _names(self, keys: Sequence[Any]) -> frozenset[Any]:
        """The sites ``(kind, layer)`` that ``keys`` name."""
        return frozenset(a.site for a in Sites(self.weights.cfg, self.weights.norm).resolve_all(list(keys)))

    def ensure(self, cache: Sequence[Any] = (), *, base_only: Sequence[Any] = (), grad: bool = False) -> Contrast:
        """:meth:`record` unless the recordings hold every site asked already (and the base recording keeps its
        graph, when ``grad`` is asked): how the sweeps of one study share one base and one source run. The sites
        a recording holds beyond those asked change no value in it. Returns ``self``."""
        if self.held is not None:
            both, base, graph = self.held
            if self._names(cache) <= both and self._names(base_only) <= both | base and (graph or not grad):
                return self
        return self.record(cache, base_only=base_only, grad=grad)

    def backward(self) -> None:
        """The metric's gradient at every site the base recording cached (their ``.grad``), from one backward
        pass through a base recording made with ``grad``; later calls do nothing (the gradients are there)."""
        assert self.base_recording is not None, "Contrast.backward needs a base recording made with grad=True"
        if not self.backed:
            with torch.enable_grad():  # whatever the caller's mode: the recording kept its graph
                self.metric(self.base_recording).backward()
            self.backed = True

    @property
    def reads_from(self) -> int:
        """The first layer whose sites the metric reads (``n_layers`` if it reads none): a patched pass
        must start there or earlier."""
        sites = Sites(self.weights.cfg, self.weights.norm)
        layers = [a.layer for a in sites.resolve_all(self.metric.reads) if a.layer is not None]
        return min(layers, default=self.weights.cfg.n_layers)

    def copies(self, max_bytes: int = PATCH_BYTES, extra: int = 0) -> int:
        """How many patched copies of the base tokens one pass holds in ``max_bytes`` (each taking
        :func:`copy_bytes` and ``extra`` bytes); at least one."""
        return max(1, max_bytes // (copy_bytes(self.weights, self.base, self.positions) + extra))

    # ------------------------------------------------------------------ patched passes
    def measure(
        self,
        K: int,
        edits: dict[Any, Any] | None = None,
        *,
        start: int | None = None,
        stream: Tensor | None = None,
        tokens: Tensor | None = None,
        since: int = 0,
        past: tuple[Tensor, Tensor] | None = None,
        firsts: Sequence[int] | None = None,
    ) -> Tensor:
        """The metric on ``K`` copies of the base tokens in one forward pass: ``[K]``. ``edits``
        patch each copy its own way (copy ``k`` is rows ``k*B .. (k+1)*B`` of the batch); ``start``:
        begin at that layer from the base recording's stream (nothing before it changes), or from
        ``stream [K*B, T, D]``; ``tokens [K*B, T]``: run these instead of the copies (from the start).
        ``since``: no copy differs from the base run before this position (attention is causal: a patch
        changes nothing before the first position it writes), so the logits there are the base
        recording's and only the later positions are unembedded. ``past``: the base run's keys and values of
        those positions (``[L, B, since, K, E]`` each): the pass then runs the positions from ``since`` on only
        (every site and ``stream`` hold those; :func:`~qkov.analysis.forward.tracer.trace`'s ``past``).
        ``firsts``: each copy's own first change (``>= since``); for a metric that is a sum over positions
        (:meth:`~qkov.analysis.causal.metrics.Metric.position_terms`) each copy is then unembedded from its own
        first change on, the base run's terms before it."""
        B, T = self.base.shape
        tune_allocator_for(self.weights)
        tokens = self.base.repeat(K, 1) if tokens is None else tokens
        whole = tokens
        start_at = None
        if stream is not None and start is None:
            raise QkovError("Contrast.measure: a stream needs the layer it enters at (start=)")
        if start is not None and stream is None and self.weights.cfg.residual != "sum":
            start = None  # a routed model has no one stream to start from: the copies run from the start
        if start is not None:
            if stream is None:
                base = self.base_recording
                assert base is not None, "Contrast.measure(start=...) needs the base recording: call record() first"
                here = base[("resid_pre", start)] if start < self.weights.cfg.n_layers else final_stream(base)
                stream = here.detach().repeat(K, 1, 1)  # (a base recording made for a gradient keeps its graph)
            start_at = (start, stream)
        every = self.positions if self.positions is not None or since <= 0 else torch.arange(T)
        later = every if every is None else every[every >= since]
        f = 0 if past is None else past[0].shape[2]
        if past is not None:  # the suffix alone, after the base run's keys and values
            assert f == since and later is not None and not self.metric.reads, "a past needs since= and logits only"
            tokens = tokens[:, f:]  # (every copy reads the base run's past)
        into_logits = start_at is not None and start_at[0] >= self.weights.cfg.n_layers
        if firsts is not None and not (into_logits and edits) and self._ragged(firsts, since):
            return self._by_copy(K, firsts, tokens, whole, start_at, edits, past)
        head = None if self.metric.reads else self._base_terms()
        narrow = None if head is not None else self._narrowed(edits)  # (vocab, metric): a few logits read alone
        out = trace(
            self.weights, tokens, start_at=start_at, edits=edits, cache=self.metric.reads,
            positions=None if later is None else later - f, past=past, vocab=None if narrow is None else narrow[0],
        )  # fmt: skip
        if past is not None:
            out = Trace(whole, out.logits, out.cache, out.source, later)
        if head is not None:  # a sum over positions: the positions before `since` add the base run's terms
            at = self._every() if later is None else later
            return self._summed(out.logits, at, whole, head[:, : head.shape[1] - len(at)].sum(1), K)
        metric = self.metric if narrow is None else narrow[1]
        early = None
        if every is not None and len(later) < len(every):  # the earlier logits: the base recording's
            early = self.base_recording.logits[:, : len(every) - len(later)].detach()  # type: ignore[union-attr]
            early = early if narrow is None else early.index_select(-1, narrow[0].to(early.device))
        values = []
        for k in range(K):  # one copy at a time: its logits whole only while its metric is read
            copy = out.select(slice(k * B, (k + 1) * B))
            if early is not None:
                copy = Trace(copy.tokens, torch.cat([early, copy.logits], 1), copy.cache, copy.source, self.positions)
            values.append(metric(copy).detach())
        return torch.stack(values)

    def _narrowed(self, edits: dict[Any, Any] | None = None) -> tuple[Tensor, Metric] | None:
        """The metric's own narrowing (:meth:`~qkov.analysis.causal.metrics.Metric.narrowed`, asked each pass: a
        metric changed in place is read as it is now) once the base run has checked its ids against the
        vocabulary, when it reads no site, fewer entries than the vocabulary, and no edit writes the logits."""
        if self.metric.reads or self.base_recording is None:
            return None
        if edits and any(kind == "logits" for kind, _ in self._names(list(edits))):
            return None
        got = self.metric.narrowed()
        return None if got is None or len(got[0]) >= self.weights.cfg.d_vocab else got

    def _every(self) -> Tensor:
        """The positions the metric reads (every one when it names none)."""
        return self.positions if self.positions is not None else torch.arange(self.base.shape[1])

    def _ragged(self, firsts: Sequence[int], since: int) -> bool:
        """Whether a pass whose copies first change at ``firsts`` unembeds each copy from its own first change:
        some copy changes later than the pass starts, the metric is a sum over positions of the logits alone, and
        the stream is one sum (its last ``resid_post`` is the final stream)."""
        cfg = self.weights.cfg
        if not firsts or max(firsts) <= since or self.metric.reads or cfg.residual != "sum" or not cfg.n_layers:
            return False
        return self._base_terms() is not None

    def _by_copy(
        self, K: int, firsts: Sequence[int], tokens: Tensor, whole: Tensor, start_at: Any, edits: Any,
        past: tuple[Tensor, Tensor] | None,
    ) -> Tensor:  # fmt: skip
        """:meth:`measure` of ``K`` copies, each unembedded at the metric's positions from its own first change
        ``firsts[k]`` on (the earlier positions' terms: the base run's): the blocks in one pass, then the rows kept
        in one unembedding."""
        B, L, every = self.base.shape[0], self.weights.cfg.n_layers, self._every()
        f = 0 if past is None else past[0].shape[2]
        if start_at is not None and start_at[0] >= L:  # a pass into the logits (no edits): its stream is the final one
            x = start_at[1]
        else:
            out = trace(
                self.weights, tokens, start_at=start_at, edits=edits, cache=[f"resid_post.{L - 1}"],
                positions=every[:0], past=past,
            )  # fmt: skip
            x = out[("resid_post", L - 1)]  # [K*B, T - f, D]
        mine = [every[every >= max(first, f)] for first in firsts]
        D = x.shape[-1]
        rows = torch.cat([x[k * B : (k + 1) * B, (m - f).to(x.device)].reshape(-1, D) for k, m in enumerate(mine)])
        logits = None
        if len(rows):  # every copy's kept rows in one unembedding
            logits = trace(self.weights, whole.new_zeros(len(rows), 1), start_at=(L, rows[:, None])).logits[:, 0]
        head = self._base_terms()
        assert head is not None
        values, at = [], 0
        for k, m in enumerate(mine):
            n = len(every) - len(m)  # positions before this copy's first change: the base run's terms
            own = head[:, :n].sum(1)
            if logits is not None and len(m):
                part = logits[at : at + B * len(m)].view(B, len(m), -1)
                terms = self.metric.position_terms(part, m, whole[k * B : (k + 1) * B])
                assert terms is not None
                own = own + terms.sum(1)
                at += B * len(m)
            values.append(own.mean())
        return torch.stack(values)

    def _base_terms(self) -> Tensor | None:
        """The metric's terms at every position it reads (:meth:`_every`) of the base recording (``[B, P]``; None
        when the metric is not a sum over positions, or nothing is recorded), computed once per recording."""
        base = self.base_recording
        if base is None:
            return None
        if self.kept_terms is None or self.kept_terms[0] is not base:
            self.kept_terms = (base, self.metric.position_terms(base.logits.detach(), self._every(), self.base))
        return self.kept_terms[1]

    def _summed(self, logits: Tensor, later: Tensor, tokens: Tensor, head: Tensor, K: int) -> Tensor:
        """``[K]``: each copy's metric as the base run's terms before its pass (``head [B]``) plus its own terms at
        ``later`` positions (``logits [K*B, P, V]``), a few copies' log-softmax at a time."""
        B = head.shape[0]
        step = max(1, (16 * 2**20) // max(1, B * logits[0].numel() * logits.element_size()))  # copies at a time
        sums = []
        for k in range(0, K, step):
            rows = slice(k * B, (k + step) * B)
            terms = self.metric.position_terms(logits[rows], later, tokens[rows])
            assert terms is not None
            sums.append(terms.sum(1))
        return (torch.cat(sums).view(K, B) + head.to(logits.device)).mean(1)

    def passes(self, firsts: Sequence[int], K: int) -> list[tuple[int, list[int]]]:
        """The patched passes of copies whose changes begin at positions ``firsts`` (the sequence length: the
        copy changes nothing, and its metric is the base run's): ``(since, copies)`` each, at most ``K`` copies
        a pass, those whose changes begin near each other together, ``since`` the earliest change among them
        (:meth:`measure`'s ``since``)."""
        T = self.base.shape[1]
        order = sorted((i for i, f in enumerate(firsts) if f < T), key=lambda i: (firsts[i], i))
        return [(firsts[order[lo]], order[lo : lo + K]) for lo in range(0, len(order), K)]

    def result(
        self, method: str, site: str, axes: Sequence[str], values: Tensor, labels: dict[str, list[str]] | None = None
    ) -> PatchResult:
        """``values`` (shaped by ``axes``) as a result of this contrast: its clean and corrupted
        metric values, direction and metric name."""
        return PatchResult(
            method, site, tuple(axes), values, self.clean_value, self.corrupted_value, self.direction,
            self.metric.name, dict(labels or {}),
        )  # fmt: skip
