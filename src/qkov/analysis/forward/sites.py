"""Named sites: every activation the analysis forward computes, addressed by one scheme for
reading (``trace(..., cache=[...])``) and writing (``trace(..., edits={...})``).

A site is a kind and, for the per-layer kinds, a layer: ``"pattern.1"`` (or ``("pattern", 1)``),
``"embed"``, ``"logits"``. Head-indexed kinds also take a head: ``"z.0.3"`` is head 3 of
``z.0`` (``out["z", 0][:, :, 3]``). Globs pick several: ``"pattern.*"``, ``"*.1"``, ``"resid_*"``;
a per-layer kind named alone (``"pattern"``, ``("z",)``, TransformerLens' short ``"attn_scores"``) is
that kind at every layer, as ``"pattern.*"`` (indexing a :class:`~qkov.analysis.forward.cache.Trace`
with it is refused: one site at a time, or ``stack()``).
TransformerLens hook names are accepted as aliases (``"blocks.1.attn.hook_pattern"``,
``"hook_embed"``, ``"ln_final.hook_scale"``, and its short names: ``("attn_scores", 1)``,
``("result", 0)``), and every site has TransformerLens' layout, so TransformerLens code ports
by search-and-replace. :data:`KINDS` lists each kind with its shape and its TransformerLens hook;
docs/conventions.md has the same table.

Which stream: a site holds the value of the weights view the recording reads. The default view of a
LayerNorm model centres the writers (TransformerLens' processed default), so ``embed``, ``pos``,
``resid_pre/mid/post``, ``head_out``, ``attn_out`` and ``mlp_out`` are the model's own values minus
their mean over ``d_model``; ``trace(..., stream="model")`` gives the model's own
(:func:`~qkov.analysis.forward.tracer.trace`).

Shapes: ``B`` batch, ``T`` positions, ``D`` d_model, ``H`` heads, ``K`` key/value heads (``H``
unless grouped-query), ``E`` d_head, ``M`` d_mlp, ``V`` d_vocab, ``G`` gate values per head (``E`` for an
elementwise gate, 1 headwise).
"""

from __future__ import annotations

import difflib
import fnmatch
import re
from dataclasses import dataclass
from typing import Any, Iterable

from ...errors import QkovError
from ...model.bus import source_count
from .address import Address

__all__ = ["Address", "BY_NAME", "COPIES", "Kind", "KINDS", "ROUTE_KINDS", "route_width", "Sites", "HEAD_INPUTS"]


@dataclass(frozen=True)
class Kind:
    """One kind of site: ``name``, ``shape`` (its layout), ``head_dim`` (the dimension of the head
    index, ``None`` if it has none), ``tl`` (the TransformerLens hook, ``{l}`` the layer), ``what``."""

    name: str
    shape: str
    head_dim: int | None
    tl: str
    what: str
    per_layer: bool = True


