"""``qkov import`` / ``qkov export`` and the analyses reading foreign sources directly; ``load_any``."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

import qkov
from helpers import perturb_non_matrices, run_main
from qkov.training.data import train_tokenizer
from qkov import ModelConfig, QkovError, Transformer
from qkov.io import load_any, save_tl, source_kind

transformers = pytest.importorskip("transformers", reason="transformers is a test extra: pip install -e '.[dev]'")
tl = pytest.importorskip("transformer_lens", reason="transformer-lens is a test extra: pip install -e '.[dev]'")
logging.getLogger("transformers").setLevel(logging.ERROR)

VOCAB = 64


@pytest.fixture(scope="module")
def tokenizer():  # -> tokenizers.Tokenizer: byte-level BPE, start token <|endoftext|> = 0
    return train_tokenizer(
        ["def f(self): return self.x\n"] * 20, VOCAB, start="<|endoftext|>", alphabet=list("def(slf):rtunx.\n ")
    )


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory, tokenizer) -> dict[str, Path]:
    """The same GPT-2-like weights as a Hugging Face directory; and a paper-style model as a TransformerLens file."""
    root = tmp_path_factory.mktemp("sources")
    cfg = transformers.GPT2Config(
        vocab_size=tokenizer.get_vocab_size(),
        n_positions=16,
        n_embd=32,
        n_layer=2,
        n_head=4,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(1)
    hf = transformers.GPT2LMHeadModel(cfg).eval()
    hf.save_pretrained(root / "hf")
    tokenizer.save(str(root / "hf" / "tokenizer.json"))
    paper = Transformer(ModelConfig(n_layers=2, n_heads=2, d_model=16, d_head=8, d_vocab=VOCAB, n_ctx=16), seed=4)
    save_tl(paper, root / "paper.safetensors")
    return {"hf": root / "hf", "tl": root / "paper.safetensors"}


def test_source_kinds(tmp_path: Path, sources: dict[str, Path]) -> None:
    qkov.save_checkpoint(Transformer(ModelConfig(n_layers=1, d_vocab=20, n_ctx=8), seed=0), tmp_path / "ck")
    assert source_kind(tmp_path / "ck") == "qkov"
    assert source_kind(sources["hf"]) == "hf" and source_kind(sources["tl"]) == "tl"
    assert source_kind("openai-community/gpt2") == "hub" and source_kind("gpt2") == "hub"
    with pytest.raises(QkovError, match="does not exist"):
        source_kind(tmp_path / "missing.pt")
    with pytest.raises(QkovError, match="a separate config applies to TransformerLens files only"):
        load_any(sources["hf"], config={})


def test_hub_name_fails_clearly_without_the_model(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    """Offline (this machine) or online (no such repository): one line, exit 2, nothing written."""
    pytest.importorskip("huggingface_hub")
    rc, _, err = run_main(capsys, "import", "qkov-tests/no-such-model-x7", "--out", tmp_path / "ck")
    assert rc == 2 and "fetching it from the Hugging Face Hub failed" in err and err.count("\n") == 1
    assert not (tmp_path / "ck").exists()


def test_hub_name_loads_what_the_hub_client_fetched(monkeypatch, sources: dict[str, Path]) -> None:
    """The success path without a network: snapshot_download stood in for by a local directory."""
    hub = pytest.importorskip("huggingface_hub")
    calls = []

    def fake_snapshot_download(name: str, allow_patterns: list[str]) -> str:
        calls.append((name, allow_patterns))
        return str(sources["hf"])

    monkeypatch.setattr(hub, "snapshot_download", fake_snapshot_download)
    m = load_any("openai-community/gpt2")
    assert calls[0][0] == "openai-community/gpt2" and "*.safetensors" in calls[0][1]
    assert not any(p.endswith((".bin", ".pt", ".h5")) for p in calls[0][1])  # never a pickle
    assert m.cfg.n_layers == 2 and m.tokenizer is not None


def test_import_analyse_export_hf(tmp_path: Path, sources: dict[str, Path], capsys: pytest.CaptureFixture) -> None:
    ckpt, out = tmp_path / "ckpt", tmp_path / "back"
    rc, stdout, _ = run_main(capsys, "import", sources["hf"], "--out", ckpt)
    assert rc == 0 and "(hf)" in stdout and "2 layers x 4 heads" in stdout
    rc, stdout, _ = run_main(capsys, "info", ckpt, "--json")
    info = json.loads(stdout)
    origin = {"format": "hf", "path": str(sources["hf"]), "family": "gpt2"}
    assert rc == 0 and info["imported_from"] == origin and info["tokenizer"]
    # the analyses read the Hugging Face directory directly, with the same result as from the checkpoint
    results = []
    for src in (ckpt, sources["hf"]):
        rc, stdout, _ = run_main(capsys, "circuits", src, "--json")
        assert rc == 0
        results.append({k: v for k, v in json.loads(stdout).items() if k != "path"})
    assert results[0] == results[1]
    text = tmp_path / "t.py"
    text.write_text("def f(self): return self.x\n" * 30)
    for argv in (
        ["paths", sources["hf"], "--text", text, "--batch", 2],
        ["heads", sources["hf"], "--text", text, "--batch", 2, "--icl-examples", 2],
        ["trigrams", sources["hf"], "--head", "1.2", "--top", 3],
    ):
        rc, stdout, err = run_main(capsys, *argv)
        assert rc == 0, err
    rc, _, _ = run_main(capsys, "export", ckpt, "--to", "hf", "--out", out)
    assert rc == 0
    tokens = torch.randint(0, 20, (2, 16), generator=torch.Generator().manual_seed(2))  # < the tokenizer's vocab
    with torch.no_grad():
        expected = transformers.GPT2LMHeadModel.from_pretrained(sources["hf"])(tokens).logits
        got = transformers.GPT2LMHeadModel.from_pretrained(out)(tokens).logits
    assert (got - expected).abs().max() < 1e-4
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok("return self")["input_ids"] == qkov.load(ckpt).to_tokens("return self", prepend_bos=False)[0].tolist()


def test_import_and_export_transformerlens(tmp_path: Path, sources: dict[str, Path], capsys) -> None:
    rc, _, _ = run_main(capsys, "import", sources["tl"], "--out", tmp_path / "ck")
    assert rc == 0
    rc, stdout, _ = run_main(capsys, "circuits", sources["tl"], "--json")
    assert rc == 0 and json.loads(stdout)["copying"]
    # a qkov model (LayerNorm, MLP, biases) to a TransformerLens .pt file, opened in TransformerLens
    cfg = ModelConfig(
        n_layers=1,
        n_heads=2,
        d_model=16,
        d_head=8,
        d_vocab=VOCAB,
        n_ctx=16,
        positional="standard",
        normalization="layernorm",
        d_mlp=32,
        bias=True,
    )
    model = perturb_non_matrices(Transformer(cfg, seed=3), 0.3)
    qkov.save_checkpoint(model, tmp_path / "mine")
    rc, _, _ = run_main(capsys, "export", tmp_path / "mine", "--to", "transformer-lens", "--out", tmp_path / "m.pt")
    assert rc == 0
    blob = torch.load(tmp_path / "m.pt", weights_only=True)
    hooked = tl.HookedTransformer(tl.HookedTransformerConfig(**blob["config"]))
    hooked.load_state_dict(blob["state_dict"])
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (hooked(tokens) - model(tokens)).abs().max() < 1e-4


def test_plain_tl_file_needs_its_config(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    fields = dict(
        n_layers=1,
        n_heads=2,
        d_model=16,
        d_head=8,
        d_vocab=VOCAB,
        n_ctx=16,
        attn_only=True,
        normalization_type=None,
        positional_embedding_type="shortformer",
        seed=1,
    )
    torch.save(tl.HookedTransformer(tl.HookedTransformerConfig(**fields)).state_dict(), tmp_path / "m.pth")
    (tmp_path / "cfg.json").write_text(json.dumps(fields))
    rc, _, err = run_main(capsys, "circuits", tmp_path / "m.pth")
    assert rc == 2 and "carries no config: give its TransformerLens config (pass --config CONFIG.json)" in err
    rc, stdout, _ = run_main(capsys, "circuits", tmp_path / "m.pth", "--config", tmp_path / "cfg.json", "--json")
    assert rc == 0 and len(json.loads(stdout)["copying"]) == 2
    rc, stdout, _ = run_main(
        capsys, "import", tmp_path / "m.pth", "--config", tmp_path / "cfg.json", "--out", tmp_path / "ck"
    )
    assert rc == 0 and "positions shortformer, norm none, mlp none" in stdout


@pytest.mark.parametrize(
    "argv, match",
    [
        (["import", "{tmp}/missing.pt", "--out", "{tmp}/a"], "does not exist"),
        (["import", "{hf}", "--out", "{hf}"], "already exists and is not empty"),
        (["export", "{hf}", "--to", "transformer-lens", "--out", "{tmp}/x.pt"], "already exists"),
        (["export", "{tl}", "--to", "hf", "--out", "{tmp}/b"], "cannot export to GPT-2 format: it has no LayerNorm"),
        (["export", "{hf}", "--to", "onnx", "--out", "{tmp}/c"], "invalid choice"),
        (["export", "{hf}", "--to", "transformer-lens", "--out", "{tmp}/c.npz"], "name it .safetensors, .pt or .pth"),
        (["circuits", "{tmp}"], "has no config.json"),
    ],
)
def test_cli_errors_are_one_line(tmp_path: Path, sources: dict[str, Path], capsys, argv, match) -> None:
    (tmp_path / "x.pt").write_bytes(b"")
    rc, _, err = run_main(capsys, *[a.format(tmp=tmp_path, hf=sources["hf"], tl=sources["tl"]) for a in argv])
    assert rc == 2 and match in err and err.count("\n") == 1, err


def test_export_refused_before_writing(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    qkov.save_checkpoint(Transformer(ModelConfig(n_layers=1, d_vocab=50, n_ctx=16), seed=0), tmp_path / "ckpt")
    rc, _, err = run_main(capsys, "export", tmp_path / "ckpt", "--to", "hf", "--out", tmp_path / "out")
    assert rc == 2 and "cannot export to GPT-2 format" in err and not (tmp_path / "out").exists()


def test_info_reads_every_source(sources: dict[str, Path], capsys: pytest.CaptureFixture) -> None:
    """``qkov info`` on a TransformerLens file and a Hugging Face directory, not only on checkpoints:
    what it is, where it came from, and that its training history is unknown."""
    rc, stdout, err = run_main(capsys, "info", sources["tl"], "--json")
    info = json.loads(stdout)
    assert rc == 0 and info["kind"] == "tl" and info["imported_from"] == {"format": "tl", "path": str(sources["tl"])}
    saved = Transformer(ModelConfig(n_layers=2, n_heads=2, d_model=16, d_head=8, d_vocab=VOCAB, n_ctx=16), seed=4)
    assert info["parameters"] == saved.num_parameters() and "steps" not in info  # the model the file was saved from
    assert info["unknown"] and info["tokenizer"] is False
    rc, stdout, err = run_main(capsys, "info", sources["hf"])
    assert rc == 0 and "Hugging Face directory (gpt2)" in stdout and "training history" in stdout, err
