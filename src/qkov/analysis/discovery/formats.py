"""Task, circuit and score files: what other circuit-discovery tools read and write.

Reading a task (:func:`load_task`):

* **AutoCircuit's JSON**: ``{"prompts": [{"clean", "corrupt", "answers", "wrong_answers"}, ...]}``,
  each a text (answers: words the tokenizer reads as one token) or token ids;
* **EAP-IG's CSV**: columns ``clean, corrupted, correct_idx, incorrect_idx`` (the answers' token ids), or
  ``correct`` and ``incorrect`` (the answers as words);
* the built-in tasks by name (``induction``, ``ioi``: :mod:`.builtin`).

Texts get the model's start token as its texts do (as EAP-IG and AutoCircuit prepend it). A clean
prompt and its corrupted twin must have the same number of tokens (one-line error otherwise).

Reading a ground-truth circuit (:func:`read_ground_truth`): a JSON list of edges or nodes, ``{"edges":
[...]}`` / ``{"nodes": [...]}``, MIB's graph file (the edges ``in_graph``), or a text file with one per
line, in any spelling :mod:`.names` reads. Writing (:func:`mib_graph`): scores and a circuit as MIB's
submission file (EAP-IG's ``Graph.to_json``: ``cfg``, ``nodes``, ``edges`` with ``score`` and ``in_graph``).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import torch

from ...errors import QkovError
from ...model.tokens import source_codec
from .builtin import BUILT_IN_TASKS, induction_task, ioi_task
from .circuit import Circuit
from .graph import Graph
from .names import mib_name, to_qkov
from .scores import EdgeScores
from .task import METRICS, Task

__all__ = ["load_task", "mib_graph", "read_ground_truth", "task_from_rows"]


def load_task(spec: Any, source: Any, *, metric: str | None = None, n: int | None = None, seed: int = 0) -> Task:
    """A task from ``spec``: a :class:`Task`, a built-in name (``induction``, ``ioi``: ``n`` prompt pairs,
    ``seed``), or a path to AutoCircuit's JSON or EAP-IG's CSV (the first ``n`` pairs); ``metric``
    (one of :data:`~.task.METRICS`) replaces the task's."""
    if isinstance(spec, Task):
        task = spec
    elif spec in BUILT_IN_TASKS:
        maker = induction_task if spec == "induction" else ioi_task
        task = maker(source, n or 32, seed=seed)
    else:
        path = Path(spec)
        if not path.is_file():
            raise QkovError(f"task: {str(spec)!r} is neither a file nor a built-in task ({', '.join(BUILT_IN_TASKS)})")
        rows = _csv_rows(path) if path.suffix.lower() == ".csv" else _json_rows(path)
        task = task_from_rows(rows[:n] if n else rows, source, name=path.name)
    if metric is not None:
        if metric not in METRICS:
            raise QkovError(f"task: the metric is one of {', '.join(METRICS)}, got {metric!r}")
        task = task.with_metric(metric)
    return task.check(source.cfg)


def _json_rows(path: Path) -> list[dict[str, Any]]:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise QkovError(f"task {path.name}: not a JSON file ({exc})") from None
    prompts = data.get("prompts") if isinstance(data, dict) else None
    if not isinstance(prompts, list) or not all(isinstance(p, dict) for p in prompts):
        raise QkovError(
            f"task {path.name}: expected AutoCircuit's "
            '{"prompts": [{"clean", "corrupt", "answers", "wrong_answers"}]}'
        )
    rows = []
    for i, p in enumerate(prompts):
        missing = [k for k in ("clean", "corrupt", "answers") if k not in p]
        if missing:
            raise QkovError(f"task {path.name}: prompt {i} has no {', '.join(missing)}")
        rows.append(
            {
                "clean": p["clean"],
                "corrupted": p["corrupt"],
                "answers": p["answers"],
                "wrong": p.get("wrong_answers", []),
            }
        )
    return rows


def _csv_rows(path: Path) -> list[dict[str, Any]]:
    try:
        with path.open(newline="") as f:
            table = list(csv.DictReader(f))
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise QkovError(f"task {path.name}: not a CSV file ({exc})") from None
    if not table or not {"clean", "corrupted"} <= set(table[0]):
        raise QkovError(f"task {path.name}: expected EAP-IG's columns clean, corrupted, correct_idx, incorrect_idx")
    rows = []
    for r in table:
        if "correct_idx" in r:
            answers, wrong = (
                [_int(r["correct_idx"], path)],
                [_int(r.get("incorrect_idx", ""), path)] if r.get("incorrect_idx") else [],
            )
        elif "correct" in r:
            answers, wrong = [r["correct"]], [r["incorrect"]] if r.get("incorrect") else []
        else:
            raise QkovError(f"task {path.name}: no answer column (correct_idx, or correct)")
        rows.append({"clean": r["clean"], "corrupted": r["corrupted"], "answers": answers, "wrong": wrong})
    return rows


