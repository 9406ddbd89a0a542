"""Hugging Face models -> qkov (GPT-2, GPT-NeoX/Pythia, Llama, Mistral, Qwen2), and qkov -> GPT-2.

The newer families' configs and weight layouts are in :mod:`qkov.io.hf_families`; this module
reads directories (one loader for every family) and holds GPT-2, both ways.

GPT-2 is a qkov model with ``positional="standard"``, ``normalization="layernorm"``, an MLP
(``d_mlp = n_inner or 4 * n_embd``) and biases. Its ``Conv1D`` layers already use the row
convention (``x @ W``), so the conversion is a split of the fused ``c_attn`` weight
``[d_model, 3 * d_model]`` into ``W_Q, W_K, W_V [n_heads, d_model, d_head]`` (columns are
head-major), a reshape of ``c_proj`` into ``W_O [n_heads, d_head, d_model]``, and
``W_U = lm_head.weight.T`` (``= wte.T`` when tied, as in the released GPT-2s). GPT-2 has
no unembedding bias, so ``b_U`` is zero on import and must be zero on export.

* :func:`load_hf` reads a directory (``config.json``, ``model.safetensors`` or a sharded
  ``model.safetensors.index.json``, optional ``tokenizer.json``) with safetensors and JSON
  only: no ``transformers`` needed, and no pickle (a ``pytorch_model.bin``-only directory
  is refused).
* :func:`save_hf` writes such a directory, which ``GPT2LMHeadModel.from_pretrained`` loads.
* :func:`from_hf` / :func:`to_hf` convert ``transformers`` model objects (``transformers``
  is imported only by :func:`to_hf`).

Refused with a :class:`~qkov.QkovError`: other architectures, ``scale_attn_weights=False``,
``scale_attn_by_inverse_layer_idx``, cross-attention, activations other than gelu /
gelu_new / relu; on export, models without LayerNorm, MLP or standard positions (GPT-2
has all three in every block), ``n_heads * d_head != d_model``, or a non-zero ``b_U``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from ..errors import QkovError
from ..model.config import ModelConfig
from ..model.transformer import Transformer
from .atomic import atomic_write_text
from .checkpoint import load_state, read_tokenizer, save_tensors
from .hf_families import FAMILIES, family_config, family_state, prepends_start, start_token
from .hf_store import WEIGHTS_FILE, shard_paths
from .plausible import check_shapes

__all__ = [
    "CONFIG_FILE",
    "from_hf",
    "gpt2_config",
    "gpt2_export",
    "hf_config",
    "load_hf",
    "save_hf",
    "to_hf",
    "TOKENIZER_FILE",
]

CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"

# Hugging Face activation name -> qkov's (gelu_pytorch_tanh and gelu_fast: the tanh approximation).
_ACT_FROM_HF = {
    "gelu": "gelu",
    "gelu_new": "gelu_new",
    "gelu_pytorch_tanh": "gelu_new",
    "gelu_fast": "gelu_new",
    "relu": "relu",
}


# ------------------------------------------------------------------ import
def hf_config(hf: dict[str, Any]) -> ModelConfig:
    """The qkov config of a supported ``config.json`` (a dict: GPT-2, GPT-NeoX, Llama, Mistral,
    Qwen2), or a QkovError naming what is unsupported; nothing is read but the dict."""
    model_type = hf.get("model_type")
    if model_type == "gpt2":
        return gpt2_config(hf)
    if model_type in FAMILIES:
        return family_config(hf)
    supported = ", ".join(["gpt2", *FAMILIES])
    raise QkovError(f"Hugging Face model: model_type {model_type!r} is not supported (qkov reads {supported})")


def gpt2_config(hf: dict[str, Any]) -> ModelConfig:
    """The qkov config of a GPT-2 ``config.json`` (a dict), or a QkovError naming what is unsupported."""
    model_type = hf.get("model_type")
    if model_type != "gpt2":
        raise QkovError(f"Hugging Face model: expected model_type 'gpt2', got {model_type!r}")
    for flag, ok in (
        ("scale_attn_weights", True),
        ("scale_attn_by_inverse_layer_idx", False),
        ("add_cross_attention", False),
    ):
        if bool(hf.get(flag, ok)) != ok:
            raise QkovError(f"Hugging Face model: {flag}={hf.get(flag)!r} is not supported")
    act = hf.get("activation_function", "gelu_new")
    if act not in _ACT_FROM_HF:
        raise QkovError(f"Hugging Face model: activation {act!r} is not supported ({', '.join(_ACT_FROM_HF)})")
    try:
        n_embd, n_head = int(hf["n_embd"]), int(hf["n_head"])
        n_inner = hf.get("n_inner")
        if n_embd % n_head:
            raise QkovError(f"Hugging Face model: n_embd {n_embd} is not a multiple of n_head {n_head}")
        return ModelConfig(
            n_layers=int(hf["n_layer"]),
            n_heads=n_head,
            d_model=n_embd,
            d_head=n_embd // n_head,
            d_vocab=int(hf["vocab_size"]),
            n_ctx=int(hf["n_positions"]),
            positional="standard",
            normalization="layernorm",
            d_mlp=int(n_inner) if n_inner else 4 * n_embd,
            act_fn=_ACT_FROM_HF[act],
            bias=True,
            ln_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        )
    except KeyError as exc:
        raise QkovError(f"Hugging Face model: config has no {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise QkovError(f"Hugging Face model: bad config value ({exc})") from None


def _gpt2_state(cfg: ModelConfig, hf_state: dict[str, torch.Tensor], tied: bool) -> dict[str, torch.Tensor]:
    """GPT-2 tensors (``transformer.`` prefix optional) -> a qkov state dict for ``cfg``."""
    sd = {(k[len("transformer.") :] if k.startswith("transformer.") else k): v for k, v in hf_state.items()}
    # causal-mask buffers of older checkpoints, not weights
    sd = {k: v for k, v in sd.items() if not k.endswith((".attn.bias", ".attn.masked_bias"))}
    H, e, d = cfg.n_heads, cfg.d_head, cfg.d_model
    used: set[str] = set()

    def take(name: str) -> torch.Tensor:
        if name not in sd:
            raise QkovError(f"Hugging Face model: missing weight {name!r}")
        used.add(name)
        return sd[name]

    out: dict[str, torch.Tensor] = {"W_E": take("wte.weight"), "W_pos": take("wpe.weight")}
    check_shapes(cfg, {k: v.shape for k, v in out.items()}, "Hugging Face model", complete=False)  # before b_U
    for l in range(cfg.n_layers):
        h, p = f"h.{l}.", f"blocks.{l}."
        w_attn, b_attn = take(h + "attn.c_attn.weight"), take(h + "attn.c_attn.bias")
        if tuple(w_attn.shape) != (d, 3 * d) or tuple(b_attn.shape) != (3 * d,):
            raise QkovError(
                f"Hugging Face model: {h}attn.c_attn has shape {tuple(w_attn.shape)}, expected {(d, 3 * d)}"
            )
        for i, n in enumerate("QKV"):
            out[p + f"attn.W_{n}"] = w_attn[:, i * d : (i + 1) * d].reshape(d, H, e).permute(1, 0, 2)
            out[p + f"attn.b_{n}"] = b_attn[i * d : (i + 1) * d].reshape(H, e)
        out[p + "attn.W_O"] = take(h + "attn.c_proj.weight").reshape(H, e, d)
        out[p + "attn.b_O"] = take(h + "attn.c_proj.bias")
        out[p + "mlp.W_in"], out[p + "mlp.b_in"] = take(h + "mlp.c_fc.weight"), take(h + "mlp.c_fc.bias")
        out[p + "mlp.W_out"], out[p + "mlp.b_out"] = take(h + "mlp.c_proj.weight"), take(h + "mlp.c_proj.bias")
        for ln, ours in (("ln_1", "ln1"), ("ln_2", "ln2")):
            out[p + ours + ".w"], out[p + ours + ".b"] = take(h + ln + ".weight"), take(h + ln + ".bias")
    out["ln_final.w"], out["ln_final.b"] = take("ln_f.weight"), take("ln_f.bias")
    if "lm_head.weight" in sd:
        used.add("lm_head.weight")
    if tied:  # a copy: a parameter of its own, as W_U is in a qkov model (never W_E's memory)
        out["W_U"] = out["W_E"].T.contiguous()
    else:
        out["W_U"] = take("lm_head.weight").T
    out["b_U"] = torch.zeros(cfg.d_vocab, dtype=out["W_E"].dtype)
    extra = sorted(set(sd) - used)
    if extra:
        raise QkovError(
            f"Hugging Face model: unexpected weight(s) {', '.join(extra[:4])}"
            f"{' ...' if len(extra) > 4 else ''} (not a plain GPT-2?)"
        )
    return out  # views of the stored tensors (strided where split or transposed): no copy


def _build(
    hf_cfg: dict[str, Any], hf_state: dict[str, torch.Tensor], dtype: torch.dtype, where: str, owned: bool = False
) -> Transformer:
    """The model of ``hf_state``; ``owned``: its tensors are nothing else's (a file's memory map),
    so the parameters are views of them in ``dtype`` (no copy unless the dtype differs); else
    they are copied into the model's own tensors."""
    cfg = hf_config(hf_cfg)
    if hf_cfg.get("model_type") == "gpt2":
        state = _gpt2_state(cfg, hf_state, bool(hf_cfg.get("tie_word_embeddings", True)))
    else:
        state = family_state(cfg, hf_cfg, hf_state)
    check_shapes(cfg, {k: v.shape for k, v in state.items()}, where)  # before the model is allocated
    model = Transformer(cfg, init=False).to(dtype=dtype)  # every parameter is loaded next
    if owned:
        state = {k: v.to(dtype) for k, v in state.items()}  # the same tensor where the dtype is already
    load_state(model, state, where=where, assign=owned)
    model.bos_token_id = start_token(hf_cfg, cfg.d_vocab, f"Hugging Face model {where!r}")
    return model.eval()


