"""Interventions: what changes when activations are removed, replaced or patched.

:mod:`.metrics` what an experiment measures; :mod:`.positions` where it intervenes; :mod:`.ablation`
head ablation; :mod:`.patching` activation and attribution patching; :mod:`.path_patch` path
patching; :mod:`.composition` [F]'s composition checked causally; :mod:`.studies` the sweeps run
first on a clean/corrupted pair.
"""

from __future__ import annotations

from .metrics import as_metric, Attention, ICLWindows, LogitDiff, Loss, Metric, OfLogits, parse_metric, Prob
from .positions import describe_positions, parse_positions, PositionSpec, resolve_positions
from .ablation import (
    ablation_budget,
    ablation_edits,
    ablation_study,
    ablation_sweep,
    AblationStudy,
    AblationSweep,
    Chunks,
    derangement,
    Measures,
    measures,
    measures_left_out,
    MODES,
    parse_heads,
    PROBE_LENGTH,
    probe_plan,
    random_sets,
    sequence_losses,
    ablation_text,
    z_means,
)
from .patching import (
    activation_patching,
    agreement,
    attribution_patching,
    batched,
    copy_bytes,
    default_axes,
    DIRECTIONS,
    largest,
    metric_values,
    pair,
    PATCH_BYTES,
    PatchResult,
    reads_from,
    result_text,
    scalar,
)
from .path_patch import input_paths, INPUTS, path_patching
from .composition import composition_paths, composition_paths_text, CompositionPaths, ICL_CHUNK
from .studies import patch_study, PatchStudy, patch_study_text
from .call_forms import ablation_args

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
    "parse_heads",
    "PROBE_LENGTH",
    "probe_plan",
    "random_sets",
    "sequence_losses",
    "ablation_text",
    "z_means",
    "activation_patching",
    "agreement",
    "attribution_patching",
    "batched",
    "copy_bytes",
    "default_axes",
    "DIRECTIONS",
    "largest",
    "metric_values",
    "pair",
    "PATCH_BYTES",
    "PatchResult",
    "reads_from",
    "result_text",
    "scalar",
    "input_paths",
    "INPUTS",
    "path_patching",
    "composition_paths",
    "composition_paths_text",
    "CompositionPaths",
    "ICL_CHUNK",
    "patch_study",
    "PatchStudy",
    "patch_study_text",
    "ablation_args",
]
