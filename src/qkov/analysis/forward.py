"""The analysis forward: one pass over any :class:`~qkov.weights.WeightSource`, written once.

:func:`run` computes the model's logits from a weights view and records what an analysis
asks for (``record``): every head's attention pattern, every normalisation's divisor, each
head's values and output, each MLP's output, each layer's query/key input. It can also run
with parts of the computation frozen: attention patterns alone (``patterns=``), or
everything a previous run fixed (``frozen=``: its patterns, normalisation divisors and MLP
outputs), with each head adding a given output instead of its own (``head_outputs=``).
Path expansion, term importance, the QK-side split, the head detectors, the probes and the
report all use it. ``observe=`` hands each layer's attention (:class:`LayerView`) to a callback
as it is computed, so scores can be accumulated layer by layer without holding any of it past
its layer (the streamed head detectors). The layer-level pieces (:func:`project`, :func:`read`,
:func:`head_writes`) are what the path expansion applies to single stream terms.

The training model (:class:`qkov.Transformer`) has its own fused forward; a test checks the
two against each other. The shared operations (mask, softmax, activations, normalisation,
loss) live in :mod:`qkov.model.ops`.

Shapes: ``B`` batch, ``T`` positions, ``L`` layers, ``H`` heads, ``D`` d_model, ``E`` d_head,
``V`` d_vocab.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import QkovError
from ..model import rotary
from ..model.ops import attention_pattern, attention_scores, normalize
from ..model.tokens import check_tokens
from ..weights.parts import AttentionWeights, WeightSource

RECORDABLE: tuple[str, ...] = ("patterns", "scales", "values", "head_outputs", "mlp_outputs", "qk_inputs")
"""What :func:`run` can record (see :class:`Run` for shapes)."""


@dataclass
class Scales:
    """The divisor of every normalisation on a run (``sqrt(var + eps)``, or the RMS in a ``scale``
    view): ``attn_v`` the attention's value input, ``attn_qk`` its query/key input (different
    from ``attn_v`` only with shortformer positions), ``mlp`` the MLP's input, each
    ``[L, B, T, 1]``; ``final`` the unembedding's input ``[B, T, 1]``."""

    attn_v: Tensor
    attn_qk: Tensor
    mlp: Tensor | None
    final: Tensor


@dataclass
class LayerView:
    """One layer's attention on a run, as :func:`run` hands it to ``observe``: ``pattern [B, H, T, T]``,
    ``values [B, H, T, E]`` (``b_V`` included), ``qk_input [B, T, D]`` (normalised) and its
    divisor ``qk_scale [B, T, 1]`` (``None`` without normalisation)."""

    layer: int
    pattern: Tensor
    values: Tensor
    qk_input: Tensor
    qk_scale: Tensor | None


@dataclass
class Run:
    """One forward pass: ``tokens [B, T]``, ``logits [B, T, V]`` and what was recorded (else ``None``).

    * ``patterns [L, B, H, T, T]`` — attention patterns (query, key);
    * ``scales`` — :class:`Scales` (``None`` for a model without normalisation);
    * ``values [L, B, H, T, E]`` — each head's values, ``b_V`` included;
    * ``head_outputs [L, B, H, T, D]`` — what each head writes, ``pattern @ values @ W_O``
      (``b_V`` included through the row-stochastic pattern, ``b_O`` not: it belongs to the layer);
    * ``mlp_outputs [L, B, T, D]`` — what each MLP writes (biases included; ``None`` without MLPs);
    * ``qk_inputs [L, B, T, D]`` — each layer's normalised query/key input.
    """

    tokens: Tensor
    logits: Tensor
    patterns: Tensor | None = None
    scales: Scales | None = None
    values: Tensor | None = None
    head_outputs: Tensor | None = None
    mlp_outputs: Tensor | None = None
    qk_inputs: Tensor | None = None

    def divisor(self, site: str, layer: int | None = None) -> Tensor | None:
        """The recorded normalisation divisor at ``site`` (a :class:`Scales` field: ``attn_v``,
        ``attn_qk``, ``mlp``, ``final``), of ``layer`` for the per-layer sites; ``None`` for a
        model without normalisation."""
        if self.scales is None:
            return None
        s = getattr(self.scales, site)
        return s if layer is None or s is None else s[layer]


def flops_per_token(cfg: Any) -> int:
    """Floating-point operations of one token through the model (matrix products, attention over a
    full context, the unembedding): what sizes the default batches of the analyses."""
    L, D, HE, M, V, T = cfg.n_layers, cfg.d_model, cfg.n_heads * cfg.d_head, cfg.d_mlp or 0, cfg.d_vocab, cfg.n_ctx
    return 2 * (L * (4 * D * HE + 2 * D * M + T * HE) + D * V)


