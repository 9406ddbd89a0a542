"""One transformer block, written once: what the training model runs and what the analysis forward
runs, with the analysis forward's sites as its hook points.

A block reads the residual stream ``x [B, T, D]`` and adds to it: attention (its query/key and value
inputs normalised, queries and keys rotated for rotary positions, grouped-query key/value heads
shared, the causal softmax of ``q k^T / sqrt(d_head)``, each head's ``z @ W_O``) and, optionally, an
MLP; sequential (``x + attn``, then ``+ mlp`` of that) or parallel (both read ``x``). Shortformer
positions enter the query/key input only, never the values or the stream.

:class:`BlockPass` is that body. Every intermediate value passes through a **hook point**, named as
the analysis forward's sites (:mod:`qkov.analysis.forward.sites`: ``resid_pre``, ``attn_in``, ``qk_in``,
``q``, ``k``, ``v``, ``scores``, ``lse``, ``pattern``, ``gate``, ``z``, ``head_out``, ``attn_out``, ``resid_mid``,
``mlp_input``, ``mlp_in``, ``mlp_pre``, ``mlp_hidden``, ``mlp_out``, ``resid_post`` ...): :meth:`BlockPass.at`
passes a value through one, :meth:`BlockPass.active` says whether anything reads or writes it,
:meth:`BlockPass.fixed` gives a value that replaces it outright. Here they do nothing, so the
training model (:class:`qkov.Transformer`) runs this body as plain fused code: attention by
``scaled_dot_product_attention``, normalisation by ``F.layer_norm``/``F.rms_norm``. The analysis
forward (:func:`qkov.analysis.forward.tracer.trace`) subclasses it with its sites: the same body then
computes the scores and patterns a site asks for, freezes a normalisation's divisor, skips the queries
and keys of a pattern given as a tensor or the MLP of an output given as one, and runs the last
layer at a few query positions only (``rows``) when nothing reads it. A new residual scheme or gate
is one edit here, plus its sites.

Shapes: ``B`` batch, ``T`` positions, ``P`` query positions, ``H`` heads, ``K`` key/value heads,
``D`` d_model, ``E`` d_head.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from . import ops, rotary
from .bus import attention_point
from .config import ModelConfig
from .ops import (
    attention_scores,
    causal_attention,
    expand_kv,
    live_bias,
    masked_scores,
    mlp_hidden,
    mlp_output,
    mlp_preactivation,
    normalize,
    project_heads,
    query_key_stream,
    write_heads,
)

__all__ = ["ATTENTION_INSIDE", "BlockPass"]

# the hook points inside a layer's attention, between its input stream and its output
ATTENTION_INSIDE = (
    "attn_scale", "attn_in", "qk_scale", "qk_in", "q_input", "k_input", "v_input", "q", "k", "v", "scores", "lse",
    "pattern", "gate", "z", "head_out",
)  # fmt: skip


class BlockPass:
    """The block body of one forward pass (see the module docstring).

    ``cfg``: the model; ``norm``: how its stream is normalised before each reader (``none``,
    ``layernorm``, ``rmsnorm``, or a weights view's ``folded`` / ``scale``); ``pos [B, T, D]`` the
    learned positions (``None`` without them) and ``turn`` the rotary ``(cos, sin)`` tables, set by
    the caller for the sequence. Weights come from :meth:`attention_weights` and :meth:`mlp_weights`:
    anything with ``W_Q, W_K, W_V [K, D, E]`` (key/value heads as stored), ``W_O [H, E, D]``,
    ``b_Q, b_K, b_V, b_O``, ``ln_w, ln_b`` (``None`` where absent), and for the MLP ``W_in, b_in,
    W_gate, b_gate, W_out, b_out, ln_w, ln_b``."""

    def __init__(self, cfg: ModelConfig, norm: str) -> None:
        self.cfg, self.norm = cfg, norm
        self.group = cfg.n_heads // cfg.kv_heads
        self.pos: Tensor | None = None
        self.turn: tuple[Tensor, Tensor] | None = None
        self.bus: Any = None  # a routed model's residual bus (qkov.model.bus.BusPass); None: the sum
        self.past: tuple[Tensor, Tensor] | None = None  # keys, values [L, B', f, K, E] of f positions before x

    # ------------------------------------------------------------------ hook points (none here)
    def at(self, kind: str, layer: int | None, value: Tensor) -> Tensor:
        """``value`` through the hook point ``kind.layer``."""
        return value

    def active(self, kind: str, layer: int | None) -> bool:
        """Whether anything reads or writes the hook point ``kind.layer``."""
        return False

    def fixed(self, kind: str, layer: int | None) -> Tensor | None:
        """A value that replaces ``kind.layer`` outright (so what computes it can be skipped)."""
        return None

    def written(self, kind: str, layer: int | None) -> bool:
        """Whether something writes ``kind.layer`` (and may do so in place)."""
        return False

    def normed(self, prefix: str, layer: int | None, x: Tensor, w: Tensor | None, b: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """``x`` normalised for the reader ``prefix`` (``attn``, ``qk``, ``mlp``, ``final``) and the divisor
        used (``None`` when it ran fused or there is no normalisation)."""
        name = "final" if prefix == "final" else f"{prefix}_in"
        D, eps = x.shape[-1], self.cfg.ln_eps
        if self.norm == "none":
            out = x
        elif self.norm == "layernorm":
            out = F.layer_norm(x, (D,), w, b, eps)
        elif self.norm == "rmsnorm":
            out = F.rms_norm(x, (D,), w, eps)
        else:  # a weights view's folded forms: the divisor, no gain
            out = normalize(x, self.norm, eps)[0]
        return self.at(name, layer, out), None

    # ------------------------------------------------------------------ weights (the caller's)
    def attention_weights(self, layer: int) -> Any:
        raise NotImplementedError

    def mlp_weights(self, layer: int) -> Any:
        raise NotImplementedError

    # ------------------------------------------------------------------ attention
    def at_heads(self, kind: str, layer: int, x: Tensor) -> Tensor:
        """A ``[B, H, T, E]`` tensor through a hook point with TransformerLens' ``[B, T, H, E]`` layout."""
        return self.at(kind, layer, x.transpose(1, 2)).transpose(1, 2) if self.active(kind, layer) else x

    def head_input(self, kind: str, l: int, x: Tensor, normed: Tensor, W: Tensor, b: Tensor | None, ln: tuple) -> Tensor:
        """Queries, keys or values ``[B, n, T, E]`` of the normalised input ``normed``; through the per-head
        input ``{kind}_input`` when that hook point is used: each head's own copy of the stream ``x``
        (shortformer positions added after it, for queries and keys), normalised on its own."""
        if not self.active(f"{kind}_input", l):
            return project_heads(normed, W, live_bias(b))
        split = x[:, :, None, :].expand(-1, -1, W.shape[0], -1)
        if self.written(f"{kind}_input", l):  # an edit may write in place: each head its own memory
            split = split.clone()
        split = self.at(f"{kind}_input", l, split)
        if kind != "v":
            split = query_key_stream(split, None if self.pos is None else self.pos[:, :, None], self.cfg.positional)
        split = normalize(split, self.norm, self.cfg.ln_eps, w=ln[0], b=ln[1])[0]
        out = torch.einsum("btnd,nde->bnte", split, W)
        return out if b is None else out + b[:, None]

    def queries_keys(self, l: int, att: Any, x: Tensor, qk_in: Tensor) -> tuple[Tensor | None, Tensor | None]:
        """Queries ``[B, H, T, E]`` and keys ``[B, K, T, E]`` (rotated); ``None`` when the pattern is
        given as a value and nothing asks for them."""
        needs = ("q_input", "k_input", "q", "k", "scores", "lse")
        if self.fixed("pattern", l) is not None and not any(self.active(k, l) for k in needs):
            return None, None
        ln = (att.ln_w, att.ln_b)
        q = self.head_input("q", l, x, qk_in, att.W_Q, att.b_Q, ln)
        k = self.head_input("k", l, x, qk_in, att.W_K, att.b_K, ln)
        if self.turn is not None:
            q, k = rotary.rotate(q, *self.turn), rotary.rotate(k, *self.turn)
        return self.at_heads("q", l, q), self.at_heads("k", l, k)

    def with_past(self, l: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, int]:
        """Layer ``l``'s keys and values ``[B, K, T, E]`` after those of the positions before the sequence
        (:attr:`past`, when the pass runs a suffix; given for ``B / r`` sequences, each batch's ``r``
        copies read them), and how many positions come before."""
        if self.past is None:
            return k, v, 0
        f = self.past[0].shape[2]

        def joined(before: Tensor, now: Tensor) -> Tensor:
            B, n, T, E = now.shape
            out = now.new_empty(B, n, f + T, E)
            out[:, :, f:] = now
            out.view(B // before.shape[0], before.shape[0], n, f + T, E)[:, :, :, :f] = before.transpose(1, 2)
            return out

        return joined(self.past[0][l], k), joined(self.past[1][l], v), f

    @staticmethod
    def offset_attention(q: Tensor, k: Tensor, v: Tensor, at: Tensor) -> Tensor:
        """``z [B, H, P, E]`` of queries at key positions ``at [P]`` (each sees the keys at or before it;
        ``k`` and ``v`` expanded to the query heads)."""
        sees = torch.arange(k.shape[2], device=q.device)[None, :] <= at[:, None]  # [P, T]
        scale = 1.0 / ops.score_divisor(q.shape[-1])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=sees, scale=scale)

    def attend(self, l: int, q: Tensor | None, k: Tensor | None, v: Tensor) -> Tensor:
        """``z [B, H, T, E]``: fused attention, unless a hook point asks for the scores or the pattern.
        The hook point ``lse`` (each query's log-sum-exp of its scores) is the fused kernel's own when
        the attention runs fused, else the log-sum-exp of the scores; nothing reads it back. After a past
        (:attr:`past`; the forward asks no scores, pattern or ``lse`` then) the queries follow it."""
        if self.past is not None:
            T = v.shape[2]
            k, v, f = self.with_past(l, k, v)  # type: ignore[arg-type]
            at = torch.arange(f, f + T, device=v.device)
            return self.offset_attention(q, expand_kv(k, self.group, dim=1), expand_kv(v, self.group, dim=1), at)  # type: ignore[arg-type]
        v = expand_kv(v, self.group, dim=1)
        if not (self.active("scores", l) or self.active("pattern", l)):
            z, lse = causal_attention(q, expand_kv(k, self.group, dim=1), v, lse=self.active("lse", l))  # type: ignore[arg-type]
            if lse is not None:
                self.at("lse", l, lse)
            return z
        if q is None:
            B, H, T = v.shape[0], self.cfg.n_heads, v.shape[2]
            pattern = self.fixed("pattern", l).expand(B, H, T, T)  # type: ignore[union-attr]
        else:
            fresh = attention_scores(q, expand_kv(k, self.group, dim=1))  # type: ignore[arg-type]  # nothing else holds it
            scores = self.at("scores", l, masked_scores(fresh, inplace=True))
            if self.active("lse", l):
                self.at("lse", l, torch.logsumexp(scores.to(torch.promote_types(scores.dtype, torch.float32)), dim=-1))
            pattern = torch.softmax(scores, dim=-1)
        return self.at("pattern", l, pattern) @ v

    def gated(self, l: int, att: Any, qk_in: Tensor, z: Tensor, site: bool = True) -> Tensor:
        """``z [B, H, P, E]`` times the attention gate of its query positions (gated attention, Qiu et al.
        2025): ``sigmoid(qk_in @ W_G[h] + b_G[h])`` ``[B, H, P, G]`` (``G = E`` elementwise, 1 headwise)
        of the stream the queries read, ``qk_in [B, P, D]``, through the hook point ``gate`` (with
        ``site``); ``z`` itself for an ungated model."""
        W_G = getattr(att, "W_G", None)
        if W_G is None:
            return z
        gate = torch.sigmoid(project_heads(qk_in, W_G, live_bias(getattr(att, "b_G", None))))
        return z * (self.at_heads("gate", l, gate) if site else gate)

    def attention(self, l: int, x: Tensor) -> Tensor:
        """Layer ``l``'s attention output ``[B, T, D]`` (``b_O`` included) for the stream ``x``; not computed when
        an edit gives ``attn_out`` outright and nothing reads or writes a site inside the attention."""
        out = self.fixed("attn_out", l)
        if out is not None and not any(self.active(k, l) for k in ATTENTION_INSIDE):
            return self.at("attn_out", l, out.expand(*x.shape[:-1], out.shape[-1]))  # as a computed one is cached
        att = self.attention_weights(l)
        v_in, _ = self.normed("attn", l, x, att.ln_w, att.ln_b)
        qk_src = query_key_stream(x, self.pos, self.cfg.positional)
        if qk_src is x:
            qk_in = self.at("qk_in", l, v_in)
        else:
            qk_in = self.normed("qk", l, qk_src, att.ln_w, att.ln_b)[0]
        q, k = self.queries_keys(l, att, x, qk_in)  # before v: a shared input's gradient sums in the same order
        v = self.at_heads("v", l, self.head_input("v", l, x, v_in, att.W_V, att.b_V, (att.ln_w, att.ln_b)))
        z = self.at_heads("z", l, self.gated(l, att, qk_in, self.attend(l, q, k, v)))
        if self.active("head_out", l):
            per_head = self.at("head_out", l, torch.einsum("bhte,hed->bthd", z, att.W_O))
            out = per_head.sum(2) if att.b_O is None else per_head.sum(2) + att.b_O
        else:
            out = write_heads(z, att.W_O, live_bias(att.b_O))
        return self.at("attn_out", l, out)

    def attention_at(self, l: int, x: Tensor, rows: Tensor) -> Tensor:
        """Layer ``l``'s attention output at the query positions ``rows [P]`` only, ``[B, P, D]``: keys
        and values at every position (through their sites: they may be edited), queries, scores and outputs
        at those (the same values as :meth:`attention`'s rows); the queries and ``z`` pass their sites at those
        positions only (what the forward allows there: edits that act on each position alone or take the rows)."""
        att = self.attention_weights(l)
        v_in = self.normed("attn", l, x, att.ln_w, att.ln_b)[0]
        qk_src = query_key_stream(x, self.pos, self.cfg.positional)
        qk_in = v_in if qk_src is x else self.normed("qk", l, qk_src, att.ln_w, att.ln_b)[0]
        k = project_heads(qk_in, att.W_K, live_bias(att.b_K))
        q = project_heads(qk_in[:, rows], att.W_Q, live_bias(att.b_Q))
        if self.turn is not None:
            cos, sin = self.turn
            q, k = rotary.rotate(q, cos[rows], sin[rows]), rotary.rotate(k, cos, sin)
        q, k = self.at_heads("q", l, q), self.at_heads("k", l, k)  # the queries at those positions only
        v = self.at_heads("v", l, project_heads(v_in, att.W_V, live_bias(att.b_V)))
        k, v, f = self.with_past(l, k, v)  # keys at or before each query: those before the sequence too
        z = self.offset_attention(q, expand_kv(k, self.group, dim=1), expand_kv(v, self.group, dim=1), rows + f)
        z = self.gated(l, att, qk_in[:, rows], z, site=False)  # nothing reads the last layer's gate here
        return write_heads(self.at_heads("z", l, z), att.W_O, live_bias(att.b_O))

    # ------------------------------------------------------------------ MLP and the block
    def mlp(self, l: int, x: Tensor) -> Tensor | None:
        """Layer ``l``'s MLP output for the stream ``x`` it reads (``None`` without an MLP)."""
        if self.cfg.d_mlp is None:
            return None
        inside = ("mlp_input", "mlp_scale", "mlp_in", "mlp_pre", "mlp_linear", "mlp_hidden")
        out = self.fixed("mlp_out", l)
        if out is None or any(self.active(k, l) for k in inside):
            mlp = self.mlp_weights(l)
            if self.active("mlp_input", l):  # the MLP's own copy: an edit of it leaves the stream alone
                x = self.at("mlp_input", l, x.clone())
            m_in = self.normed("mlp", l, x, mlp.ln_w, mlp.ln_b)[0]
            pre, linear = mlp_preactivation(m_in, mlp.W_in, live_bias(mlp.b_in), mlp.W_gate, live_bias(mlp.b_gate))
            pre = self.at("mlp_pre", l, pre)
            linear = None if linear is None else self.at("mlp_linear", l, linear)
            hidden = self.at("mlp_hidden", l, mlp_hidden(self.cfg.act_fn, pre, linear))
            out = mlp_output(hidden, mlp.W_out, live_bias(mlp.b_out))
        return self.at("mlp_out", l, out)

    def block(self, l: int, x: Tensor, rows: Tensor | None = None) -> Tensor:
        """Block ``l`` on the stream ``x [B, T, D]`` -> ``[B, T, D]``; with ``rows [P]``, its output at
        those positions only, ``[B, P, D]`` (the last layer, when nothing reads it: its input passes
        ``resid_pre`` whole, its MLP and output stream pass their sites at the rows). A routed model
        (``self.bus`` set) reads and writes through its bus instead: ``x`` and ``rows`` are unused and
        the result is the bus's latest sublayer input (:meth:`routed`)."""
        if self.bus is not None:
            return self.routed(l)
        x = self.at("resid_pre", l, x)
        if rows is None:
            a = self.attention(l, x)
        else:
            a, x = self.attention_at(l, x, rows), x[:, rows]
        if self.cfg.parallel:  # attention and MLP both read the block's input
            m = self.mlp(l, x)
            x = x + a if m is None else x + a + m
        else:
            x = x + a
            if self.cfg.d_mlp is not None:
                x = x if rows is not None else self.at("resid_mid", l, x)
                x = x + self.mlp(l, x)  # type: ignore[operator]
        return self.at("resid_post", l, x)  # with rows: at those positions only

    def routed(self, l: int) -> Tensor:
        """Block ``l`` of a routed model: each sublayer reads its input from the bus (through ``resid_pre``,
        ``resid_mid``: the sublayer's input) and writes its output to it; returns the last input read."""
        bus, parallel = self.bus, self.cfg.parallel or self.cfg.d_mlp is None
        s = attention_point(self.cfg, l)
        x = self.at("resid_pre", l, bus.read(s))
        a = self.attention(l, x)
        if parallel:
            m = self.mlp(l, x)
            bus.write(s, [a] if m is None else [a, m])
            return x
        bus.write(s, [a])
        x = self.at("resid_mid", l, bus.read(s + 1))
        bus.write(s + 1, [self.mlp(l, x)])
        return x
