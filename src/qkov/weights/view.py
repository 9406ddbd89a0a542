"""The canonical weights view: frozen tensors in the row convention of docs/conventions.md.

``Weights.from_model(model)`` copies every weight out of a model (once: folding and centring
then change those copies in place) into one frozen object with a leading layer dimension:
``W_E [d_vocab, d_model]``, ``W_pos [n_ctx, d_model]``, ``W_Q [n_layers, n_heads, d_model,
d_head]``, ``W_K/W_V [n_layers, n_kv_heads, d_model, d_head]`` (``n_kv_heads = n_heads``
unless grouped-query), ``W_O [n_layers, n_heads, d_head, d_model]``, ``W_in [n_layers,
d_model, d_mlp]``, ``W_out [n_layers, d_mlp, d_model]``, ``W_U [d_model, d_vocab]`` and
biases (zeros where the model has none). All analysis reads this view (or the memory-mapped
:class:`~qkov.weights.LazyCheckpoint`) through the :class:`~qkov.weights.WeightSource` getters,
never the module.

Options (each documented where it is applied). The defaults give the weights TransformerLens
analyses (``process_weights_``): LayerNorm folded, writers centred for LayerNorm models,
unembedding centred; so composition and copying scores of the same model agree with it.

* ``fold_ln`` — LayerNorm's gain and bias are folded into the weights that read the
  normalised stream (``W_Q, W_K, W_V``, ``W_in``, ``W_U``), each of whose columns is then
  centred over ``d_model`` (the normalised stream has zero mean, so this changes nothing). What stays
  is a pure "centre and divide by the standard deviation" at each LayerNorm.
* ``center_writing`` — the writers (``W_E``; ``W_pos`` for standard positions, or for any
  positions in a normalised view; ``W_O``, ``b_O``, ``W_out``, ``b_out``) have their mean over
  ``d_model`` removed. Exact for LayerNorm models (LN removes that mean anyway); on a model
  without LayerNorm it would change the model's function, so it is refused there. Default:
  on for LayerNorm models, off otherwise.
* ``center_unembed`` (default on) — ``W_U`` (and ``b_U``) lose their mean over the vocabulary,
  a change of logits by a per-position constant, which softmax ignores.

:meth:`Weights.rotate` applies an orthogonal change of basis of the residual stream;
:func:`qkov.analysis.forward.tracer.trace` runs the model from any view (tests check that every
option keeps the model's function).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from ..device import pick_device
from ..errors import QkovError
from ..expect import expect_model, expect_source, float_dtype
from ..model.config import ModelConfig
from ..model.ops import expand_kv as expand
from ..model.transformer import Transformer
from .parts import (
    AttentionWeights,
    MLPWeights,
    Unembedding,
    WeightSource,
    centre_rows,
    check_head,
    fold_reader,
    writer_centring,
)

__all__ = ["Weights"]


@dataclass(frozen=True)
class Weights:
    """Frozen canonical weights; see the module docstring for shapes and options.

    A :class:`~qkov.weights.WeightSource` whose reads are views of the stacked tensors below.
    """

    in_memory: ClassVar[bool] = True
    cfg: ModelConfig
    W_E: Tensor
    W_pos: Tensor | None
    W_Q: Tensor
    W_K: Tensor
    W_V: Tensor
    W_O: Tensor
    b_Q: Tensor
    b_K: Tensor
    b_V: Tensor
    b_O: Tensor
    W_U: Tensor
    b_U: Tensor
    W_in: Tensor | None = None
    b_in: Tensor | None = None
    W_out: Tensor | None = None
    b_out: Tensor | None = None
    W_gate: Tensor | None = None  # [n_layers, d_model, d_mlp] (gated MLPs only)
    b_gate: Tensor | None = None
    W_G: Tensor | None = None  # [n_layers, n_heads, d_model, G] (gated attention only; G = d_head or 1)
    b_G: Tensor | None = None  # [n_layers, n_heads, G] (zeros where the model has no bias)
    # Normalisation as it stands in this view: "none", "layernorm" (affine w/b below), "rmsnorm"
    # (gain w below), "folded" (centre + scale, affine folded away) or "scale" (divide by the RMS only).
    norm: str = "none"
    ln1_w: Tensor | None = None  # [n_layers, d_model] (only when norm is "layernorm" or "rmsnorm")
    ln1_b: Tensor | None = None
    ln2_w: Tensor | None = None
    ln2_b: Tensor | None = None
    lnf_w: Tensor | None = None  # [d_model]
    lnf_b: Tensor | None = None
    centered_writing: bool = False
    centered_unembed: bool = False
    # What travels with the weights (not weights: left out of comparisons and the repr): the start
    # token the analyses prepend when not told otherwise, and the tokenizer (None when there is none).
    bos_token_id: int | None = dataclasses.field(default=None, compare=False)
    tokenizer: Any = dataclasses.field(default=None, compare=False, repr=False)
    default_prepend_bos: bool = dataclasses.field(default=True, compare=False, repr=False)
    # A routed model's residual-bus parameters (qkov.model.bus: name -> tensor, stacked over effective
    # sublayers), None for the plain sum; read by the analysis forward, never folded or centred.
    bus: dict[str, Tensor] | None = dataclasses.field(default=None, compare=False, repr=False)

    # ---------------------------------------------------------------- build
    @classmethod
    def from_model(
        cls,
        model: Transformer,
        *,
        fold_ln: bool = True,
        center_writing: bool | None = None,
        center_unembed: bool = True,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> "Weights":
        """Copy ``model``'s weights into a view; see the module docstring for the options.

        ``center_writing=None`` centres the writers of a LayerNorm model (where it is exact) and
        leaves a model without LayerNorm alone; ``True`` on a model without LayerNorm is refused. A looped
        model gives its unrolled view (``cfg.unrolled()``: layer ``l`` a copy of block ``l % n_layers``)."""
        expect_model("qkov.Weights.from_model", model)
        cfg = model.cfg.unrolled()
        center_writing = writer_centring(cfg, center_writing)
        dtype = float_dtype("qkov.Weights.from_model", dtype)
        try:
            dev = pick_device(device) if device is not None else model.W_E.device
        except QkovError as exc:
            raise QkovError(f"qkov.Weights.from_model: {exc}") from None
        L, H, D, E = cfg.n_layers, cfg.n_heads, cfg.d_model, cfg.d_head

        def t(x: Tensor | None) -> Tensor | None:  # a row-major copy, whatever x's strides
            return None if x is None else x.detach().to(dev, dtype).clone(memory_format=torch.contiguous_format)

        def stack(get, shape: tuple[int, ...]) -> Tensor:  # type: ignore[no-untyped-def]
            if L == 0:
                return torch.zeros(0, *shape, dtype=dtype, device=dev)
            parts = [get(b) for b in model.effective_blocks()]
            zeros = torch.zeros(shape, dtype=dtype, device=dev)
            return torch.stack([zeros if p is None else p.detach().to(device=dev, dtype=dtype) for p in parts])  # one copy

        mlp, M, KV = cfg.d_mlp is not None, cfg.d_mlp or 0, cfg.kv_heads
        norm = cfg.normalization  # "none", "layernorm" or "rmsnorm": the view starts unfolded
        affine = norm == "layernorm"
        gated, G = mlp and cfg.gated_mlp, cfg.gate_width
        w = cls(
            cfg=cfg,
            W_E=t(model.W_E),  # type: ignore[arg-type]
            W_pos=t(model.W_pos),
            W_Q=stack(lambda b: b.attn.W_Q, (H, D, E)),
            W_K=stack(lambda b: b.attn.W_K, (KV, D, E)),
            W_V=stack(lambda b: b.attn.W_V, (KV, D, E)),
            W_O=stack(lambda b: b.attn.W_O, (H, E, D)),
            b_Q=stack(lambda b: b.attn.b_Q, (H, E)),
            b_K=stack(lambda b: b.attn.b_K, (KV, E)),
            b_V=stack(lambda b: b.attn.b_V, (KV, E)),
            b_O=stack(lambda b: b.attn.b_O, (D,)),
            W_U=t(model.W_U),  # type: ignore[arg-type]
            b_U=t(model.b_U) if model.b_U is not None else torch.zeros(cfg.d_vocab, dtype=dtype, device=dev),
            W_in=stack(lambda b: b.mlp.W_in, (D, M)) if mlp else None,
            b_in=stack(lambda b: b.mlp.b_in, (M,)) if mlp else None,
            W_out=stack(lambda b: b.mlp.W_out, (M, D)) if mlp else None,
            b_out=stack(lambda b: b.mlp.b_out, (D,)) if mlp else None,
            W_gate=stack(lambda b: b.mlp.W_gate, (D, M)) if gated else None,
            b_gate=stack(lambda b: b.mlp.b_gate, (M,)) if gated else None,
            W_G=stack(lambda b: b.attn.W_G, (H, D, G)) if G else None,
            b_G=stack(lambda b: b.attn.b_G, (H, G)) if G else None,
            norm=norm,
            ln1_w=stack(lambda b: b.ln1.w, (D,)) if norm != "none" else None,
            ln1_b=stack(lambda b: b.ln1.b, (D,)) if affine else None,
            ln2_w=stack(lambda b: b.ln2.w, (D,)) if (norm != "none" and mlp) else None,
            ln2_b=stack(lambda b: b.ln2.b, (D,)) if (affine and mlp) else None,
            lnf_w=t(model.ln_final.w) if model.ln_final is not None else None,
            lnf_b=t(model.ln_final.b) if affine else None,
            bos_token_id=model.bos_token_id,
            tokenizer=model.tokenizer,
            default_prepend_bos=model.default_prepend_bos,
            bus=None if model.bus is None else {k: t(v) for k, v in model.bus.tensors().items()},  # type: ignore[misc]
        )
        if fold_ln:  # every tensor of w is its own copy: fold and centre in place, no second one
            w = w._fold_ln(inplace=True)
        if center_writing:
            w = w._center_writing(inplace=True)
        if center_unembed:
            w = w._center_unembed(inplace=True)
        return w

    @classmethod
    def from_source(cls, source: WeightSource) -> "Weights":
        """An in-memory view of any :class:`~qkov.weights.WeightSource` (a memory-mapped
        :class:`~qkov.weights.LazyCheckpoint`, say), read layer by layer into tensors allocated once:
        it takes the view's own memory plus one layer, never a model beside it. The view keeps the
        source's folding and centring (tested equal to ``from_model`` of the loaded model)."""
        expect_source("qkov.Weights.from_source", source)
        cfg = source.cfg
        L, H, KV, D, E, M = cfg.n_layers, cfg.n_heads, cfg.kv_heads, cfg.d_model, cfg.d_head, cfg.d_mlp or 0
        opts: dict[str, Any] = dict(dtype=source.dtype, device=source.device)
        shapes = {"W_Q": (H, D, E), "W_K": (KV, D, E), "W_V": (KV, D, E), "W_O": (H, E, D), "b_Q": (H, E), "b_K": (KV, E)}
        shapes |= {"b_V": (KV, E), "b_O": (D,), "ln1_w": (D,), "ln1_b": (D,)}
        if cfg.d_mlp is not None:
            shapes |= {"W_in": (D, M), "b_in": (M,), "W_out": (M, D), "b_out": (D,), "ln2_w": (D,), "ln2_b": (D,)}
            shapes |= {"W_gate": (D, M), "b_gate": (M,)} if cfg.gated_mlp else {}
        if cfg.gate_width:
            shapes |= {"W_G": (H, D, cfg.gate_width), "b_G": (H, cfg.gate_width)}
        out: dict[str, Any] = {k: torch.empty(L, *v, **opts) for k, v in shapes.items()}
        for l in range(L):
            att, mlp = source.attention(l, expand_kv=False), source.mlp(l)
            parts = {**vars(att), "ln1_w": att.ln_w, "ln1_b": att.ln_b}
            if mlp is not None:
                parts |= {**vars(mlp), "ln2_w": mlp.ln_w, "ln2_b": mlp.ln_b}
            for k in shapes:
                if parts.get(k) is None:
                    out[k] = None
                elif out[k] is not None:
                    out[k][l] = parts[k]
            del att, mlp, parts
        unemb = source.unembed()
        return cls(
            cfg=cfg, W_E=source.embed(), W_pos=source.pos(), W_U=unemb.W_U, b_U=unemb.b_U, lnf_w=unemb.ln_w,
            lnf_b=unemb.ln_b, norm=source.norm, centered_writing=source.centered_writing,
            centered_unembed=source.centered_unembed, bos_token_id=getattr(source, "bos_token_id", None),
            tokenizer=getattr(source, "tokenizer", None),
            default_prepend_bos=getattr(source, "default_prepend_bos", True), bus=getattr(source, "bus", None), **out,
        )  # fmt: skip

    def replace(self, **changes: object) -> "Weights":
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    @property
    def n_layers(self) -> int:
        return self.cfg.n_layers

    @property
    def n_heads(self) -> int:
        return self.cfg.n_heads

    @property
    def dtype(self) -> torch.dtype:
        return self.W_E.dtype

    @property
    def device(self) -> torch.device:
        return self.W_E.device

    def to(self, *args: Any, **kwargs: Any) -> "Weights":
        """Every tensor moved or cast as ``Tensor.to(*args, **kwargs)`` would: ``w.to(torch.float64)``,
        ``w.to("cuda")``, ``w.to(device, dtype)``, ``w.to(dtype=...)``."""
        changes = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, Tensor):
                changes[f.name] = v.to(*args, **kwargs)
            elif f.name == "bus" and v is not None:
                changes[f.name] = {k: t.to(*args, **kwargs) for k, t in v.items()}
        return self.replace(**changes)

    # ---------------------------------------------------------------- reading (WeightSource)
    def embed(self, rows: slice | None = None) -> Tensor:
        """``W_E [d_vocab, d_model]`` (or the block ``rows``): a view."""
        return self.W_E if rows is None else self.W_E[rows]

    def pos(self) -> Tensor | None:
        """``W_pos [n_ctx, d_model]`` or ``None``."""
        return self.W_pos

    def unembed(self, cols: slice | None = None) -> Unembedding:
        """``W_U``, ``b_U`` (all columns or the block ``cols``), and the final LayerNorm if unfolded."""
        W_U, b_U = (self.W_U, self.b_U) if cols is None else (self.W_U[:, cols], self.b_U[cols])
        return Unembedding(W_U, b_U, self.lnf_w, self.lnf_b)

    def attention(self, layer: int, head: int | None = None, *, expand_kv: bool = True) -> AttentionWeights:
        """Layer ``layer``'s attention, every head or only ``head`` (leading dim 1): views
        (``expand_kv``: see :meth:`WeightSource.attention`)."""
        check_head(self.cfg, layer, head)
        hs = slice(None) if head is None else slice(head, head + 1)
        ln = self._ln(self.ln1_w, self.ln1_b, layer)
        W_K, W_V, b_K, b_V = (x[layer] for x in (self.W_K, self.W_V, self.b_K, self.b_V))
        group = self.cfg.n_heads // self.cfg.kv_heads
        if head is not None:  # the query head's key/value head: a view
            kv = slice(head // group, head // group + 1)
            W_K, W_V, b_K, b_V = W_K[kv], W_V[kv], b_K[kv], b_V[kv]
        elif expand_kv:  # every query head's key/value weights, for this read only
            W_K, W_V, b_K, b_V = (expand(x, group) for x in (W_K, W_V, b_K, b_V))
        gate = {} if self.W_G is None else {"W_G": self.W_G[layer, hs], "b_G": self.b_G[layer, hs]}  # type: ignore[index]
        return AttentionWeights(
            self.W_Q[layer, hs], W_K, W_V, self.W_O[layer, hs], self.b_Q[layer, hs], b_K, b_V, self.b_O[layer], *ln, **gate
        )

    def _ln(self, w: Tensor | None, b: Tensor | None, layer: int) -> tuple[Tensor | None, Tensor | None]:
        """A reader's unfolded normalisation (gain, bias) at ``layer``; ``(None, None)`` when folded."""
        if self.norm not in ("layernorm", "rmsnorm"):
            return None, None
        return w[layer], (None if b is None else b[layer])  # type: ignore[index]

    def mlp(self, layer: int) -> MLPWeights | None:
        """Layer ``layer``'s MLP (views), or ``None`` for an attention-only model."""
        check_head(self.cfg, layer)
        if self.W_in is None:
            return None
        assert self.b_in is not None and self.W_out is not None and self.b_out is not None
        ln = self._ln(self.ln2_w, self.ln2_b, layer)
        gate = (None, None) if self.W_gate is None else (self.W_gate[layer], self.b_gate[layer])  # type: ignore[index]
        return MLPWeights(self.W_in[layer], self.b_in[layer], self.W_out[layer], self.b_out[layer], *ln, *gate)

    # ---------------------------------------------------------------- folding
    def fold_ln(self) -> "Weights":
        """Fold each normalisation's gain (and LayerNorm's bias) into the weights that read its
        output. LayerNorm's readers are then centred (its output has zero mean) and the view's norm
        becomes ``folded``; RMSNorm's are not (its output is not centred) and it becomes ``scale``."""
        return self._fold_ln(inplace=False)

    def _fold_ln(self, inplace: bool) -> "Weights":
        if self.norm not in ("layernorm", "rmsnorm"):
            return self
        ch: dict[str, Tensor | None | str] = {}
        if self.n_layers:
            assert self.ln1_w is not None
            for name in ("Q", "K", "V"):
                W, b = getattr(self, f"W_{name}"), getattr(self, f"b_{name}")
                ch[f"W_{name}"], ch[f"b_{name}"] = fold_reader(W, b, self.ln1_w, self.ln1_b, 2, inplace)
            if self.W_G is not None:  # the gate reads what W_Q reads: folded as W_Q is
                ch["W_G"], ch["b_G"] = fold_reader(self.W_G, self.b_G, self.ln1_w, self.ln1_b, 2, inplace)  # type: ignore[arg-type]
            if self.W_in is not None:
                assert self.ln2_w is not None and self.b_in is not None
                ch["W_in"], ch["b_in"] = fold_reader(self.W_in, self.b_in, self.ln2_w, self.ln2_b, 1, inplace)
            if self.W_gate is not None:
                assert self.ln2_w is not None and self.b_gate is not None
                ch["W_gate"], ch["b_gate"] = fold_reader(self.W_gate, self.b_gate, self.ln2_w, self.ln2_b, 1, inplace)
        assert self.lnf_w is not None
        ch["W_U"], ch["b_U"] = fold_reader(self.W_U, self.b_U, self.lnf_w, self.lnf_b, 0, inplace)
        ch.update(ln1_w=None, ln1_b=None, ln2_w=None, ln2_b=None, lnf_w=None, lnf_b=None)
        ch["norm"] = "folded" if self.norm == "layernorm" else "scale"
        return self.replace(**ch)

    def center_writing_weights(self) -> "Weights":
        """Remove the mean over ``d_model`` from every writer (exact only under LayerNorm: it
        changes a model without LayerNorm, which :meth:`from_model` therefore refuses)."""
        return self._center_writing(inplace=False)

    def _center_writing(self, inplace: bool) -> "Weights":
        def c(x: Tensor | None) -> Tensor | None:
            return centre_rows(x, inplace)

        ch: dict[str, object] = {"W_E": c(self.W_E), "W_O": c(self.W_O), "b_O": c(self.b_O), "centered_writing": True}
        if self.cfg.positional == "standard" or (self.W_pos is not None and self.norm != "none"):
            ch["W_pos"] = c(self.W_pos)
        if self.W_out is not None:
            ch["W_out"], ch["b_out"] = c(self.W_out), c(self.b_out)
        return self.replace(**ch)

    def center_unembed(self) -> "Weights":
        """Remove the mean over the vocabulary from ``W_U`` and ``b_U`` (softmax is unchanged)."""
        return self._center_unembed(inplace=False)

    def _center_unembed(self, inplace: bool) -> "Weights":
        mean = self.W_U.mean(dim=-1, keepdim=True)
        W_U = self.W_U.sub_(mean) if inplace else self.W_U - mean
        return self.replace(W_U=W_U, b_U=self.b_U - self.b_U.mean(), centered_unembed=True)

    # ---------------------------------------------------------------- rotation
    def rotate(self, R: Tensor) -> "Weights":
        """Change the residual stream's basis by an orthogonal ``R [d_model, d_model]``.

        Writers become ``W R`` and readers ``R^T W`` (``W_E R``, ``W_pos R``, ``W_O R``,
        ``W_out R``, ``R^T W_Q`` ...). Logits are unchanged (tested) for LayerNorm-free
        models. LayerNorm has a privileged direction (the all-ones vector it subtracts),
        so a LayerNorm model must first be folded and centred (``fold_ln=True,
        center_writing=True``): its stream then has zero mean, LayerNorm reduces to
        division by the RMS, and the rotated view keeps only that ("scale").
        """
        D = self.cfg.d_model
        if R.shape != (D, D):
            raise QkovError(f"rotate: expected R of shape [{D}, {D}], got {tuple(R.shape)}")
        R = R.to(device=self.W_E.device, dtype=self.W_E.dtype)
        eye = torch.eye(D, dtype=R.dtype, device=R.device)
        tol = 1e-4 if R.dtype == torch.float32 else 1e-10
        if (R.T @ R - eye).abs().max() > tol:
            raise QkovError("rotate: R is not orthogonal (R^T R != I)")
        if self.cfg.residual != "sum":  # the bus's key and stream norms have per-dimension gains
            raise QkovError(f"rotate: a model with residual {self.cfg.residual!r} has a privileged basis (its bus normalises)")
        if self.norm in ("layernorm", "rmsnorm"):
            raise QkovError("rotate: fold the normalisation first (Weights.from_model(..., fold_ln=True))")
        if self.norm == "folded" and not self.centered_writing:
            raise QkovError("rotate: LayerNorm's centring breaks rotation unless the writing weights are centred")
        ch: dict[str, object] = {
            "W_E": self.W_E @ R,
            "W_Q": R.T @ self.W_Q,
            "W_K": R.T @ self.W_K,
            "W_V": R.T @ self.W_V,
            "W_O": self.W_O @ R,
            "b_O": self.b_O @ R,
            "W_U": R.T @ self.W_U,
        }
        if self.W_pos is not None:
            ch["W_pos"] = self.W_pos @ R
        if self.W_in is not None:
            assert self.W_out is not None and self.b_out is not None
            ch.update(W_in=R.T @ self.W_in, W_out=self.W_out @ R, b_out=self.b_out @ R)
        if self.W_gate is not None:
            ch["W_gate"] = R.T @ self.W_gate
        if self.W_G is not None:
            ch["W_G"] = R.T @ self.W_G
        if self.norm == "folded":
            ch["norm"] = "scale"
        return self.replace(**ch)