def load_hf(path: Path | str, *, dtype: torch.dtype = torch.float32) -> Transformer:
    """Load a Hugging Face model directory (GPT-2, GPT-NeoX/Pythia, Llama, Mistral, Qwen2) -> a
    qkov :class:`~qkov.Transformer` (CPU, eval mode).

    Reads ``config.json``, ``model.safetensors`` (or the shards listed in
    ``model.safetensors.index.json``; float32, float16 or bfloat16 on disk, converted to
    ``dtype``) and, if present, ``tokenizer.json``; the start token is the config's
    ``bos_token_id`` (50256, ``<|endoftext|>``, for the released GPT-2s).
    Nothing is copied where ``dtype`` is the stored one: the parameters are views (strided where
    a fused Q/K/V is split or a matrix transposed) of the files mapped copy-on-write, so loading
    reads each byte once (the NaN check) and a model that is edited or trained copies only the
    pages it writes, never changing the files.
    Tested: logits agree with ``transformers``' model of each family on the same directory.
    """
    path = Path(path)
    if not path.is_dir():
        raise QkovError(f"Hugging Face model {str(path)!r} is not a directory")
    try:
        hf_cfg = json.loads((path / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise QkovError(f"Hugging Face model {str(path)!r} has no {CONFIG_FILE}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise QkovError(f"Hugging Face model {str(path)!r}: {CONFIG_FILE} is not valid JSON ({exc})") from None
    except RecursionError:
        raise QkovError(
            f"Hugging Face model {str(path)!r}: {CONFIG_FILE} is nested too deeply to be a config"
        ) from None
    if not isinstance(hf_cfg, dict):
        raise QkovError(f"Hugging Face model {str(path)!r}: {CONFIG_FILE} is not a JSON object")
    hf_config(hf_cfg)  # refuse an unsupported model before reading its weights
    model = _build(hf_cfg, _read_weights(path), dtype, where=str(path), owned=True)
    model.tokenizer = read_tokenizer(path / TOKENIZER_FILE, where=f"Hugging Face model {str(path)!r}")
    model.default_prepend_bos = prepends_start(hf_cfg, model.tokenizer)
    return model


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    """Every shard's tensors, memory-mapped: ``load_file`` maps each file private (copy-on-write:
    pages are read when touched, and a write to a parameter copies its page, never the file)."""
    state: dict[str, torch.Tensor] = {}
    for f in shard_paths(path):
        try:
            state.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as exc:
            raise QkovError(f"Hugging Face model {str(path)!r}: {f.name} is unreadable ({exc})") from None
    return state


def from_hf(hf_model: Any, *, dtype: torch.dtype = torch.float32) -> Transformer:
    """A qkov model from a ``transformers`` ``GPT2LMHeadModel`` (or ``GPT2Model``, unembedding tied to ``wte``)."""
    config = getattr(hf_model, "config", None)
    if config is None or not hasattr(config, "to_dict") or not hasattr(hf_model, "state_dict"):
        raise QkovError(f"expected a transformers GPT-2 model, got {type(hf_model).__name__}")
    state = {k: v.detach().to("cpu") for k, v in hf_model.state_dict().items()}
    hf_cfg = config.to_dict()
    if "lm_head.weight" not in state:
        hf_cfg["tie_word_embeddings"] = True
    return _build(hf_cfg, state, dtype, where=type(hf_model).__name__)


# ------------------------------------------------------------------ export
def gpt2_export(model: Transformer) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(config.json dict, GPT2LMHeadModel state dict)`` for ``model``, or a QkovError saying why not."""
    c = model.cfg
    why = []
    if c.normalization != "layernorm":
        why.append("it has no LayerNorm")
    if c.d_mlp is None:
        why.append("it has no MLP")
    if c.positional != "standard":
        why.append(f"its positions are {c.positional!r}, not 'standard'")
    if c.residual != "sum":
        why.append(f"its residual stream is routed ({c.residual!r})")
    if c.n_heads * c.d_head != c.d_model:
        why.append(f"n_heads * d_head = {c.n_heads * c.d_head} differs from d_model = {c.d_model}")
    if model.b_U is not None and bool(model.b_U.detach().abs().max() > 0):
        why.append("its unembedding has a bias")
    if c.gate != "none":
        why.append("it has gated attention")
    if c.loop != 1:
        why.append("its blocks are looped")
    if why:
        raise QkovError("cannot export to GPT-2 format: " + "; ".join(why))
    ours = {k: v.detach().to("cpu") for k, v in model.state_dict().items()}
    zeros = torch.zeros  # where the qkov model has no biases, GPT-2's are zero
    tied = torch.equal(ours["W_U"], ours["W_E"].T)
    sd: dict[str, torch.Tensor] = {"transformer.wte.weight": ours["W_E"], "transformer.wpe.weight": ours["W_pos"]}
    d, dt = c.d_model, ours["W_E"].dtype
    for l in range(c.n_layers):
        h, p = f"transformer.h.{l}.", f"blocks.{l}."
        sd[h + "attn.c_attn.weight"] = torch.cat(
            [ours[p + f"attn.W_{n}"].permute(1, 0, 2).reshape(d, d) for n in "QKV"], dim=1
        )
        sd[h + "attn.c_attn.bias"] = torch.cat(
            [ours.get(p + f"attn.b_{n}", zeros(c.n_heads, c.d_head, dtype=dt)).reshape(d) for n in "QKV"]
        )
        sd[h + "attn.c_proj.weight"] = ours[p + "attn.W_O"].reshape(d, d)
        sd[h + "attn.c_proj.bias"] = ours.get(p + "attn.b_O", zeros(d, dtype=dt))
        sd[h + "mlp.c_fc.weight"] = ours[p + "mlp.W_in"]
        sd[h + "mlp.c_fc.bias"] = ours.get(p + "mlp.b_in", zeros(c.d_mlp, dtype=dt))
        sd[h + "mlp.c_proj.weight"] = ours[p + "mlp.W_out"]
        sd[h + "mlp.c_proj.bias"] = ours.get(p + "mlp.b_out", zeros(d, dtype=dt))
        for ln, ours_ln in (("ln_1", "ln1"), ("ln_2", "ln2")):
            sd[h + ln + ".weight"], sd[h + ln + ".bias"] = ours[p + ours_ln + ".w"], ours[p + ours_ln + ".b"]
    sd["transformer.ln_f.weight"], sd["transformer.ln_f.bias"] = ours["ln_final.w"], ours["ln_final.b"]
    if not tied:
        sd["lm_head.weight"] = ours["W_U"].T
    act = {"gelu": "gelu", "gelu_new": "gelu_new", "relu": "relu"}[c.act_fn]
    config = {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "vocab_size": c.d_vocab,
        "n_positions": c.n_ctx,
        "n_embd": d,
        "n_layer": c.n_layers,
        "n_head": c.n_heads,
        "n_inner": c.d_mlp,
        "activation_function": act,
        "layer_norm_epsilon": c.ln_eps,
        "scale_attn_weights": True,
        "tie_word_embeddings": tied,
        "bos_token_id": model.bos_token_id,
        "eos_token_id": model.bos_token_id,
        "torch_dtype": str(dt).removeprefix("torch."),
    }
    return config, {k: v.contiguous() for k, v in sd.items()}


def save_hf(model: Transformer, path: Path | str) -> None:
    """Write ``model`` as a Hugging Face GPT-2 directory (each file atomically).

    ``config.json`` and ``model.safetensors`` always; ``tokenizer.json`` and a
    ``tokenizer_config.json`` (fast tokenizer, the start token as bos/eos) when the model
    has a tokenizer. Tested: ``GPT2LMHeadModel.from_pretrained(path)`` gives the same logits.
    """
    config, state = gpt2_export(model)
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise QkovError(f"{str(path)!r} exists and is not a directory")
    path.mkdir(parents=True, exist_ok=True)
    save_tensors(path / WEIGHTS_FILE, state, metadata={"format": "pt"})
    if model.tokenizer is not None:
        atomic_write_text(path / TOKENIZER_FILE, model.tokenizer.to_str())
        bos = model.tokenizer.id_to_token(model.bos_token_id)
        tok_cfg = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": bos,
            "eos_token": bos,
            "model_max_length": model.cfg.n_ctx,
        }
        atomic_write_text(path / "tokenizer_config.json", json.dumps(tok_cfg, indent=2))
    atomic_write_text(path / CONFIG_FILE, json.dumps(config, indent=2))


def to_hf(model: Transformer) -> Any:
    """A ``transformers`` ``GPT2LMHeadModel`` (eval mode) holding ``model``'s weights (needs ``transformers``)."""
    config, state = gpt2_export(model)
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        raise QkovError("exporting to a transformers model needs it installed: pip install 'qkov[hf]'") from None
    config = {k: v for k, v in config.items() if k not in ("model_type", "architectures", "torch_dtype")}
    hf = GPT2LMHeadModel(GPT2Config(**config)).to(dtype=state["transformer.wte.weight"].dtype)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and config["tie_word_embeddings"])]
    if missing or unexpected:  # pragma: no cover - a transformers version with other names
        raise QkovError(f"transformers' GPT-2 has other weight names (missing {missing}, unexpected {unexpected})")
    return hf.eval()