KINDS: tuple[Kind, ...] = (
    Kind("embed", "[B, T, D]", None, "hook_embed", "the token embedding W_E[tokens]", False),
    Kind("pos", "[B, T, D]", None, "hook_pos_embed", "the learned positions W_pos[:T] (standard, shortformer)", False),
    Kind("route_attn", "[B, T, R]", None, "", "a routed model's read weights for the attention's input (AttnRes: per source; hyper, mHC: per stream)"),
    Kind("mix_attn", "[B, T, N, N]", None, "", "hyper/mHC: the stream mixing M at the attention (H_new = M H + w out)"),
    Kind("write_attn", "[B, T, N]", None, "", "hyper/mHC: the attention output's weight on each stream"),
    Kind("resid_pre", "[B, T, D]", None, "blocks.{l}.hook_resid_pre", "the residual stream entering the block"),
    Kind("attn_scale", "[B, T, 1]", None, "blocks.{l}.ln1.hook_scale", "the attention input's normalisation divisor"),
    Kind("attn_in", "[B, T, D]", None, "blocks.{l}.ln1.hook_normalized", "the normalised input the values read"),
    Kind("qk_scale", "[B, T, 1]", None, "", "the query/key input's divisor (shortformer with normalisation)"),
    Kind("qk_in", "[B, T, D]", None, "", "the normalised input the queries and keys read"),
    Kind("q_input", "[B, T, H, D]", 2, "blocks.{l}.hook_q_input", "each head's own copy of resid_pre for its query"),
    Kind("k_input", "[B, T, K, D]", 2, "blocks.{l}.hook_k_input", "each key head's own copy of resid_pre"),
    Kind("v_input", "[B, T, K, D]", 2, "blocks.{l}.hook_v_input", "each value head's own copy of resid_pre"),
    Kind("q", "[B, T, H, E]", 2, "blocks.{l}.attn.hook_rot_q", "queries (after rotary)"),
    Kind("k", "[B, T, K, E]", 2, "blocks.{l}.attn.hook_rot_k", "keys (after rotary)"),
    Kind("v", "[B, T, K, E]", 2, "blocks.{l}.attn.hook_v", "values (b_V included)"),
    Kind("scores", "[B, H, T, T]", 1, "blocks.{l}.attn.hook_attn_scores", "q k^T / sqrt(E), -inf after the query"),
    Kind("lse", "[B, H, T]", 1, "", "log-sum-exp of each query's scores, pattern = exp(scores - lse); nothing reads it back"),
    Kind("pattern", "[B, H, T, T]", 1, "blocks.{l}.attn.hook_pattern", "attention pattern [query, key]"),
    Kind("gate", "[B, T, H, G]", 2, "", "gated attention: sigmoid(qk_in @ W_G + b_G) per head (G = E or 1)"),
    Kind("z", "[B, T, H, E]", 2, "blocks.{l}.attn.hook_z", "pattern @ values, per head (times the gate: what W_O reads)"),
    Kind("head_out", "[B, T, H, D]", 2, "blocks.{l}.attn.hook_result", "what each head writes, z @ W_O (no b_O)"),
    Kind("attn_out", "[B, T, D]", None, "blocks.{l}.hook_attn_out", "the attention's output: heads + b_O"),
    Kind("route_mlp", "[B, T, R]", None, "", "a routed model's read weights for the MLP's input"),
    Kind("mix_mlp", "[B, T, N, N]", None, "", "hyper/mHC: the stream mixing at the MLP"),
    Kind("write_mlp", "[B, T, N]", None, "", "hyper/mHC: the MLP output's weight on each stream"),
    Kind("resid_mid", "[B, T, D]", None, "blocks.{l}.hook_resid_mid", "the stream between attention and MLP"),
    Kind("mlp_input", "[B, T, D]", None, "blocks.{l}.hook_mlp_in", "the MLP's own copy of the stream it reads (before its norm)"),
    Kind("mlp_scale", "[B, T, 1]", None, "blocks.{l}.ln2.hook_scale", "the MLP input's normalisation divisor"),
    Kind("mlp_in", "[B, T, D]", None, "blocks.{l}.ln2.hook_normalized", "the MLP's normalised input"),
    Kind("mlp_pre", "[B, T, M]", None, "blocks.{l}.mlp.hook_pre", "pre-activations (a gated MLP: the gate's)"),
    Kind("mlp_linear", "[B, T, M]", None, "blocks.{l}.mlp.hook_pre_linear", "a gated MLP's linear factor"),
    Kind("mlp_hidden", "[B, T, M]", None, "blocks.{l}.mlp.hook_post", "hidden activations"),
    Kind("mlp_out", "[B, T, D]", None, "blocks.{l}.hook_mlp_out", "what the MLP writes (b_out included)"),
    Kind("resid_post", "[B, T, D]", None, "blocks.{l}.hook_resid_post", "the residual stream leaving the block"),
    Kind("route_final", "[B, T, R]", None, "", "a routed model's read weights for the final stream", False),
    Kind("resid_final", "[B, T, D]", None, "", "a routed model's final stream: the final read, before the final normalisation", False),
    Kind("final_scale", "[B, T, 1]", None, "ln_final.hook_scale", "the final normalisation's divisor", False),
    Kind("final", "[B, T, D]", None, "ln_final.hook_normalized", "the normalised final stream", False),
    Kind("logits", "[B, T, V]", None, "unembed.hook_out", "the logits", False),
)
BY_NAME: dict[str, Kind] = {k.name: k for k in KINDS}
HEAD_INPUTS = ("q_input", "k_input", "v_input")
"""Each head's own copy of the stream: ``H`` times a layer's stream in memory, and each head then
normalises its own copy, so a glob whose kind is a wildcard (``"*"``, ``"*.1"``) leaves them out;
name them to cache or edit them (``"q_input.1"``, ``"k_input.*"``)."""
COPIES = (*HEAD_INPUTS, "mlp_input")
"""The readers' own copies of the stream (:data:`HEAD_INPUTS` and the MLP's ``mlp_input``): an edit
of one changes what that reader sees and nothing else (the residual stream and the other readers
keep their value). A wildcard kind leaves them out; name them."""

