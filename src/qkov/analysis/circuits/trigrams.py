"""Skip-trigram and bigram tables read off the weights ([F], "One-Layer Attention-Only Transformers").

A head contributes skip-trigrams ``[source] ... [destination] -> [output]``: the QK circuit
decides how much a destination token attends to a source token, the OV circuit what the
source then promotes. Scoring (a documented choice, docs/conventions.md):

* ``qk[d, s]`` — the full QK circuit ``W_E W_QK W_E^T``, **centred per destination** (the
  mean over sources subtracted: softmax only sees differences between a destination's keys);
* ``ov[s, o]`` — the full OV circuit ``W_E W_OV W_U``, **centred per source** (the mean over
  outputs subtracted: softmax only sees differences between logits);
* ``score = qk[d, s] * ov[s, o]`` over pairs where both are positive (the destination
  attends to the source more than average *and* the source raises the output more than
  average). This is the token-token part only: positions and other heads are left out,
  which is exact for the paper's layer-0 heads up to the positional term.
* Left out by default as source, destination and output (``exclude=None``;
  :func:`~qkov.model.tokens.left_out_tokens`): the start token (every example's first token and the
  default place for heads to park attention) and, for a model with a tokenizer, every id that is not
  an ordinary text token: special tokens, byte-fallback pieces (``<0x00>``..``<0xFF>``: a
  SentencePiece model rarely or never trains them, and their many near-identical rows would fill the
  table) and ids past the tokenizer's vocabulary (padding rows). ``exclude=()`` keeps every id; the
  result's ``left_out`` says what was left out.

Because the table is a product of two factors, raising ``(s, d1, o1)`` and ``(s, d2, o2)``
raises the crossed ``(s, d1, o2)`` and ``(s, d2, o1)`` too: the paper's "skip-trigram bugs"
(:meth:`TrigramTable.crossed`). Everything is computed factored and in chunks (never a full
``d_vocab x d_vocab`` matrix).

For a head beyond layer 0 the table is its one-layer (direct) view: it reads token embeddings
as queries and keys and writes straight to the unembedding, leaving out what earlier layers
write into the head's inputs.

A :class:`TrigramTable` reads one head's circuits from a :class:`~qkov.weights.WeightSource`
once (``W_E`` and ``W_U`` are read and dropped; it keeps ``[d_vocab, d_head]`` factors), so a
memory-mapped checkpoint's head is analysed holding one of ``W_E``/``W_U`` at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence
from typing import Callable, ClassVar
from dataclasses import field

import torch
from torch import Tensor

from ...device import check_fits, memory_budget
from ...errors import QkovError
from ...weights.parts import WeightSource
from ...model.tokens import left_out_tokens
from ...weights.convert import SourceLike, as_source
from .rotary import rotations
from .vocab import embed_product, unembed_product
from ..budget import item, rows_per_chunk
from .bounded import SCREEN_ROWS, screen_bytes, screen_dtype, stable_topk
from .factored import DEFAULT_MAX_BYTES, LowRank
from ..shown import TEXT, Shown, decoder, num, register, table, token
from .vocab import VOCAB_BLOCK
from ..shown import Items

__all__ = [
    "Bigram",
    "bigram_bytes",
    "Bigrams",
    "bigrams",
    "bigrams_text",
    "first_bug",
    "SEARCH_BATCH",
    "skip_trigrams",
    "SkipTrigram",
    "SkipTrigrams",
    "SourceView",
    "trigram_search_bytes",
    "trigram_table_bytes",
    "trigrams_text",
    "TrigramTable",
]


@dataclass(frozen=True)
class SkipTrigram:
    source: int
    destination: int
    output: int
    qk: float  # centred QK score of (destination, source)
    ov: float  # centred OV logit of (source, output)

    @property
    def score(self) -> float:
        return self.qk * self.ov

    def to_dict(self, decode: Any = None) -> dict[str, Any]:
        d: dict[str, Any] = {
            "source": self.source,
            "destination": self.destination,
            "output": self.output,
            "qk": self.qk,
            "ov": self.ov,
            "score": self.score,
        }
        if decode is not None:
            d.update(
                source_str=decode(self.source), destination_str=decode(self.destination), output_str=decode(self.output)
            )
        return d


class TrigramTable:
    """One head's factored skip-trigram table, read from ``source`` once: ``.qk [source,
    destination]`` (the module docstring's ``qk[d, s]``, transposed so that both factors are
    indexed by source first) and ``.ov [source, output]``.

    The table and its search are planned against the memory budget first
    (:func:`qkov.device.memory_budget`): :meth:`top` visits fewer sources at once, in smaller row
    chunks, when the defaults would not fit, and a table whose smallest search would not fit is
    refused before anything is read."""

    def __init__(self, source: WeightSource, layer: int, head: int, offsets: list[int] | None = None) -> None:
        self.batch, self.max_bytes = _search_budget(source, layer, head)
        att = source.attention(layer, head)
        # [V, d_head] each, from one pass over the embedding
        EQ, EK, EV = embed_product(source, torch.cat([att.W_Q[0], att.W_K[0], att.W_V[0]], -1)).split(
            att.W_Q.shape[-1], -1
        )
        Rs = rotations(source, offsets)
        if Rs is not None:  # rotary: the QK side at an offset drawn uniformly from the offset set
            EQ = EQ @ Rs.mean(0)
        OU = unembed_product(source, att.W_O[0])  # [d_head, V]
        self.d_vocab = source.cfg.d_vocab
        self.left_out = left_out_tokens(source, self.d_vocab)  # what exclude=None leaves out, and its wording
        self.ov = LowRank(EV, OU - OU.mean(dim=-1, keepdim=True))  # centred over outputs, per source
        B = EK.T - EK.T.mean(dim=-1, keepdim=True)  # full QK = EQ @ EK^T; centred over sources, per destination
        self.qk = LowRank(B.T, EQ.T)  # [source, destination]

    def top(
        self,
        top: int = 20,
        *,
        exclude: tuple[int, ...] | None = None,
        max_bytes: int | None = None,
        batch: int | None = None,
    ) -> list[SkipTrigram]:
        """The ``top`` skip-trigrams over the whole vocabulary, strongest first (exact).

        Branch and bound: a source's best trigram scores at most ``max_d qk[d, s] * max_o ov[s, o]``,
        bounded from above by one fast screen of each factored circuit
        (:meth:`~qkov.analysis.circuits.factored.LowRank.row_max_bound`). Sources are visited from the
        largest bound down, ``batch`` at a time; each visited source contributes its best ``top``
        destinations x ``top`` outputs; the search stops once the ``top``-th best score found beats
        every remaining bound. Scores are ``qk * ov`` of the float32 values, in float64 (exact); equal
        scores come by source, then destination, then output, so the result does not depend on the
        order of the visit. ``max_bytes`` and ``batch`` default to the planned ones (at most
        :data:`~qkov.analysis.circuits.factored.DEFAULT_MAX_BYTES` and :data:`SEARCH_BATCH`).
        """
        V, qk, ov = self.d_vocab, self.qk, self.ov
        exclude = self.excluded(exclude)
        max_bytes = self.max_bytes if max_bytes is None else max_bytes
        batch = self.batch if batch is None else batch
        k = min(top, V - len(exclude))
        if k < 1:
            raise QkovError("skip_trigrams: vocabulary too small")
        bound = qk.row_max_bound(max_bytes=max_bytes).clamp_min(0) * ov.row_max_bound(max_bytes=max_bytes).clamp_min(0)
        bound[list(exclude)] = 0
        order = torch.argsort(bound, descending=True)
        best: list[tuple[float, int, int, int, float, float]] = []  # (-score, s, d, o, qk, ov)
        excl = torch.tensor(list(exclude), dtype=torch.long, device=bound.device)
        for lo in range(0, V, batch):
            srcs = order[lo : lo + batch]
            if len(best) >= top and -best[top - 1][0] > float(bound[srcs[0]]):
                break  # an equal bound may still hold an equal score that comes first
            srcs = srcs[bound[srcs] > 0]
            if srcs.numel() == 0:
                break
            best = sorted(best + _source_best(qk.rows(srcs), ov.rows(srcs), srcs, excl, k, top))[:top]
        return [SkipTrigram(s, d, o, q, v) for _, s, d, o, q, v in best]

    def source_view(self, source: int, *, top: int = 10, exclude: tuple[int, ...] | None = None) -> "SourceView":
        """What token ``source`` promotes (its OV row) and which destinations attend to it (its QK column)."""
        V = self.d_vocab
        if not 0 <= source < V:
            raise QkovError(f"source token id {source} out of range [0, {V})")
        ov_row, qk_col = self.ov.rows([source])[0], self.qk.rows([source])[0]
        exclude = self.excluded(exclude)
        ov_row[list(exclude)] = float("-inf")
        qk_col[list(exclude)] = float("-inf")
        k = min(top, V - len(exclude))
        ov_v, ov_i = torch.topk(ov_row, k)
        qk_v, qk_i = torch.topk(qk_col, k)
        return SourceView(source, list(zip(ov_i.tolist(), ov_v.tolist())), list(zip(qk_i.tolist(), qk_v.tolist())))

    def excluded(self, exclude: tuple[int, ...] | None) -> tuple[int, ...]:
        """``exclude`` as given, or (``None``) the default ids left out (the module docstring)."""
        return self.left_out[0] if exclude is None else tuple(int(e) for e in exclude)

    def left_out_note(self, exclude: tuple[int, ...] | None) -> str:
        """What ``exclude`` leaves out, in words (``""``: nothing)."""
        if exclude is None:
            return self.left_out[1]
        return f"{len(exclude)} token{'s' if len(exclude) != 1 else ''} left out" if exclude else ""

    def crossed(self, a: SkipTrigram, b: SkipTrigram) -> list[SkipTrigram]:
        """The skip-trigram bug: two trigrams sharing a source imply the two crossed ones.

        Returns ``[(s, d_a, o_b), (s, d_b, o_a)]`` with their scores, which the factored
        table assigns whether or not the data supports them.
        """
        if a.source != b.source:
            raise QkovError("crossed trigrams need two trigrams with the same source")
        s = a.source
        ov_row, qk_col = self.ov.rows([s])[0], self.qk.rows([s])[0]
        return [
            SkipTrigram(s, a.destination, b.output, float(qk_col[a.destination]), float(ov_row[b.output])),
            SkipTrigram(s, b.destination, a.output, float(qk_col[b.destination]), float(ov_row[a.output])),
        ]


def _source_best(
    q_rows: Tensor, o_rows: Tensor, srcs: Tensor, excl: Tensor, k: int, top: int
) -> list[tuple[float, int, int, int, float, float]]:
    """Each source's candidates ``(-score, source, destination, output, qk, ov)`` from its QK and OV rows
    ``[b, V]``: its ``k`` best destinations x ``k`` best outputs (:func:`~qkov.analysis.circuits.bounded.stable_topk`:
    equal values by id), the positive scores down to its ``top``-th (every equal one kept). Any trigram
    of the source left out has ``k`` others before it in the order (-score, destination, output)."""
    if excl.numel():
        q_rows[:, excl] = float("-inf")
        o_rows[:, excl] = float("-inf")
    qv, qi = stable_topk(q_rows, k)
    ovv, oi = stable_topk(o_rows, k)
    prod = qv.double()[:, :, None].clamp_min(0) * ovv.double()[:, None, :].clamp_min(0)  # [b, k, k], exact
    flat = prod.reshape(prod.shape[0], -1)
    floor = torch.topk(flat, min(top, flat.shape[1]), dim=-1).values[:, -1:]
    out = []
    for r, f in torch.nonzero((flat >= floor) & (flat > 0)).tolist():
        a, b = divmod(f, k)
        out.append((-float(flat[r, f]), int(srcs[r]), int(qi[r, a]), int(oi[r, b]), float(qv[r, a]), float(ovv[r, b])))
    return out


SEARCH_BATCH = 256  # sources whose rows the search of the top trigrams reads at once


def _search_budget(source: WeightSource, layer: int, head: int) -> tuple[int, int]:
    """``(batch, max_bytes)`` of :meth:`TrigramTable.top` under the memory budget, refusing a table
    whose search of one source at a time, with one-row screen blocks, would not fit."""
    V, row = source.cfg.d_vocab, source.cfg.d_vocab * item(source)
    table = trigram_table_bytes(source)
    least = table + trigram_search_bytes(source, batch=1, chunk_rows=1)
    what = f"trigrams: the skip-trigram table of head {layer}.{head}"
    check_fits(least, source.device, what, "analyse a model with a smaller vocabulary", hint="memory")
    have, _ = memory_budget(source.device)
    chunk = min(DEFAULT_MAX_BYTES, SCREEN_ROWS * row)  # the screens' blocks
    full = table + trigram_search_bytes(source, batch=SEARCH_BATCH, chunk_rows=rows_per_chunk(source, V, V, chunk))
    if have is None or full <= have:
        return SEARCH_BATCH, DEFAULT_MAX_BYTES
    spare = have - least  # shared between the batch's rows (two circuits, values, indices, masks) and the block
    per_source = 2 * row + 18 * V
    batch = min(SEARCH_BATCH, 1 + spare // (2 * per_source))
    return batch, min(chunk, row * (1 + (spare - (batch - 1) * per_source) // row))


def skip_trigrams(source: SourceLike, layer: int, head: int, *, top: int = 20, **options: Any) -> SkipTrigrams:
    """The ``top`` skip-trigrams of one head (:meth:`TrigramTable.top`; ``options`` go there:
    ``exclude=None`` leaves out the start token, special and byte-fallback tokens, ``exclude=()``
    nothing). ``.with_tokens(model)`` on the result shows token strings; ``.left_out`` says what was
    left out."""
    source = as_source(source, where="qkov.skip_trigrams")
    table = TrigramTable(source, layer, head)
    found = table.top(top, **options)
    return SkipTrigrams(found, f"{layer}.{head}", left_out=table.left_out_note(options.get("exclude")))


@dataclass
class SourceView:
    """For one source token: what it promotes (OV row) and who attends to it (QK column)."""

    source: int
    outputs: list[tuple[int, float]]  # (output token, centred logit), best first
    destinations: list[tuple[int, float]]  # (destination token, centred QK score), best first


def first_bug(trigrams: Sequence[SkipTrigram] | SkipTrigrams) -> tuple[SkipTrigram, SkipTrigram] | None:
    """Two trigrams of ``trigrams`` (a list, or what :func:`skip_trigrams` returns) with the same
    source but different destination and output."""
    if isinstance(trigrams, SkipTrigrams):
        trigrams = trigrams.trigrams
    for i, a in enumerate(trigrams):
        for b in trigrams[i + 1 :]:
            if a.source == b.source and a.destination != b.destination and a.output != b.output:
                return a, b
    return None


@dataclass(frozen=True)
class Bigram:
    token: int
    next: int
    logit: float  # direct-path logit, centred per row

    def to_dict(self, decode: Any = None) -> dict[str, Any]:
        d: dict[str, Any] = {"token": self.token, "next": self.next, "logit": self.logit}
        if decode is not None:
            d.update(token_str=decode(self.token), next_str=decode(self.next))
        return d


def bigrams(
    source: SourceLike, *, top: int = 20, exclude: tuple[int, ...] | None = None, max_bytes: int = DEFAULT_MAX_BYTES
) -> Bigrams:
    """The ``top`` strongest entries of the direct path ``W_E W_U`` (centred per row): the bigram
    model. Entries in an excluded token's row or column are skipped; when the largest entries
    sit there, more are fetched until ``top`` remain (or the matrix is exhausted). Its copies of the
    embedding and unembedding are checked against the memory budget first, and the row chunks
    shrink to fit it."""
    source = as_source(source, where="qkov.bigrams")
    V = source.cfg.d_vocab
    default_ids, default_note = left_out_tokens(source, V)
    note = default_note if exclude is None else (f"{len(exclude)} tokens left out" if exclude else "")
    exclude = default_ids if exclude is None else tuple(int(e) for e in exclude)
    least = bigram_bytes(source, chunk_rows=1)
    advice = "analyse a model with a smaller vocabulary"
    check_fits(least, source.device, "trigrams: the bigram table", advice, hint="memory")
    have, _ = memory_budget(source.device)
    if have is not None:
        max_bytes = min(max_bytes, V * item(source) * (1 + (have - least) // (V * item(source))))
    W_U = source.unembed().W_U
    B = W_U - W_U.mean(dim=-1, keepdim=True)
    keep = torch.ones(V, dtype=torch.bool)
    keep[list(exclude)] = False
    ids = keep.nonzero().squeeze(-1)
    if ids.numel() == 0:
        raise QkovError("bigrams: every token is left out")
    res = LowRank(source.embed(), B).topk(min(top, ids.numel() ** 2), max_bytes=max_bytes, rows=ids, cols=ids)
    entries = zip(res.values.tolist(), res.rows.tolist(), res.cols.tolist())
    return Bigrams([Bigram(r, c, v) for v, r, c in entries], left_out=note)


@dataclass(repr=False, eq=False)
class SkipTrigrams(Items, Shown):
    """What :func:`~qkov.analysis.circuits.trigrams.skip_trigrams` returns: ``trigrams``, the
    :class:`~qkov.analysis.circuits.trigrams.SkipTrigram` list of head ``head`` (``"layer.head"``), strongest first."""

    ITEMS: ClassVar[str] = "trigrams"
    trigrams: list[Any] = field(default_factory=list)
    head: str = ""
    left_out: str = ""  # which tokens the search left out ("the start token, 3 special ... left out")

    def to_dict(self, decode: Callable[[int], str] | None = None) -> dict[str, Any]:
        """``decode`` (``id -> str``; default: the one given to :meth:`with_tokens`) adds token strings."""
        d = decode or decoder(self)
        return {"head": self.head, "left_out": self.left_out, "trigrams": [t.to_dict(d) for t in self.trigrams]}


@dataclass(repr=False, eq=False)
class Bigrams(Items, Shown):
    """What :func:`~qkov.analysis.circuits.trigrams.bigrams` returns: ``bigrams``, the
    :class:`~qkov.analysis.circuits.trigrams.Bigram` list, strongest first."""

    ITEMS: ClassVar[str] = "bigrams"
    bigrams: list[Any] = field(default_factory=list)
    left_out: str = ""  # which tokens the table left out

    def to_dict(self, decode: Callable[[int], str] | None = None) -> dict[str, Any]:
        """``decode`` (``id -> str``; default: the one given to :meth:`with_tokens`) adds token strings."""
        d = decode or decoder(self)
        return {"left_out": self.left_out, "bigrams": [b.to_dict(d) for b in self.bigrams]}


@register(TEXT, SkipTrigrams)
def trigrams_text(tri: SkipTrigrams) -> str:
    d = decoder(tri)
    rows = [
        [token(d, t.source), token(d, t.destination), token(d, t.output), num(t.qk), num(t.ov), num(t.score)]
        for t in tri.trigrams
    ]
    title = f"skip-trigrams of head {tri.head}: [source] ... [destination] -> [output], strongest first"
    return title + "\n" + table(["source", "destination", "output", "qk", "ov", "score"], rows)


@register(TEXT, Bigrams)
def bigrams_text(bi: Bigrams) -> str:
    d = decoder(bi)
    rows = [[token(d, b.token), token(d, b.next), num(b.logit)] for b in bi.bigrams]
    return "bigrams of the direct path W_E W_U (centred logits):\n" + table(["token", "next", "logit"], rows)


def trigram_table_bytes(source: WeightSource) -> int:
    """What a :class:`~qkov.analysis.circuits.trigrams.TrigramTable` holds: its ``[d_vocab, d_head]``
    factors (and one block of the vocabulary while a streamed source is read)."""
    c = source.cfg
    read = 0 if source.in_memory else VOCAB_BLOCK * c.d_model
    return (8 * c.d_vocab * c.d_head + read) * item(source)


def trigram_search_bytes(source: WeightSource, *, batch: int, chunk_rows: int) -> int:
    """Peak of :meth:`~qkov.analysis.circuits.trigrams.TrigramTable.top` beyond the table: the bounds
    (float64), a screen of one circuit (its low-precision copies of the factors and a block of at most
    ``chunk_rows`` rows' bytes: :func:`~qkov.analysis.circuits.bounded.screen_bytes`), and ``batch``
    sources' rows of both circuits with their top-k indices and masks."""
    c, it = source.cfg, item(source)
    V, E = c.d_vocab, c.d_head
    screen = screen_bytes(V, V, E, chunk_rows * V * it, screen_dtype(source.device, source.dtype))
    return 32 * V + screen + 2 * batch * V * it + 2 * batch * V * 9


def bigram_bytes(source: WeightSource, *, chunk_rows: int) -> int:
    """Peak of :func:`~qkov.analysis.circuits.trigrams.bigrams`: the copied embedding and the centred
    unembedding (both read first from a streamed source), the top-k's screen of their product (its
    low-precision copies of both and a block: :func:`~qkov.analysis.circuits.bounded.screen_bytes`) and a
    chunk of ``chunk_rows`` exact rows."""
    c, it = source.cfg, item(source)
    V, D = c.d_vocab, c.d_model
    screen = screen_bytes(V, V, D, chunk_rows * V * it, screen_dtype(source.device, source.dtype))
    return ((2 if source.in_memory else 4) * V * D + chunk_rows * V) * it + screen
