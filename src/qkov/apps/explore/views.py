"""The views of ``qkov explore``: :data:`VIEWS` maps a view's name to ``view(ex, args, progress) -> dict``.

This module holds the model's summary (``model``), a text's tokens, loss and predictions (``text``), one
head's attention pattern on a text (``attention``) and the heads table (``heads``, cached on disk per
model); the head card, composition graph, term effects, ablation and patching live in ``views_card``,
``views_graph`` and ``views_causal`` and register here. Every number is the library's: the model's
forward pass (:func:`qkov.trace`, one run per text shared by the views, :mod:`~qkov.apps.explore.runs`),
:func:`qkov.head_report`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable


from ...analysis.heads.report import SCORE_COLUMNS, head_report
from ...analysis.paths.expansion import default_batch
from ...analysis.heads.probes import default_icl_examples
from ...progress import Progress
from ..inputs import analysis_inputs
from .context import BadRequest, Explorer
from .disk_cache import entry_key, entry_path, read_entry, write_entry
from .runs import TOP_K, clean_run, pattern_of
from .session import fingerprint
from .views_card import card, r6
from .views_causal import ablate, patch
from .views_circuit import circuit, circuit_edge
from .views_graph import composition, terms

__all__ = [
    "IN_MEMORY_VIEWS", "in_memory_only", "QUICK_VIEWS", "TOP_K", "View", "view_attention", "view_heads", "view_model",
    "view_text", "VIEWS",
]  # fmt: skip

View = Callable[[Explorer, dict[str, Any], Progress], dict[str, Any]]


def _head_names(ex: Explorer) -> list[str]:
    cfg = ex.cfg
    return [f"{l}.{h}" for l in range(cfg.n_layers) for h in range(cfg.n_heads)]


def view_model(ex: Explorer, args: dict[str, Any], progress: Progress) -> dict[str, Any]:
    """The model's shape and what the page needs first (no computation)."""
    cfg = ex.cfg
    return {
        "name": ex.name,
        "source": str(ex.extra.get("source", ex.name)),
        "n_layers": cfg.n_layers,
        "n_heads": cfg.n_heads,
        "d_model": cfg.d_model,
        "d_head": cfg.d_head,
        "d_vocab": cfg.d_vocab,
        "n_ctx": cfg.n_ctx,
        "bos": ex.bos,
        "max_tokens": ex.max_tokens,
        "heads": _head_names(ex),
        "rotary": cfg.positional == "rotary",
        "cache_dir": None if ex.cache_dir is None else str(ex.cache_dir),
        "has_tokenizer": ex.codec is not None,
        "streamed": ex.streamed,
        "unavailable": {name: why for name, why in IN_MEMORY_VIEWS.items()} if ex.streamed else {},
    }


def view_text(ex: Explorer, args: dict[str, Any], progress: Progress) -> dict[str, Any]:
    """A text's tokens, loss per token, its mean and the top next-token predictions (its clean run,
    :func:`~qkov.apps.explore.runs.clean_run`, kept for the other views of the same text)."""
    ids = ex.tokens(args)
    run = clean_run(ex, ids, progress)
    loss = [r6(v) for v in run.nll.tolist()] + [None]
    known = [v for v in loss if v is not None]
    return {
        "ids": ids[0].tolist(),
        "tokens": [ex.decode(i) for i in ids[0].tolist()],
        "loss": loss,
        "mean_loss": r6(sum(known) / len(known)) if known else None,
        "top": run.top,
    }


def view_attention(ex: Explorer, args: dict[str, Any], progress: Progress) -> dict[str, Any]:
    """One head's pattern on a text: query rows, key columns (lower triangular) and each row's argmax."""
    layer, head = ex.head(args)
    ids = ex.tokens(args)
    pattern = pattern_of(ex, ids, layer, head, progress)
    return {
        "head": f"{layer}.{head}",
        "tokens": [ex.decode(i) for i in ids[0].tolist()],
        "pattern": [[r6(v) for v in row[: q + 1]] + [0.0] * (len(row) - q - 1) for q, row in enumerate(pattern.tolist())],
        "argmax": pattern.argmax(dim=-1).tolist(),
    }


