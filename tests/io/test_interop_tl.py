"""TransformerLens import/export: both directions checked against TransformerLens' own forward pass."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from helpers import LN_MLP, perturb_non_matrices
from qkov.training.data import train_tokenizer
from qkov import ModelConfig, QkovError, Transformer, Weights, trace
from qkov.io import from_hooked, load_tl, save_tl, to_hooked

tl = pytest.importorskip("transformer_lens", reason="transformer-lens is a test extra: pip install -e '.[dev]'")

D = torch.float64
CONFIGS = {
    "paper": ModelConfig(n_layers=2, n_heads=3, d_model=24, d_head=8, d_vocab=40, n_ctx=12),
    "gpt2-like": LN_MLP.replace(positional="standard", act_fn="gelu_new"),
    "ln-attn-only": ModelConfig(
        n_layers=2,
        n_heads=2,
        d_model=16,
        d_head=8,
        d_vocab=30,
        n_ctx=12,
        normalization="layernorm",
        positional="standard",
        bias=True,
    ),
    "no-pos-relu": ModelConfig(
        n_layers=1,
        n_heads=3,
        d_model=16,
        d_head=5,
        d_vocab=30,
        n_ctx=12,
        positional="none",
        d_mlp=8,
        act_fn="relu",
        bias=True,
    ),
    "shortformer-mlp-gelu": ModelConfig(
        n_layers=2, n_heads=2, d_model=16, d_head=8, d_vocab=30, n_ctx=12, d_mlp=24, act_fn="gelu", bias=True
    ),
}


def _model(cfg: ModelConfig, seed: int = 1) -> Transformer:
    return perturb_non_matrices(Transformer(cfg, seed=seed).to(D), 0.3).eval()


def _tokens(cfg: ModelConfig, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, cfg.d_vocab, (3, cfg.n_ctx), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_export_matches_transformerlens_forward_and_patterns(name: str) -> None:
    cfg = CONFIGS[name]
    m, tokens = _model(cfg), _tokens(cfg)
    hooked = to_hooked(m, dtype=D)
    with torch.no_grad():
        ours = trace(Weights.from_model(m, dtype=D, fold_ln=False, center_unembed=False), tokens, cache="pattern.*")
        logits, cache = hooked.run_with_cache(tokens)
        assert (m(tokens) - logits).abs().max() < 1e-10
    assert (ours.logits - logits).abs().max() < 1e-10
    for l in range(cfg.n_layers):
        assert (ours["pattern", l] - cache["pattern", l]).abs().max() < 1e-12


@pytest.mark.parametrize("name", ["paper", "gpt2-like", "no-pos-relu", "shortformer-mlp-gelu"])
def test_round_trip_through_transformerlens_is_identity(name: str) -> None:
    cfg = CONFIGS[name]
    m = _model(cfg)
    back = from_hooked(to_hooked(m, dtype=D), dtype=D)
    # positions "none" export as TransformerLens "standard" with a zero W_pos: same function
    assert back.cfg == (cfg.replace(positional="standard") if cfg.positional == "none" else cfg)
    ours, theirs = m.state_dict(), back.state_dict()
    for k, v in ours.items():
        assert torch.equal(v, theirs[k]), k
    tokens = _tokens(cfg)
    with torch.no_grad():
        assert (m(tokens) - back(tokens)).abs().max() < 1e-12


def _tl_model(**kw: object):  # -> HookedTransformer, built and initialised by TransformerLens itself
    base: dict[str, object] = dict(
        n_layers=2,
        n_heads=4,
        d_model=32,
        d_head=8,
        d_vocab=50,
        n_ctx=16,
        d_mlp=64,
        act_fn="gelu_new",
        normalization_type="LN",
        dtype=D,
        seed=7,
        default_prepend_bos=False,
    )
    base.update(kw)
    hooked = tl.HookedTransformer(tl.HookedTransformerConfig(**base))
    # TransformerLens initialises biases to 0 and LN to 1: make them matter (its names follow qkov's W_/b_ scheme)
    return perturb_non_matrices(hooked, 0.3).eval()


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"act_fn": "relu", "positional_embedding_type": "standard"},
        {"attn_only": True, "normalization_type": None, "positional_embedding_type": "shortformer"},
        {"act_fn": "gelu_fast"},
    ],
)
def test_import_matches_transformerlens_forward(kw: dict) -> None:
    hooked = _tl_model(**kw)
    m = from_hooked(hooked, dtype=D)
    assert m.cfg.bias
    tokens = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        diff = (m(tokens) - hooked(tokens)).abs().max()
    assert diff < (1e-8 if kw.get("act_fn") == "gelu_fast" else 1e-10)  # gelu_fast rounds its constant


def test_import_of_folded_weights_lnpre() -> None:
    """TransformerLens' processed weights (LN folded, writers and unembedding centred) import exactly."""
    hooked = _tl_model()
    tokens = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        before = hooked(tokens).log_softmax(-1)
        hooked.process_weights_(fold_ln=True, center_writing_weights=True, center_unembed=True)
        assert hooked.cfg.normalization_type == "LNPre"
        m = from_hooked(hooked, dtype=D)
        assert (m(tokens) - hooked(tokens)).abs().max() < 1e-10
        # TransformerLens' own processing moves its float64 log-probs by ~4e-7 here; the import adds nothing
        assert (m(tokens).log_softmax(-1) - before).abs().max() < 1e-5
    assert float((m.blocks[0].ln1.w - 1).abs().max()) == 0 and float(m.blocks[0].ln1.b.abs().max()) == 0


