"""Interventions: what changes when activations are removed, replaced or patched.

:mod:`.metrics` what an experiment measures; :mod:`.positions` where it intervenes; :mod:`.ablation`
head ablation, :mod:`.sweep` every head ablated alone. The causal toolkit every patching method is built on: :mod:`.result` (a result with
named axes), :mod:`.contrast` (a clean/corrupted pair, its two runs and the batched patched passes),
:mod:`.registry` (the sweeps a study runs and every surface shows). The methods: :mod:`.patching`
activation and attribution patching; :mod:`.path_patch` path patching; :mod:`.composition` [F]'s
composition checked causally; :mod:`.studies` the registered sweeps run on a clean/corrupted pair.
docs/dev/plugging-in.md shows how a new method plugs in.
"""

from __future__ import annotations

from .metrics import as_metric, Attention, ICLWindows, LogitDiff, Loss, Metric, OfLogits, parse_metric, Prob
from .positions import describe_positions, parse_positions, PositionSpec, resolve_positions
from .sweep import ablation_sweep, AblationSweep
from .ablation import (
    ablation_budget,
    ablation_edits,
    ablation_study,
    AblationStudy,
    Chunks,
    derangement,
    Measures,
    measures,
    measures_left_out,
    MODES,
    PROBE_LENGTH,
    probe_plan,
    random_sets,
    sequence_losses,
    ablation_text,
    z_means,
)
from .result import agreement, by_direction, largest, PatchResult, result_text
from .contrast import Contrast, copy_bytes, DIRECTIONS, PATCH_BYTES
from .registry import Needs, Option, register_sweep, study_options, StudyRun, Sweep, SWEEPS
from .patching import (
    activation_patching,
    activation_sites,
    attribution_patching,
    default_axes,
    patch_activations,
    patch_attribution,
    study_axes,
)
from .path_patch import input_paths, patch_paths, path_patching, path_sites, receivers_of
from .composition import composition_paths, composition_paths_text, CompositionPaths, ICL_CHUNK, k_path_share, KPathShare
from .studies import patch_study, PatchStudy, patch_study_text

__all__ = [
    "as_metric",
    "Attention",
    "ICLWindows",
    "LogitDiff",
    "Loss",
    "Metric",
    "OfLogits",
    "parse_metric",
    "Prob",
    "describe_positions",
    "parse_positions",
    "PositionSpec",
    "resolve_positions",
    "ablation_budget",
    "ablation_edits",
    "ablation_study",
    "ablation_sweep",
    "AblationStudy",
    "AblationSweep",
    "Chunks",
    "derangement",
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
    "agreement",
    "by_direction",
    "largest",
    "PatchResult",
    "result_text",
    "Contrast",
    "copy_bytes",
    "DIRECTIONS",
    "PATCH_BYTES",
    "Needs",
    "Option",
    "register_sweep",
    "study_options",
    "StudyRun",
    "Sweep",
    "SWEEPS",
    "activation_patching",
    "activation_sites",
    "attribution_patching",
    "default_axes",
    "patch_activations",
    "patch_attribution",
    "study_axes",
    "input_paths",
    "patch_paths",
    "path_patching",
    "path_sites",
    "receivers_of",
    "composition_paths",
    "composition_paths_text",
    "CompositionPaths",
    "ICL_CHUNK",
    "k_path_share",
    "KPathShare",
    "patch_study",
    "PatchStudy",
    "patch_study_text",
]