def _heads_inputs(ex: Explorer) -> tuple[Any, int, int]:
    """The inputs ``qkov heads SOURCE [--text FILE]`` runs on (:func:`qkov.apps.inputs.analysis_inputs` with its
    default batch and ICL examples: the text ``ex.extra["text"]`` when the explorer was given one, else a qkov
    checkpoint's validation text, else seeded random tokens), the batch and the number of ICL examples; read
    once, kept in ``ex.extra``."""
    if "heads_inputs" in ex.extra:
        return ex.extra["heads_inputs"]
    cfg = ex.cfg
    batch, icl_examples = default_batch(cfg.n_ctx), default_icl_examples(cfg)
    source = Path(str(ex.extra.get("source", ex.name)))
    text = ex.extra.get("text")
    rows = max(batch, icl_examples)
    inputs = analysis_inputs(source, ex.weights, text=None if text is None else Path(text), batch=rows, want_corpus=True)
    ex.extra["heads_inputs"] = (inputs, batch, icl_examples)
    return inputs, batch, icl_examples


def _compute_heads(ex: Explorer, progress: Progress) -> dict[str, Any]:
    """:func:`qkov.head_report` on the default inputs, as the ``heads`` view's dict (without ``cached``)."""
    if ex.cfg.n_layers == 0:
        raise BadRequest("heads: the model has no attention layers")
    inputs, batch, icl_examples = _heads_inputs(ex)
    text = inputs.tokens.to(ex.weights.device)
    report = head_report(
        ex.weights,
        text[:batch],
        bos=ex.bos,
        frequencies=inputs.frequencies,
        icl_text=text[:icl_examples],
        icl=inputs.natural,
        progress=progress,
    )
    data = report.to_dict()
    rows = [{k: (r6(v) if isinstance(v, float) else v) for k, v in row.items()} for row in data["heads"]]
    return {
        "columns": [{"label": label, "key": key} for label, key in SCORE_COLUMNS],
        "rows": rows,
        "inputs": inputs.source,
        "natural": inputs.natural,
        "left_out": data["left_out"],
        "icl": data["icl"],
        "thresholds": data["thresholds"],
    }


def view_heads(ex: Explorer, args: dict[str, Any], progress: Progress) -> dict[str, Any]:
    """The heads table with roles (:func:`_compute_heads`), read from the disk cache when this model's entry
    is there and sound, else computed and written there; ``cached`` is the file (``None``: no cache)."""
    if ex.cfg.n_layers == 0:
        raise BadRequest("heads: the model has no attention layers")
    if ex.cache_dir is None:
        return {**_compute_heads(ex, progress), "cached": None, "from_cache": False}
    inputs, _, _ = _heads_inputs(ex)
    key = entry_key("heads", fingerprint(ex), inputs.tokens, {"seed": 0, "diag_k": 5})
    path = entry_path(ex.cache_dir, "heads", key)
    stored = read_entry(path, key)
    if stored is not None:
        return {**stored, "cached": str(path), "from_cache": True}
    result = _compute_heads(ex, progress)
    write_entry(path, key, result)
    return {**result, "cached": str(path), "from_cache": False}


IN_MEMORY_VIEWS: dict[str, str] = {
    "heads": "the heads table runs the model over several full-context texts",
    "terms": "the path expansion holds every head's output at every position",
    "patch": "patching runs the model once per patched site",
    "circuit": "circuit discovery runs the model once per edge it scores",
    "circuit_edge": "circuit discovery runs the model once per edge it scores",
}
"""The views a streamed session (weights read from disk layer by layer) does not answer, and why: each would
read every layer from disk many times over. Asked, they answer one line (:func:`in_memory_only`)."""


def in_memory_only(name: str, view: View) -> View:
    """``view``, answering a streamed session with one line (400) saying why it is not available there."""

    def guarded(ex: Explorer, args: dict[str, Any], progress: Progress) -> dict[str, Any]:
        if ex.streamed:
            raise BadRequest(
                f"{name}: not available while the weights are read from disk layer by layer ({IN_MEMORY_VIEWS[name]}); "
                "the text, attention, head card, composition and ablation views are; open a model that fits in memory "
                "for this one"
            )
        return view(ex, args, progress)

    guarded.__doc__ = view.__doc__
    return guarded


VIEWS: dict[str, View] = {
    "model": view_model,
    "text": view_text,
    "attention": view_attention,
    "heads": view_heads,
    "card": card,
    "composition": composition,
    "terms": terms,
    "ablate": ablate,
    "patch": patch,
    "circuit": circuit,
    "circuit_edge": circuit_edge,
}
"""Every view the server answers, by name (the other view modules add theirs); those of
:data:`IN_MEMORY_VIEWS` answer a streamed session with one line."""
VIEWS.update({name: in_memory_only(name, VIEWS[name]) for name in IN_MEMORY_VIEWS})

QUICK_VIEWS: set[str] = {"model", "text", "attention"}
"""Views that run in the quick lane of the job runner (their own worker), so a long computation (the heads
table, patching) never holds them up."""