def test_import_without_biases_gives_bias_free_model() -> None:
    hooked = tl.HookedTransformer(
        tl.HookedTransformerConfig(
            n_layers=1,
            n_heads=2,
            d_model=16,
            d_head=8,
            d_vocab=20,
            n_ctx=8,
            attn_only=True,
            normalization_type=None,
            positional_embedding_type="shortformer",
            dtype=D,
            seed=1,
        )
    )
    m = from_hooked(hooked, dtype=D)
    assert not m.cfg.bias and m.cfg.positional == "shortformer" and m.cfg.normalization == "none"


def test_import_keeps_a_fast_tokenizer() -> None:
    from transformers import PreTrainedTokenizerFast

    tok = train_tokenizer(["the cat sat on the mat"] * 20, 280, start="<|s|>")
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|s|>")
    hooked = _tl_model(d_vocab=tok.get_vocab_size())
    hooked.tokenizer = hf_tok  # set_tokenizer wants a tokenizer loaded from the hub; from_hooked reads this only
    m = from_hooked(hooked, dtype=D)
    assert m.tokenizer is not None and m.bos_token_id == 0
    assert m.to_tokens("the cat")[0].tolist() == [0, *tok.encode("the cat").ids]


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"positional_embedding_type": "rotary", "rotary_dim": 8}, "positional_embedding_type 'rotary'"),
        ({"normalization_type": "RMS"}, "normalization_type 'RMS'"),
        ({"n_key_value_heads": 2}, "n_key_value_heads=2"),
        ({"gated_mlp": True}, "gated_mlp=True"),
        ({"attn_scale": 3.0}, "attention scale"),
        ({"positional_embedding_type": "shortformer"}, "shortformer positions with LayerNorm"),
        ({"act_fn": "silu"}, "activation 'silu'"),
        ({"d_vocab_out": 60}, "d_vocab_out 60"),
    ],
)
def test_import_refuses_what_qkov_cannot_compute(kw: dict, match: str) -> None:
    with pytest.raises(QkovError, match=match):
        from_hooked(_tl_model(**kw))


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(positional="rotary"), "rotary positions"),
        (dict(normalization="rmsnorm"), "rmsnorm normalisation"),
        (dict(parallel=True), "parallel attention and MLP"),
        (dict(n_kv_heads=1), "grouped-query attention"),
        (dict(gated_mlp=True, act_fn="silu"), "a gated MLP"),
    ],
)
def test_export_refuses_what_transformer_lens_would_compute_differently(kw: dict, match: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A model outside the family qkov writes for TransformerLens is refused, not written without its
    rotary positions, parallel blocks, grouped heads or gate (the file would compute another model)."""
    cfg = LN_MLP.replace(**{"positional": "standard", **kw})
    with pytest.raises(QkovError, match=f"cannot export this model to TransformerLens: .*{match}"):
        save_tl(Transformer(cfg, seed=0), tmp_path / "m.safetensors")
    assert not (tmp_path / "m.safetensors").exists()


def test_export_refuses_shortformer_with_layernorm_and_non_models() -> None:
    with pytest.raises(QkovError, match="shortformer positions with LayerNorm"):
        to_hooked(Transformer(LN_MLP, seed=0))
    with pytest.raises(QkovError, match="expected a TransformerLens HookedTransformer"):
        from_hooked(object())


# ------------------------------------------------------------------ TransformerBridge (TransformerLens 4 API)
BRIDGE_CFG = dict(
    n_layers=2, n_heads=2, d_model=16, d_head=8, d_vocab=30, n_ctx=10, d_mlp=32, act_fn="gelu_new", seed=0
)


def _boot_native(**kw: object):  # -> TransformerBridge around a TransformerLens-native model, built by TL itself
    bridge_cls = pytest.importorskip("transformer_lens.model_bridge").TransformerBridge
    if not hasattr(bridge_cls, "boot_native"):
        pytest.skip("this TransformerLens has no TransformerBridge.boot_native")
    return bridge_cls.boot_native({**BRIDGE_CFG, **kw}, dtype=D)


@pytest.mark.parametrize(
    "kw",
    [{}, {"attn_only": True}, {"normalization_type": None, "act_fn": "relu"}, {"normalization_type": "LNPre"}],
)
def test_import_transformer_bridge_boot_native(kw: dict) -> None:
    bridge = _boot_native(**kw)
    with torch.no_grad():
        for name, p in bridge.named_parameters():
            if name.endswith("bias") or ".ln" in name or name.startswith("ln"):
                p.add_(torch.randn_like(p) * 0.3)
        m = from_hooked(bridge, dtype=D)
        tokens = torch.randint(0, 30, (2, 10), generator=torch.Generator().manual_seed(1))
        assert (m(tokens) - bridge(tokens)).abs().max() < 1e-10
    assert (m.cfg.d_mlp is None) == bool(kw.get("attn_only")) and m.cfg.bias


def test_bridge_refuses_rotary() -> None:
    with pytest.raises(QkovError, match="'rotary' is not supported"):
        from_hooked(_boot_native(positional_embedding_type="rotary", rotary_dim=8))


# ------------------------------------------------------------------ state-dict files
@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
@pytest.mark.parametrize("name", ["paper", "gpt2-like"])
def test_exported_file_opens_in_transformerlens(tmp_path: Path, suffix: str, name: str) -> None:
    """The recipe the README gives: HookedTransformer(HookedTransformerConfig(**config)).load_state_dict(sd)."""
    m = _model(CONFIGS[name]).float()
    path = tmp_path / f"model{suffix}"
    save_tl(m, path)
    if suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as fh:
            config = json.loads(fh.metadata()["transformer_lens_config"])
            sd = {k: fh.get_tensor(k) for k in fh.keys()}
    else:
        blob = torch.load(path, weights_only=True)
        config, sd = blob["config"], blob["state_dict"]
    hooked = tl.HookedTransformer(tl.HookedTransformerConfig(**config))
    hooked.load_state_dict(sd)
    tokens = _tokens(CONFIGS[name])
    with torch.no_grad():
        assert (hooked(tokens) - m(tokens)).abs().max() < 1e-4  # float32, as the issue asks
        assert (load_tl(path)(tokens) - m(tokens)).abs().max() == 0


def test_plain_state_dict_file_with_separate_config(tmp_path: Path) -> None:
    """The attention-only shortformer format without LayerNorm: torch.save(model.state_dict()) + a config."""
    fields = dict(
        n_layers=2,
        n_heads=4,
        d_model=32,
        d_head=8,
        d_vocab=50,
        n_ctx=16,
        attn_only=True,
        normalization_type=None,
        positional_embedding_type="shortformer",
        seed=3,
    )
    hooked = tl.HookedTransformer(tl.HookedTransformerConfig(**fields)).eval()
    torch.save(hooked.state_dict(), tmp_path / "attn_only_2L.pth")
    (tmp_path / "cfg.json").write_text(json.dumps(fields))
    with pytest.raises(QkovError, match="carries no config") as err:
        load_tl(tmp_path / "attn_only_2L.pth")
    assert err.value.hint == "config" and "--config" not in str(err.value)  # the CLI adds its flag
    wrong = {**fields, "attn_only": False, "d_mlp": 64, "act_fn": "relu"}
    with pytest.raises(QkovError, match="missing weight 'blocks.0.mlp.W_in'"):
        load_tl(tmp_path / "attn_only_2L.pth", wrong)
    # a 1-layer config: layer 1 left over, refused from the shapes before anything is built
    with pytest.raises(QkovError, match=r"the config says 1 layer\(s\), but the weights hold 2 \(blocks 0 to 1\)"):
        load_tl(tmp_path / "attn_only_2L.pth", {**fields, "n_layers": 1})
    m = load_tl(tmp_path / "attn_only_2L.pth", tmp_path / "cfg.json")
    assert m.cfg.positional == "shortformer" and m.cfg.normalization == "none" and m.cfg.d_mlp is None
    tokens = torch.randint(0, 50, (4, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert (m(tokens) - hooked(tokens)).abs().max() < 1e-4


class _Gadget:  # a pickled object that weights_only=True must refuse to build
    def __reduce__(self):
        return (print, ("unpickled!",))


def test_torch_files_are_read_without_unpickling_code(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    torch.save({"embed.W_E": torch.zeros(2, 2), "x": _Gadget()}, tmp_path / "evil.pt")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's own warning (advising weights_only=False) must not show
        with pytest.raises(QkovError, match="holds Python objects beyond tensors.*qkov never does") as err:
            load_tl(tmp_path / "evil.pt", {"n_layers": 0})
    assert "weights_only=False" not in str(err.value) and "unpickled!" not in capfd.readouterr().out
    (tmp_path / "garbage.pt").write_bytes(b"not a torch file")
    with pytest.raises(QkovError, match="is unreadable"):
        load_tl(tmp_path / "garbage.pt", {"n_layers": 0})
    (tmp_path / "m.txt").write_text("x")
    with pytest.raises(QkovError, match="expected .pt, .pth or .safetensors"):
        load_tl(tmp_path / "m.txt", {})
    with pytest.raises(QkovError, match="cannot export shortformer positions with LayerNorm"):
        save_tl(Transformer(LN_MLP, seed=0), tmp_path / "x.pt")


# ------------------------------------------------------------------ circuits on imported weights
def test_circuit_scores_of_an_imported_model_equal_transformerlens() -> None:
    """qkov's default view of an imported GPT-2-like model (LayerNorm folded, writers and unembedding
    centred) == TransformerLens' process_weights_: the same weights, copying and composition scores."""
    from qkov.analysis import circuits as C
    from qkov.analysis.circuits.composition import composition_raw

    hooked = _tl_model()
    m = from_hooked(hooked, dtype=D)
    w = Weights.from_model(m, dtype=D)  # the defaults, as every analysis builds it
    hooked.process_weights_(fold_ln=True, center_writing_weights=True, center_unembed=True)
    for name in ("W_E", "W_Q", "W_K", "W_V", "W_O", "W_in", "W_out", "W_U"):
        assert (getattr(w, name) - getattr(hooked, name)).abs().max() < 1e-6, name
    for kind in "qkv":
        ours, theirs = composition_raw(w, kind)[kind], hooked.all_composition_scores(kind.upper())
        valid = ~torch.isnan(ours)
        assert valid.sum() == 16 and (ours[valid] - theirs[valid]).abs().max() < 1e-6
    full = (hooked.W_E @ hooked.OV @ hooked.W_U).eigenvalues
    theirs = full.sum(-1).real / full.abs().sum(-1)
    ours = torch.tensor([h.eigen_score for h in C.copying_scores(w, diag_k=None)]).reshape(2, 4)
    assert (ours - theirs).abs().max() < 1e-6
