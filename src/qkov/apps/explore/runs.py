"""A text's clean run in ``qkov explore``, made once and shared by every view that reads the same text.

:func:`clean_run` runs :func:`qkov.trace` on the folded weights over a text's ids and keeps what the views
read: the next-token loss at each position, the top predictions at each position and, when it fits
:data:`STREAM_BYTES`, the residual stream entering every layer. The session keeps the last :data:`KEEP`
texts' runs (:class:`Runs`, most recent first; the weights never change during a session, so a run is a
function of the ids alone). The ``text`` view reads the losses and predictions; ``ablate`` takes its
"before" from the run and starts the ablated pass at the first ablated layer from the kept stream
(nothing before that layer changes); ``attention`` computes one layer's pattern from the stream entering
it. Each gives the values a pass from the first token gives, bit for bit (tested).
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ...analysis.forward.tracer import trace
from ...progress import Progress
from .context import Explorer, r6

__all__ = [
    "CleanRun", "clean_run", "KEEP", "kept_run", "layer_ticks", "pattern_of", "Runs", "scored", "STREAM_BYTES", "TOP_K", "top_tokens",
]  # fmt: skip

TOP_K = 5
"""Next-token predictions listed per position."""
KEEP = 4
"""Texts whose clean runs a session keeps."""
STREAM_BYTES = 64 * 2**20
"""The most a kept run's streams may take (GPT-2 small at 1024 tokens: 36 MiB); a longer run keeps none."""


def top_tokens(ex: Explorer, logprobs: Tensor, k: int = TOP_K) -> list[list[dict[str, Any]]]:
    """The ``k`` most likely next tokens at each position of ``logprobs [seq, d_vocab]``, with their probabilities."""
    values, ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
    return [
        [{"token": ex.decode(int(i)), "id": int(i), "p": r6(math.exp(float(v)))} for v, i in zip(vs, row)]
        for vs, row in zip(values.tolist(), ids.tolist())
    ]


def scored(ex: Explorer, logits: Tensor, ids: Tensor) -> tuple[Tensor, list[list[dict[str, Any]]]]:
    """The next-token loss ``[seq - 1]`` of ``ids [1, seq]`` and the top predictions at each position, from
    ``logits [1, seq, d_vocab]`` through one log-softmax (float32; the loss as :func:`qkov.model.ops.next_token_nll`)."""
    logprobs = torch.log_softmax(logits[0].float(), dim=-1)
    nll = -logprobs[:-1].gather(-1, ids[0, 1:, None].to(logprobs.device))[:, 0]
    return nll.cpu(), top_tokens(ex, logprobs)


@dataclass(frozen=True)
class CleanRun:
    """A text's run: ``nll [seq - 1]`` (position ``i`` predicting token ``i + 1``), ``top`` (:func:`top_tokens`
    at each position) and ``streams [n_layers, 1, seq, d_model]`` (``resid_pre`` of every layer; ``None``
    when they would take more than :data:`STREAM_BYTES`)."""

    nll: Tensor
    top: list[list[dict[str, Any]]]
    streams: Tensor | None

    def stream(self, layer: int) -> tuple[int, Tensor] | None:
        """``(layer, stream [1, seq, d_model])`` to start a pass at ``layer`` (``trace(start_at=...)``), or
        ``None`` when the run kept no streams."""
        return None if self.streams is None else (layer, self.streams[layer])


class Runs:
    """The clean runs a session keeps, by the text's ids (at most :data:`KEEP`, the least recently used
    dropped first); safe to share between the server's worker threads."""

    def __init__(self, keep: int = KEEP) -> None:
        self.keep = keep
        self._runs: OrderedDict[tuple[int, ...], CleanRun] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple[int, ...]) -> CleanRun | None:
        with self._lock:
            run = self._runs.get(key)
            if run is not None:
                self._runs.move_to_end(key)
            return run

    def put(self, key: tuple[int, ...], run: CleanRun) -> None:
        with self._lock:
            self._runs[key] = run
            self._runs.move_to_end(key)
            while len(self._runs) > self.keep:
                self._runs.popitem(last=False)


def _runs(ex: Explorer) -> Runs:
    return ex.extra.setdefault("runs", Runs())  # type: ignore[no-any-return]


def kept_run(ex: Explorer, ids: Tensor) -> CleanRun | None:
    """The session's run of ``ids [1, seq]`` if it has one (nothing is computed)."""
    return _runs(ex).get(tuple(ids[0].tolist()))


def layer_ticks(ex: Explorer, progress: Progress | None, upto: int | None = None) -> dict[str, Any]:
    """Edits for :func:`qkov.trace` that report ``("reading layer l of L from disk", l, layers)`` to ``progress``
    as each layer starts (observers: they change nothing), in a streamed session only, where a pass reads each
    layer from disk (a second or more each); ``upto``: the pass stops at that layer. ``{}`` otherwise."""
    if progress is None or not ex.streamed or not ex.cfg.n_layers:
        return {}
    total = ex.cfg.n_layers if upto is None else upto + 1

    def tick(value: Tensor, site: Any) -> Tensor:
        progress(f"reading layer {site.layer} of {ex.cfg.n_layers} from disk", site.layer, total)
        return value

    return {f"resid_pre.{layer}": tick for layer in range(total)}


def clean_run(ex: Explorer, ids: Tensor, progress: Progress | None = None) -> CleanRun:
    """The clean run of ``ids [1, seq]`` (:class:`CleanRun`): the session's, or made now and kept
    (``progress``: told of each layer in a streamed session, :func:`layer_ticks`)."""
    key = tuple(ids[0].tolist())
    run = _runs(ex).get(key)
    if run is not None:
        return run
    w = ex.weights
    cfg, T = w.cfg, ids.shape[1]
    keep = cfg.residual == "sum" and cfg.n_layers * T * cfg.d_model * torch.empty(0, dtype=w.dtype).element_size() <= STREAM_BYTES
    ids = ids.to(w.device)
    out = trace(w, ids, cache=["resid_pre.*"] if keep and cfg.n_layers else [], edits=layer_ticks(ex, progress))
    nll, top = scored(ex, out.logits, ids)
    run = CleanRun(nll=nll, top=top, streams=out.stack("resid_pre") if keep and cfg.n_layers else None)
    _runs(ex).put(key, run)
    return run


def pattern_of(ex: Explorer, ids: Tensor, layer: int, head: int, progress: Progress | None = None) -> Tensor:
    """Head ``layer.head``'s attention pattern ``[query, key]`` on ``ids [1, seq]`` (:func:`qkov.trace`): from
    the stream entering ``layer`` when the session keeps the text's run (one layer read), else from the first
    token; the pass stops at the pattern (no later layer, no unembedding). ``progress``: told of each layer
    of a pass from the first token in a streamed session (:func:`layer_ticks`)."""
    w = ex.weights
    run = kept_run(ex, ids)
    start = None if run is None else run.stream(layer)
    ticks = layer_ticks(ex, progress, upto=layer) if start is None else {}
    with torch.no_grad():
        out = trace(w, ids.to(w.device), cache=[f"pattern.{layer}"], start_at=start, logits=False, edits=ticks)
    return out["pattern", layer][0, head].float().cpu()
