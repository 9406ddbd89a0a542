"""The canonical weights view: frozen tensors in the row convention of SPEC.md.

``Weights.from_model(model)`` copies every weight out of a model into one frozen
object with a leading layer dimension: ``W_E [d_vocab, d_model]``, ``W_pos [n_ctx,
d_model]``, ``W_Q/W_K/W_V [n_layers, n_heads, d_model, d_head]``, ``W_O [n_layers,
n_heads, d_head, d_model]``, ``W_in [n_layers, d_model, d_mlp]``, ``W_out [n_layers,
d_mlp, d_model]``, ``W_U [d_model, d_vocab]`` and biases (zeros where the model has
none). All analysis reads this view, never the module.

Options (each documented where it is applied):

* ``fold_ln`` — LayerNorm's gain and bias are folded into the weights that read the
  normalised stream (``W_Q, W_K, W_V``, ``W_in``, ``W_U``), whose rows are then
  centred (the normalised stream has zero mean, so this changes nothing). What stays
  is a pure "centre and divide by the standard deviation" at each LayerNorm.
* ``center_writing`` — the writers (``W_E``, ``W_pos`` for standard positions,
  ``W_O``, ``b_O``, ``W_out``, ``b_out``) have their mean over ``d_model`` removed.
  Exact for LayerNorm models (LN removes that mean anyway); it changes an LN-free model.
* ``center_unembed`` — ``W_U`` (and ``b_U``) lose their mean over the vocabulary, a
  change of logits by a per-position constant, which softmax ignores.

:func:`forward` runs a model from this view (the independent check that a view is
exact), and :meth:`Weights.rotate` applies an orthogonal change of basis of the
residual stream.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from .config import ModelConfig
from .errors import QkovError

if TYPE_CHECKING:  # pragma: no cover
    from .model import Transformer


@dataclass(frozen=True)
class Weights:
    """Frozen canonical weights; see the module docstring for shapes and options."""

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
    # LayerNorm as it stands in this view: "none", "layernorm" (affine w/b below),
    # "folded" (centre + scale, affine folded away) or "scale" (divide by the RMS only).
    norm: str = "none"
    ln1_w: Tensor | None = None  # [n_layers, d_model] (only when norm == "layernorm")
    ln1_b: Tensor | None = None
    ln2_w: Tensor | None = None
    ln2_b: Tensor | None = None
    lnf_w: Tensor | None = None  # [d_model]
    lnf_b: Tensor | None = None
    centered_writing: bool = False
    centered_unembed: bool = False

    # ---------------------------------------------------------------- build
    @classmethod
    def from_model(
        cls,
        model: "Transformer",
        *,
        fold_ln: bool = True,
        center_writing: bool = False,
        center_unembed: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> "Weights":
        """Copy ``model``'s weights into a view; see the module docstring for the options."""
        cfg = model.cfg
        dev = torch.device(device) if device is not None else model.W_E.device
        L, H, D, E = cfg.n_layers, cfg.n_heads, cfg.d_model, cfg.d_head

        def t(x: Tensor | None) -> Tensor | None:
            return None if x is None else x.detach().to(device=dev, dtype=dtype).clone()

        def stack(get, shape: tuple[int, ...]) -> Tensor:  # type: ignore[no-untyped-def]
            if L == 0:
                return torch.zeros(0, *shape, dtype=dtype, device=dev)
            parts = [get(b) for b in model.blocks]
            return torch.stack([torch.zeros(shape, dtype=dtype, device=dev) if p is None else t(p) for p in parts])

        blocks = model.blocks
        mlp = cfg.d_mlp is not None
        M = cfg.d_mlp or 0
        w = cls(
            cfg=cfg,
            W_E=t(model.W_E),  # type: ignore[arg-type]
            W_pos=t(model.W_pos),
            W_Q=stack(lambda b: b.attn.W_Q, (H, D, E)),
            W_K=stack(lambda b: b.attn.W_K, (H, D, E)),
            W_V=stack(lambda b: b.attn.W_V, (H, D, E)),
            W_O=stack(lambda b: b.attn.W_O, (H, E, D)),
            b_Q=stack(lambda b: b.attn.b_Q, (H, E)),
            b_K=stack(lambda b: b.attn.b_K, (H, E)),
            b_V=stack(lambda b: b.attn.b_V, (H, E)),
            b_O=stack(lambda b: b.attn.b_O, (D,)),
            W_U=t(model.W_U),  # type: ignore[arg-type]
            b_U=t(model.b_U) if model.b_U is not None else torch.zeros(cfg.d_vocab, dtype=dtype, device=dev),
            W_in=stack(lambda b: b.mlp.W_in, (D, M)) if mlp else None,
            b_in=stack(lambda b: b.mlp.b_in, (M,)) if mlp else None,
            W_out=stack(lambda b: b.mlp.W_out, (M, D)) if mlp else None,
            b_out=stack(lambda b: b.mlp.b_out, (D,)) if mlp else None,
            norm="layernorm" if cfg.normalization == "layernorm" else "none",
            ln1_w=stack(lambda b: b.ln1.w, (D,)) if cfg.normalization == "layernorm" else None,
            ln1_b=stack(lambda b: b.ln1.b, (D,)) if cfg.normalization == "layernorm" else None,
            ln2_w=stack(lambda b: b.ln2.w, (D,)) if (cfg.normalization == "layernorm" and mlp) else None,
            ln2_b=stack(lambda b: b.ln2.b, (D,)) if (cfg.normalization == "layernorm" and mlp) else None,
            lnf_w=t(model.ln_final.w) if model.ln_final is not None else None,
            lnf_b=t(model.ln_final.b) if model.ln_final is not None else None,
        )
        del blocks
        if fold_ln:
            w = w.fold_ln()
        if center_writing:
            w = w.center_writing_weights()
        if center_unembed:
            w = w.center_unembed()
        return w

    def replace(self, **changes: object) -> "Weights":
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    @property
    def n_layers(self) -> int:
        return self.cfg.n_layers

    @property
    def n_heads(self) -> int:
        return self.cfg.n_heads

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> "Weights":
        changes = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, Tensor):
                changes[f.name] = v.to(device=device, dtype=dtype)
        return self.replace(**changes)

    # ---------------------------------------------------------------- folding
    def fold_ln(self) -> "Weights":
        """Fold each LayerNorm's gain/bias into the weights that read its output; centre those readers."""
        if self.norm != "layernorm":
            return self

        ch: dict[str, Tensor | None | str] = {}
        if self.n_layers:
            assert self.ln1_w is not None and self.ln1_b is not None
            for name in ("Q", "K", "V"):
                W, b = getattr(self, f"W_{name}"), getattr(self, f"b_{name}")
                ch[f"W_{name}"], ch[f"b_{name}"] = fold_reader(W, b, self.ln1_w, self.ln1_b, read_dim=2)
            if self.W_in is not None:
                assert self.ln2_w is not None and self.ln2_b is not None and self.b_in is not None
                ch["W_in"], ch["b_in"] = fold_reader(self.W_in, self.b_in, self.ln2_w, self.ln2_b, read_dim=1)
        assert self.lnf_w is not None and self.lnf_b is not None
        ch["W_U"], ch["b_U"] = fold_reader(self.W_U, self.b_U, self.lnf_w, self.lnf_b, read_dim=0)
        ch.update(norm="folded", ln1_w=None, ln1_b=None, ln2_w=None, ln2_b=None, lnf_w=None, lnf_b=None)
        return self.replace(**ch)

    def center_writing_weights(self) -> "Weights":
        """Remove the mean over ``d_model`` from every writer (exact only under LayerNorm)."""

        def c(x: Tensor | None) -> Tensor | None:
            return None if x is None else x - x.mean(dim=-1, keepdim=True)

        ch: dict[str, object] = {"W_E": c(self.W_E), "W_O": c(self.W_O), "b_O": c(self.b_O), "centered_writing": True}
        if self.cfg.positional == "standard" or (self.W_pos is not None and self.norm != "none"):
            ch["W_pos"] = c(self.W_pos)
        if self.W_out is not None:
            ch["W_out"], ch["b_out"] = c(self.W_out), c(self.b_out)
        return self.replace(**ch)

    def center_unembed(self) -> "Weights":
        """Remove the mean over the vocabulary from ``W_U`` and ``b_U`` (softmax is unchanged)."""
        return self.replace(
            W_U=self.W_U - self.W_U.mean(dim=-1, keepdim=True), b_U=self.b_U - self.b_U.mean(), centered_unembed=True
        )

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
        if self.norm == "layernorm":
            raise QkovError("rotate: fold LayerNorm first (Weights.from_model(..., fold_ln=True, center_writing=True))")
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
        if self.norm == "folded":
            ch["norm"] = "scale"
        return self.replace(**ch)


