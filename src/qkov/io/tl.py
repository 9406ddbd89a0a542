"""TransformerLens <-> qkov: objects (``HookedTransformer``, ``TransformerBridge``) and state-dict files.

Both libraries store weights in the same row convention and the same per-head shapes
(``W_Q [n_heads, d_model, d_head]``, ``W_O [n_heads, d_head, d_model]``, ``W_U [d_model,
d_vocab]``), and a HookedTransformer's state-dict names (``embed.W_E``, ``pos_embed.W_pos``,
``blocks.{l}.attn.W_Q``, ``blocks.{l}.ln1.w``, ``unembed.W_U`` ...) are qkov's with three
prefixes. A conversion is a renaming plus checks that the two forward passes are the same
function. Where they are not, it refuses with a :class:`~qkov.QkovError` naming the feature:

* qkov's shortformer with LayerNorm computes ``ln1(x + pos)``; TransformerLens computes
  ``ln1(x) + pos``. Without LayerNorm (the paper's models) the two agree.
* TransformerLens features qkov lacks: rotary/alibi positions, grouped-query attention,
  gated or mixture-of-experts MLPs, RMSNorm, parallel attention+MLP, local attention,
  soft caps, non-standard attention scales, ... (see ``_UNSUPPORTED``).

Positions ``none`` export as TransformerLens ``standard`` with a zero ``W_pos`` (exact).
``LNPre`` (LayerNorm already folded by TransformerLens) imports as a qkov LayerNorm with
gain 1 and bias 0. A ``TransformerBridge`` (TransformerLens 4 API, present in 3.9 as
``TransformerBridge.boot_native``) is read through its stacked ``W_Q ... b_U`` views.

TransformerLens files: a ``.pt``/``.pth`` file holding a state dict (read with
``torch.load(weights_only=True)``, never unpickling code) or ``{"config", "state_dict"}``,
or a ``.safetensors`` file whose metadata may hold the config as JSON under
``transformer_lens_config``; otherwise the config comes from a JSON file or dict of
``HookedTransformerConfig`` fields. Only ``to_hooked`` and ``save_tl`` import
``transformer_lens``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from ..errors import QkovError
from ..model.config import ModelConfig
from ..model.transformer import Transformer
from .atomic import atomic_write
from .checkpoint import load_state, save_tensors
from .plausible import check_shapes
from .torchfile import read_torch_file

__all__ = ["CONFIG_KEY", "from_hooked", "load_tl", "save_tl", "tl_config_dict", "tl_config_to_qkov", "to_hooked"]

CONFIG_KEY = "transformer_lens_config"  # safetensors metadata key holding the config JSON

# TransformerLens activation name -> qkov's. gelu_fast and gelu_pytorch_tanh are the tanh
# approximation, algebraically the same function as gelu_new.
_ACT_FROM_TL = {
    "gelu": "gelu",
    "gelu_new": "gelu_new",
    "gelu_fast": "gelu_new",
    "gelu_pytorch_tanh": "gelu_new",
    "relu": "relu",
}
_ACT_TO_TL = {"gelu": "gelu", "gelu_new": "gelu_new", "relu": "relu"}

# config fields whose non-default values change the function computed
_UNSUPPORTED: dict[str, Any] = {
    "n_key_value_heads": None,
    "gated_mlp": False,
    "num_experts": None,
    "final_rms": False,
    "use_qk_norm": False,
    "clip_qkv": None,
    "use_logn_attn": False,
    "use_local_attn": False,
    "scale_attn_by_inverse_layer_idx": False,
    "parallel_attn_mlp": False,
    "post_embedding_ln": False,
    "use_normalization_before_and_after": False,
    "use_attention_sinks": False,
}


def _get(c: Any, name: str, default: Any = None) -> Any:
    return c.get(name, default) if isinstance(c, dict) else getattr(c, name, default)


def tl_config_to_qkov(c: Any, *, bias: bool) -> ModelConfig:
    """The qkov config of a TransformerLens config (object or dict of its fields), or a QkovError."""
    try:
        n_heads, d_model, d_head = int(_get(c, "n_heads")), int(_get(c, "d_model")), int(_get(c, "d_head"))
        n_layers, d_vocab, n_ctx = int(_get(c, "n_layers")), int(_get(c, "d_vocab")), int(_get(c, "n_ctx"))
    except (TypeError, ValueError):
        raise QkovError(
            "TransformerLens config: n_layers, n_heads, d_model, d_head, d_vocab and n_ctx are required integers"
        ) from None
    for name, default in _UNSUPPORTED.items():
        value = _get(c, name, default)
        if name == "n_key_value_heads" and value in (None, n_heads):
            continue
        if value != default:
            raise QkovError(f"TransformerLens model: {name}={value!r} is not supported by qkov")
    if _get(c, "attention_dir", "causal") != "causal":
        raise QkovError("TransformerLens model: only causal attention is supported")
    if any(t != "global" for t in (_get(c, "attn_types") or [])):
        raise QkovError("TransformerLens model: local attention layers are not supported")
    for cap in ("attn_scores_soft_cap", "output_logits_soft_cap"):
        if float(_get(c, cap, -1.0)) > 0:
            raise QkovError(f"TransformerLens model: {cap} is not supported")
    scale = float(_get(c, "attn_scale", -1.0))  # -1: "sqrt(d_head)" in TransformerBridge configs
    if not _get(c, "use_attn_scale", True) or (scale > 0 and not math.isclose(scale, math.sqrt(d_head))):
        raise QkovError("TransformerLens model: only the attention scale sqrt(d_head) is supported")
    d_vocab_out = int(_get(c, "d_vocab_out", -1))
    if d_vocab_out not in (-1, d_vocab):
        raise QkovError(f"TransformerLens model: d_vocab_out {d_vocab_out} differs from d_vocab {d_vocab}")
    positional = _get(c, "positional_embedding_type", "standard")
    if positional not in ("standard", "shortformer"):
        raise QkovError(
            f"TransformerLens model: positional_embedding_type {positional!r} is not supported "
            "(standard or shortformer)"
        )
    norm = _get(c, "normalization_type", "LN")
    if norm not in (None, "LN", "LNPre"):
        raise QkovError(f"TransformerLens model: normalization_type {norm!r} is not supported (None, LN or LNPre)")
    if norm is not None and positional == "shortformer":
        raise QkovError(
            "TransformerLens model: shortformer positions with LayerNorm differ between the libraries "
            "(TransformerLens: ln1(x) + pos, qkov: ln1(x + pos))"
        )
    d_mlp, act = None, "gelu"
    if not _get(c, "attn_only", False):
        d_mlp = int(_get(c, "d_mlp") or 4 * d_model)
        act_fn = _get(c, "act_fn")
        if act_fn not in _ACT_FROM_TL:
            raise QkovError(
                f"TransformerLens model: activation {act_fn!r} is not supported ({', '.join(_ACT_FROM_TL)})"
            )
        act = _ACT_FROM_TL[act_fn]
    return ModelConfig(
        n_layers=n_layers,
        n_heads=n_heads,
        d_model=d_model,
        d_head=d_head,
        d_vocab=d_vocab,
        n_ctx=n_ctx,
        positional=positional,
        normalization="none" if norm is None else "layernorm",
        d_mlp=d_mlp,
        act_fn=act,
        bias=bias,
        ln_eps=float(_get(c, "eps", 1e-5)),
    )


# TransformerLens names that differ from qkov's (the blocks' names are the same)
_QKOV_NAMES = {"embed.W_E": "W_E", "pos_embed.W_pos": "W_pos", "unembed.W_U": "W_U", "unembed.b_U": "b_U"}


def _is_bias(name: str) -> bool:
    """A Q/K/V/O, MLP or unembedding bias (not a LayerNorm bias) in TransformerLens naming."""
    parent, leaf = name.rsplit(".", 1) if "." in name else ("", name)
    return leaf.startswith("b_") and not parent.endswith(("ln1", "ln2", "ln_final"))


def _from_tl_state(c: Any, sd: dict[str, torch.Tensor], dtype: torch.dtype, where: str) -> Transformer:
    """A qkov model from a TransformerLens config and a HookedTransformer-named state dict.

    Every tensor must be used: one the config does not explain (say MLP weights under an
    ``attn_only`` config) means config and file disagree, and is refused rather than dropped.
    """
    bias = any(_is_bias(k) and v.is_floating_point() and bool(v.abs().max() > 0) for k, v in sd.items() if v.numel())
    cfg = tl_config_to_qkov(c, bias=bias)
    check_shapes(cfg, {_QKOV_NAMES.get(k, k): v.shape for k, v in sd.items()}, where, complete=False)  # before allocating
    used: set[str] = set()

    def take(name: str, default: torch.Tensor | None = None) -> torch.Tensor:
        if name in sd:
            used.add(name)
            return sd[name]
        if default is None:
            raise QkovError(f"{where}: missing weight {name!r}")
        return default

    def ln(name: str) -> dict[str, torch.Tensor]:  # LNPre has no parameters: gain 1, bias 0
        ones, zeros = torch.ones(cfg.d_model), torch.zeros(cfg.d_model)
        return {name + ".w": take(name + ".w", ones), name + ".b": take(name + ".b", zeros)}

    H, e, d = cfg.n_heads, cfg.d_head, cfg.d_model
    state = {"W_E": take("embed.W_E"), "W_U": take("unembed.W_U")}
    if bias:
        state["b_U"] = take("unembed.b_U", torch.zeros(cfg.d_vocab))
    if cfg.positional != "none":
        state["W_pos"] = take("pos_embed.W_pos")
    for l in range(cfg.n_layers):
        p = f"blocks.{l}."  # the same block names in both libraries
        for n in ("W_Q", "W_K", "W_V", "W_O"):
            state[p + "attn." + n] = take(p + "attn." + n)
        if bias:
            for n, zeros in (("b_Q", (H, e)), ("b_K", (H, e)), ("b_V", (H, e)), ("b_O", (d,))):
                state[p + "attn." + n] = take(p + "attn." + n, torch.zeros(zeros))
        if cfg.d_mlp is not None:
            state[p + "mlp.W_in"], state[p + "mlp.W_out"] = take(p + "mlp.W_in"), take(p + "mlp.W_out")
            if bias:
                state[p + "mlp.b_in"] = take(p + "mlp.b_in", torch.zeros(cfg.d_mlp))
                state[p + "mlp.b_out"] = take(p + "mlp.b_out", torch.zeros(d))
        if cfg.normalization == "layernorm":
            state.update(ln(p + "ln1"))
            if cfg.d_mlp is not None:
                state.update(ln(p + "ln2"))
    if cfg.normalization == "layernorm":
        state.update(ln("ln_final"))
    # TransformerLens' own buffers, and all-zero biases of a bias-free model, carry no weights
    ignorable = {k for k in sd if k.rsplit(".", 1)[-1] in ("mask", "IGNORE") or (not bias and _is_bias(k))}
    extra = sorted(set(sd) - used - ignorable)
    if extra:
        raise QkovError(
            f"{where}: weight(s) {', '.join(extra[:4])}{' ...' if len(extra) > 4 else ''} are not explained by "
            "the config (does the config belong to this file?)"
        )
    model = Transformer(cfg, init=False).to(dtype=dtype)  # before loading: a float64 source keeps its precision
    load_state(model, state, where=where)
    return model.eval()


def _bridge_state(bridge: Any) -> dict[str, torch.Tensor]:
    """A TransformerBridge's weights under HookedTransformer names, from its stacked views."""
    raw = bridge.state_dict()
    sd: dict[str, torch.Tensor] = {"embed.W_E": bridge.W_E, "unembed.W_U": bridge.W_U}
    if getattr(bridge, "b_U", None) is not None:
        sd["unembed.b_U"] = bridge.b_U
    if "pos_embed.weight" in raw:
        sd["pos_embed.W_pos"] = raw["pos_embed.weight"]
    stacked = ["W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V", "b_O"]
    mlp = [] if _get(bridge.cfg, "attn_only", False) else ["W_in", "W_out", "b_in", "b_out"]
    for attr in stacked + mlp:
        try:
            value = getattr(bridge, attr)
        except AttributeError:
            continue
        for l in range(int(bridge.cfg.n_layers)):
            sd[f"blocks.{l}.{'attn' if attr in stacked else 'mlp'}.{attr}"] = value[l]
    for name in ["ln_final"] + [f"blocks.{l}.{n}" for l in range(int(bridge.cfg.n_layers)) for n in ("ln1", "ln2")]:
        for ours, theirs in (("w", "weight"), ("b", "bias")):
            if f"{name}.{theirs}" in raw:
                sd[f"{name}.{ours}"] = raw[f"{name}.{theirs}"]
    return sd


