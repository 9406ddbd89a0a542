"""The head card of ``qkov explore`` (view ``card``): one head's circuits, each read off the weights by
the library function that computes it, for this head only.

* ``ov_eigenvalues`` / ``copying``: the eigenvalues of the full OV circuit ``W_E W_OV W_U``
  (:func:`qkov.full_ov` ``.eigenvalues()``, the ``d_head`` values of its small twin: the same numbers
  :func:`qkov.ov_eigenvalues` gives for every head) and :func:`~qkov.analysis.circuits.copying.eigen_copying_score`;
* ``qk_eigenvalues`` / ``top_qk``: the full QK circuit ``W_E W_QK W_E^T`` (:func:`qkov.analysis.circuits.qk_ov.full_qk`);
  a rotary head has one per offset, so its card reads the direct-path table at the offset its profile
  prefers (:func:`~qkov.analysis.circuits.rotary.offset_qk`, ``qk_offset`` says which);
* ``top_ov`` / ``top_qk``: the largest entries over the whole vocabulary, exact, by bound and refine
  (:meth:`LowRank.topk <qkov.analysis.circuits.factored.LowRank.topk>`: a fast screen bounds every row, only
  the rows that can reach the top are computed; nothing ``d_vocab x d_vocab`` is held; equal values in
  row-major order);
* ``trigrams``: :func:`~qkov.analysis.circuits.trigrams.skip_trigrams` (exact branch and bound on the same
  screen's bounds, start token excluded);
* ``positional``: a learned-position head's ``W_pos W_QK W_pos^T`` (:func:`qkov.positional_qk`)
  averaged along each offset ``query - key``; a rotary head's weights-only offset profile
  (:func:`~qkov.analysis.circuits.rotary.offset_profile`);
* ``composition``: the head's row and column of Q/K/V composition, computed for this head's pairs
  only with the scores of :func:`qkov.composition_scores` (tested equal to the all-pairs result);
* ``pattern``: the head's attention pattern on ``text`` when given (the ``attention`` view's form).

At GPT-2's vocabulary each vocabulary-wide table costs about one screen of a ``d_vocab x d_vocab``
product of inner dimension ``d_head`` (the trigrams two; about half a second each on a 2-core CPU with
bfloat16 matrix units, a float32 scan elsewhere): ``"tables": false`` leaves ``top_ov``, ``top_qk`` and
``trigrams`` out (``null``): the rest of the card costs a few ``d_vocab x d_model x d_head`` products.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import Tensor

from ...analysis.circuits.copying import eigen_copying_score
from ...analysis.circuits.qk_ov import full_ov, full_qk, positional_qk
from ...analysis.circuits.composition import KINDS, reader_matrix
from ...analysis.circuits.factored import LowRank
from ...progress import tick
from ...analysis.circuits.rotary import offset_profile, offset_qk, rotations
from ...analysis.circuits.trigrams import skip_trigrams
from ...model.tokens import left_out_tokens
from ...progress import Progress
from .context import BadRequest, Explorer, r6
from .runs import pattern_of

__all__ = ["card", "int_arg", "MAX_OFFSET", "MAX_TOP", "positional", "r6", "spectrum", "TOP"]

TOP = 20
"""Entries listed per vocabulary-wide table (``top_ov``, ``top_qk``, ``trigrams``) by default."""
MAX_TOP = 200
MAX_OFFSET = 64
"""The positional profile covers offsets ``0 .. min(n_ctx - 1, MAX_OFFSET)``."""


def int_arg(args: dict[str, Any], key: str, default: int, lo: int, hi: int) -> int:
    """``args[key]`` as an int in ``lo .. hi`` (``default`` when absent), else :class:`BadRequest`."""
    value = args.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise BadRequest(f"{key!r} must be an integer in {lo} .. {hi}, got {value!r}")
    return value


def _pattern_result(ex: Explorer, ids: Tensor, layer: int, head: int) -> dict[str, Any]:
    """Head ``layer.head``'s pattern on ``ids [1, seq]`` (:func:`~qkov.apps.explore.runs.pattern_of`), as the
    ``attention`` view gives it: ``{head, tokens, pattern (query rows, key columns, zeros above the diagonal), argmax}``."""
    pattern = pattern_of(ex, ids, layer, head)
    return {
        "head": f"{layer}.{head}",
        "tokens": [ex.decode(i) for i in ids[0].tolist()],
        "pattern": [[r6(v) for v in row[: q + 1]] + [0.0] * (len(row) - q - 1) for q, row in enumerate(pattern.tolist())],
        "argmax": pattern.argmax(dim=-1).tolist(),
    }


def spectrum(eigs: Tensor) -> list[dict[str, float | None]]:
    """Complex eigenvalues ``[r]`` as ``[{re, im}]``, largest magnitude first."""
    order = torch.argsort(eigs.abs(), descending=True)
    return [{"re": r6(eigs[i].real), "im": r6(eigs[i].imag)} for i in order.tolist()]


def positional(ex: Explorer, layer: int, head: int) -> dict[str, Any]:
    """The head's score by offset ``query - key`` from its weights alone (``kind`` says how)."""
    w, cfg = ex.weights, ex.cfg
    offsets = list(range(min(cfg.n_ctx, MAX_OFFSET + 1)))
    if cfg.positional == "rotary":
        values = offset_profile(w, layer, head, offsets).tolist()
        return {"offsets": offsets, "values": [r6(v) for v in values], "kind": "rotary"}
    if w.pos() is None:
        return {"offsets": [], "values": [], "kind": "none"}
    table = positional_qk(w, layer, head).materialize()  # [n_ctx, n_ctx]: n_ctx^2 floats
    values = [float(table.diagonal(-d).mean()) for d in offsets]  # query i, key i - d
    return {"offsets": offsets, "values": [r6(v) for v in values], "kind": "learned"}