ROUTE_KINDS = ("route_attn", "mix_attn", "write_attn", "route_mlp", "mix_mlp", "write_mlp", "route_final")
"""A routed model's bus coefficients (:mod:`qkov.model.bus`): cached and edited like any site; a tensor
edit freezes the routing."""

_TL_EXTRA = {"unembed.hook_in": "final", "blocks.{l}.attn.hook_q": "q", "blocks.{l}.attn.hook_k": "k"}
_TL_SHORT = {
    "attn_scores": "scores",
    "result": "head_out",
    "rot_q": "q",
    "rot_k": "k",
    "pre": "mlp_pre",
    "pre_linear": "mlp_linear",
    "post": "mlp_hidden",
    "pos_embed": "pos",
}
_TL: dict[str, str] = {k.tl: k.name for k in KINDS if k.tl} | _TL_EXTRA
_ROTARY_PRE = ("blocks.{l}.attn.hook_q", "blocks.{l}.attn.hook_k")


class Sites:
    """The sites one model has (some kinds exist only with normalisation, learned positions, MLPs,
    shortformer positions or gated MLPs) and the resolution of names, tuples, globs and aliases."""

    def __init__(self, cfg: Any, norm: str) -> None:
        self.cfg, self.norm = cfg, norm
        self.kinds = [k for k in KINDS if self._exists(k.name)]
        self.layer_names = self._forward_order()  # every site of kind and layer, in the forward's order
        self.order = {name: i for i, name in enumerate(self.layer_names)}

    def _exists(self, kind: str) -> bool:
        c, normed = self.cfg, self.norm != "none"
        mlp = c.d_mlp is not None
        routed, streams = c.residual != "sum", c.residual in ("hyper", "mhc")
        sequential = mlp and not c.parallel
        return {
            "route_attn": routed,
            "route_mlp": routed and sequential,
            "route_final": routed,
            "resid_final": routed,  # the sum's final stream is resid_post of the last layer
            "mix_attn": streams,
            "write_attn": streams,
            "mix_mlp": streams and sequential,
            "write_mlp": streams and sequential,
            "resid_post": not routed,  # a routed model has no one stream after a block
            "pos": c.positional in ("standard", "shortformer"),
            "attn_scale": normed,
            "final_scale": normed,
            "qk_scale": normed and c.positional == "shortformer",
            "mlp_scale": normed and mlp,
            "mlp_input": mlp,
            "resid_mid": mlp and not c.parallel,
            "mlp_in": mlp,
            "mlp_pre": mlp,
            "mlp_linear": mlp and c.gated_mlp,
            "mlp_hidden": mlp,
            "mlp_out": mlp,
            "gate": getattr(c, "gate", "none") != "none",
        }.get(kind, True)

    def _forward_order(self) -> list[str]:
        """Every site name in the order the forward computes it."""
        first = [k.name for k in self.kinds if not k.per_layer and k.name in ("embed", "pos")]
        last = [k.name for k in self.kinds if not k.per_layer and k.name not in ("embed", "pos")]
        per = [k.name for k in self.kinds if k.per_layer]
        return first + [f"{k}.{l}" for l in range(self.cfg.n_layers) for k in per] + last

    # ------------------------------------------------------------------ resolving
    def resolve(self, key: Any) -> list[Address]:
        """The addresses ``key`` names (one, or several for a glob); a one-line error otherwise."""
        if isinstance(key, Address):
            return [self._check(key, key.name)]
        if isinstance(key, tuple):
            return self._every_layer(self._from_parts(key, repr(key), bare=True))
        if not isinstance(key, str):
            raise QkovError(f"site {key!r}: give a name such as 'pattern.1' or a tuple such as ('pattern', 1)")
        if any(c in key for c in "*?["):
            kind_part = key.split(".")[0]
            skip_copies = kind_part not in COPIES  # a wildcard kind never takes the readers' copies
            found = [
                Address(*_split(n))
                for n in self.layer_names
                if fnmatch.fnmatchcase(n, key) and (not skip_copies or n.split(".")[0] not in COPIES)
            ]
            if not found and not any(fnmatch.fnmatchcase(k.name, kind_part) for k in self.kinds if k.per_layer):
                raise QkovError(f"no site matches {key!r}; sites are {self.summary()}")
            return found
        tl = self._from_tl(key)
        if tl is not None:
            return [tl]
        if key.startswith("blocks."):
            raise QkovError(
                f"no site {key!r}: not the TransformerLens hook of a qkov site (docs/conventions.md lists them; "
                "TransformerLens' optional per-head copy hook_attn_in has none: use q_input, k_input, v_input)"
            )
        return self._every_layer(self._from_parts(tuple(_split(key)), repr(key), bare=True))

    def resolve_all(self, keys: Iterable[Any]) -> list[Address]:
        """Every address of ``keys`` (a name, a ``(kind, layer[, head])`` tuple, or a collection of
        them), in forward order, once each."""
        if isinstance(keys, (str, Address)) or _is_key_tuple(keys):
            keys = [keys]
        seen: dict[str, Address] = {}
        for key in keys:
            for a in self.resolve(key):
                seen.setdefault(a.name, a)
        return sorted(seen.values(), key=lambda a: (self.order[Address(a.kind, a.layer).name], a.head or 0))

    def _from_parts(self, parts: tuple[Any, ...], shown: str, *, bare: bool = False) -> Address:
        """The address of ``(kind, layer[, head])``; with ``bare``, a per-layer kind alone is
        returned without a layer (for :meth:`_every_layer`) instead of refused."""
        if not parts or not isinstance(parts[0], str) or len(parts) > 3:
            raise QkovError(f"site {shown}: expected (kind, layer[, head]), e.g. ('pattern', 1)")
        kind = _TL_SHORT.get(parts[0], parts[0])
        kind = kind[5:] if kind.startswith("hook_") and kind[5:] in BY_NAME else kind
        try:
            nums = [int(p) for p in parts[1:]]
        except (TypeError, ValueError):
            raise QkovError(f"site {shown}: layer and head must be integers") from None
        if bare and not nums and kind in BY_NAME and BY_NAME[kind].per_layer:
            if kind not in {k.name for k in self.kinds}:
                self._check(Address(kind, 0), shown)  # raises: a kind this model lacks
            return Address(kind)
        return self._check(Address(kind, *nums), shown)

    def _every_layer(self, a: Address) -> list[Address]:
        """A per-layer kind without a layer (``"pattern"``) at every layer; any other address as it is."""
        if a.layer is None and BY_NAME[a.kind].per_layer:
            return [Address(a.kind, l) for l in range(self.cfg.n_layers)]
        return [a]

    def _from_tl(self, key: str) -> Address | None:
        m = re.fullmatch(r"blocks\.(\d+)\.(.+)", key)
        pattern, layer = (f"blocks.{{l}}.{m.group(2)}", int(m.group(1))) if m else (key, None)
        kind = _TL.get(pattern)
        if kind is None:
            return None
        if pattern in _ROTARY_PRE and self.cfg.positional == "rotary":
            raise QkovError(
                f"{key}: TransformerLens' hook_q/hook_k are before rotary; qkov's q and k are after it "
                f"(TransformerLens' hook_rot_q/hook_rot_k): use {kind}.{layer}"
            )
        return self._check(Address(kind, layer), key)

    def _check(self, a: Address, shown: str) -> Address:
        kind = BY_NAME.get(a.kind)
        if a.kind == "resid_post" and self.cfg.residual != "sum":
            raise QkovError(
                f"no site {shown}: a model with residual {self.cfg.residual!r} has no one stream after a block "
                "(resid_pre and resid_mid are each sublayer's input)"
            )
        if kind is None or kind.name not in {k.name for k in self.kinds}:
            hint = difflib.get_close_matches(a.kind, [k.name for k in self.kinds], n=1)
            why = "" if kind is None else " in this model"
            raise QkovError(
                f"no site {shown}{why}" + (f" (did you mean {hint[0]}?)" if hint else "") + f"; sites are {self.summary()}"
            )
        L = self.cfg.n_layers
        if kind.per_layer and (a.layer is None or not 0 <= a.layer < L):
            raise QkovError(f"site {shown}: {a.kind} needs a layer in 0..{L - 1} (the model has {L} layers)")
        if not kind.per_layer and a.layer is not None:
            raise QkovError(f"site {shown}: {a.kind} has no layer")
        if a.head is not None:
            heads = self.heads(a.kind)
            if kind.head_dim is None:
                raise QkovError(f"site {shown}: {a.kind} has no head index")
            if not 0 <= a.head < heads:
                raise QkovError(f"site {shown}: head {a.head} out of range (the site has {heads} heads)")
        return a

    def tl_name(self, a: Address) -> str:
        """The TransformerLens hook name of ``a``'s site (``"blocks.1.attn.hook_z"``; ``attn.hook_q`` in a
        model without rotary, ``attn.hook_rot_q`` with it), or its qkov name where TransformerLens has none."""
        kind = BY_NAME[a.kind]
        if a.kind in ("q", "k") and self.cfg.positional != "rotary":
            return f"blocks.{a.layer}.attn.hook_{a.kind}"
        return kind.tl.format(l=a.layer) if kind.tl else Address(a.kind, a.layer).name

    def heads(self, kind: str) -> int:
        """Heads along a head-indexed kind: key/value heads for ``k, v, k_input, v_input``."""
        return self.cfg.kv_heads if kind in ("k", "v", "k_input", "v_input") else self.cfg.n_heads

    def shape(self, kind: str, batch: int, seq: int, layer: int | None = None) -> tuple[int, ...]:
        """The shape of a ``kind`` site (at ``layer``) on ``batch`` sequences of ``seq`` tokens."""
        c = self.cfg
        dims = {"B": batch, "T": seq, "D": c.d_model, "H": c.n_heads, "K": c.kv_heads, "E": c.d_head}
        dims |= {"M": c.d_mlp or 0, "V": c.d_vocab, "1": 1, "G": c.gate_width, "N": c.n_streams, "R": route_width(c, kind, layer)}
        return tuple(dims[d] for d in BY_NAME[kind].shape.strip("[]").split(", "))

    def summary(self) -> str:
        per = [k.name for k in self.kinds if k.per_layer]
        glob = [k.name for k in self.kinds if not k.per_layer]
        return f"{', '.join(glob)} and, per layer 0..{self.cfg.n_layers - 1}, {', '.join(per)}"


