"""GPT-NeoX (Pythia), Llama, Mistral and Qwen2 imported from ``save_pretrained`` directories:
logits and patterns against ``transformers``' own forward, the two config forms, sharded and
bfloat16 files, and one-line refusals of what qkov does not implement."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from qkov import QkovError, Weights, trace
from qkov.io.hf import load_hf
from qkov.io.hf_families import family_config

from helpers import run_main
import hf_models
from hf_models import VARIANTS, build, save

transformers = pytest.importorskip("transformers")

TOKENS = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {name: save(name, root / name) for name in VARIANTS}


def _float64_rmsnorm(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Llama-family RMSNorm computes in float32 whatever the model's dtype (by design, for
    half precision); a float64 reference must keep float64, so its forward is replaced by the
    same formula without the cast."""

    def forward(self, x):  # type: ignore[no-untyped-def]
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    for family in ("llama", "mistral", "qwen2"):
        module = getattr(transformers.models, family)
        cls = getattr(getattr(module, f"modeling_{family}"), f"{family.capitalize()}RMSNorm")
        monkeypatch.setattr(cls, "forward", forward)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_equal_transformers_in_float32_and_float64(
    name: str, dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    hf = build(name)
    model = load_hf(dirs[name])
    with torch.no_grad():
        ref = hf(TOKENS).logits
        assert ref.abs().max() > 1  # logits of a few units: the tolerance means something
        assert (model(TOKENS) - ref).abs().max() < 1e-4
        # the analysis forward over the folded, centred view: the same distribution
        lp = trace(Weights.from_model(model), TOKENS).logits.log_softmax(-1)
        assert (lp - ref.log_softmax(-1)).abs().max() < 1e-4
    _float64_rmsnorm(monkeypatch)
    hf64 = build(name).double()
    hf64.config._attn_implementation = "sdpa"  # the eager path's softmax runs in float32
    model64 = load_hf(dirs[name], dtype=torch.float64)
    with torch.no_grad():
        ref64 = hf64(TOKENS).logits
        assert (model64(TOKENS) - ref64).abs().max() < 1e-9
        w64 = Weights.from_model(model64, dtype=torch.float64, center_unembed=False)
        assert (trace(w64, TOKENS).logits - ref64).abs().max() < 1e-9


@pytest.mark.parametrize("name", ["neox-parallel", "llama-gqa-bias", "qwen2-window"])
def test_attention_patterns_equal_transformers(name: str, dirs: dict[str, Path]) -> None:
    hf = build(name)
    hf.config._attn_implementation = "eager"
    with torch.no_grad():
        ref = torch.stack(hf(TOKENS, output_attentions=True).attentions)  # [L, B, H, T, T]
    ours = trace(Weights.from_model(load_hf(dirs[name])), TOKENS, cache="pattern.*").stack("pattern")
    assert ours.shape == ref.shape and (ours - ref).abs().max() < 1e-5


def test_configs_of_each_family(dirs: dict[str, Path]) -> None:
    def cfg(name: str):  # type: ignore[no-untyped-def]
        return load_hf(dirs[name]).cfg

    neox = cfg("neox-parallel")
    assert (neox.positional, neox.normalization, neox.parallel, neox.act_fn) == ("rotary", "layernorm", True, "gelu")
    assert (neox.rotary_dim, neox.rotary_base, neox.n_kv_heads) == (2, 500.0, None)  # a quarter of d_head 8
    assert cfg("neox-sequential").parallel is False
    llama = cfg("llama-gqa-bias")
    assert (llama.normalization, llama.gated_mlp, llama.act_fn, llama.kv_heads, llama.d_head) == (
        "rmsnorm",
        True,
        "silu",
        2,
        12,
    )
    assert llama.rotary_width == 12 and llama.rope_scaling is None
    assert cfg("llama-llama3-tied").rope_scaling == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }
    # within the sliding window: the context is capped where the window masks nothing
    assert cfg("mistral-window").n_ctx == 10 and cfg("qwen2-window").n_ctx == 12


