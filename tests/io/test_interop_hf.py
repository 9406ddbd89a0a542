"""Hugging Face GPT-2 import/export, checked against ``transformers``' own GPT2LMHeadModel; the CLI commands."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from helpers import LN_MLP, perturb_non_matrices
from qkov.training.data import train_tokenizer
import qkov
from qkov import QkovError, Transformer, Weights, trace
from qkov.io import from_hf, load_hf, save_hf, to_hf

transformers = pytest.importorskip("transformers", reason="transformers is a test extra: pip install -e '.[dev]'")
logging.getLogger("transformers").setLevel(logging.ERROR)

D = torch.float64
VOCAB = 271  # the tokenizer below


def _hf_model(tied: bool = True, act: str = "gelu_new", **kw: object):  # -> GPT2LMHeadModel built by transformers
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=16,
        n_embd=32,
        n_layer=2,
        n_head=4,
        activation_function=act,
        tie_word_embeddings=tied,
        bos_token_id=0,
        eos_token_id=0,
        **kw,
    )
    torch.manual_seed(5)
    hf = transformers.GPT2LMHeadModel(cfg).to(D)
    with torch.no_grad():  # transformers initialises biases to 0 and LN to 1: make them matter
        for name, p in hf.named_parameters():
            if name.endswith("bias") or ".ln_" in name:
                p.add_(torch.randn_like(p) * 0.3)
    return hf.eval()


def _tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(seed))


def _hf_logits(hf, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(tokens).logits


@pytest.fixture(scope="module")
def tokenizer():  # -> tokenizers.Tokenizer: byte-level BPE, GPT-2 style, start token <|endoftext|> = 0
    tok = train_tokenizer(["def f(self):\n    return self.x\n"] * 50, VOCAB, start="<|endoftext|>")
    assert tok.get_vocab_size() == VOCAB
    return tok


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer) -> Path:
    out = tmp_path_factory.mktemp("gpt2")
    _hf_model().save_pretrained(out)
    tokenizer.save(str(out / "tokenizer.json"))
    return out


# ------------------------------------------------------------------ import
@pytest.mark.parametrize("tied, act", [(True, "gelu_new"), (False, "gelu"), (True, "relu")])
def test_import_matches_transformers_forward(tmp_path: Path, tied: bool, act: str) -> None:
    hf = _hf_model(tied, act)
    hf.save_pretrained(tmp_path)
    tokens = _tokens()
    expected = _hf_logits(hf, tokens)
    for m in (load_hf(tmp_path, dtype=D), from_hf(hf, dtype=D)):
        assert m.cfg.positional == "standard" and m.cfg.normalization == "layernorm" and m.cfg.d_mlp == 128
        with torch.no_grad():
            assert (m(tokens) - expected).abs().max() < 1e-10
            view = Weights.from_model(m, dtype=D, center_unembed=False)
            assert (trace(view, tokens).logits - expected).abs().max() < 1e-10


def test_import_headless_gpt2model_ties_the_unembedding() -> None:
    hf = _hf_model(tied=True)
    m = from_hf(hf.transformer, dtype=D)  # a GPT2Model: no lm_head, so W_U = wte.T
    tokens = _tokens(3)
    assert (m(tokens) - _hf_logits(hf, tokens)).abs().max() < 1e-10


def test_import_attention_patterns_match_transformers(hf_dir: Path) -> None:
    hf = transformers.GPT2LMHeadModel.from_pretrained(hf_dir, dtype=D, attn_implementation="eager").eval()
    tokens = _tokens(1)
    with torch.no_grad():
        theirs = hf(tokens, output_attentions=True).attentions
        ours = trace(Weights.from_model(load_hf(hf_dir, dtype=D), dtype=D), tokens, cache="pattern.*").stack("pattern")
    for l in range(2):
        assert (ours[l] - theirs[l]).abs().max() < 1e-12


def test_import_reads_sharded_safetensors(tmp_path: Path) -> None:
    hf = _hf_model()
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file() and not (tmp_path / "model.safetensors").exists()
    tokens = _tokens()
    with torch.no_grad():
        assert (load_hf(tmp_path, dtype=D)(tokens) - _hf_logits(hf, tokens)).abs().max() < 1e-10


def test_import_keeps_tokenizer_and_start_token(hf_dir: Path, tokenizer) -> None:
    m = load_hf(hf_dir)
    assert m.bos_token_id == 0
    assert m.W_E.dtype == torch.float32  # float32 unless asked
    assert m.to_tokens("return self")[0].tolist() == [0, *tokenizer.encode("return self").ids]


def _write(dir: Path, config: dict | None, weights: dict | None = None) -> Path:
    dir.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (dir / "config.json").write_text(json.dumps(config))
    if weights is not None:
        save_file(weights, str(dir / "model.safetensors"))
    return dir


@pytest.mark.parametrize(
    "change, match",
    [
        ({"model_type": "phi"}, "model_type 'phi' is not supported"),
        ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
        ({"scale_attn_weights": False}, "scale_attn_weights"),
        ({"activation_function": "silu"}, "activation 'silu'"),
        ({"n_head": 5}, "not a multiple"),
    ],
)
def test_import_refuses_unsupported_configs(tmp_path: Path, hf_dir: Path, change: dict, match: str) -> None:
    config = {**json.loads((hf_dir / "config.json").read_text()), **change}
    with pytest.raises(QkovError, match=match):
        load_hf(_write(tmp_path, config))


def test_import_refuses_bad_directories(tmp_path: Path, hf_dir: Path) -> None:
    config = json.loads((hf_dir / "config.json").read_text())
    with pytest.raises(QkovError, match="is not a directory"):
        load_hf(tmp_path / "nowhere")
    with pytest.raises(QkovError, match="has no config.json"):
        load_hf(_write(tmp_path / "empty", None))
    pickled = _write(tmp_path / "bin", config)
    (pickled / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(QkovError, match="safetensors only, never pickle"):
        load_hf(pickled)
    corrupt = _write(tmp_path / "corrupt", config)
    (corrupt / "model.safetensors").write_bytes(b"\x00" * 20)
    with pytest.raises(QkovError, match="model.safetensors is unreadable"):
        load_hf(corrupt)
    from safetensors.torch import load_file

    state = load_file(str(hf_dir / "model.safetensors"))
    with pytest.raises(QkovError, match="missing weight 'h.1.mlp.c_fc.bias'"):
        load_hf(_write(tmp_path / "missing", config, {k: v for k, v in state.items() if "h.1.mlp.c_fc.bias" not in k}))
    with pytest.raises(QkovError, match="unexpected weight"):
        load_hf(_write(tmp_path / "extra", config, {**state, "transformer.h.0.attn.q_norm.weight": torch.ones(8)}))
    with pytest.raises(QkovError, match="W_E has shape \\(271, 32\\) but the config implies \\(272, 32\\)"):
        load_hf(_write(tmp_path / "shape", {**config, "vocab_size": VOCAB + 1}, state))


# ------------------------------------------------------------------ export
def _gpt2_like(tied: bool = False) -> Transformer:
    m = perturb_non_matrices(Transformer(LN_MLP.replace(positional="standard", act_fn="gelu_new"), seed=2).to(D), 0.3)
    with torch.no_grad():
        m.b_U.zero_()
        if tied:
            m.W_U.copy_(m.W_E.T)
    return m.eval()


@pytest.mark.parametrize("tied", [False, True])
def test_export_loads_in_transformers_with_the_same_logits(tmp_path: Path, tied: bool) -> None:
    m = _gpt2_like(tied)
    save_hf(m, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["tie_word_embeddings"] == tied
    tokens = torch.randint(0, 30, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = m(tokens)
        hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path, dtype=D).eval()
        assert (hf(tokens).logits - expected).abs().max() < 1e-10
        assert (to_hf(m)(tokens).logits - expected).abs().max() < 1e-10
        back = load_hf(tmp_path, dtype=D)
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in m.state_dict().items())


def test_export_refuses_what_gpt2_cannot_express(tmp_path: Path) -> None:
    with pytest.raises(QkovError, match="no LayerNorm; it has no MLP; its positions are 'shortformer'"):
        save_hf(Transformer(qkov.ModelConfig(), seed=0), tmp_path)
    m = _gpt2_like()
    with torch.no_grad():
        m.b_U.add_(1.0)
    with pytest.raises(QkovError, match="unembedding has a bias"):
        to_hf(m)
    with pytest.raises(QkovError, match="n_heads \\* d_head = 10"):
        save_hf(Transformer(LN_MLP.replace(positional="standard", d_head=5), seed=0), tmp_path)
    assert not any(tmp_path.iterdir())