def route_width(cfg: Any, kind: str, layer: int | None) -> int:
    """The last dimension of a ``route_*`` site: the streams (hyper, mHC) or the sources the AttnRes
    aggregation point reads (:func:`qkov.model.bus.source_count`); 0 for other kinds."""
    if not kind.startswith("route_") or cfg.residual == "sum":
        return 0
    if cfg.residual in ("hyper", "mhc"):
        return cfg.n_streams
    sequential = cfg.d_mlp is not None and not cfg.parallel
    s = cfg.sublayers if kind == "route_final" else (layer or 0) * (2 if sequential else 1) + (kind == "route_mlp")
    return source_count(cfg, s)


def _split(name: str) -> list[Any]:
    """``"pattern.1.3"`` -> ``["pattern", 1, 3]`` (non-integer parts left as strings, refused later)."""
    head, *rest = name.split(".")
    return [head, *(int(p) if p.lstrip("-").isdigit() else p for p in rest)]


def _is_key_tuple(keys: Any) -> bool:
    """``("pattern", 1)`` is one key; ``("pattern.1", "z.0")`` and ``()`` are collections of keys."""
    return (
        isinstance(keys, tuple)
        and len(keys) >= 2
        and isinstance(keys[0], str)
        and all(isinstance(k, int) for k in keys[1:])
    )