def test_legacy_and_new_config_forms_agree(dirs: dict[str, Path]) -> None:
    """transformers 5 writes ``rope_parameters``; Hub checkpoints carry the older keys."""
    new = json.loads((dirs["neox-parallel"] / "config.json").read_text())
    assert "rope_parameters" in new
    legacy = {k: v for k, v in new.items() if k != "rope_parameters"}
    legacy.update(rotary_pct=0.25, rotary_emb_base=500.0)
    assert family_config(legacy) == family_config(new)
    new = json.loads((dirs["llama-llama3-tied"] / "config.json").read_text())
    rp = dict(new["rope_parameters"])
    legacy = {k: v for k, v in new.items() if k != "rope_parameters"}
    legacy.update(rope_theta=rp.pop("rope_theta"), rope_scaling=rp)
    assert family_config(legacy) == family_config(new)


def test_sharded_bfloat16_directory(tmp_path: Path) -> None:
    d = save("llama-gqa-bias", tmp_path / "bf16", dtype=torch.bfloat16, shard="20KB")
    assert len(list(d.glob("model-*.safetensors"))) > 2 and (d / "model.safetensors.index.json").is_file()
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():
        assert (load_hf(d)(TOKENS) - hf(TOKENS).logits).abs().max() < 1e-4


def _config(d: Path) -> dict:
    return json.loads((d / "config.json").read_text())


def _copy(src: Path, dst: Path, config: dict | None = None, state: dict | None = None) -> Path:
    dst.mkdir()
    (dst / "config.json").write_text(json.dumps(config if config is not None else _config(src)))
    save_file(state if state is not None else load_file(str(src / "model.safetensors")), str(dst / "model.safetensors"))
    return dst


def test_malformed_directories_are_one_line_errors(tmp_path: Path, dirs: dict[str, Path], capsys) -> None:  # type: ignore[no-untyped-def]
    src = dirs["llama-gqa-bias"]
    state = load_file(str(src / "model.safetensors"))
    cases: list[tuple[Path, str]] = []
    # a missing shard
    sharded = save("llama-gqa-bias", tmp_path / "sharded", shard="20KB")
    next(iter(sorted(sharded.glob("model-*.safetensors")))).unlink()
    cases.append(
        (sharded, "shard model-00001-of-00006.safetensors (listed in model.safetensors.index.json) is missing")
    )
    # a tensor of the wrong shape
    bad = dict(state, **{"model.layers.1.self_attn.k_proj.weight": torch.zeros(23, 32)})
    cases.append((_copy(src, tmp_path / "shape", state=bad), "k_proj.weight has shape (23, 32), expected (24, 32)"))
    # rope scalings qkov does not implement, and unsupported architectures
    for kind in ("yarn", "dynamic", "longrope"):
        cfg = dict(_config(src), rope_parameters={"rope_type": kind, "factor": 2.0, "rope_theta": 10000.0})
        cases.append((_copy(src, tmp_path / kind, cfg), f"rope scaling '{kind}' is not supported"))
    cfg = dict(_config(src), architectures=["LlamaForSequenceClassification"])
    cases.append(
        (_copy(src, tmp_path / "cls", cfg), "architecture ['LlamaForSequenceClassification'] is not supported")
    )
    cfg = dict(_config(src), model_type="gemma2")
    cases.append((_copy(src, tmp_path / "gemma", cfg), "model_type 'gemma2' is not supported"))
    cases.append((_copy(src, tmp_path / "act", dict(_config(src), hidden_act="quick_gelu")), "activation 'quick_gelu'"))
    capsys.readouterr()  # transformers' own progress bars
    for d, needle in cases:
        rc, out, err = run_main(capsys, "import", d, "--out", tmp_path / f"out-{d.name}")
        assert rc == 2 and needle in err and len(err.strip().splitlines()) == 1, (d.name, err)
        assert not (tmp_path / f"out-{d.name}").exists()
    with pytest.raises(QkovError, match="missing weight 'model.norm.weight'"):
        load_hf(_copy(src, tmp_path / "missing", state={k: v for k, v in state.items() if k != "model.norm.weight"}))
    with pytest.raises(QkovError, match="unexpected weight"):
        load_hf(
            _copy(
                src, tmp_path / "extra", state=dict(state, **{"model.layers.0.self_attn.q_norm.weight": torch.ones(12)})
            )
        )