def from_hooked(hooked: Any, *, dtype: torch.dtype = torch.float32) -> Transformer:
    """A qkov :class:`~qkov.Transformer` computing the same logits as a TransformerLens model.

    Args:
        hooked: a ``HookedTransformer``, or a ``TransformerBridge`` built with ``boot_native``.
        dtype: dtype of the returned model (on the CPU, in eval mode).

    Returns:
        The model; ``bias=True`` only if some attention, MLP or unembedding bias is non-zero.
        ``model.tokenizer`` is the source's fast tokenizer backend when it has one. LayerNorm
        stays in the model (the logits must match); :class:`~qkov.Weights` folds it for analysis.
        Tested: logits agree with the source's forward pass.
    """
    c = getattr(hooked, "cfg", None)
    if c is None or not hasattr(hooked, "state_dict"):
        raise QkovError(
            f"expected a TransformerLens HookedTransformer or TransformerBridge, got {type(hooked).__name__}"
        )
    with torch.no_grad():
        if type(hooked).__name__ == "TransformerBridge":
            sd = _bridge_state(hooked)
        else:
            sd = dict(hooked.state_dict())
        sd = {k: v.detach().to("cpu") for k, v in sd.items()}
    model = _from_tl_state(c, sd, dtype, where=f"TransformerLens {type(hooked).__name__}")
    tok = getattr(hooked, "tokenizer", None)
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        model.tokenizer = backend
        bos = getattr(tok, "bos_token_id", None)
        if isinstance(bos, int) and 0 <= bos < model.cfg.d_vocab:
            model.bos_token_id = bos
    return model


