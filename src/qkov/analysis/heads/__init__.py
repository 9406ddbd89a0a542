"""What each head does, measured on behaviour [F, I].

:mod:`.probes` the repeated-random-token probe and the in-context-learning score; :mod:`.repeated`
the scores on repeated tokens (prefix matching, induction, copying); :mod:`.pattern_scores` the
scores read from attention patterns on text (previous token, sinks, positional fraction), streamed;
:mod:`.report` the head report: detectors, thresholds and roles.
"""

from __future__ import annotations

from .probes import (
    default_icl_examples,
    ICL_FLOPS,
    ICL_LATE,
    icl_left_out,
    icl_score,
    ICL_SHORTEST,
    ICL_TOKENS,
    icl_windows,
    ICLScore,
    induction_attention,
    induction_probe,
    induction_probe_tokens,
    InductionProbe,
    LOGIT_BYTES,
    NOT_TEXT,
    prefix_matching_tokens,
    probe_text,
    random_ids,
    token_pool,
)
from .repeated import COPYING_LOGITS, copying_queries, earlier_same, repeat_bytes, repeat_scores, RepeatScores
from .pattern_scores import (
    chunk_size,
    LayerView,
    LayerWatch,
    positional_fraction,
    previous_token_scores,
    self_attention_scores,
    sequence_bytes,
    sink_scores,
    TEXT_CHUNK_BYTES,
    text_scores,
    value_weighted_sink_scores,
)
from .report import (
    assign_roles,
    head_report,
    HeadReport,
    heads_text,
    memory_neurons,
    POSITIONAL_NA,
    ROLES,
    SCORE_COLUMNS,
    THRESHOLDS,
)

__all__ = [
    "default_icl_examples",
    "ICL_FLOPS",
    "ICL_LATE",
    "icl_left_out",
    "icl_score",
    "ICL_SHORTEST",
    "ICL_TOKENS",
    "icl_windows",
    "ICLScore",
    "induction_attention",
    "induction_probe",
    "induction_probe_tokens",
    "InductionProbe",
    "LOGIT_BYTES",
    "NOT_TEXT",
    "prefix_matching_tokens",
    "probe_text",
    "random_ids",
    "token_pool",
    "COPYING_LOGITS",
    "copying_queries",
    "earlier_same",
    "repeat_bytes",
    "repeat_scores",
    "RepeatScores",
    "chunk_size",
    "LayerView",
    "LayerWatch",
    "positional_fraction",
    "previous_token_scores",
    "self_attention_scores",
    "sequence_bytes",
    "sink_scores",
    "TEXT_CHUNK_BYTES",
    "text_scores",
    "value_weighted_sink_scores",
    "assign_roles",
    "head_report",
    "HeadReport",
    "heads_text",
    "memory_neurons",
    "POSITIONAL_NA",
    "ROLES",
    "SCORE_COLUMNS",
    "THRESHOLDS",
]
