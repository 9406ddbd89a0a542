"""The masked pass: ``K`` circuits run as ``K`` copies of a batch of prompts in one forward pass, each
receiver of copy ``k`` reading its senders through the copy's coefficients (circuit evaluation, :mod:`.evaluate`).

Receiver ``r`` of copy ``k`` reads ``x_r + sum_s W[k, s, r] (a~_s - a_s)``: ``x_r`` its input in the pass,
``a_s`` sender ``s``'s output in the pass, ``a~_s`` its replacement. That is also ``x_r(all ablated) + sum_s
(W[k, s, r] - 1) (a~_s - a_s)``, with ``x_r(all ablated)`` the same in every pass (computed once:
:func:`~.senders.ablated_streams`). Each receiver takes the form with fewer non-zero coefficients, so one
with every edge kept reads the stream as it is, one with every edge ablated its precomputed input (for a
head, its precomputed query, key or value) and the others a masked sum.

What a pass does beyond the forward (``N = B T`` tokens of ``D`` numbers):

* each sender some receiver reads writes its change ``a~_s - a_s`` into one buffer ``[K, n, B, T, D]``
  as the pass makes it, once: a layer's heads from the layer's ``z``, ``(z~_h - z_h) W_O^h``, one batched
  product (:func:`~.senders.head_changes`; the forward's per-head outputs are never formed);
* at each layer's input, one matrix product ``[r, n] x [n, N D]`` per copy over the changes of the ``n``
  earlier senders its computed receivers read (gathered first when fewer than half of them): the layer's
  key and value receivers, its query receivers, and the part of its MLP's input the earlier senders give
  (the layer's own heads are added at the MLP, so no change is read twice for one layer);
* each computed receiver is normalised and projected on its own (its query, key or value alone);
* the last layer runs its queries, attention output, MLP and final stream at the metric's positions only
  (:func:`~qkov.analysis.forward.edits.at_rows`): its query receivers, its MLP input and the logits read
  the senders' changes there only.

A pass starts at ``start``, the first layer a copy of it changes, from the base run's stream there (the
senders before it are the base run's: their changes are formed from the kept ``z`` and outputs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from ..causal.contrast import Contrast
from ..forward.address import Address
from ..forward.edits import at_rows
from .graph import Graph
from .head_inputs import HeadProjector
from .senders import SenderSet, head_changes, io_index

__all__ = ["first_layers", "MaskedPass", "Prepared"]

GATHER = 0.5  # a product gathers the changes it reads when they are fewer than this share of the senders before it
CHUNK_BYTES = 8 << 20  # the inputs of a chunk of tokens, normalised and projected while in cache


@dataclass
class Prepared:
    """A batch of prompts made ready for masked passes: the ``contrast`` (base tokens, metric, base value),
    the replacement ``rep`` and the base run's senders ``base`` (:class:`~.senders.SenderSet`), the base
    run's layer inputs ``resid [L, B, T, D]``, and what a receiver with every edge ablated reads: ``streams``
    (:func:`~.senders.ablated_streams`) and ``heads`` (:func:`~.senders.ablated_heads`). Every position
    axis starts at ``since``, the first position a pass can change: ``past`` the base run's keys and values
    before it (``[L, B, since, K, E]`` each; ``None`` when ``since`` is 0)."""

    contrast: Contrast
    rep: SenderSet
    base: SenderSet
    resid: Tensor
    streams: dict[str, Tensor]
    heads: dict[tuple[int, str], Tensor]
    since: int = 0
    past: tuple[Tensor, Tensor] | None = None


def first_layers(graph: Graph, flat: Tensor) -> Tensor:
    """``[K]`` the first layer whose receivers copy ``k`` changes (``flat [K, E]`` or ``[K, T, E]``: each
    edge's coefficient, non-zero where it is changed): at most ``L - 1`` (a change of the logits alone runs
    the last layer at the metric's positions); ``L`` for a copy that changes nothing."""
    L = graph.cfg.n_layers
    layer = torch.tensor([L - 1 if r.kind == "logits" else r.layer for r in graph.receivers], device=flat.device)
    changed = flat != 0
    if changed.ndim == 3:
        changed = changed.any(1)
    at = torch.where(changed, layer[graph.dst.to(flat.device)], L)
    return at.amin(-1) if at.shape[-1] else torch.full(at.shape[:1], L, device=flat.device)


class MaskedPass:
    """One masked pass of ``K`` copies (see the module docstring): ``W [K, S, R]`` (``[K, S, R, T]`` per
    position) each edge's coefficient, dense; :meth:`run` gives the metric of each copy ``[K]``."""

    def __init__(self, prep: Prepared, graph: Graph, W: Tensor, start: int = 0) -> None:
        c, w, f = prep.contrast, prep.contrast.weights, prep.since
        self.p, self.g, self.w, self.start = prep, graph, w, start
        self.K, self.B, self.T = W.shape[0], c.base.shape[0], c.base.shape[1] - f  # the positions from f on
        self.W = W.to(device=w.device, dtype=w.dtype)[..., f:] if W.ndim == 4 else W.to(device=w.device, dtype=w.dtype)
        self.pos = W.ndim == 4
        S, dev = len(graph.senders), self.W.device
        self.fan = graph.fan_in.to(dev)  # senders into each receiver
        nz, no = self.W != 0, self.W != 1
        if self.pos:  # a sender counts when its coefficient is non-zero at any position
            nz, no = nz.any(-1), no.any(-1)
        no &= torch.arange(S, device=dev)[:, None] < self.fan  # [S, R]: only real edges
        self.ii = no.sum(1) < nz.sum(1)  # [K, R]: read from the fully ablated input
        self.active = torch.where(self.ii[:, None], no, nz)  # [K, S, R]: the senders each receiver reads
        self.some = self.active.any(1)  # [K, R]: computed from the senders' changes
        self.full = self.ii & ~self.some  # [K, R]: the fully ablated input
        needed = self.active.any(2).any(0)  # [S]
        self.order = needed.nonzero()[:, 0]  # the senders in the buffer, in sender order
        self.upto = torch.cat([needed.new_zeros(1, dtype=torch.long), needed.cumsum(0)]).tolist()  # rows before s
        D = graph.cfg.d_model
        self.diff = torch.empty(self.K, len(self.order), self.B, self.T, D, dtype=w.dtype, device=w.device)
        self.rows = None if c.positions is None else c.positions.to(dev) - f  # the metric's positions
        self.cur: Tensor | None = None  # the current layer's input [K*B, T, D]
        self.acc: dict[int, Tensor] = {}  # per copy: the earlier senders' part of the current MLP's input
        self.made: dict[str, list[tuple[int, Tensor, Tensor]]] = {}  # per kind: (copy, heads, [n, B, T, E])

    def run(self) -> Tensor:
        """The metric of each copy, ``[K]``."""
        c, s, p = self.p.contrast, self.start, self.p
        self._before()
        stream = None if s == 0 else p.resid[s].repeat(self.K, 1, 1)
        return c.measure(self.K, self.edits(), start=s or None, stream=stream, since=p.since, past=p.past)

    # ------------------------------------------------------------------ what receivers read
    def at(self, n: int) -> Tensor | None:
        """The positions a site of ``n`` positions holds (``None``: every one)."""
        return None if n == self.T else self.rows

    def coef(self, k: int, lo: int, hi: int, cols: Tensor) -> Tensor:
        """``[hi - lo, c(, T)]``: copy ``k``'s coefficients of senders ``lo .. hi-1`` into receivers ``cols``
        in the form each receiver reads (``W - 1`` from the fully ablated input)."""
        C = self.W[k, lo:hi][:, cols]
        ii = self.ii[k, cols]
        return torch.where(ii[:, None] if self.pos else ii, C - 1, C)

    def masked_sum(self, k: int, lo: int, C: Tensor, pos: Tensor | None) -> Tensor:
        """``[c, B, P, D]``: ``sum_s C[s - lo] (a~_s - a_s)`` over senders ``lo .. lo + len(C) - 1`` of copy
        ``k`` (``C [n, c]`` or ``[n, c, T]``), at positions ``pos`` (``None``: every one)."""
        a, b = self.upto[lo], self.upto[lo + len(C)]
        C = C[self.order[a:b] - lo]  # the senders in the buffer
        use = (C != 0).flatten(1).any(1)
        n_use = int(use.sum())
        D = self.diff[k, a:b]
        if pos is not None:
            D = D.index_select(2, pos)
            C = C if not self.pos else C.index_select(2, pos)
        if n_use < GATHER * len(C):  # few senders: gather them
            pick = use.nonzero()[:, 0]
            D, C = D.index_select(0, pick), C[pick]
        c, shape = C.shape[1], D.shape[1:]
        if self.pos:
            return torch.einsum("sbtd,sct->cbtd", D, C)
        return (C.T @ D.reshape(len(C), shape.numel())).view(c, *shape)

    def grouped(self, k: int, l: int, cols: Tensor) -> tuple[Tensor, list[int]]:
        """Head receivers ``cols`` of layer ``l`` (in receiver order) as :meth:`heads_from` takes them:
        queries and keys that read the stream as it is, those that read the fully ablated input, then values
        likewise; and where each of the four groups ends."""
        ii = self.ii[k, cols]
        is_v = cols - self.g.attention_receivers(l).start >= self.g.cfg.n_heads + self.g.cfg.kv_heads
        groups = [cols[~is_v & ~ii], cols[~is_v & ii], cols[is_v & ~ii], cols[is_v & ii]]
        return torch.cat(groups), torch.tensor([len(x) for x in groups]).cumsum(0).tolist()

    def heads_from(self, l: int, k: int, cols: Tensor, now: Tensor, pos: Tensor | None, mlp: int | None = None) -> None:
        """Copy ``k``'s head receivers ``cols`` of layer ``l`` (and the part of MLP receiver ``mlp``'s input the
        senders before the layer give): ``base + sum_s C[s, r] (a~_s - a_s)`` over the senders before the
        layer (``now [B, P, D]`` the stream as it is), normalised and projected each on its own, kept for the
        ``q`` / ``k`` / ``v`` sites (``self.made``); the MLP's part, without a base, in ``self.acc``. A chunk
        of tokens at a time, so that a chunk's inputs are normalised and projected while in cache."""
        g, f = self.g, self.p.since
        H, kv, r0 = g.cfg.n_heads, g.cfg.kv_heads, g.attention_receivers(l).start
        cols, ends = self.grouped(k, l, cols)
        r = len(cols)
        C = self.coef(k, 0, g.before(r0), cols if mlp is None else torch.cat([cols, cols.new_tensor([mlp])]))
        a, b = self.upto[0], self.upto[len(C)]
        C = C[self.order[a:b]]  # the senders in the buffer
        use = (C != 0).flatten(1).any(1)
        pick = use.nonzero()[:, 0] if int(use.sum()) < GATHER * len(C) else None
        C = C if pick is None else C[pick]
        D = self.diff[k, a:b] if pos is None else self.diff[k, a:b].index_select(2, pos)
        P, Dm = D.shape[2], D.shape[-1]
        M = self.B * P
        D = D.reshape(b - a, M, Dm)
        abl = self.p.streams[f"attn.{l}"] if pos is None else self.p.streams[f"attn.{l}"].index_select(1, pos)
        bases = (now.reshape(M, Dm), abl.reshape(M, Dm)) * 2
        if mlp is not None:
            self.acc[k] = now.new_empty(self.B, P, Dm)
        at = (cols - r0).tolist()
        kinds = ["q" if i < H else "k" if i < H + kv else "v" for i in at]
        slots = [i if i < H else (i - H) % kv for i in at]
        project = HeadProjector(self.w, l, kinds, slots, fused=True)
        out = now.new_empty(r, self.B, P, g.cfg.d_head)
        flat = out.view(r, M, g.cfg.d_head)
        where = (torch.arange(M, device=D.device) % P if pos is None else pos.repeat(self.B)) + f
        step = max(1, CHUNK_BYTES // (4 * (r + 1) * Dm))
        for t0 in range(0, M, step):
            t1 = min(M, t0 + step)
            Dc = D[:, t0:t1] if pick is None else D[:, t0:t1].index_select(0, pick)
            if self.pos:
                X = torch.einsum("umd,ucm->cmd", Dc, C[..., where[t0:t1] - f])
            else:
                X = (C.T @ Dc.reshape(len(C), (t1 - t0) * Dm)).view(C.shape[1], t1 - t0, Dm)
            for lo, hi, base in zip([0, *ends[:-1]], ends, bases):
                if hi > lo:
                    X[lo:hi] += base[t0:t1]
            if mlp is not None:
                self.acc[k].view(M, Dm)[t0:t1] = X[r]
            if r:
                flat[:, t0:t1] = project(X[:r], where[t0:t1])
        cuts = sorted({0, *ends, *(i for i in range(1, r) if kinds[i] != kinds[i - 1])} - {r})
        for lo, hi in zip(cuts, [*cuts[1:], r]):  # per run of one kind: the copy's heads and their values
            self.made.setdefault(kinds[lo], []).append((k, torch.tensor(slots[lo:hi]), out[lo:hi]))

    def layer_inputs(self, l: int, cur: Tensor) -> None:
        """At layer ``l``'s input ``cur [K*B, T, D]``: each copy's computed key and value receivers (and
        query receivers, but the last layer's), and the earlier senders' part of its MLP's input, from one
        product over the changes of the senders before the layer."""
        g, L = self.g, self.g.cfg.n_layers
        rs = g.attention_receivers(l)
        mlp = g.mlp_receiver(l) if g.mlp else None
        self.made, self.acc = {}, {}
        for k in range(self.K):
            some = self.some[k, rs.start : rs.stop].clone()
            if l == L - 1:
                some[: g.cfg.n_heads] = False  # the last layer's queries: at their site, at its positions
            cols = some.nonzero()[:, 0] + rs.start
            extra = mlp if mlp is not None and bool(self.some[k, mlp]) else None
            if len(cols) or extra is not None:
                self.heads_from(l, k, cols, cur.view(self.K, self.B, self.T, -1)[k], None, extra)

    # ------------------------------------------------------------------ the edits
    def _before(self) -> None:
        """The changes of the senders before ``start`` some receiver reads: the base run's, for every copy."""
        g, p = self.g, self.p
        first = g.head_sender(self.start) if self.start < g.cfg.n_layers else len(g.senders)
        for layer in range(self.start):
            h0 = g.head_sender(layer)
            mine = [int(s) for s in self.order if h0 <= s < h0 + g.cfg.n_heads]
            if mine:
                heads = torch.tensor(mine, device=self.W.device) - h0
                assert p.base.z is not None
                got = head_changes(self.w, layer, heads, p.base.z[layer].index_select(0, heads), p.rep)
                self.diff[:, self.upto[mine[0]] : self.upto[mine[-1] + 1]] = got
        for s in (int(s) for s in self.order if s < first):
            if s == 0 or (g.mlp and s == g.mlp_sender((s - 1) // g.per_layer)):
                i = io_index(g, s)
                self.diff[:, self.upto[s]] = p.rep.io[i] - p.base.io[i]

    def observe_input(self, l: int) -> Callable[[Tensor, Address], Tensor]:
        """``resid_pre.l``: the layer's input, and its receivers computed (layer 0: the input's change)."""

        def fn(value: Tensor, site: Address) -> Tensor:
            if l == 0 and self.upto[1]:  # the input is a sender some receiver reads
                now = value.view(self.K, self.B, self.T, -1)
                torch.sub(self.p.rep.io[0], now, out=self.diff[:, 0])
            self.cur = value
            self.layer_inputs(l, value)
            return value

        return fn

    def observe_heads(self, l: int) -> Callable[[Tensor, Address], Tensor] | None:
        """``z.l`` (``[K*B, P, H, E]``): the change of each head of layer ``l`` some receiver reads."""
        h0, H = self.g.head_sender(l), self.g.cfg.n_heads
        a, b = self.upto[h0], self.upto[h0 + H]
        if a == b:
            return None
        heads = self.order[a:b] - h0

        def fn(value: Tensor, site: Address) -> Tensor:
            pos = self.at(value.shape[1])
            z = value.unflatten(0, (self.K, self.B)).permute(0, 3, 1, 2, 4)  # [K, H, B, P, E]
            for k in range(self.K):
                mine = z[k].index_select(0, heads)
                if pos is None:
                    head_changes(self.w, l, heads, mine, self.p.rep, None, out=self.diff[k, a:b])
                else:
                    self.diff[k, a:b, :, pos] = head_changes(self.w, l, heads, mine, self.p.rep, pos)
            return value

        return at_rows(fn)

    def observe_mlp(self, l: int) -> Callable[[Tensor, Address], Tensor] | None:
        """``mlp_out.l`` (``[K*B, P, D]``): the MLP's change, when some receiver reads it."""
        s = self.g.mlp_sender(l)
        if self.upto[s] == self.upto[s + 1]:
            return None
        rep = self.p.rep.io[1 + l]

        def fn(value: Tensor, site: Address) -> Tensor:
            pos = self.at(value.shape[1])
            now = value.view(self.K, self.B, value.shape[1], -1)
            if pos is None:
                torch.sub(rep, now, out=self.diff[:, self.upto[s]])
            else:
                self.diff[:, self.upto[s], :, pos] = (rep if rep.shape[1] == 1 else rep.index_select(1, pos)) - now
            return value

        return at_rows(fn)

    def head_edit(self, l: int, kind: str) -> Callable[[Tensor, Address], Tensor] | None:
        """``q`` / ``k`` / ``v`` of layer ``l`` (``[K*B, P, n, E]``): heads with every edge in ablated read
        their precomputed value, computed heads theirs, the rest are left as they are; in place."""
        H, kv = self.g.cfg.n_heads, self.g.cfg.kv_heads
        off, n = {"q": (0, H), "k": (H, kv), "v": (H + kv, kv)}[kind]
        r0 = self.g.attention_receivers(l).start + off
        if not bool((self.some | self.full)[:, r0 : r0 + n].any()):
            return None
        late = kind == "q" and l == self.g.cfg.n_layers - 1  # computed here, at the site's positions

        def fn(value: Tensor, site: Address) -> Tensor:
            pos = self.at(value.shape[1])
            view = value.unflatten(0, (self.K, self.B))
            ablated = self.p.heads[l, kind] if pos is None else self.p.heads[l, kind].index_select(1, pos)
            for k in range(self.K):
                f = self.full[k, r0 : r0 + n].nonzero()[:, 0]
                if len(f):
                    view[k][:, :, f] = ablated[:, :, f]
            if late:
                self.late_queries(l, view, pos)
            for k, slots, new in self.made.get(kind, []):
                view[k][:, :, slots] = new.permute(1, 2, 0, 3).to(view)
            return value

        return at_rows(fn) if late else fn

    def late_queries(self, l: int, view: Tensor, pos: Tensor | None) -> None:
        """The last layer's computed query receivers, at the positions its queries run at."""
        r0, H = self.g.attention_receivers(l).start, self.g.cfg.n_heads
        assert self.cur is not None
        now = self.cur.view(self.K, self.B, self.T, -1)
        for k in range(self.K):
            cols = self.some[k, r0 : r0 + H].nonzero()[:, 0] + r0
            if len(cols):
                self.heads_from(l, k, cols, now[k] if pos is None else now[k].index_select(1, pos), pos)

    def stream_edit(self, r: int, name: str, lo: int) -> Callable[[Tensor, Address], Tensor] | None:
        """The edit of an MLP's input copy or of the final stream (receiver ``r``, fully ablated input
        ``streams[name]``; ``[K*B, P, D]``), its senders from ``lo`` on read here (those before: the
        layer's product, ``self.acc``); ``None`` when no copy changes it."""
        if not bool((self.some | self.full)[:, r].any()):
            return None
        rs = torch.tensor([r], device=self.W.device)

        def fn(value: Tensor, site: Address) -> Tensor:
            pos = self.at(value.shape[1])
            out = value.clone()
            view = out.view(self.K, self.B, value.shape[1], -1)
            abl = self.p.streams[name] if pos is None else self.p.streams[name].index_select(1, pos)
            for k in range(self.K):
                if self.full[k, r]:
                    view[k] = abl
                elif self.some[k, r]:
                    if self.ii[k, r]:
                        view[k] = abl
                    if k in self.acc and lo:
                        view[k] += self.acc[k] if pos is None else self.acc[k].index_select(1, pos)
                    C = self.coef(k, lo, int(self.fan[r]), rs)
                    if len(C) and bool((C != 0).any()):
                        view[k] += self.masked_sum(k, lo, C, pos)[0]
            return out

        return at_rows(fn)

    def edits(self) -> dict[str, Any]:
        g, L = self.g, self.g.cfg.n_layers
        edits: dict[str, Any] = {}
        for l in range(self.start, L):
            edits[f"resid_pre.{l}"] = self.observe_input(l)
            for kind in "qkv":
                fn = self.head_edit(l, kind)
                if fn is not None:
                    edits[f"{kind}.{l}"] = fn
            fn = self.observe_heads(l)
            if fn is not None:
                edits[f"z.{l}"] = fn
            if g.mlp:
                r = g.mlp_receiver(l)
                fn = self.stream_edit(r, f"mlp.{l}", g.before(g.attention_receivers(l).start))
                if fn is not None:
                    edits[f"mlp_input.{l}"] = fn
                fn = self.observe_mlp(l)
                if fn is not None:
                    edits[f"mlp_out.{l}"] = fn
        fn = self.stream_edit(g.logits_receiver, "logits", 0)
        if fn is not None:
            edits[f"resid_post.{L - 1}"] = fn
        return edits
