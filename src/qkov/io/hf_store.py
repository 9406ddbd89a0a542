"""A Hugging Face directory (GPT-NeoX, Llama, Mistral, Qwen2) read memory-mapped under qkov's names.

:class:`HFStore` offers what :class:`~qkov.io.tensorfile.TensorFile` offers (``entries``,
``shape``, ``read(name, index, cols)``) for the tensors of a qkov checkpoint of the same model —
``blocks.3.attn.W_Q [n_heads, d_model, d_head]`` and so on — while reading the directory's own
safetensors shards, so :class:`~qkov.weights.LazyCheckpoint` streams such a directory layer by
layer, one head or one block of the vocabulary at a time, with no conversion written to disk.
Each read copies only the rows or columns it needs out of the map (one head of ``q_proj`` is
``d_head`` contiguous rows) and rearranges them; bfloat16 and float16 stay as stored until the
caller casts the block it holds. Biases a family does not have read as zeros, as the in-memory
import gives them.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..errors import QkovError
from ..model.config import ModelConfig
from .hf_families import FAMILIES, family_config
from .tensorfile import TensorFile

__all__ = ["HFStore", "INDEX_FILE", "shard_paths", "WEIGHTS_FILE"]

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class _Recipe:
    """How one qkov tensor comes out of a stored one. ``kind``: ``plain`` (same layout), ``rows``
    (stored ``[heads * E, D]`` -> ``[heads, D, E]``), ``cols`` (stored ``[D, heads * E]`` ->
    ``[heads, E, D]``), ``bias`` (``[heads * E]`` -> ``[heads, E]``), ``fused`` (NeoX's
    ``[H * 3 * E, D]``, part ``part`` -> ``[H, D, E]``), ``fused_bias``, ``transpose`` (stored
    ``[n, m]`` -> ``[m, n]``) or ``zeros``."""

    kind: str
    shape: tuple[int, ...]  # the qkov shape
    stored: str = ""
    heads: int = 0
    part: int = 0


class HFStore:
    """The tensors of a Hugging Face directory under qkov's names (see the module docstring)."""

    def __init__(self, path: Path | str, hf_config: dict[str, Any] | None = None) -> None:
        self.path = Path(path)
        where = f"Hugging Face model {str(self.path)!r}"
        if hf_config is None:
            try:
                hf_config = json.loads((self.path / "config.json").read_text())
            except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
                raise QkovError(f"{where}: config.json is unreadable ({type(exc).__name__}: {exc})") from None
        assert hf_config is not None
        if hf_config.get("model_type") not in FAMILIES:
            raise QkovError(
                f"{where}: streaming reads {', '.join(FAMILIES)} directories; import other models first (qkov import)"
            )
        self.hf_config = hf_config
        self.cfg: ModelConfig = family_config(hf_config)
        self.files = [TensorFile(f) for f in shard_paths(self.path)]
        self._where: dict[str, TensorFile] = {n: f for f in self.files for n in f.entries}
        self.recipes = _recipes(self.cfg, hf_config, {n: f.shape(n) for n, f in self._where.items()}, where)
        self.entries = {name: r.shape for name, r in self.recipes.items()}

    @property
    def reads(self) -> Counter[str]:
        out: Counter[str] = Counter()
        for f in self.files:
            out.update(f.reads)
        return out

    @property
    def bytes_read(self) -> int:
        return sum(f.bytes_read for f in self.files)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.recipes[name].shape

    def _raw(self, name: str, index: int | slice | None = None, cols: slice | None = None) -> Tensor:
        return self._where[name].read(name, index, cols)

    def read(self, name: str, index: int | slice | None = None, cols: slice | None = None) -> Tensor:
        """Tensor ``name`` (qkov's name and layout): all of it, entry (or block) ``index`` of its
        leading dim, and/or the block ``cols`` of its last dim."""
        r = self.recipes[name]
        if r.kind == "zeros":
            out = torch.zeros(r.shape)
            out = out if index is None else out[index]
            return out if cols is None else out[..., cols]
        if r.kind == "plain":
            return self._raw(r.stored, index, cols)
        if r.kind == "transpose":  # a column block of ours is a row block of the stored tensor
            out = self._raw(r.stored, cols).T
            return out if index is None else out[index]
        E = r.shape[-1] if r.kind in ("rows", "fused", "bias", "fused_bias") else r.shape[1]
        heads = _head_range(index, r.heads)
        if r.kind == "rows":  # [heads * E, D] -> [h, D, E]
            out = self._raw(r.stored, slice(heads.start * E, heads.stop * E))
            out = out.view(-1, E, out.shape[-1]).transpose(1, 2)
        elif r.kind == "bias":
            out = self._raw(r.stored, slice(heads.start * E, heads.stop * E)).view(-1, E)
        elif r.kind == "cols":  # [D, heads * E] -> [h, E, D]
            out = self._raw(r.stored, cols=slice(heads.start * E, heads.stop * E))
            out = out.view(out.shape[0], -1, E).permute(1, 2, 0)
        elif r.kind == "fused":  # rows ordered (head, q/k/v, E)
            out = self._raw(r.stored, slice(heads.start * 3 * E, heads.stop * 3 * E))
            out = out.view(-1, 3, E, out.shape[-1])[:, r.part].transpose(1, 2)
        else:  # fused_bias
            out = self._raw(r.stored, slice(heads.start * 3 * E, heads.stop * 3 * E)).view(-1, 3, E)[:, r.part]
        out = out[0] if isinstance(index, int) else out
        return (out if cols is None else out[..., cols]).contiguous()


