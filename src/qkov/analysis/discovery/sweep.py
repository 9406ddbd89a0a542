"""Edge attribution as a sweep of the patching study: ``qkov patch --edge-attribution``, the explorer's
``patch`` view and ``patch_study(..., edge_attribution=True)`` score every edge of the model's graph by
EAP on the study's own contrast and metric (registered here, off by default).

On a contrast, EAP runs in the study's direction: the base run's gradient at every receiver times each
sender's change from the base run to the source run (noising: the clean run, changes to the corrupted
values; denoising, the study's default: the corrupted run, changes to the clean values). The result is
an :class:`~.scores.EdgeScores` (a patching result with an ``edge`` axis): the metric after each edge's
patch, estimated. ``qkov circuit`` finds and checks a circuit from such scores.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ...weights.convert import SourceLike, as_source
from ..causal.contrast import Contrast
from ..causal.registry import Option, StudyRun, Sweep, register_sweep
from ..causal.result import PatchResult
from .ablations import Ablation, sender_deltas, sender_sites
from .grads import accumulate, fast_grads, fast_sites
from .graph import graph_of
from .scores import EdgeScores

__all__ = ["contrast_edge_scores", "EDGE_SWEEP"]


def contrast_edge_scores(
    source: SourceLike, clean: Tensor, corrupted: Tensor, *, metric: Any = None, direction: str = "denoise"
) -> EdgeScores:
    """EAP of every edge on one contrast (see the module docstring): ``values [E]``, the metric after
    each edge's patch, estimated to first order."""
    w = as_source(source, where="qkov.analysis.discovery.contrast_edge_scores")
    g = graph_of(w.cfg)
    c = Contrast.of(w, clean, corrupted, metric=metric, direction=direction, where="edge attribution")
    c.record(sender_sites(g), base_only=fast_sites(g, w.norm), grad=True)
    c.backward()
    scores = torch.zeros(len(g.senders), len(g.receivers), dtype=torch.float64, device=w.device)
    delta = sender_deltas(Ablation("corrupted"), c.base_recording, c.source_recording, w, g)  # type: ignore[arg-type]
    accumulate(scores, delta, fast_grads(c.base_recording, w, g), g)  # type: ignore[arg-type]
    values = c.base_value + scores[g.src, g.dst].cpu()
    return EdgeScores(
        "eap", "edges", ("edge",), values, c.clean_value, c.corrupted_value, direction, c.metric.name,
        {"edge": list(g.names)}, graph=g, ablation="corrupted", prompts=int(c.clean.shape[0]),
    )  # fmt: skip


def _edge_sweep(study: StudyRun) -> list[PatchResult]:
    return [contrast_edge_scores(**study.inputs())]


EDGE_SWEEP = register_sweep(
    Sweep(
        "edges",
        "every edge of the model's graph scored by edge attribution patching (EAP)",
        _edge_sweep,
        options=(
            Option(
                "edge_attribution", False, "score every edge of the model's graph by EAP (qkov circuit finds a circuit)"
            ),
        ),
        when=lambda o: bool(o["edge_attribution"]),
    )
)
