"""The diagonal top-k rate's sampling (how many tokens, which, how uncertain): read by
:func:`~qkov.analysis.circuits.copying_scores`, re-exported from :mod:`qkov.analysis.circuits`."""

from __future__ import annotations

import math

from torch import Tensor

from ..errors import QkovError
from .sampling import seeded_subset

DIAG_EXACT_MAX = 8192  # vocabularies up to this size get the exact own-logit-in-top-k rate
DIAG_SAMPLE = 1024  # tokens the rate is estimated on above it (standard error <= 0.016)


def check_diag_k(k: int, d_vocab: int) -> None:
    """Refuse a ``diag_k`` that is not from 1 to ``d_vocab - 1`` (one-line :class:`QkovError`)."""
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k < d_vocab:
        raise QkovError(
            f"diag_k must be an integer from 1 to {d_vocab - 1}, below the vocabulary ({d_vocab} tokens): "
            f"the top {d_vocab} of a row holds every token; got {k!r}"
        )


def diag_tokens(d_vocab: int, sample: int | None = None, *, seed: int = 0) -> Tensor | None:
    """The tokens (rows) the own-logit-in-top-k rate is measured on: ``None`` for all of them.

    ``sample=None`` chooses: every token up to :data:`DIAG_EXACT_MAX`, else :data:`DIAG_SAMPLE`
    tokens drawn without replacement (seeded, sorted). A ``sample`` of at least ``d_vocab`` means all.
    """
    if sample is None:
        sample = d_vocab if d_vocab <= DIAG_EXACT_MAX else DIAG_SAMPLE
    if not isinstance(sample, int) or isinstance(sample, bool) or sample < 1:
        raise QkovError(f"diag_sample must be a positive number of tokens, got {sample!r}")
    if sample >= d_vocab:
        return None
    return seeded_subset(d_vocab, sample, seed)


def rate_stderr(rate: float, n: int, population: int) -> float:
    """Standard error of a rate measured on ``n`` of ``population`` tokens drawn without
    replacement: binomial with the finite-population correction, 0 when ``n`` is all of them.
    The rate is shrunk to ``(x + 2) / (n + 4)`` first (Agresti-Coull), so a rate of 0 or 1
    seen on a sample still gets the uncertainty it has (about 0.14 points at n = 1024)."""
    if n >= population:
        return 0.0
    p = (rate * n + 2) / (n + 4)
    return math.sqrt(p * (1 - p) / n * (population - n) / max(1, population - 1))