def fold_reader(W: Tensor, b: Tensor, g: Tensor, beta: Tensor, read_dim: int) -> tuple[Tensor, Tensor]:
    """Fold a LayerNorm's gain ``g`` and bias ``beta`` into a reader ``W`` (bias ``b``); centre ``W``.

    ``W`` reads the normalised stream along ``read_dim`` (size d_model): ``(n * g + beta) @ W =
    n @ (g W) + beta @ W``; then the mean over ``read_dim`` is removed (``n`` has zero mean).
    Either stacked over layers (``g, beta [L, D]``; ``W [L, H, D, E]`` or ``[L, D, M]``) or one
    LayerNorm (``g, beta [D]``; ``W [D, V]``, ``[H, D, E]`` or ``[D, M]``, read along its
    second-to-last dim). Each output column folds on its own, so one head, one layer or a
    block of ``W_U``'s columns folds exactly as it would inside the whole.
    """
    new_b = b + (beta @ W if beta.ndim == 1 else _read(beta, W))
    new_W = W * g.reshape(_bshape(g, W, read_dim))
    new_W = new_W - new_W.mean(dim=read_dim, keepdim=True)
    return new_W, new_b


def _read(beta: Tensor, W: Tensor) -> Tensor:
    """``beta @ W`` for a per-layer bias ``beta [L, D]`` and reader ``W [L, H, D, E]`` or ``[L, D, M]``."""
    if W.ndim == 4:
        return torch.einsum("ld,lhde->lhe", beta, W)
    return torch.einsum("ld,ldm->lm", beta, W)