# ------------------------------------------------------------------ files
def load_tl(
    path: Path | str, config: dict[str, Any] | Path | str | None = None, *, dtype: torch.dtype = torch.float32
) -> Transformer:
    """Import a TransformerLens state-dict file (``.pt``/``.pth`` or ``.safetensors``) plus its config.

    Args:
        path: the weights; torch files are read with ``weights_only=True``.
        config: ``HookedTransformerConfig`` fields as a dict or a JSON file; may be omitted when
            the file carries its config (as :func:`save_tl` writes it).
        dtype: dtype of the returned model.
    """
    path = Path(path)
    if not path.is_file():
        raise QkovError(f"TransformerLens file {str(path)!r} does not exist")
    embedded: Any = None
    if path.suffix == ".safetensors":
        try:
            with safe_open(str(path), framework="pt") as fh:
                meta = fh.metadata() or {}
                sd = {k: fh.get_tensor(k) for k in fh.keys()}
        except (SafetensorError, OSError, ValueError) as exc:
            raise QkovError(f"TransformerLens file {str(path)!r} is unreadable ({exc})") from None
        embedded = meta.get(CONFIG_KEY)
        if embedded is not None:
            embedded = _parse_json(embedded, f"{path}: metadata {CONFIG_KEY}")
    elif path.suffix in (".pt", ".pth"):
        obj = read_torch_file(path, "TransformerLens file")
        if isinstance(obj, dict) and "state_dict" in obj:
            embedded, sd = obj.get("config"), obj["state_dict"]
        else:
            sd = obj
        if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
            raise QkovError(f"TransformerLens file {str(path)!r} does not hold a state dict of tensors")
    else:
        raise QkovError(f"TransformerLens file {str(path)!r}: expected .pt, .pth or .safetensors")
    if isinstance(config, (str, Path)):
        try:
            config = _parse_json(Path(config).read_text(), str(config))
        except OSError as exc:
            raise QkovError(f"TransformerLens config {str(config)!r} is unreadable ({exc.strerror})") from None
    cfg = config if config is not None else embedded
    if not isinstance(cfg, dict):
        raise QkovError(
            f"TransformerLens file {str(path)!r} carries no config: give its TransformerLens config", hint="config"
        )
    return _from_tl_state(cfg, sd, dtype, where=str(path))