def _scores(writer: LowRank, readers: Iterable[LowRank]) -> Tensor:
    """Composition scores ``[n_writers, n_readers]``: ``||W_writer M_reader||_F / (||W_writer|| ||M_reader||)``
    through :meth:`LowRank.row_factor` / :meth:`LowRank.col_factor` (as :func:`qkov.composition_scores`),
    averaged over ``readers`` (one per rotary offset; else one)."""
    rows, w_norm = writer.row_factor(), writer.norm()  # [n, E, D], [n]
    out = []
    for reader in readers:
        cols, r_norm = reader.col_factor(), reader.norm()  # [m, D, E], [m]
        num = torch.einsum("ned,mdf->nmef", rows, cols).square().sum((-1, -2)).sqrt()
        out.append(num / (w_norm[:, None] * r_norm[None, :]))
    return torch.stack(out).mean(0)


def _readers(atts: list[Any], kind: str, Rs: Tensor | None) -> Iterator[LowRank]:
    """The reader side of ``kind``-composition of every head of ``atts`` (layers), stacked ``[heads, D, D]``:
    one per rotary offset of ``Rs`` for Q and K, else one; each made as it is read (one offset's at a time)."""
    turns: list[Tensor | None] = [None] if kind == "v" or Rs is None else list(Rs)
    for R in turns:
        parts = [reader_matrix(att, kind, R) for att in atts]
        yield LowRank(torch.cat([p.A for p in parts]), torch.cat([p.B for p in parts]))


def _composition_of(ex: Explorer, layer: int, head: int, seen: Callable[[int], None] = lambda l: None) -> dict[str, Any]:
    """The head's column (``reads``: every earlier head it composes with, by Q/K/V) and row (``read_by``:
    every later head composing with it) of raw composition scores, from this head's weights alone and the
    other layers'. In memory every earlier layer's writers (and every later layer's readers) go through one
    batched product; streamed from disk, one layer's at a time (the same scores: each pair's is its own), each
    layer told to ``seen`` as it is read."""
    w, cfg = ex.weights, ex.cfg
    H = cfg.n_heads
    Rs = rotations(w, None)
    mine = w.attention(layer, head)  # [1, ...]: this head
    names = lambda layers: [f"{l}.{h}" for l in layers for h in range(H)]  # noqa: E731
    blocks = lambda layers: [[l] for l in layers] if ex.streamed else [list(layers)]  # noqa: E731
    reads: list[dict[str, Any]] = []
    read_by: list[dict[str, Any]] = []
    if layer > 0:
        mine_k = {k: list(_readers([mine], k, Rs)) for k in KINDS}
        s: dict[str, list[float]] = {k: [] for k in KINDS}
        for block in blocks(range(layer)):
            seen(block[0])
            atts = [w.attention(l) for l in block]
            writer = LowRank(torch.cat([a.W_V for a in atts]), torch.cat([a.W_O for a in atts]))
            for k in KINDS:
                s[k] += _scores(writer, mine_k[k])[:, 0].tolist()
        reads = [{"head": n, **{k: r6(s[k][i]) for k in KINDS}} for i, n in enumerate(names(range(layer)))]
    if layer + 1 < cfg.n_layers:
        writer = LowRank(mine.W_V, mine.W_O)
        s = {k: [] for k in KINDS}
        for block in blocks(range(layer + 1, cfg.n_layers)):
            seen(block[0])
            atts = [w.attention(l) for l in block]
            for k in KINDS:
                s[k] += _scores(writer, _readers(atts, k, Rs))[0].tolist()
        later = names(range(layer + 1, cfg.n_layers))
        read_by = [{"head": n, **{k: r6(s[k][i]) for k in KINDS}} for i, n in enumerate(later)]
    return {"reads": reads, "read_by": read_by}  # the baselines: the composition view (drawing them costs seconds)