def _bshape(g: Tensor, W: Tensor, read_dim: int) -> list[int]:
    """Shape that broadcasts a gain ``g`` ([L, D] or [D]) along ``read_dim`` of ``W``."""
    shape = [1] * W.ndim
    if g.ndim == 2:
        shape[0] = g.shape[0]
    shape[read_dim] = g.shape[-1]
    return shape


# -------------------------------------------------------------------- forward
def normalize(x: Tensor, norm: str, eps: float, w: Tensor | None = None, b: Tensor | None = None) -> Tensor:
    """Apply the LayerNorm of a view: ``layernorm`` (affine), ``folded`` (centre + scale) or ``scale`` (RMS)."""
    if norm == "none":
        return x
    if norm == "layernorm":
        return F.layer_norm(x, (x.shape[-1],), w, b, eps)
    if norm == "folded":
        return F.layer_norm(x, (x.shape[-1],), None, None, eps)
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def forward(
    w: Weights, tokens: Tensor, *, patterns: Tensor | None = None, return_patterns: bool = False
) -> tuple[Tensor, Tensor | None]:
    """Logits ``[batch, seq, d_vocab]`` computed from a weights view (and patterns ``[L, B, H, T, T]``).

    An independent implementation of the model written head by head with einsum, used
    to check that folding, centring and rotation keep the model's function.
    """
    cfg = w.cfg
    tokens = tokens if tokens.ndim == 2 else tokens[None]
    T = tokens.shape[1]
    x = w.W_E[tokens]
    pos = w.W_pos[:T] if w.W_pos is not None else None
    if cfg.positional == "standard":
        x = x + pos
    eps = cfg.ln_eps
    mask = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
    kept = []
    for layer in range(cfg.n_layers):
        g1 = (w.ln1_w[layer], w.ln1_b[layer]) if w.norm == "layernorm" else (None, None)  # type: ignore[index]
        v_in = normalize(x, w.norm, eps, *g1)
        qk_in = normalize(x + pos, w.norm, eps, *g1) if cfg.positional == "shortformer" else v_in
        q = torch.einsum("btd,hde->bhte", qk_in, w.W_Q[layer]) + w.b_Q[layer][:, None]
        k = torch.einsum("btd,hde->bhte", qk_in, w.W_K[layer]) + w.b_K[layer][:, None]
        v = torch.einsum("btd,hde->bhte", v_in, w.W_V[layer]) + w.b_V[layer][:, None]
        if patterns is None:
            s = (q @ k.transpose(-1, -2)) / math.sqrt(cfg.d_head)
            p = torch.softmax(s.masked_fill(mask, float("-inf")), dim=-1)
        else:
            p = patterns[layer]
        kept.append(p)
        x = x + torch.einsum("bhte,hed->btd", p @ v, w.W_O[layer]) + w.b_O[layer]
        if w.W_in is not None:
            assert w.b_in is not None and w.W_out is not None and w.b_out is not None
            g2 = (w.ln2_w[layer], w.ln2_b[layer]) if w.norm == "layernorm" else (None, None)  # type: ignore[index]
            pre = normalize(x, w.norm, eps, *g2) @ w.W_in[layer] + w.b_in[layer]
            act = {"gelu": F.gelu, "relu": F.relu}.get(cfg.act_fn, lambda y: F.gelu(y, approximate="tanh"))
            x = x + act(pre) @ w.W_out[layer] + w.b_out[layer]
    gf = (w.lnf_w, w.lnf_b) if w.norm == "layernorm" else (None, None)
    logits = normalize(x, w.norm, eps, *gf) @ w.W_U + w.b_U
    return logits, (torch.stack(kept) if return_patterns and kept else None)