@pytest.mark.parametrize("name", ["neox-parallel", "llama-gqa-bias"])
def test_offset_qk_equals_transformers_scores(name: str, dirs: dict[str, Path]) -> None:
    """Layer 0's QK circuit at each offset gives the scores transformers computes: compared
    through its patterns, whose log differences along a query row are score differences."""
    from qkov.analysis.circuits.rotary import offset_qk

    hf = build(name)
    hf.config._attn_implementation = "eager"
    with torch.no_grad():
        pattern = hf(TOKENS, output_attentions=True).attentions[0]  # [B, H, T, T]
    w = Weights.from_model(load_hf(dirs[name]))
    T = TOKENS.shape[1]
    for h in range(w.cfg.n_heads):
        tables = [offset_qk(w, 0, h, d).materialize() for d in range(T)]
        for b, t in enumerate(TOKENS):
            for i in range(T):
                logp = pattern[b, h, i, : i + 1].log()
                mine = torch.stack([tables[i - j][t[i], t[j]] for j in range(i + 1)])
                assert ((logp - logp[i]) - (mine - mine[i])).abs().max() < 1e-4


@pytest.mark.parametrize("name", hf_models.TL_VARIANTS)
def test_transformerlens_parity(name: str, dirs: dict[str, Path]) -> None:
    """The same weights through TransformerLens (its converters, its folding and centring) give the
    same next-token distribution and the same OV circuits (its W_OV is per query head)."""
    pytest.importorskip("transformer_lens")
    tl = hf_models.hooked(build(name))
    w = Weights.from_model(load_hf(dirs[name]))
    with torch.no_grad():
        ref = tl(TOKENS).log_softmax(-1)
        assert (trace(w, TOKENS).logits.log_softmax(-1) - ref).abs().max() < 1e-4
        for layer in range(w.cfg.n_layers):
            att = w.attention(layer)
            ours = torch.linalg.matrix_norm(att.W_V @ att.W_O)
            theirs = torch.linalg.matrix_norm(tl.blocks[layer].attn.W_V @ tl.blocks[layer].attn.W_O)
            assert (ours - theirs).abs().max() < 1e-4 * theirs.abs().max()


@pytest.mark.parametrize("name", ["neox-parallel", "llama-gqa-bias", "llama-llama3-tied", "qwen2-window"])
def test_streamed_directory_equals_the_imported_model(name: str, dirs: dict[str, Path], tmp_path: Path) -> None:
    """The directory read memory-mapped under qkov's names (no conversion written) gives the weights,
    the circuits and the forward of the imported model; attention analyses never read an MLP."""
    from qkov.analysis import circuits as C
    from qkov.weights import LazyCheckpoint

    w = Weights.from_model(load_hf(dirs[name]), dtype=torch.float64)
    for d in (dirs[name], save(name, tmp_path / "sharded", shard="20KB")):
        ck = LazyCheckpoint(d, dtype=torch.float64)
        assert ck.cfg == w.cfg and ck.norm == w.norm
        for layer, head in [(0, None), (1, None), (1, 3)]:
            a, b = ck.attention(layer, head), w.attention(layer, head)
            for f in ("W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V", "b_O"):
                assert (getattr(a, f) - getattr(b, f)).abs().max() < 1e-12, (layer, head, f)
        m1, m2 = ck.mlp(1), w.mlp(1)
        for f in ("W_in", "b_in", "W_out", "b_out", "W_gate", "b_gate"):
            assert (getattr(m1, f) is None) == (getattr(m2, f) is None)
            if getattr(m1, f) is not None:
                assert (getattr(m1, f) - getattr(m2, f)).abs().max() < 1e-12
        assert (ck.unembed(slice(5, 17)).W_U - w.W_U[:, 5:17]).abs().max() < 1e-12
        fresh = LazyCheckpoint(d, dtype=torch.float64)
        ours, ref = C.circuits_report(fresh, diag_k=3), C.circuits_report(w, diag_k=3)
        assert not [n for n in fresh.file.reads if ".mlp." in n]  # attention analyses read no MLP
        for kind in "qkv":
            assert torch.allclose(ours.composition[kind].raw.nan_to_num(), ref.composition[kind].raw.nan_to_num())
        assert [c.eigen_score for c in ours.copying] == pytest.approx([c.eigen_score for c in ref.copying], abs=1e-9)
        assert (trace(ck, TOKENS).logits - trace(w, TOKENS).logits).abs().max() < 1e-10


