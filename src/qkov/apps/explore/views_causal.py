"""Interventions in ``qkov explore``: ablate heads on a text, patch between two texts.

* ``ablate`` {text, heads, mode} — the edits of :func:`qkov.analysis.causal.ablation.ablation_edits` (``zero``: the
  heads write nothing; ``mean``: each writes its mean output over every position of this text,
  :func:`~qkov.analysis.causal.ablation.z_means`), run by :func:`qkov.trace`: the loss per token and the top
  predictions before (the text's clean run, shared with the text view) and after (a pass started at the
  first ablated layer from the clean run's stream there). The mean loss is what ``qkov ablate SOURCE
  --heads ... --mode ...`` reports for this text as its validation sample (:func:`qkov.ablation_study`'s ``intact`` / ``ablated`` loss; tested).
* ``patch`` {clean, corrupted, metric?, ...} — :func:`qkov.analysis.causal.studies.patch_study` with ``qkov
  patch``'s defaults: activation patching of the residual stream by (layer, position) and of every head's
  output by (layer, head), attribution patching of the head outputs and its agreement; ``metric`` as ``qkov
  patch --metric`` writes it (``loss``, ``logit-diff:A,B``, ``prob:T``). Any registered sweep's option
  (:func:`~qkov.analysis.causal.registry.study_options`: ``sites``, ``by_pos``, ``attribution``,
  ``receivers``, ``input``, ...) may be given by name, as text or a JSON value.
"""

from __future__ import annotations

from typing import Any

import torch

from ...analysis.causal.ablation import ablation_edits, z_means
from ...analysis.forward.tracer import trace
from ...analysis.causal.metrics import parse_metric
from ...analysis.causal.registry import study_options
from ...analysis.causal.studies import patch_study
from ...analysis.forward.address import Address, parse_heads
from ...errors import QkovError
from ...finite import json_safe
from ...progress import Progress
from .context import BadRequest, Explorer
from .runs import TOP_K, clean_run, scored
from .views_card import r6

__all__ = ["ablate", "MODES", "patch", "TOP_K"]

MODES = ("zero", "mean")


def _heads(ex: Explorer, args: dict[str, Any]) -> list[Address]:
    """``args["heads"]``: heads as ``"1.0,1.3"`` or a list (``"L.H"`` or ``[L, H]``), read by the one head
    parser, in order, once each: 400 when malformed or none, 404 for a head the model lacks."""
    value = args.get("heads")
    try:
        if not isinstance(value, (str, list)):
            raise QkovError(f"'heads' must be a non-empty list of heads like [\"1.3\"], got {value!r}")
        heads = parse_heads(value, what="'heads'")
    except QkovError as exc:
        raise BadRequest(str(exc)) from None
    try:
        return [h.check(ex.cfg, "'heads'") for h in heads]
    except QkovError as exc:
        raise BadRequest(str(exc), status=404) from None


def ablate(ex: Explorer, args: dict[str, Any], progress: Progress) -> dict[str, Any]:
    """The text's loss per token and top predictions, intact and with ``heads`` ablated (``mode``). The intact
    ones are the text's clean run (:func:`~qkov.apps.explore.runs.clean_run`, the session's when the text view
    made it); the ablated pass starts at the first ablated layer from the run's stream there."""
    ids = ex.tokens(args).to(ex.weights.device)
    heads = _heads(ex, args)
    mode = args.get("mode", "zero")
    if mode not in MODES:
        raise BadRequest(f"'mode' must be one of {', '.join(MODES)}, got {mode!r}")
    if ids.shape[1] < 2:
        raise BadRequest("'text' needs at least 2 tokens to have a loss")
    progress("ablate", 0, 2)
    run = clean_run(ex, ids, progress)
    progress("ablate", 1, 2)
    means = z_means(ex.weights, ids, heads) if mode == "mean" else None
    start = run.stream(min(h.layer for h in heads))  # type: ignore[type-var]
    with torch.no_grad():
        logits = trace(ex.weights, ids, edits=ablation_edits(heads, mode, means=means), start_at=start).logits
    after_nll, top_after = scored(ex, logits, ids)
    before, after = run.nll.tolist(), after_nll.tolist()
    progress("ablate", 2, 2)
    return {
        "heads": [h.name for h in heads],
        "mode": mode,
        "mean_sample": f"every position of this text ({ids.shape[1]} tokens)" if mode == "mean" else None,
        "loss_before": [r6(v) for v in before] + [None],
        "loss_after": [r6(v) for v in after] + [None],
        "mean_before": r6(sum(before) / len(before)),
        "mean_after": r6(sum(after) / len(after)),
        "top_before": run.top,
        "top_after": top_after,
    }


def patch(ex: Explorer, args: dict[str, Any], progress: Progress) -> dict[str, Any]:
    """``qkov patch``'s default study of ``clean`` against ``corrupted`` (two texts of the same length)."""
    clean, corrupted = ex.tokens(args, "clean"), ex.tokens(args, "corrupted")
    if clean.shape != corrupted.shape:
        raise BadRequest(
            f"'clean' and 'corrupted' must have the same number of tokens, got {clean.shape[1]} and {corrupted.shape[1]}"
        )
    metric = args.get("metric", "loss")
    if metric is not None and not isinstance(metric, str):
        raise BadRequest(f"'metric' must be a string (loss, logit-diff:A,B or prob:T), got {metric!r}")
    dev = ex.weights.device
    clean, corrupted = clean.to(dev), corrupted.to(dev)
    try:
        m = parse_metric(metric, clean, ex.codec, ex.cfg.d_vocab)
        options = {name: opt.value(args[name]) for name, opt in study_options().items() if args.get(name) is not None}
    except QkovError as exc:
        raise BadRequest(str(exc)) from None
    study = patch_study(ex.weights, clean, corrupted, metric=m, decode=ex.decode, progress=progress, **options)
    return json_safe(study.to_dict(), digits=6)