# ------------------------------------------------------------------ layer pieces
def project(x: Tensor, W: Tensor, b: Tensor | None = None) -> Tensor:
    """``x [B, T, D]`` through per-head ``W [H, D, E]`` (plus ``b [H, E]``) -> ``[B, H, T, E]``."""
    out = torch.einsum("btd,hde->bhte", x, W)
    return out if b is None else out + b[:, None]


def head_writes(pattern: Tensor, v: Tensor, W_O: Tensor) -> Tensor:
    """Each head's output ``[B, H, T, D]``: ``pattern [B, H, T, T] @ v [B, H, T, E] @ W_O [H, E, D]``."""
    return torch.einsum("bhte,hed->bhtd", pattern @ v, W_O)


def head_terms(source: WeightSource, run: "Run", layer: int, x: Tensor, heads: list[int] | None = None) -> Tensor:
    """What each head of ``layer`` (or only ``heads``) writes for one stream term ``x [B, T, D]``
    alone, with the run's patterns and normalisation divisors frozen, no biases: ``[h, B, T, D]``."""
    att = source.attention(layer)
    pattern = run.patterns[layer]  # type: ignore[index]
    W_V, W_O = att.W_V, att.W_O
    if heads is not None:
        pattern, W_V, W_O = pattern[:, heads], W_V[heads], W_O[heads]
    v = project(read(x, source.norm, run.divisor("attn_v", layer)), W_V)
    return head_writes(pattern, v, W_O).transpose(0, 1)


def read(x: Tensor, norm: str, scale: Tensor | None) -> Tensor:
    """A reader's (linear) view of a stream term ``x [B, T, D]`` with the normalisation's divisor
    frozen at ``scale [B, T, 1]``: centred and divided (``folded``), divided (``scale``), or
    ``x`` itself (``none``). Summed over terms, it gives the real normalised input."""
    if norm == "layernorm":
        raise QkovError("a frozen read needs a weights view with LayerNorm folded (fold_ln=True)")
    return normalize(x, norm, 0.0, scale=scale)[0] if scale is not None else x


def _check_record(record: Iterable[str]) -> frozenset[str]:
    want = frozenset(record)
    unknown = sorted(want - set(RECORDABLE))
    if unknown:
        raise QkovError(f"run: cannot record {', '.join(unknown)} (choose from {', '.join(RECORDABLE)})")
    return want


def _check_patterns(patterns: Tensor, source: WeightSource, tokens: Tensor) -> Tensor:
    c, (b, t) = source.cfg, tokens.shape
    if patterns.ndim == 4:
        patterns = patterns[:, None]
    if (
        patterns.ndim != 5
        or patterns.shape[0] != c.n_layers
        or patterns.shape[2] != c.n_heads
        or patterns.shape[3:] != (t, t)
        or patterns.shape[1] not in (1, b)
    ):
        raise QkovError(
            f"patterns: expected shape [{c.n_layers}, {b}, {c.n_heads}, {t}, {t}], got {tuple(patterns.shape)}"
        )
    return patterns.to(device=source.device, dtype=source.dtype)


def queries_keys(att: AttentionWeights, qk_in: Tensor, turn: tuple[Tensor, Tensor] | None) -> tuple[Tensor, Tensor]:
    """Queries and keys ``[B, H, T, E]`` from the (normalised) query/key input ``qk_in [B, T, D]``,
    rotated by their positions when ``turn`` holds the rotary ``cos, sin`` tables."""
    q, k = project(qk_in, att.W_Q, att.b_Q), project(qk_in, att.W_K, att.b_K)
    if turn is not None:
        q, k = rotary.rotate(q, *turn), rotary.rotate(k, *turn)
    return q, k


def _attend(
    att: AttentionWeights,
    qk_in: Tensor,
    v: Tensor,
    pattern: Tensor | None,
    need_pattern: bool,
    turn: tuple[Tensor, Tensor] | None,
) -> tuple[Tensor | None, Tensor | None]:
    """The pattern (frozen or computed) and, when no pattern is wanted, the fused ``pattern @ v``."""
    if pattern is not None:
        return pattern, None
    q, k = queries_keys(att, qk_in, turn)
    if need_pattern:
        return attention_pattern(attention_scores(q, k)), None
    return None, F.scaled_dot_product_attention(q, k, v, is_causal=True)