def test_streamed_bfloat16_directory_converts_block_by_block(tmp_path: Path) -> None:
    from qkov.weights import LazyCheckpoint

    d = save("llama-gqa-bias", tmp_path / "bf16", dtype=torch.bfloat16, shard="20KB")
    ck = LazyCheckpoint(d, dtype=torch.float32)
    w = Weights.from_model(load_hf(d))  # the in-memory import of the same bfloat16 file
    att = ck.attention(1, 2)
    assert att.W_Q.dtype == torch.float32 and (att.W_Q - w.attention(1, 2).W_Q).abs().max() < 1e-6
    assert (trace(ck, TOKENS).logits - trace(w, TOKENS).logits).abs().max() < 1e-4
    gpt2_like = tmp_path / "gpt2"
    gpt2_like.mkdir()
    (gpt2_like / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(QkovError, match="import other models first"):
        LazyCheckpoint(gpt2_like)


def test_every_command_runs_on_a_modern_directory(tmp_path: Path, dirs: dict[str, Path], capsys) -> None:  # type: ignore[no-untyped-def]
    """circuits, trigrams, heads, paths and report on a Llama and a NeoX directory, with token ids;
    the streamed circuits equal the in-memory ones and carry the offset profiles."""
    import numpy as np

    toks = tmp_path / "toks.npy"
    np.save(toks, np.random.default_rng(0).integers(1, 96, size=600))
    for name in ("llama-gqa-bias", "neox-parallel"):
        d = dirs[name]
        capsys.readouterr()
        rc, eager, err = run_main(capsys, "circuits", d, "--json")
        assert rc == 0, err
        rc, streamed, err = run_main(capsys, "circuits", d, "--json", "--lazy", "--bf16-matmul")
        assert rc == 0, err
        a, b = json.loads(eager), json.loads(streamed)
        assert [c["eigen_score"] for c in a["copying"]] == pytest.approx(
            [c["eigen_score"] for c in b["copying"]], abs=1e-5
        )
        assert a["composition"]["k"]["offsets"] == [0, 1, 2, 4, 8, 16, 32]
        top_a, top_b = a["composition"]["k"]["pairs"][0], b["composition"]["k"]["pairs"][0]
        assert abs(top_a["raw"] - top_b["raw"]) < 2e-3  # bfloat16 products: close, not equal
        assert len(a["offset_profiles"]["heads"]) == 8
        for argv in (
            ["trigrams", d, "--head", "0.1", "--json"],
            ["heads", d, "--tokens", toks, "--json"],
            ["paths", d, "--tokens", toks, "--json"],
            ["report", d, "-o", tmp_path / f"rep-{name}", "--tokens", toks, "--quiet"],
        ):
            rc, out, err = run_main(capsys, *argv)
            assert rc == 0, (argv, err)
        assert (tmp_path / f"rep-{name}" / "index.html").is_file()
    rc, _, err = run_main(capsys, "circuits", dirs["llama-gqa-bias"], "--offsets", "0,99")
    assert rc == 2 and "offsets must lie in 0 .. 63" in err
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    rc, _, err = run_main(capsys, "circuits", gpt2, "--lazy")
    assert rc == 2 and "import GPT-2 first" in err and len(err.strip().splitlines()) == 1
