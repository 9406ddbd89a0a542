"""A newcomer's first session at the command line: a small Llama-family model (rotary positions,
RMSNorm, grouped-query attention, start token 1) and a GPT-2-family model (start token
``<|endoftext|>``, the last id, as GPT-2's 50256),
each a Hugging Face directory with its tokenizer, and a one-paragraph text much shorter than the
context. ``info``, ``heads``, ``paths``, ``report`` and ``ablate`` all run on them without a
refusal; the text is analysed as one sequence of its own length, the start token first; the
in-context-learning score, which needs longer sequences, is left out with its reason; and the
numbers the commands report on the short text equal what ``transformers`` computes on the same
tokens."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers import run_main

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

PARAGRAPH = (
    "The old lighthouse keeper climbed the stairs every night. He lit the lamp and watched the ships. "
    "The ships sailed past the rocks, and the keeper climbed down the stairs again."
)
N_CTX = 64


def _tokenizer(words: list[str], specials: dict[str, int]) -> Any:
    """A word-level tokenizer (whitespace and punctuation split) over ``words`` and ``specials``."""
    vocab = dict(specials)
    for w in words:
        vocab.setdefault(w, len(vocab))
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return tok


def _words() -> list[str]:
    pre = tokenizers.pre_tokenizers.Whitespace()
    return sorted({w for w, _ in pre.pre_tokenize_str(PARAGRAPH)}) + ["extra", "words", "here"]


def _llama(folder: Path) -> tuple[Path, int]:
    tok = _tokenizer(_words(), {"<unk>": 0, "<s>": 1, "</s>": 2})  # Llama's layout: <s> is 1
    # and, as a real Llama tokenizer.json, a post-processor that adds <s> itself (one start token, not two)
    tok.post_processor = tokenizers.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    cfg = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=N_CTX, bos_token_id=1,
        eos_token_id=2, initializer_range=0.15,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(folder)
    tok.save(str(folder / "tokenizer.json"))
    return folder, 1


def _gpt2(folder: Path) -> tuple[Path, int]:
    # GPT-2's layout: the words first, its start token <|endoftext|> the last id of the vocabulary
    # (50256 in the released models; a small vocabulary keeps the test fast)
    words = _tokenizer(_words(), {"<unk>": 0}).get_vocab()
    bos = len(words)
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab={**words, "<|endoftext|>": bos}, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    cfg = transformers.GPT2Config(
        vocab_size=bos + 1, n_positions=N_CTX, n_embd=32, n_layer=2, n_head=4, bos_token_id=bos, eos_token_id=bos,
        initializer_range=0.1,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(cfg).eval().save_pretrained(folder)
    tok.save(str(folder / "tokenizer.json"))
    return folder, bos


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def source(request: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int, Path]:
    folder = tmp_path_factory.mktemp(request.param)
    path, bos = (_llama if request.param == "llama" else _gpt2)(folder / "model")
    text = folder / "story.txt"
    text.write_text(PARAGRAPH)
    return path, bos, text


def _ids(path: Path, bos: int) -> list[int]:
    """The tokens the analyses should read: the paragraph as the tokenizer in the directory encodes it
    (read here with ``tokenizers`` itself, special tokens included: what ``transformers`` gives), with
    one start token first: the Llama tokenizer's own ``<s>``, or the one GPT-2's convention prepends."""
    tok = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    ids = tok.encode(PARAGRAPH).ids
    return ids if ids[0] == bos else [bos, *ids]


def _hf(path: Path, ids: list[int]) -> Any:
    """``transformers``' forward of ``ids`` (one sequence): logits and attention patterns."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(torch.tensor([ids]), output_attentions=True)


def _json(capsys: Any, *argv: object) -> dict[str, Any]:
    rc, out, err = run_main(capsys, *argv, "--json")
    assert rc == 0 and "error" not in err, err
    return json.loads(out)


def test_info_reads_the_directory(source: tuple[Path, int, Path], capsys: Any) -> None:
    path, bos, _ = source
    hf_cfg = json.loads((path / "config.json").read_text())
    info = _json(capsys, "info", path)
    assert info["kind"] == "hf" and info["bos_token_id"] == bos and info["tokenizer"] is True
    assert info["imported_from"] == {"format": "hf", "path": str(path), "family": hf_cfg["model_type"]}
    assert info["model"]["n_ctx"] == N_CTX and info["model"]["d_vocab"] == hf_cfg["vocab_size"]
    assert any("training history" in u for u in info["unknown"])
    rc, out, err = run_main(capsys, "info", path)
    assert rc == 0 and "imported" in out and "unknown" in out and "training history" in out, err
    assert info["parameters"] == transformers.AutoModelForCausalLM.from_pretrained(path).num_parameters()
    if hf_cfg["model_type"] == "llama":  # streamed from the headers alone: the same description
        assert _json(capsys, "info", path, "--lazy") == info


