"""The composition graph and the term effects of ``qkov explore``.

* ``composition`` {} — every pair of heads in increasing layers, Q/K/V: :func:`qkov.composition_scores`
  (raw scores and each kind's random-matrix baseline), computed once per model and kept in memory;
  the page filters the edges by threshold, which starts at ``default_threshold`` (:func:`default_threshold`:
  the :data:`GRAPH_EDGES` strongest edges above their baselines).
* ``terms`` {text, position} — the path expansion of the text (:func:`qkov.analysis.paths.expansion.expand`, patterns,
  normalisation divisors and MLP outputs frozen at the real forward pass), then the loss change at one
  position when each term is removed: the direct path (token and position embeddings), every single
  head (:func:`~qkov.analysis.paths.effects.term_effects`) and the largest virtual heads (the same
  :func:`~qkov.analysis.paths.virtual.select_virtual` choice ``qkov paths`` makes). ``position`` is the position
  whose prediction of the next token is measured (the ``text`` view's ``loss[position]``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ...analysis.circuits.composition import KINDS, composition_scores
from ...analysis.forward.frozen import read
from ...analysis.paths.expansion import VIRTUAL_AUTO_MAX, expand, virtual_pairs
from ...analysis.paths.effects import term_effects
from ...analysis.paths.virtual import select_virtual
from ...progress import Progress
from .context import BadRequest, Explorer
from .views_card import int_arg, r6

__all__ = ["composition", "default_threshold", "GRAPH_EDGES", "terms", "TOP_VIRTUAL"]

GRAPH_EDGES = 24
"""Edges the composition graph shows at first: the strongest ones above their kind's random baseline (a graph
of every pair above the baseline is a hairball: hundreds of edges on a model of a few layers)."""

TOP_VIRTUAL = 10
"""Virtual-head terms listed by ``terms`` by default (the largest over the text, as ``qkov paths``)."""


def _scores_of(ex: Explorer, progress: Progress) -> Any:
    """:func:`qkov.composition_scores` of the model (``"qkv"``), computed once and kept in ``ex.extra``."""
    if "composition" not in ex.extra:
        ex.extra["composition"] = composition_scores(ex.weights, "qkv", progress=progress)
    return ex.extra["composition"]


def composition(ex: Explorer, args: dict[str, Any], progress: Progress) -> dict[str, Any]:
    """Every head pair's raw Q/K/V composition score beside its kind's baseline (mean over random weights)."""
    cfg = ex.cfg
    L, H = cfg.n_layers, cfg.n_heads
    scores = _scores_of(ex, progress)
    edges, baselines = [], {}
    for kind in KINDS:
        c = scores.kinds[kind]
        baselines[kind] = {"mean": r6(c.baseline.mean), "std": r6(c.baseline.std), "samples": c.baseline.samples}
        raw = c.raw.float().cpu()
        for l1 in range(L):
            for h1 in range(H):
                block = raw[l1, h1, l1 + 1 :].tolist()  # [later layers, H]
                for i, row in enumerate(block):
                    edges += [{"src": f"{l1}.{h1}", "dst": f"{l1 + 1 + i}.{h2}", "kind": kind, "value": r6(v),
                               "baseline": baselines[kind]["mean"]} for h2, v in enumerate(row)]  # fmt: skip
    return {
        "heads": [f"{l}.{h}" for l in range(L) for h in range(H)],
        "edges": edges,
        "baselines": baselines,
        "default_threshold": default_threshold(edges),
        "default_edges": GRAPH_EDGES,
    }


def default_threshold(edges: list[dict[str, Any]], most: int = GRAPH_EDGES) -> float:
    """The graph's first threshold: the score of the ``most``-th strongest edge among those at or above their
    kind's baseline mean (``edge["baseline"]``), so at most ``most`` edges show (more only on a tie), none below
    its baseline; with none above its baseline, the largest score (the strongest edge alone)."""
    above = sorted((e["value"] for e in edges if e["value"] is not None and e["value"] >= e["baseline"]), reverse=True)
    if above:
        return float(above[min(most, len(above)) - 1])
    return max((float(e["value"]) for e in edges if e["value"] is not None), default=0.0)


def _position(args: dict[str, Any], seq: int) -> int:
    """``args["position"]``: a position with a next token (``0 .. seq - 2``; negative counts from ``seq - 1``)."""
    value = args.get("position")
    if not isinstance(value, int) or isinstance(value, bool) or not -(seq - 1) <= value < seq - 1:
        raise BadRequest(f"'position' must be an integer in 0 .. {seq - 2} (a position with a next token), got {value!r}")
    return value % (seq - 1)


def terms(ex: Explorer, args: dict[str, Any], progress: Progress) -> dict[str, Any]:
    """Loss change at ``position`` (nats; positive: the term helps predict the next token) from removing
    the direct path, each head's term and the ``top`` largest virtual heads' terms."""
    ids = ex.tokens(args)
    if ids.shape[1] < 2:
        raise BadRequest("'text' needs at least 2 tokens: a position and the token it predicts")
    position = _position(args, ids.shape[1])
    top = int_arg(args, "top", TOP_VIRTUAL, 0, 100)
    w = ex.weights
    with torch.no_grad():
        exp = expand(w, ids.to(w.device), progress=progress)
        coverage = None
        if virtual_pairs(w) > 0 and top > 0:
            exp.virtual, coverage = select_virtual(
                w, exp.recording, exp.heads, exp.orders[2], most=VIRTUAL_AUTO_MAX, keep=top, progress=progress
            )
        at = torch.tensor([[0, position]], device=w.device)
        effects = term_effects(exp, top_virtual=top, positions=at, progress=progress)
        direct, loss = _direct(exp, position, ids.to(w.device))
    rows = [{"term": "direct", "kind": "direct", "effect": r6(direct), "size": None}]
    rows += [{"term": e.name, "kind": "head", "effect": r6(e.loss_change), "size": r6(e.size)} for e in effects.singles]
    rows += [{"term": e.name, "kind": "virtual", "effect": r6(e.loss_change), "size": r6(e.size)} for e in effects.virtual]
    return {
        "position": position,
        "token": ex.decode(int(ids[0, position])),
        "next": ex.decode(int(ids[0, position + 1])),
        "loss": r6(loss),
        "rows": rows,
        "virtual_coverage": None if coverage is None else coverage.to_dict(),
        "reconstruction_error": r6(exp.reconstruction_error()),
    }


def _direct(exp: Any, t: int, ids: torch.Tensor) -> tuple[float, float]:
    """The loss change at position ``t`` from removing the direct path (order 0), and the loss there;
    logits read at ``t`` as :func:`~qkov.analysis.paths.effects.term_effects` reads them."""
    scale, W_U, b_U = exp.recording.divisor("final"), exp.source.unembed().W_U, exp.source.unembed().b_U

    def logits_of(x: torch.Tensor) -> torch.Tensor:  # [1, V]
        return read(x[:, t][:, None], exp.source.norm, None if scale is None else scale[:, t][:, None])[:, 0] @ W_U

    full = logits_of(sum(exp.orders, torch.zeros_like(exp.bias)) + exp.bias + exp.mlp) + b_U
    target = ids[:, t + 1]
    base = float(F.cross_entropy(full.double(), target))
    return float(F.cross_entropy((full - logits_of(exp.orders[0])).double(), target)) - base, base