def _head_range(index: int | slice | None, heads: int) -> range:
    if index is None:
        return range(heads)
    if isinstance(index, int):
        return range(index, index + 1)
    return range(index.start or 0, heads if index.stop is None else index.stop)


def shard_paths(path: Path) -> list[Path]:
    """The safetensors files of a Hugging Face directory: ``model.safetensors``, or the shards its
    ``model.safetensors.index.json`` lists (each checked to exist inside the directory)."""
    where = f"Hugging Face model {str(path)!r}"
    single = path / WEIGHTS_FILE
    if single.is_file():
        return [single]
    index = path / INDEX_FILE
    if not index.is_file():
        other = [p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt", ".h5")]
        hint = f" (found {', '.join(sorted(other))}: qkov reads safetensors only, never pickle)" if other else ""
        raise QkovError(f"{where} has no {WEIGHTS_FILE}{hint}")
    try:
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise QkovError(f"{where}: {INDEX_FILE} is unreadable ({exc})") from None
    files = [path / n for n in names]
    for f in files:
        if f.resolve().parent != path.resolve():
            raise QkovError(f"{where}: shard {f.name!r} lies outside the directory")
        if not f.is_file():
            raise QkovError(f"{where}: shard {f.name} (listed in {INDEX_FILE}) is missing")
    return files


def _stored_shape(kind: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape the stored tensor must have for a recipe of ``kind`` giving ``shape``."""
    if kind == "rows":
        return (shape[0] * shape[2], shape[1])
    if kind == "cols":
        return (shape[2], shape[0] * shape[1])
    if kind == "bias":
        return (shape[0] * shape[1],)
    if kind == "fused":
        return (3 * shape[0] * shape[2], shape[1])
    if kind == "fused_bias":
        return (3 * shape[0] * shape[1],)
    if kind == "transpose":
        return (shape[1], shape[0])
    return shape


def _recipes(
    cfg: ModelConfig, hf: dict[str, Any], shapes: dict[str, tuple[int, ...]], where: str
) -> dict[str, _Recipe]:
    """qkov name -> recipe for every tensor of ``Transformer(cfg)``; every stored tensor used once."""
    stored = set(shapes)
    H, KV, E, D, F, V = cfg.n_heads, cfg.kv_heads, cfg.d_head, cfg.d_model, cfg.d_mlp or 0, cfg.d_vocab
    out: dict[str, _Recipe] = {}
    used: set[str] = set()

    def have(name: str) -> bool:
        return name in stored

    def take(ours: str, kind: str, shape: tuple[int, ...], name: str, heads: int = 0, part: int = 0) -> None:
        if name not in stored:
            if kind in ("bias", "fused_bias") or ours.endswith(("b_O", "b_in", "b_out", "b_gate")):
                out[ours] = _Recipe("zeros", shape)
                return
            raise QkovError(f"{where}: missing weight {name!r}")
        want = _stored_shape(kind, shape)
        if shapes[name] != want:
            raise QkovError(f"{where}: {name} has shape {shapes[name]}, expected {want} from config.json")
        used.add(name)
        out[ours] = _Recipe(kind, shape, name, heads, part)

    neox = hf.get("model_type") == "gpt_neox"
    take("W_E", "plain", (V, D), "gpt_neox.embed_in.weight" if neox else "model.embed_tokens.weight")
    for l in range(cfg.n_layers):
        p = f"blocks.{l}."
        if neox:
            h = f"gpt_neox.layers.{l}."
            for i, n in enumerate("QKV"):
                take(p + f"attn.W_{n}", "fused", (H, D, E), h + "attention.query_key_value.weight", H, i)
                take(p + f"attn.b_{n}", "fused_bias", (H, E), h + "attention.query_key_value.bias", H, i)
            take(p + "attn.W_O", "cols", (H, E, D), h + "attention.dense.weight", H)
            take(p + "attn.b_O", "plain", (D,), h + "attention.dense.bias")
            take(p + "mlp.W_in", "transpose", (D, F), h + "mlp.dense_h_to_4h.weight")
            take(p + "mlp.b_in", "plain", (F,), h + "mlp.dense_h_to_4h.bias")
            take(p + "mlp.W_out", "transpose", (F, D), h + "mlp.dense_4h_to_h.weight")
            take(p + "mlp.b_out", "plain", (D,), h + "mlp.dense_4h_to_h.bias")
            for hf_ln, ours in (("input_layernorm", "ln1"), ("post_attention_layernorm", "ln2")):
                take(p + ours + ".w", "plain", (D,), h + hf_ln + ".weight")
                take(p + ours + ".b", "plain", (D,), h + hf_ln + ".bias")
        else:
            h = f"model.layers.{l}."
            for n, heads in (("Q", H), ("K", KV), ("V", KV)):
                take(p + f"attn.W_{n}", "rows", (heads, D, E), h + f"self_attn.{n.lower()}_proj.weight", heads)
                take(p + f"attn.b_{n}", "bias", (heads, E), h + f"self_attn.{n.lower()}_proj.bias", heads)
            take(p + "attn.W_O", "cols", (H, E, D), h + "self_attn.o_proj.weight", H)
            take(p + "attn.b_O", "plain", (D,), h + "self_attn.o_proj.bias")
            for hf_name, ours, shape in (
                ("gate_proj", "gate", (D, F)),
                ("up_proj", "in", (D, F)),
                ("down_proj", "out", (F, D)),
            ):
                take(p + f"mlp.W_{ours}", "transpose", shape, h + f"mlp.{hf_name}.weight")
                take(p + f"mlp.b_{ours}", "plain", (shape[1],), h + f"mlp.{hf_name}.bias")
            take(p + "ln1.w", "plain", (D,), h + "input_layernorm.weight")
            take(p + "ln2.w", "plain", (D,), h + "post_attention_layernorm.weight")
    take("ln_final.w", "plain", (D,), "gpt_neox.final_layer_norm.weight" if neox else "model.norm.weight")
    if neox:
        take("ln_final.b", "plain", (D,), "gpt_neox.final_layer_norm.bias")
    head = next((n for n in ("lm_head.weight", "embed_out.weight") if have(n)), None)
    if bool(hf.get("tie_word_embeddings", False)):
        out["W_U"] = _Recipe("transpose", (D, V), out["W_E"].stored)
        if head is not None:
            used.add(head)
    elif head is not None:
        take("W_U", "transpose", (D, V), head)
    else:
        raise QkovError(f"{where}: missing weight 'lm_head.weight' (and the embeddings are not tied)")
    out["b_U"] = _Recipe("zeros", (V,))
    extra = sorted(
        n
        for n in stored - used
        if not n.endswith((".rotary_emb.inv_freq", ".attention.bias", ".attention.masked_bias"))
    )
    if extra:
        raise QkovError(f"{where}: unexpected weight(s) {', '.join(extra[:4])}{' ...' if len(extra) > 4 else ''}")
    return out