def _parse_json(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise QkovError(f"{where} is not valid JSON ({type(exc).__name__}: {exc})") from None


def tl_config_dict(cfg: ModelConfig) -> dict[str, Any]:
    """``HookedTransformerConfig`` fields (JSON-ready) for a qkov config of the family qkov writes for
    TransformerLens (standard or shortformer positions, LayerNorm or none, sequential blocks, a plain MLP,
    one key/value head per head: the family :func:`load_tl` reads back); refuses anything else, and
    LayerNorm + shortformer, rather than write a file that computes something else."""
    if cfg.normalization == "layernorm" and cfg.positional == "shortformer":
        raise QkovError(
            "cannot export shortformer positions with LayerNorm to TransformerLens "
            "(TransformerLens: ln1(x) + pos, qkov: ln1(x + pos))"
        )
    other = [
        what
        for what, has in (
            ("rotary positions", cfg.positional == "rotary"),
            (f"{cfg.normalization} normalisation", cfg.normalization not in ("layernorm", "none")),
            ("parallel attention and MLP", cfg.parallel),
            ("grouped-query attention", cfg.n_kv_heads not in (None, cfg.n_heads)),
            ("a gated MLP", cfg.gated_mlp),
            ("gated attention", cfg.gate != "none"),
            ("looped depth", cfg.loop != 1),
            (f"residual {cfg.residual!r}", cfg.residual != "sum"),
        )
        if has
    ]
    if other:
        raise QkovError(
            "cannot export this model to TransformerLens: qkov writes the GPT-2 family there (standard or "
            f"shortformer positions, LayerNorm or none, a plain MLP); it has {', '.join(other)} "
            "(save it as a qkov checkpoint or a Hugging Face directory instead)"
        )
    return {
        "n_layers": cfg.n_layers,
        "n_heads": cfg.n_heads,
        "d_model": cfg.d_model,
        "d_head": cfg.d_head,
        "d_vocab": cfg.d_vocab,
        "n_ctx": cfg.n_ctx,
        "d_mlp": cfg.d_mlp,
        "attn_only": cfg.d_mlp is None,
        "act_fn": _ACT_TO_TL[cfg.act_fn] if cfg.d_mlp is not None else None,
        "normalization_type": "LN" if cfg.normalization == "layernorm" else None,
        "eps": cfg.ln_eps,
        "positional_embedding_type": "shortformer" if cfg.positional == "shortformer" else "standard",
        "default_prepend_bos": False,
    }


def to_hooked(model: Transformer, *, dtype: torch.dtype = torch.float32, device: str = "cpu") -> Any:
    """A TransformerLens ``HookedTransformer`` holding ``model``'s weights (needs ``transformer-lens``).

    Returns it in eval mode with ``default_prepend_bos=False`` (qkov token ids already carry
    their start token) and no tokenizer (tokenize with ``model.to_tokens``). Tested: logits
    and every attention pattern agree with ``model.run``.
    """
    fields = tl_config_dict(model.cfg)
    try:
        from transformer_lens import HookedTransformer, HookedTransformerConfig
    except ImportError:
        raise QkovError("exporting to TransformerLens needs it installed: pip install 'qkov[peer]'") from None
    hooked = HookedTransformer(HookedTransformerConfig(**fields, device=device, dtype=dtype))
    sd = dict(hooked.state_dict())  # keeps TransformerLens' own buffers (masks)
    sd.update({k: torch.zeros_like(v) for k, v in sd.items() if _is_bias(k)})
    prefixed = {"W_E": "embed.W_E", "W_pos": "pos_embed.W_pos", "W_U": "unembed.W_U", "b_U": "unembed.b_U"}
    for name, value in model.state_dict().items():
        sd[prefixed.get(name, name)] = value.detach()  # blocks.*, ln_final.*: the same names in both libraries
    if model.cfg.positional == "none":
        sd["pos_embed.W_pos"] = torch.zeros_like(sd["pos_embed.W_pos"])
    sd = {k: (v.to(device=device, dtype=dtype) if v.is_floating_point() else v.to(device)) for k, v in sd.items()}
    hooked.load_state_dict(sd, strict=True)
    return hooked.eval()


def save_tl(model: Transformer, path: Path | str) -> None:
    """Write ``model`` as a TransformerLens state-dict file with its config (atomically).

    ``.safetensors``: the state dict, config JSON in the metadata under ``transformer_lens_config``.
    ``.pt``/``.pth``: ``{"config": dict, "state_dict": dict}`` (``torch.load(weights_only=True)`` reads it).
    Either opens in TransformerLens as ``HookedTransformer(HookedTransformerConfig(**config))``
    followed by ``load_state_dict(state_dict)`` (tested).
    """
    path = Path(path)
    if path.suffix not in (".safetensors", ".pt", ".pth"):
        raise QkovError(f"TransformerLens file {str(path)!r}: name it .safetensors, .pt or .pth")
    dtype = model.W_E.dtype
    config = tl_config_dict(model.cfg)
    sd = {k: v.detach().to("cpu").contiguous() for k, v in to_hooked(model, dtype=dtype).state_dict().items()}
    if path.suffix == ".safetensors":
        save_tensors(path, sd, metadata={CONFIG_KEY: json.dumps(config), "format": "pt"})
    else:
        atomic_write(path, lambda tmp: torch.save({"config": config, "state_dict": sd}, tmp))