def _qk_circuit(ex: Explorer, layer: int, head: int, prof: dict[str, Any]) -> tuple[LowRank, int | None]:
    """The head's token-token QK table and, for a rotary head, the offset it is read at (the profile's peak)."""
    if ex.cfg.positional != "rotary":
        return full_qk(ex.weights, layer, head), None
    values = [v if v is not None else -math.inf for v in prof["values"]]
    delta = prof["offsets"][max(range(len(values)), key=values.__getitem__)]
    return offset_qk(ex.weights, layer, head, delta), delta


def card(ex: Explorer, args: dict[str, Any], progress: Progress) -> dict[str, Any]:
    """One head's card (module docstring): args ``head``, optional ``text`` (its pattern), ``top``
    (entries per table, default 20) and ``tables`` (default true; false leaves the vocabulary-wide tables out)."""
    layer, head = ex.head(args)
    ids = ex.tokens(args) if args.get("text") is not None else None  # checked before any work
    top = int_arg(args, "top", TOP, 1, MAX_TOP)
    tables = args.get("tables", True)
    if not isinstance(tables, bool):
        raise BadRequest(f"'tables' must be true or false, got {tables!r}")
    steps, what = 6 if tables else 3, f"card {layer}.{head}"
    tick(progress, what, 0, steps)
    fov = full_ov(ex.weights, layer, head)
    ov_eigs = fov.eigenvalues()
    prof = positional(ex, layer, head)
    fqk, qk_offset = _qk_circuit(ex, layer, head, prof)
    out: dict[str, Any] = {
        "head": f"{layer}.{head}",
        "ov_eigenvalues": spectrum(ov_eigs),
        "qk_eigenvalues": spectrum(fqk.eigenvalues()),
        "qk_offset": qk_offset,
        "copying": r6(eigen_copying_score(ov_eigs)),
        "positional": prof,
    }
    tick(progress, what, 1, steps)
    seen = lambda l: tick(progress, f"{what}: composition, reading layer {l} from disk", 1, steps)  # noqa: E731
    out["composition"] = _composition_of(ex, layer, head, seen if ex.streamed else lambda l: None)
    tick(progress, what, 2, steps)
    out["pattern"] = None if ids is None else _pattern_result(ex, ids, layer, head)
    tick(progress, what, 3, steps)
    out["top_ov"] = out["top_qk"] = out["trigrams"] = None
    if tables:
        left_out, out["left_out"] = left_out_tokens(ex.weights, ex.cfg.d_vocab)  # as the trigram search's
        keep = torch.ones(ex.cfg.d_vocab, dtype=torch.bool)
        keep[list(left_out)] = False
        ids = keep.nonzero().squeeze(-1)
        k = min(top, ids.numel() ** 2)
        t = fov.topk(k, rows=ids, cols=ids)
        out["top_ov"] = [{"src": ex.decode(r), "out": ex.decode(c), "src_id": r, "out_id": c, "value": r6(v)}
                         for v, r, c in zip(t.values.tolist(), t.rows.tolist(), t.cols.tolist())]  # fmt: skip
        tick(progress, what, 4, steps)
        t = fqk.topk(k, rows=ids, cols=ids)
        out["top_qk"] = [{"query": ex.decode(r), "key": ex.decode(c), "query_id": r, "key_id": c, "value": r6(v)}
                         for v, r, c in zip(t.values.tolist(), t.rows.tolist(), t.cols.tolist())]  # fmt: skip
        tick(progress, what, 5, steps)
        found = skip_trigrams(ex.weights, layer, head, top=top).trigrams
        out["trigrams"] = [
            {"src": ex.decode(s.source), "dest": ex.decode(s.destination), "out": ex.decode(s.output),
             "src_id": s.source, "dest_id": s.destination, "out_id": s.output, "value": r6(s.score)}
            for s in found
        ]  # fmt: skip
        tick(progress, what, 6, steps)
    return out
