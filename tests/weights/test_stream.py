"""Which residual stream a site holds: the default view of a LayerNorm model centres the writers, so
``resid_*``, ``attn_out`` and ``mlp_out`` are the model's own minus their mean over ``d_model``;
``trace(..., stream="model")`` gives the model's own, checked against ``transformers``' GPT-2 on the same
directory (``output_hidden_states`` and hooks on its attention and MLP modules)."""

from __future__ import annotations

import logging

import pytest
import torch

import qkov
from qkov import QkovError, Weights, trace
from qkov.io.hf import load_hf

transformers = pytest.importorskip("transformers", reason="transformers is a test extra: pip install -e '.[dev]'")
logging.getLogger("transformers").setLevel(logging.ERROR)

SITES = ["resid_pre.*", "resid_post.*", "attn_out.*", "mlp_out.*", "pattern.*", "head_out.*"]


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory):  # -> (transformers model, qkov model, tokens)
    cfg = transformers.GPT2Config(vocab_size=97, n_positions=16, n_embd=32, n_layer=2, n_head=4, bos_token_id=0)
    torch.manual_seed(3)
    hf = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():  # transformers initialises biases to 0 and LayerNorm to 1: make them matter
        for name, p in hf.named_parameters():
            if name.endswith("bias") or ".ln_" in name:
                p.add_(torch.randn_like(p) * 0.3)
    folder = tmp_path_factory.mktemp("gpt2")
    hf.save_pretrained(folder)
    toks = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(1))
    return hf, load_hf(folder), toks, folder


def _hf_stream(hf, toks: torch.Tensor) -> dict[str, list[torch.Tensor]]:  # type: ignore[no-untyped-def]
    """What the transformers model computes: hidden states, each block's attention and MLP output
    (forward hooks), and the final stream before ln_f."""
    seen: dict[str, list[torch.Tensor]] = {"attn": [], "mlp": [], "final": []}
    hooks = [b.attn.register_forward_hook(lambda m, i, o: seen["attn"].append(o[0])) for b in hf.transformer.h]
    hooks += [b.mlp.register_forward_hook(lambda m, i, o: seen["mlp"].append(o)) for b in hf.transformer.h]
    hooks.append(hf.transformer.ln_f.register_forward_pre_hook(lambda m, i: seen["final"].append(i[0])))
    try:
        with torch.no_grad():
            seen["hidden"] = list(hf(toks, output_hidden_states=True).hidden_states)
    finally:
        for h in hooks:
            h.remove()
    return seen


def test_stream_model_is_what_transformers_computes_and_the_default_is_it_centred(gpt2) -> None:  # type: ignore[no-untyped-def]
    hf, m, toks, _ = gpt2
    theirs = _hf_stream(hf, toks)
    own = trace(m, toks, cache=SITES, stream="model")
    centred = trace(m, toks, cache=SITES)
    L = m.cfg.n_layers

    def centre(x: torch.Tensor) -> torch.Tensor:
        return x - x.mean(-1, keepdim=True)

    for l in range(L):
        pairs = [("resid_pre", theirs["hidden"][l]), ("attn_out", theirs["attn"][l]), ("mlp_out", theirs["mlp"][l])]
        for kind, hf_value in pairs:
            assert (own[kind, l] - hf_value).abs().max() < 1e-5, f"{kind}.{l}"
            assert (centred[kind, l] - centre(hf_value)).abs().max() < 1e-5, f"{kind}.{l} centred"
            # the default differs from transformers by the mean over d_model, which is not small here
            assert (centred[kind, l] - hf_value).abs().max() > 1e-2, f"{kind}.{l}"
        assert (own["pattern", l] - centred["pattern", l]).abs().max() < 1e-6  # heads attend the same
        assert (centre(own["head_out", l]) - centred["head_out", l]).abs().max() < 1e-5
    assert (own["resid_post", L - 1] - theirs["final"][0]).abs().max() < 1e-5
    assert (own.logits.log_softmax(-1) - hf(toks).logits.log_softmax(-1)).abs().max() < 1e-4
    assert (own.logits.log_softmax(-1) - centred.logits.log_softmax(-1)).abs().max() < 1e-5


def test_stream_model_takes_a_path_and_an_uncentred_view_and_refuses_a_centred_one(gpt2) -> None:  # type: ignore[no-untyped-def]
    hf, m, toks, folder = gpt2
    ckpt = folder.parent / "qkov-ckpt"
    qkov.save_checkpoint(m, ckpt)
    want = trace(m, toks, cache=["resid_pre.1"], stream="model")["resid_pre", 1]
    uncentred = (folder, Weights.from_model(m, center_writing=False), qkov.LazyCheckpoint(ckpt, center_writing=False))
    for source in uncentred:
        got = trace(source, toks, cache=["resid_pre.1"], stream="model")["resid_pre", 1]
        assert (got - want).abs().max() < 1e-5, type(source).__name__
    for centred in (Weights.from_model(m), qkov.LazyCheckpoint(ckpt)):
        with pytest.raises(QkovError, match="stream='model' needs uncentred writers.*center_writing=False"):
            trace(centred, toks, stream="model")
    with pytest.raises(QkovError, match="stream must be None .* or 'model'"):
        trace(m, toks, stream="hf")
