"""Hugging Face GPT-NeoX (Pythia), Llama, Mistral and Qwen2 -> qkov: configs and weights.

qkov reads ``config.json`` itself (no ``transformers`` needed), in both the form older
checkpoints carry (``rope_theta``, ``rope_scaling``, ``rotary_pct``, ``rotary_emb_base``) and
the one ``transformers`` 5 writes (``rope_parameters``). What each family means:

* **GPT-NeoX** (``gpt_neox``): LayerNorm with biases; a fused ``query_key_value`` weight whose rows
  are ordered (head, q/k/v, d_head); biases everywhere; rotary on the first
  ``partial_rotary_factor`` (``rotary_pct``, 0.25 by default) of each head; attention and MLP in
  parallel unless ``use_parallel_residual`` is false; an exact-erf GELU MLP.
* **Llama** (``llama``), **Mistral** (``mistral``), **Qwen2** (``qwen2``): RMSNorm; separate q/k/v/o
  projections, grouped-query; a SiLU-gated MLP; full-width rotary; biases on q/k/v/o with Llama's
  ``attention_bias``, on q/k/v always for Qwen2, on the MLP with Llama's ``mlp_bias``.

Sliding-window attention (Mistral always, Qwen2 with ``use_sliding_window``) is taken "within
its window": the model's context is capped at the window, where the window masks nothing, so
qkov computes exactly what the model does on every sequence it accepts. Rope rescalings other
than ``linear`` and ``llama3`` (``dynamic``, ``yarn``, ``longrope``) are refused in one line.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch

from ..errors import QkovError, QkovWarning
from ..model.config import ModelConfig
from ..model.tokens import TextCodec

__all__ = ["BUFFERS", "FAMILIES", "family_config", "family_state", "Maybe", "prepends_start", "start_token", "Take"]

FAMILIES: dict[str, str] = {
    "gpt_neox": "GPTNeoXForCausalLM",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
"""``model_type`` -> the one architecture qkov reads for it."""

_ACT = {"gelu": "gelu", "gelu_new": "gelu_new", "gelu_pytorch_tanh": "gelu_new", "gelu_fast": "gelu_new"}
_ACT.update(relu="relu", silu="silu", swish="silu")
# buffers some checkpoints carry that are not weights
BUFFERS = (".rotary_emb.inv_freq", ".attention.bias", ".attention.masked_bias")


def prepends_start(hf: dict[str, Any], tokenizer: Any) -> bool:
    """Whether texts get the start token unless asked (a model's ``default_prepend_bos``): GPT-2 and
    GPT-NeoX/Pythia by convention (TransformerLens prepends it; their tokenizers add nothing); the
    Llama family (Llama, Mistral, Qwen2) as its own tokenizer does: ``<s>`` where its post-processor
    adds it, none where it adds nothing (what ``transformers`` gives for the same directory)."""
    if hf.get("model_type") in ("gpt2", "gpt_neox") or tokenizer is None:
        return True
    return TextCodec(tokenizer, 0).tokenizer_adds_bos


def start_token(hf: dict[str, Any], d_vocab: int, where: str) -> int:
    """The start token of a Hugging Face ``config.json``: its ``bos_token_id`` when that is a token of
    the vocabulary; else 0, with a :class:`~qkov.errors.QkovWarning` naming the id, the vocabulary and
    the token used (a small model built from a stock config keeps GPT-2's 50256, say). The start token
    begins the repeated and random sequences the analyses build, so a silent substitute would be wrong."""
    bos = hf.get("bos_token_id")
    if bos is None or (isinstance(bos, int) and not isinstance(bos, bool) and 0 <= bos < d_vocab):
        return 0 if bos is None else bos
    warnings.warn(
        f"{where}: bos_token_id {bos!r} in config.json is not a token of its vocabulary of {d_vocab:,}: "
        "start token 0 is used instead",
        QkovWarning,
        stacklevel=3,
    )
    return 0


def _fail(what: str) -> QkovError:
    return QkovError(f"Hugging Face model: {what}")


def _rope(hf: dict[str, Any], neox: bool) -> tuple[float, float, dict[str, Any] | None]:
    """``(theta, partial_rotary_factor, rope_scaling)`` from either config form."""
    rp = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    if not isinstance(rp, dict):
        raise _fail(f"rope settings must be a JSON object, got {rp!r}")
    kind = rp.get("rope_type", rp.get("type", "default"))
    if neox:  # NeoX keeps its own legacy names; a top-level rope_theta is not read by the family
        theta = rp.get("rope_theta", hf.get("rotary_emb_base", 10000.0))
        partial = rp.get("partial_rotary_factor", hf.get("rotary_pct", 0.25))
    else:
        theta = rp.get("rope_theta", hf.get("rope_theta", 10000.0))
        partial = rp.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) if kind != "default" else 1.0
    if kind == "default":
        return float(theta), float(partial), None
    if kind == "linear":
        return float(theta), float(partial), {"rope_type": "linear", "factor": rp.get("factor")}
    if kind == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor")
        scaling = {"rope_type": "llama3", **{k: rp.get(k) for k in keys}}
        scaling["original_max_position_embeddings"] = rp.get(
            "original_max_position_embeddings", hf.get("max_position_embeddings")
        )
        return float(theta), float(partial), scaling
    raise _fail(f"rope scaling {kind!r} is not supported (qkov implements default, linear and llama3 exactly)")


def _common(hf: dict[str, Any], d_head: int, default_act: str) -> dict[str, Any]:
    act = hf.get("hidden_act", default_act)
    if act not in _ACT:
        raise _fail(f"activation {act!r} is not supported ({', '.join(sorted(_ACT))})")
    return dict(
        n_layers=int(hf["num_hidden_layers"]),
        n_heads=int(hf["num_attention_heads"]),
        d_model=int(hf["hidden_size"]),
        d_head=d_head,
        d_vocab=int(hf["vocab_size"]),
        d_mlp=int(hf["intermediate_size"]),
        act_fn=_ACT[act],
        positional="rotary",
        bias=True,  # families with only some biases carry zeros for the others
    )


def family_config(hf: dict[str, Any]) -> ModelConfig:
    """The qkov config of a NeoX / Llama / Mistral / Qwen2 ``config.json`` (a dict), or a
    :class:`QkovError` naming what is unsupported."""
    kind = hf.get("model_type")
    arch = hf.get("architectures")
    if arch is not None and (not isinstance(arch, list) or arch[:1] != [FAMILIES[kind]]):
        raise _fail(f"architecture {arch!r} is not supported (for {kind!r} qkov reads {FAMILIES[kind]})")
    try:
        H, D = int(hf["num_attention_heads"]), int(hf["hidden_size"])
        if kind == "gpt_neox":
            if D % H:
                raise _fail(f"hidden_size {D} is not a multiple of num_attention_heads {H}")
            theta, partial, scaling = _rope(hf, neox=True)
            dh = D // H
            fields = _common(hf, dh, "gelu") | dict(
                normalization="layernorm",
                ln_eps=float(hf.get("layer_norm_eps", 1e-5)),
                parallel=bool(hf.get("use_parallel_residual", True)),
            )
        else:
            theta, partial, scaling = _rope(hf, neox=False)
            dh = int(hf.get("head_dim") or D // H)
            fields = _common(hf, dh, "silu") | dict(
                normalization="rmsnorm",
                ln_eps=float(hf.get("rms_norm_eps", 1e-6)),
                gated_mlp=True,
                n_kv_heads=int(hf.get("num_key_value_heads") or H),
            )
        rotary_dim = int(dh * partial)
        fields.update(
            rotary_dim=None if rotary_dim == dh else rotary_dim,
            rotary_base=theta,
            rope_scaling=scaling,
            n_ctx=_context(hf, kind),
        )
        return ModelConfig(**fields)
    except KeyError as exc:
        raise _fail(f"config has no {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise _fail(f"bad config value ({exc})") from None
    except QkovError as exc:
        msg = str(exc)
        raise (exc if msg.startswith("Hugging Face model") else _fail(msg)) from None


def _context(hf: dict[str, Any], kind: str) -> int:
    """The longest sequence qkov runs the model on: ``max_position_embeddings``, capped at a
    sliding window (where the window masks nothing)."""
    n = int(hf.get("max_position_embeddings", 2048))
    window = None
    if kind == "mistral":  # the family's window is 4096 when config.json does not say
        window = hf["sliding_window"] if "sliding_window" in hf else 4096
    elif kind == "qwen2" and hf.get("use_sliding_window"):
        window = hf.get("sliding_window", 4096)
    return min(n, int(window)) if window is not None else n


def family_state(cfg: ModelConfig, hf: dict[str, Any], sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors (Hugging Face names) -> a qkov state dict for ``cfg``; every tensor
    used once, shapes checked, buffers skipped, anything else refused. The tensors are views of
    ``sd``'s (fused Q/K/V split, transposes: strided views), except a tied ``W_U`` (a copy)."""
    sd = {k: v for k, v in sd.items() if not k.endswith(BUFFERS)}
    used: set[str] = set()

    def take(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in sd:
            raise _fail(f"missing weight {name!r}")
        t = sd[name]
        if tuple(t.shape) != shape:
            raise _fail(f"{name} has shape {tuple(t.shape)}, expected {shape} from config.json")
        used.add(name)
        return t

    def maybe(name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        return take(name, shape) if name in sd else None

    convert = _neox if hf.get("model_type") == "gpt_neox" else _llama
    out = convert(cfg, take, maybe)
    tied = bool(hf.get("tie_word_embeddings", False))
    V, D = cfg.d_vocab, cfg.d_model
    head = next((n for n in ("lm_head.weight", "embed_out.weight") if n in sd), None)
    if head is not None and not tied:
        out["W_U"] = take(head, (V, D)).T
    elif tied:
        if head is not None:
            used.add(head)
        out["W_U"] = out["W_E"].T.contiguous()  # W_U's own memory, as a qkov model has
    else:
        raise _fail("missing weight 'lm_head.weight' (and the embeddings are not tied)")
    out["b_U"] = torch.zeros(V, dtype=out["W_E"].dtype)
    extra = sorted(set(sd) - used)
    if extra:
        raise _fail(f"unexpected weight(s) {', '.join(extra[:4])}{' ...' if len(extra) > 4 else ''}")
    return out  # views of ``sd``'s tensors (split, transposed: strided), never copies


Take = Callable[[str, tuple[int, ...]], torch.Tensor]
Maybe = Callable[[str, tuple[int, ...]], "torch.Tensor | None"]


def _zeros_like_bias(ref: torch.Tensor, n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=ref.dtype)


def _neox(cfg: ModelConfig, take: Take, maybe: Maybe) -> dict[str, torch.Tensor]:
    H, dh, D, F = cfg.n_heads, cfg.d_head, cfg.d_model, cfg.d_mlp or 0
    out = {"W_E": take("gpt_neox.embed_in.weight", (cfg.d_vocab, D))}
    for l in range(cfg.n_layers):
        h, p = f"gpt_neox.layers.{l}.", f"blocks.{l}."
        qkv = take(h + "attention.query_key_value.weight", (3 * D, D)).view(H, 3, dh, D)
        bias = maybe(h + "attention.query_key_value.bias", (3 * D,))
        b = (bias if bias is not None else _zeros_like_bias(qkv, 3 * D)).view(H, 3, dh)
        for i, n in enumerate("QKV"):
            out[p + f"attn.W_{n}"] = qkv[:, i].transpose(1, 2)  # [H, D, dh]
            out[p + f"attn.b_{n}"] = b[:, i]
        out[p + "attn.W_O"] = take(h + "attention.dense.weight", (D, D)).view(D, H, dh).permute(1, 2, 0)
        b_o = maybe(h + "attention.dense.bias", (D,))
        out[p + "attn.b_O"] = b_o if b_o is not None else _zeros_like_bias(qkv, D)
        out[p + "mlp.W_in"] = take(h + "mlp.dense_h_to_4h.weight", (F, D)).T
        out[p + "mlp.b_in"] = take(h + "mlp.dense_h_to_4h.bias", (F,))
        out[p + "mlp.W_out"] = take(h + "mlp.dense_4h_to_h.weight", (D, F)).T
        out[p + "mlp.b_out"] = take(h + "mlp.dense_4h_to_h.bias", (D,))
        for hf_ln, ours in (("input_layernorm", "ln1"), ("post_attention_layernorm", "ln2")):
            out[p + ours + ".w"] = take(h + hf_ln + ".weight", (D,))
            out[p + ours + ".b"] = take(h + hf_ln + ".bias", (D,))
    out["ln_final.w"] = take("gpt_neox.final_layer_norm.weight", (D,))
    out["ln_final.b"] = take("gpt_neox.final_layer_norm.bias", (D,))
    return out


def _llama(cfg: ModelConfig, take: Take, maybe: Maybe) -> dict[str, torch.Tensor]:
    H, KV, dh, D, F = cfg.n_heads, cfg.kv_heads, cfg.d_head, cfg.d_model, cfg.d_mlp or 0
    out = {"W_E": take("model.embed_tokens.weight", (cfg.d_vocab, D))}
    for l in range(cfg.n_layers):
        h, p = f"model.layers.{l}.", f"blocks.{l}."
        for n, heads in (("q", H), ("k", KV), ("v", KV)):
            W = take(h + f"self_attn.{n}_proj.weight", (heads * dh, D))
            out[p + f"attn.W_{n.upper()}"] = W.view(heads, dh, D).transpose(1, 2)  # [heads, D, dh]
            b = maybe(h + f"self_attn.{n}_proj.bias", (heads * dh,))
            out[p + f"attn.b_{n.upper()}"] = (b if b is not None else _zeros_like_bias(W, heads * dh)).view(heads, dh)
        W_o = take(h + "self_attn.o_proj.weight", (D, H * dh))
        out[p + "attn.W_O"] = W_o.view(D, H, dh).permute(1, 2, 0)  # [H, dh, D]
        b_o = maybe(h + "self_attn.o_proj.bias", (D,))
        out[p + "attn.b_O"] = b_o if b_o is not None else _zeros_like_bias(W_o, D)
        for hf_name, ours, shape in (
            ("gate_proj", "gate", (F, D)),
            ("up_proj", "in", (F, D)),
            ("down_proj", "out", (D, F)),
        ):
            W = take(h + f"mlp.{hf_name}.weight", shape)
            out[p + f"mlp.W_{ours}"] = W.T
            b = maybe(h + f"mlp.{hf_name}.bias", (shape[0],))
            out[p + f"mlp.b_{ours}"] = b if b is not None else _zeros_like_bias(W, shape[0])
        out[p + "ln1.w"] = take(h + "input_layernorm.weight", (D,))
        out[p + "ln2.w"] = take(h + "post_attention_layernorm.weight", (D,))
    out["ln_final.w"] = take("model.norm.weight", (D,))
    return out