def test_heads_on_a_short_text(source: tuple[Path, int, Path], capsys: Any) -> None:
    path, bos, text = source
    ids = _ids(path, bos)
    assert len(ids) < N_CTX - 16  # one paragraph, far shorter than the context
    data = _json(capsys, "heads", path, "--text", text)
    assert f"one sequence of {len(ids)} tokens" in data["inputs"]
    assert data["icl"] is None
    why = data["left_out"]["icl"]
    assert why.endswith(f"the text has {len(ids)}") and f"needs sequences of at least {N_CTX} tokens" in why
    # the previous-token score is the mean of A[i, i-1] over the text: transformers' patterns agree
    att = torch.stack(_hf(path, ids).attentions)[:, 0]  # [L, H, T, T]
    want = att.diagonal(offset=-1, dim1=-2, dim2=-1).mean(-1)
    got = torch.tensor([[h["previous_token"] for h in data["heads"] if h["layer"] == l] for l in range(len(att))])
    want = want.to(got.dtype)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    rc, out, _ = run_main(capsys, "heads", path, "--text", text)
    assert rc == 0 and "in-context learning score left out: needs sequences of at least" in out


def test_paths_and_ablate_on_a_short_text(source: tuple[Path, int, Path], capsys: Any) -> None:
    path, bos, text = source
    ids = _ids(path, bos)
    # the loss paths and ablate report on the text is transformers' mean next-token loss on the same tokens
    logits = _hf(path, ids).logits[0]
    want = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]))
    paths = _json(capsys, "paths", path, "--text", text)
    assert paths["tokens"][:2] == [1, len(ids)] and paths["reconstruction_max_abs_error"] < 1e-3
    assert paths["term_importance"]["full_loss"] == pytest.approx(float(want), rel=1e-4)
    ab = _json(capsys, "ablate", path, "--heads", "1.0", "--text", text, "--draws", "1")
    assert ab["intact"]["loss"] == pytest.approx(float(want), rel=1e-4)
    assert ab["intact"]["icl"] is None and "the text has" in ab["left_out"]["icl"]
    assert f"one sequence of {len(ids)} tokens" in ab["sample"]


def test_report_on_a_short_text(source: tuple[Path, int, Path], tmp_path: Path, capsys: Any) -> None:
    path, bos, text = source
    ids = _ids(path, bos)
    out = tmp_path / "r"
    rc, _, err = run_main(capsys, "report", path, "--text", text, "-o", out, "--quiet", "--icl-examples", "4")
    assert rc == 0, err
    rep = json.loads((tmp_path / "r" / "report.json").read_text())
    assert rep["attention"]["ids"] == ids  # the viewer's text: the start token, then the paragraph
    assert "the text has" in rep["left_out"]["icl"] and rep["heads"]["icl"] is None
    card = rep["card"]
    assert card["source"] == "hf" and card["origin"]["path"] == str(path) and card["unknown"]
    assert "steps" not in card and "train_loss" not in card  # no training record is made up
    # the parameters the directory holds, as `qkov info` counts them (no zero biases qkov's form adds, a tied
    # unembedding once: GPT-2's is tied, this Llama's has no biases)
    stored = transformers.AutoModelForCausalLM.from_pretrained(path).num_parameters()
    assert card["parameters"] == _json(capsys, "info", path)["parameters"] == stored
    # the viewer's patterns are transformers' (report.json keeps 3 significant digits)
    att = torch.stack(_hf(path, ids).attentions)[:, 0]
    for l, h, q in ((0, 0, len(ids) - 1), (1, 3, len(ids) // 2)):
        got = torch.tensor(rep["attention"]["patterns"][l][h][q])
        torch.testing.assert_close(got, att[l, h, q, : q + 1], atol=5e-4, rtol=5e-3)


def test_the_python_equivalents_on_a_short_text(source: tuple[Path, int, Path]) -> None:
    """The library path the commands take: the text's tokens (start token first, its own length)
    and the head report, whose ICL score is left out only below the length it reads."""
    from qkov.analysis.heads.report import head_report
    from qkov.analysis.heads.probes import icl_left_out, icl_score
    from qkov.apps.inputs import analysis_inputs
    from qkov.io import load_any
    from qkov.weights.view import Weights

    path, bos, text = source
    model = load_any(path)
    assert model.bos_token_id == bos
    toks = analysis_inputs(path, model, text=text).tokens
    assert toks.tolist() == [_ids(path, bos)]
    w = Weights.from_model(model)
    rep = head_report(w, toks, bos=bos, diag_k=None)
    assert rep.icl is None and rep.left_out["icl"] == icl_left_out(toks.shape[1], N_CTX)
    # the boundary: one token short of the context is left out, the whole context is measured
    full = torch.randint(0, model.cfg.d_vocab, (4, N_CTX), generator=torch.Generator().manual_seed(0))
    full[:, 0] = bos
    assert head_report(w, full[:, :-1], bos=bos, diag_k=None).icl is None
    got = head_report(w, full, bos=bos, diag_k=None).icl
    assert got is not None and got.score == pytest.approx(icl_score(w, full).score) and got.late == N_CTX - 2