def _int(text: str, path: Path) -> int:
    try:
        return int(text)
    except ValueError:
        raise QkovError(f"task {path.name}: {text!r} is not a token id") from None


def task_from_rows(rows: list[dict[str, Any]], source: Any, *, name: str = "task") -> Task:
    """A task from rows ``{"clean", "corrupted", "answers", "wrong"}`` of texts or token ids (see the module
    docstring)."""
    if not rows:
        raise QkovError(f"task {name}: no prompts")
    codec = None
    clean, corrupted, answers, wrong = [], [], [], []
    for i, r in enumerate(rows):
        if any(isinstance(r[k], str) for k in ("clean", "corrupted")) or any(
            isinstance(a, str) for a in [*r["answers"], *r["wrong"]]
        ):
            codec = codec or source_codec(source, where=f"task {name}")
        c, k = (_tokens(r[key], codec) for key in ("clean", "corrupted"))
        if len(c) != len(k):
            raise QkovError(
                f"task {name}: prompt {i}'s clean and corrupted texts have {len(c)} and {len(k)} tokens; "
                "each pair must have one length (aligning spans of different lengths is not supported)"
            )
        clean.append(c)
        corrupted.append(k)
        answers.append([_answer(a, codec, name) for a in r["answers"]])
        wrong.append([_answer(a, codec, name) for a in r["wrong"]])
    for what, lists in (("answers", answers), ("wrong answers", wrong)):
        if len({len(a) for a in lists}) > 1:
            raise QkovError(f"task {name}: every prompt needs the same number of {what}")
    lengths = torch.tensor([len(c) for c in clean])
    T = int(lengths.max())
    pad = lambda ids: ids + [0] * (T - len(ids))  # noqa: E731
    texts = [r["clean"] for r in rows] if all(isinstance(r["clean"], str) for r in rows) else None
    return Task(
        name, [pad(c) for c in clean], [pad(k) for k in corrupted], answers, wrong, lengths=lengths, texts=texts
    )


def _tokens(x: Any, codec: Any) -> list[int]:
    if isinstance(x, str):
        return codec.encode(x)
    if isinstance(x, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in x):
        return list(x)
    raise QkovError(f"task: a prompt must be a text or a list of token ids, got {x!r}")


def _answer(a: Any, codec: Any, name: str) -> int:
    if isinstance(a, int) and not isinstance(a, bool):
        return a
    if isinstance(a, str):
        try:
            return int(codec.single_token(a))
        except QkovError as exc:
            raise QkovError(f"task {name}: the answer {a!r} is not a single token: {exc}") from None
    raise QkovError(f"task {name}: an answer must be a token id or a word, got {a!r}")


def read_ground_truth(path: str | Path) -> list[str]:
    """The edges or nodes of a ground-truth file, in qkov's spelling (see the module docstring)."""
    p = Path(path)
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise QkovError(f"ground truth: cannot read {str(path)!r} ({exc})") from None
    try:
        data: Any = json.loads(text)
    except json.JSONDecodeError:
        data = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]
    if isinstance(data, dict):
        items = data.get("edges", data.get("nodes"))
        if isinstance(items, dict):  # MIB's graph: the edges in the circuit
            items = [k for k, v in items.items() if isinstance(v, dict) and v.get("in_graph", True)]
        data = items
    if not isinstance(data, list) or not all(isinstance(x, str) for x in data):
        raise QkovError(f"ground truth {p.name}: expected a list of edges or nodes (JSON, or one per line)")
    return [to_qkov(x) for x in data]


def mib_graph(scores: EdgeScores, circuit: Circuit | None = None) -> dict[str, Any]:
    """``scores`` (each edge's importance: positive carries the clean behaviour) and ``circuit`` (else
    every edge) in MIB's submission shape; per-position scores are summed over positions."""
    g: Graph = scores.graph  # type: ignore[assignment]
    imp = scores.importance
    imp = imp.nan_to_num(0.0).sum(0) if scores.per_position else imp.nan_to_num(0.0)
    on = torch.ones(g.n_edges, dtype=torch.bool) if circuit is None else circuit.union
    nodes_on = Circuit(g, on).node_mask
    cfg = g.cfg
    return {
        "cfg": {
            "n_layers": cfg.n_layers,
            "n_heads": cfg.n_heads,
            "parallel_attn_mlp": bool(cfg.parallel),
            "d_model": cfg.d_model,
        },
        "nodes": {mib_name(a): {"in_graph": bool(nodes_on[i])} for i, a in enumerate(g.nodes)},
        "edges": {mib_name(g.edge(i)): {"score": float(imp[i]), "in_graph": bool(on[i])} for i in range(g.n_edges)},
    }
