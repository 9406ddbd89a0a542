"""Parity with TransformerLens 3.9 on the same weights: every hook TransformerLens caches equals the
qkov site its name resolves to (an LN + MLP GPT-2-like model, the paper's attention-only
shortformer model, a rotary grouped-query Llama-like model), and its patching functions
(``get_act_patch_resid_pre``, ``get_act_patch_attn_head_out_all_pos``,
``get_act_patch_attn_head_out_by_pos``) equal qkov's batched sweeps."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from qkov import ModelConfig, QkovError, Transformer, Weights, trace
from qkov.analysis.causal.metrics import LogitDiff
from qkov.analysis.causal.patching import activation_patching
from qkov.io import to_hooked
from qkov.io.hf import load_hf

import hf_models
from helpers import LN_MLP, perturb_non_matrices

tl = pytest.importorskip("transformer_lens", reason="transformer-lens is a test extra: pip install -e '.[dev]'")
warnings.filterwarnings("ignore", category=DeprecationWarning)

PAPER = ModelConfig(n_layers=2, n_heads=3, d_model=24, d_head=8, d_vocab=40, n_ctx=12)
GPT2_LIKE = LN_MLP.replace(positional="standard", act_fn="gelu_new")
TOL = 1e-5


def _processed(m: Transformer):  # type: ignore[no-untyped-def]
    """``m`` in TransformerLens with the weight processing qkov's default view matches (LayerNorm
    folded, writers centred, unembedding centred; value biases left in the values, as qkov keeps them)."""
    h = to_hooked(m)
    h.load_and_process_state_dict(
        h.state_dict(), fold_ln=True, center_writing_weights=True, center_unembed=True, fold_value_biases=False
    )
    return h.eval()


def _pair(name: str, tmp_path: Path):  # type: ignore[no-untyped-def]
    """(qkov view, TransformerLens model, tokens) of the same weights."""
    if name == "llama-gqa-rotary":
        hf = hf_models.build("llama-llama3-tied")
        hf.save_pretrained(tmp_path / "llama")
        w, h = Weights.from_model(load_hf(tmp_path / "llama")), hf_models.hooked(hf)
    else:
        m = perturb_non_matrices(Transformer(GPT2_LIKE if name == "gpt2-like" else PAPER, seed=1).eval(), 0.1)
        w, h = Weights.from_model(m), _processed(m)
    toks = torch.randint(1, w.cfg.d_vocab, (3, 12), generator=torch.Generator().manual_seed(0))
    return w, h, toks


def _close(ours: torch.Tensor, theirs: torch.Tensor, what: str) -> None:
    assert ours.shape == theirs.shape, what
    inf = torch.isinf(theirs)
    assert torch.equal(torch.isinf(ours), inf), what  # attention scores: -inf after the query in both
    ours, theirs = ours[~inf], theirs[~inf]
    assert (ours - theirs).abs().max() <= TOL * max(1.0, float(theirs.abs().max())), what


@pytest.mark.parametrize("name", ["gpt2-like", "paper-attn-only", "llama-gqa-rotary"])
def test_every_transformerlens_hook_equals_the_qkov_site_of_its_name(name: str, tmp_path: Path) -> None:
    w, h, toks = _pair(name, tmp_path)
    h.set_use_attn_result(True)
    with torch.no_grad():
        logits, cache = h.run_with_cache(toks)
    out = trace(w, toks, cache=["*", "q_input.*", "k_input.*", "v_input.*"])
    _close(out.logits, logits, "logits")
    compared = []
    for hook, theirs in cache.items():
        if w.cfg.positional == "rotary" and hook.endswith(("attn.hook_q", "attn.hook_k")):
            with pytest.raises(QkovError, match="before rotary"):  # qkov's q and k are TL's rot_q, rot_k
                out[hook]
            continue
        _close(out[hook], theirs, hook)
        compared.append(hook)
    assert len(compared) >= 24 and any("hook_result" in c for c in compared)
    # the per-head input copies, with TransformerLens' split inputs (no normalisation to split here)
    if w.cfg.normalization == "none":
        h.set_use_split_qkv_input(True)
        with torch.no_grad():
            _, split = h.run_with_cache(toks)
        for l in range(w.cfg.n_layers):
            for x in ("q", "k", "v"):
                _close(out[f"blocks.{l}.hook_{x}_input"], split[f"blocks.{l}.hook_{x}_input"], f"{x}_input.{l}")


def test_transformerlens_short_names_resolve_as_transformerlens_resolves_them() -> None:
    """Every short activation name TransformerLens' get_act_name knows and qkov accepts names the same
    site as the full hook name TransformerLens makes of it (in a rotary model, its pre-rotary hook_q
    and hook_k are refused: qkov's q and k are after rotary)."""
    from transformer_lens.utils import get_act_name

    from qkov.analysis.forward.sites import Sites

    short = ["resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out", "q", "k", "v", "z", "pattern",
             "attn_scores", "result", "rot_q", "rot_k", "pre", "pre_linear", "post", "q_input", "k_input", "v_input"]
    for positional in ("rotary", "standard"):
        cfg = ModelConfig(
            n_layers=2, n_heads=4, n_kv_heads=2, d_model=16, d_head=4, d_vocab=30, n_ctx=12, positional=positional,
            normalization="rmsnorm", d_mlp=24, act_fn="silu", gated_mlp=True,
        )  # fmt: skip
        sites = Sites(cfg, "scale")
        for name in short:
            full = get_act_name(name, 1)
            if positional == "rotary" and full.endswith(("attn.hook_q", "attn.hook_k")):
                with pytest.raises(QkovError, match="before rotary"):
                    sites.resolve(full)
            elif name not in ("rot_q", "rot_k") or positional == "rotary":
                assert sites.resolve((name, 1)) == sites.resolve(full), (name, full)
    for name in ("embed", "pos_embed"):
        assert sites.resolve(name) == sites.resolve(get_act_name(name)), name


def _logit_diff(toks: torch.Tensor):  # type: ignore[no-untyped-def]
    a, b = toks[:, -1], (toks[:, -1] + 1) % 30

    def metric(logits: torch.Tensor) -> torch.Tensor:
        last = logits[:, -1]
        return (last.gather(-1, a[:, None]) - last.gather(-1, b[:, None])).mean()

    return metric, LogitDiff(correct=a, incorrect=b)


@pytest.mark.parametrize("name", ["gpt2-like", "paper-attn-only"])
def test_patching_sweeps_equal_transformerlens_patching(name: str, tmp_path: Path) -> None:
    from transformer_lens import patching

    w, h, clean = _pair(name, tmp_path)
    corrupted = torch.randint(1, w.cfg.d_vocab, clean.shape, generator=torch.Generator().manual_seed(9))
    tl_metric, ours = _logit_diff(clean)
    with torch.no_grad():
        _, clean_cache = h.run_with_cache(clean)
        checks = [
            (patching.get_act_patch_resid_pre, dict(site="resid_pre")),
            (patching.get_act_patch_attn_head_out_all_pos, dict(site="z")),
            (patching.get_act_patch_attn_head_out_by_pos, dict(site="z", axes=("layer", "pos", "head"))),
        ]
        for fn, kw in checks:
            theirs = fn(h, corrupted, clean_cache, tl_metric)
            for metric in (tl_metric, ours):  # TransformerLens' own metric function, and qkov's
                got = activation_patching(w, clean, corrupted, metric=metric, max_bytes=2**16, **kw)
                _close(got.values, theirs.float(), fn.__name__ if hasattr(fn, "__name__") else str(kw))
            # head outputs patched as z or as head_out: the same sweep
    by_out = activation_patching(w, clean, corrupted, site="head_out", metric=ours)
    by_z = activation_patching(w, clean, corrupted, site="z", metric=ours)
    _close(by_out.values, by_z.values, "head_out vs z")