# ------------------------------------------------------------------------- run
@dataclass
class _Pass:
    """One forward pass in progress: what is fixed (source, frozen parts, what to record) and
    what it has kept so far, layer by layer."""

    source: WeightSource
    want: frozenset[str]
    patterns: Tensor | None  # frozen [L, B|1, H, T, T]
    fixed: Scales | None  # frozen divisors
    mlp_frozen: Tensor | None  # frozen MLP outputs [L, B, T, D]
    head_override: Tensor | None  # [L, B, H, T, D] written instead of the heads' own outputs
    pos: Tensor | None  # [T, D]
    turn: tuple[Tensor, Tensor] | None  # rotary cos, sin [T, r]
    observe: Callable[[LayerView], None] | None = None
    kept: dict[str, Any] = field(default_factory=lambda: {"scales": []})

    def _keep(self, name: str, layer: int, value: Tensor) -> None:
        """Record ``value`` as layer ``layer``'s ``name`` (only what was asked for is held past its
        layer), into one ``[n_layers, ...]`` buffer: stacking a list at the end would hold two copies."""
        if name not in self.want:
            return
        if name not in self.kept:
            self.kept[name] = value.new_empty(self.source.cfg.n_layers, *value.shape)
        self.kept[name][layer] = value

    def _norm(self, x: Tensor, site: str, layer: int | None, w: Tensor | None, b: Tensor | None) -> Tensor:
        """Normalise at ``site`` (a :class:`Scales` field), with the frozen divisor when there is one."""
        frozen = None if self.fixed is None else getattr(self.fixed, site)
        scale = frozen if frozen is None or layer is None else frozen[layer]
        out, s = normalize(x, self.source.norm, self.source.cfg.ln_eps, scale=scale, w=w, b=b)
        if s is not None:
            self.kept["scales"].append((site, s))
        return out

    def attention(self, l: int, x: Tensor) -> Tensor:
        """Layer ``l``'s attention added to the stream ``x``."""
        att, cfg = self.source.attention(l), self.source.cfg
        v_in = self._norm(x, "attn_v", l, att.ln_w, att.ln_b)
        if cfg.positional == "shortformer":
            qk_in = self._norm(x + self.pos, "attn_qk", l, att.ln_w, att.ln_b)  # type: ignore[operator]
        else:
            qk_in = v_in
            if self.source.norm != "none":  # the query/key input is the value input: one divisor
                self.kept["scales"].append(("attn_qk", self.kept["scales"][-1][1]))
        v = project(v_in, att.W_V, att.b_V)
        per_head = "head_outputs" in self.want or self.head_override is not None
        frozen = None if self.patterns is None else self.patterns[l]
        need = per_head or "patterns" in self.want or self.observe is not None
        p, z = _attend(att, qk_in, v, frozen, need, self.turn)
        if self.observe is not None:
            qk_scale = self.kept["scales"][-1][1] if self.source.norm != "none" else None
            self.observe(LayerView(l, p, v, qk_in, qk_scale))  # type: ignore[arg-type]
        if per_head:
            outputs = head_writes(p, v, att.W_O)  # type: ignore[arg-type]  # [B, H, T, D]
            self._keep("head_outputs", l, outputs)
            written = (outputs if self.head_override is None else self.head_override[l]).sum(1)
        else:
            written = torch.einsum("bhte,hed->btd", p @ v if z is None else z, att.W_O)  # type: ignore[operator]
        for name, value in (("patterns", p), ("values", v), ("qk_inputs", qk_in)):
            self._keep(name, l, value)  # type: ignore[arg-type]
        return x + written + att.b_O

    def mlp(self, l: int, x: Tensor, into: Tensor | None = None) -> Tensor:
        """Layer ``l``'s MLP (or its frozen output) reading the stream ``x``, added to ``into``
        (default ``x``; a parallel block's MLP reads the block's input and adds to the stream
        attention already wrote to)."""
        into = x if into is None else into
        mlp = self.source.mlp(l)
        if mlp is None:
            return into
        if self.mlp_frozen is not None:
            out = self.mlp_frozen[l]
        else:
            out = mlp(self._norm(x, "mlp", l, mlp.ln_w, mlp.ln_b), self.source.cfg.act_fn)
        self._keep("mlp_outputs", l, out)
        return into + out

    def logits(self, x: Tensor) -> Tensor:
        unemb = self.source.unembed()
        return self._norm(x, "final", None, unemb.ln_w, unemb.ln_b) @ unemb.W_U + unemb.b_U

    def scales(self) -> Scales | None:
        """The divisors this pass used, stacked by site (the frozen ones when it had them)."""
        if self.fixed is not None or self.source.norm == "none":
            return self.fixed
        by_site: dict[str, list[Tensor]] = {"attn_v": [], "attn_qk": [], "mlp": [], "final": []}
        for site, s in self.kept["scales"]:
            by_site[site].append(s)
        final = by_site["final"][0]
        layer = {k: torch.stack(v) if v else final.new_zeros(0, *final.shape) for k, v in by_site.items()}
        return Scales(layer["attn_v"], layer["attn_qk"], layer["mlp"] if by_site["mlp"] else None, final)


