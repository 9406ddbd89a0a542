"""The exact path expansion [F]: with patterns, normalisation divisors and MLP outputs frozen at a
real pass (:mod:`qkov.analysis.forward.frozen`), the logits are a sum of path terms.

:mod:`.importance` the paper's term importance and the loss; :mod:`.virtual` which virtual-head
(order-2) terms to materialise; :mod:`.expansion` the expansion itself; :mod:`.effects` the loss
change when one term is removed; :mod:`.summary` the ``qkov paths`` report; :mod:`.qk_side` the
same expansion of one head's pre-softmax scores; :mod:`.routed` the expansion through a routed
residual stream's frozen routes.
"""

from __future__ import annotations

from .importance import heads_write, lm_loss, loss, rms, term_importance, TermImportance
from .routed import expand_routed, routed_runs, routing_coefficients
from .virtual import Key, materialize, select_virtual, virtual_bounds, virtual_keys, VirtualCoverage
from .expansion import (
    BATCH_TOKENS,
    default_batch,
    expand,
    Expansion,
    paths_batch,
    PASS_FLOPS,
    VIRTUAL_AUTO_MAX,
    virtual_pairs,
)
from .effects import (
    EFFECT_LOGITS,
    effect_positions,
    GRAM_COLUMNS,
    head_read,
    head_unembed,
    head_values,
    SampledTerms,
    term_effects,
    term_effects_text,
    term_logits,
    TermEffect,
    TermEffects,
    unembed_gram,
)
from .summary import expansion_bytes, paths_text, PathSummary, summarize
from .qk_side import expand_qk, QKExpansion

__all__ = [
    "heads_write",
    "lm_loss",
    "loss",
    "rms",
    "term_importance",
    "TermImportance",
    "Key",
    "materialize",
    "select_virtual",
    "virtual_bounds",
    "virtual_keys",
    "VirtualCoverage",
    "BATCH_TOKENS",
    "default_batch",
    "expand",
    "Expansion",
    "paths_batch",
    "PASS_FLOPS",
    "VIRTUAL_AUTO_MAX",
    "virtual_pairs",
    "EFFECT_LOGITS",
    "effect_positions",
    "GRAM_COLUMNS",
    "head_read",
    "head_unembed",
    "head_values",
    "SampledTerms",
    "term_effects",
    "term_effects_text",
    "term_logits",
    "TermEffect",
    "TermEffects",
    "unembed_gram",
    "expansion_bytes",
    "paths_text",
    "PathSummary",
    "summarize",
    "expand_qk",
    "QKExpansion",
    "expand_routed",
    "routed_runs",
    "routing_coefficients",
]