@torch.no_grad()
def run(
    source: WeightSource,
    tokens: Tensor,
    *,
    record: Iterable[str] = ("patterns",),
    patterns: Tensor | None = None,
    frozen: Run | None = None,
    head_outputs: Tensor | None = None,
    observe: Callable[[LayerView], None] | None = None,
    positions: Tensor | None = None,
) -> Run:
    """Run the model of ``source`` on ``tokens [B, T]`` (or ``[T]``); see the module docstring.

    Args:
        record: names from :data:`RECORDABLE` to keep (default: the attention patterns).
        patterns: frozen attention patterns ``[L, B, H, T, T]`` (or ``[L, H, T, T]``, broadcast
            over the batch) used instead of the model's own.
        frozen: a previous run of the same tokens that recorded ``patterns`` and ``scales``
            (and ``mlp_outputs`` for a model with MLPs): its patterns, divisors and MLP
            outputs are used instead of being computed. With patterns, divisors and MLP
            outputs frozen, the logits are linear in the one-hot tokens.
        head_outputs: ``[L, B, H, T, D]``: each head adds this to the stream instead of its
            live output (the live output is still computed and can be recorded); ``b_O`` is
            added as usual. Used by the term-importance runs.
        observe: called with each layer's :class:`LayerView` as soon as it is computed.
        positions: ``[P]`` positions: the logits are unembedded there only (``Run.logits`` is then
            ``[B, P, d_vocab]``), for scores that read a few positions of long examples.
    Returns:
        :class:`Run`. Computed under ``torch.no_grad``.
    """
    cfg = source.cfg
    want = _check_record(record)
    tokens = check_tokens(tokens, cfg).to(source.device)
    if patterns is not None and frozen is not None:
        raise QkovError("run: give frozen patterns or a frozen run, not both")
    if frozen is not None:
        if frozen.patterns is None or (source.norm != "none" and frozen.scales is None):
            raise QkovError("run: a frozen run must have recorded its patterns and scales")
        if cfg.d_mlp is not None and frozen.mlp_outputs is None:
            raise QkovError("run: a frozen run of a model with MLPs must have recorded mlp_outputs")
        patterns = frozen.patterns
    if patterns is not None:
        patterns = _check_patterns(patterns, source, tokens)
    pos = source.pos()
    pos = pos[: tokens.shape[1]] if pos is not None else None
    fixed, mlp_frozen = (None, None) if frozen is None else (frozen.scales, frozen.mlp_outputs)
    turn = rotary.tables(cfg, tokens.shape[1], source.device, source.dtype) if cfg.positional == "rotary" else None
    state = _Pass(source, want, patterns, fixed, mlp_frozen, head_outputs, pos, turn, observe)
    x = F.embedding(tokens, source.embed())
    if cfg.positional == "standard":
        x = x + pos
    for l in range(cfg.n_layers):
        x = state.mlp(l, x, into=state.attention(l, x)) if cfg.parallel else state.mlp(l, state.attention(l, x))
    return _collect(source, tokens, state.logits(x if positions is None else x[:, positions.to(x.device)]), state)


def _collect(source: WeightSource, tokens: Tensor, logits: Tensor, state: _Pass) -> Run:
    """The :class:`Run` of what was asked for, per-layer lists stacked along a leading layer dim."""
    B, T = tokens.shape
    c = source.cfg

    def stacked(name: str, empty: tuple[int, ...]) -> Tensor | None:
        if name not in state.want:
            return None
        return state.kept.get(name, logits.new_zeros(0, *empty))

    H, D, E = c.n_heads, c.d_model, c.d_head
    return Run(
        tokens=tokens,
        logits=logits,
        patterns=stacked("patterns", (B, H, T, T)),
        scales=state.scales() if "scales" in state.want else None,
        values=stacked("values", (B, H, T, E)),
        head_outputs=stacked("head_outputs", (B, H, T, D)),
        mlp_outputs=stacked("mlp_outputs", (B, T, D)) if c.d_mlp is not None else None,
        qk_inputs=stacked("qk_inputs", (B, T, D)),
    )
