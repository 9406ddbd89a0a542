"""Texts on models whose tokenizers are shaped like the real ones (issue 35): a Llama-family
directory whose ``tokenizer.json`` adds ``<s>`` itself (SentencePiece-style ``▁`` spaces, 256
byte-fallback pieces), one whose tokenizer adds nothing, a GPT-2-style byte-level one, and qkov's
own. Every command's token count, loss and positions are checked against what ``transformers``
computes with the directory's own tokenizer and model, and no text may carry a second start token.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer

import qkov
from qkov.analysis.causal.metrics import LogitDiff, parse_metric
from qkov.apps.explore.session import open_explorer
from qkov.model.tokens import TextCodec

from helpers import run_main
from hf_models import SMALL
from tokenizers_like import STORY, gpt2_tokenizer, llama_tokenizer, write_tokenizer

transformers = pytest.importorskip("transformers")

N_CTX = 64
LONG_STORY = (STORY * 4).strip()  # longer than one 64-token window: some of it cannot be read


def _llama_dir(folder: Path, *, adds_bos: bool) -> Path:
    tok = llama_tokenizer(512, adds_bos=adds_bos)
    cfg = transformers.LlamaConfig(
        **{**SMALL, "vocab_size": 512, "max_position_embeddings": N_CTX}, num_key_value_heads=2,
        intermediate_size=48, bos_token_id=1, eos_token_id=2, initializer_range=0.15,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(folder)
    write_tokenizer(folder, tok)
    return folder


@pytest.fixture(scope="module", params=[True, False], ids=["adds-bos", "adds-nothing"])
def llama(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _llama_dir(tmp_path_factory.mktemp("llama"), adds_bos=request.param)


def _hf_ids(folder: Path, text: str) -> list[int]:
    """What the directory's own tokenizer makes of ``text`` (``transformers``, special tokens as it adds them)."""
    return list(transformers.AutoTokenizer.from_pretrained(str(folder))(text)["input_ids"])


def _hf_loss(folder: Path, ids: list[int]) -> float:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    with torch.no_grad():
        t = torch.tensor([ids])
        return float(model(t, labels=t).loss)


def _one_start(ids: list[int], bos: int) -> None:
    assert bos not in ids[1:], f"a second start token: {ids[:4]}"


def test_to_tokens_is_the_directorys_own_tokenizer(llama: Path) -> None:
    model = qkov.load(llama)  # qkov.load reads a Hugging Face directory too
    for text in (STORY, "Lily had a red ball.", "Tim", "ü\n\tx  y"):
        want = _hf_ids(llama, text)
        got = model.to_tokens(text)[0].tolist()
        assert got == want, text
        _one_start(got, 1)
    # a text that starts with a space: qkov reads tokenizer.json as written ("▁" prepended, then the
    # space: '▁', '▁Tim'), as the tokenizers library does; transformers 5's LlamaTokenizer rewrites that
    # normalizer into a Metaspace pre-tokenizer that gives '▁Tim' alone (docs/modern-models.md says so)
    raw = Tokenizer.from_file(str(llama / "tokenizer.json"))
    assert model.to_tokens(" Tim")[0].tolist() == raw.encode(" Tim").ids != _hf_ids(llama, " Tim")
    adds = model.codec.tokenizer_adds_bos
    assert adds == (_hf_ids(llama, "a")[0] == 1) and model.default_prepend_bos == adds
    plain = model.to_tokens("Lily had", prepend_bos=False)[0].tolist()
    assert 1 not in plain and model.to_tokens("Lily had", prepend_bos=True)[0].tolist() == [1, *plain]
    # the decision travels: a weights view, a lazy view, a qkov checkpoint saved from the model
    assert qkov.Weights.from_model(model).default_prepend_bos == adds == qkov.LazyCheckpoint(llama).default_prepend_bos


def test_qkov_checkpoint_keeps_the_start_token_decision(llama: Path, tmp_path: Path) -> None:
    model = qkov.load(llama)
    qkov.save_checkpoint(model, tmp_path / "ck")
    again = qkov.load(tmp_path / "ck")
    assert again.default_prepend_bos == model.default_prepend_bos
    assert again.to_tokens(STORY)[0].tolist() == _hf_ids(llama, STORY)


def test_token_strings_read_as_text(llama: Path) -> None:
    model = qkov.load(llama)
    strs = model.to_str_tokens("Lily had a red ball. ü\n")
    assert "".join(strs[1 if model.default_prepend_bos else 0 :]) == " Lily had a red ball. ü\n".replace("ü", "<0xC3><0xBC>")
    assert " Lily" in strs and "<0xC3>" in strs  # SentencePiece's ▁ as a space, byte tokens by name
    assert model.to_str_tokens(torch.tensor([model.to_single_token("▁")])) == [" "]  # a lone ▁ is a space
    assert model.to_str_tokens("Lily") == model.to_str_tokens(model.to_tokens("Lily"))
    with pytest.raises(qkov.QkovError, match="one sequence"):
        model.to_str_tokens(torch.zeros(2, 3, dtype=torch.long))


def test_words_resolve_to_one_token(llama: Path) -> None:
    model = qkov.load(llama)
    tim = model.to_single_token("Tim")
    assert model.codec.token_str(tim) == " Tim"
    assert model.to_single_token(" Tim") == model.to_single_token("▁Tim") == tim
    assert model.to_single_token("<0x0A>") == 3 + 0x0A and model.to_single_token("<s>") == 1
    clean = model.to_tokens("Lily gave the ball to")
    for spec in ("logit-diff: Tim, Lily", "logit-diff:Tim,Lily"):
        m = parse_metric(spec, clean, model.codec, model.cfg.d_vocab)
        assert (m.correct, m.incorrect) == (tim, model.to_single_token("Lily"))
        assert "' Tim'" in m.name
    with pytest.raises(qkov.QkovError, match=r"'Timbuktu' is not one token: it splits into \[' Tim'"):
        parse_metric("prob:Timbuktu", clean, model.codec, model.cfg.d_vocab)


def test_metrics_take_their_tokens_positionally() -> None:
    m = LogitDiff(317, 326)
    assert (m.correct, m.incorrect, m.reads, m.positions) == (317, 326, (), [-1]) and m.name == "logit diff 317 - 326"
    assert LogitDiff(5, 6, position=-2).positions == [-2]
    with pytest.raises(qkov.QkovError, match="to_single_token"):
        LogitDiff("Tim", 326)
    with pytest.raises(TypeError):
        LogitDiff()  # type: ignore[call-arg]


def test_every_command_reads_a_text_as_transformers_does(llama: Path, tmp_path: Path, capsys: Any) -> None:
    """heads and ablate count the tokens the directory's tokenizer gives and ablate's intact loss is
    transformers' loss on them; patch reads its lines the same way and takes its metric as words."""
    text = tmp_path / "story.txt"
    text.write_text(STORY.strip())
    want = _hf_ids(llama, STORY.strip())
    assert len(want) < N_CTX
    rc, out, err = run_main(capsys, "heads", llama, "--text", text, "--json")
    assert rc == 0, err
    assert f"one sequence of {len(want)} tokens" in json.loads(out)["inputs"]
    rc, out, err = run_main(capsys, "paths", llama, "--text", text, "--json")
    assert rc == 0, err
    assert f"one sequence of {len(want)} tokens" in json.loads(out)["inputs"]
    rc, out, err = run_main(capsys, "report", llama, "--text", text, "-o", tmp_path / "rep")
    assert rc == 0, err
    assert f"one sequence of {len(want)} tokens" in json.loads((tmp_path / "rep" / "report.json").read_text())["inputs"]
    rc, out, err = run_main(capsys, "ablate", llama, "--heads", "1.0", "--text", text, "--draws", "0", "--json")
    assert rc == 0, err
    assert json.loads(out)["intact"]["loss"] == pytest.approx(_hf_loss(llama, want), abs=1e-5)
    clean, corrupted = tmp_path / "clean.txt", tmp_path / "corrupted.txt"
    clean.write_text("Lily had a red ball. She gave it to\n")
    corrupted.write_text("Tim had a red ball. She gave it to\n")
    assert len(_hf_ids(llama, clean.read_text().strip())) == len(_hf_ids(llama, corrupted.read_text().strip()))
    args = ["--clean", clean, "--corrupted", corrupted, "--metric", "logit-diff: Tim, Lily", "--json"]
    rc, out, err = run_main(capsys, "patch", llama, *args)
    assert rc == 0, err
    data = json.loads(out)
    ids = _hf_ids(llama, clean.read_text().strip())
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(llama)).eval()
    with torch.no_grad():
        last = hf(torch.tensor([ids])).logits[0, -1]
    model = qkov.load(llama)
    expect = float(last[model.to_single_token("Tim")] - last[model.to_single_token("Lily")])
    assert data["results"][0]["clean"] == pytest.approx(expect, abs=1e-4)


def test_text_beyond_the_context_is_named(llama: Path, tmp_path: Path, capsys: Any) -> None:
    text = tmp_path / "long.txt"
    text.write_text(LONG_STORY)
    n = len(qkov.load(llama).codec.plain(LONG_STORY))
    rc, out, err = run_main(capsys, "heads", llama, "--text", text, "--json")
    assert rc == 0, err
    inputs = json.loads(out)["inputs"]
    start = 1 if qkov.load(llama).default_prepend_bos else 0
    windows = n // (N_CTX - start)
    read = windows * (N_CTX - start)
    assert f"{windows} sequences of {N_CTX} tokens" in inputs and f"{read:,} of {n:,} tokens read" in inputs
    assert f"the last {n - read:,} not read" in inputs


def test_the_explorer_reads_texts_as_the_tokenizer_does(llama: Path) -> None:
    ex = open_explorer(llama, cache_dir=None)
    assert ex.tokens({"text": STORY.strip()})[0].tolist() == _hf_ids(llama, STORY.strip())


def test_a_rotary_models_positional_score_is_not_applicable(llama: Path, tmp_path: Path, capsys: Any) -> None:
    text = tmp_path / "story.txt"
    text.write_text(STORY.strip())
    rc, out, err = run_main(capsys, "heads", llama, "--text", text, "--json")
    data = json.loads(out)
    assert all(h["positional_fraction"] is None for h in data["heads"])
    assert "not applicable" in data["left_out"]["positional_fraction"]
    rc, out, err = run_main(capsys, "heads", llama, "--text", text)
    assert rc == 0 and "n/a" in out and "pos score left out: not applicable" in out


def test_tables_and_probes_leave_byte_and_special_tokens_out(llama: Path) -> None:
    model = qkov.load(llama)
    tri = qkov.skip_trigrams(model, 0, 0, top=40)
    assert tri.left_out == "the start token, 2 special, 256 byte-fallback tokens left out"
    assert all(3 + 256 <= i for t in tri for i in (t.source, t.destination, t.output))
    everything = qkov.skip_trigrams(model, 0, 0, top=40, exclude=())
    assert everything.left_out == "" and any(i < 3 + 256 for t in everything for i in (t.source, t.destination, t.output))
    bi = qkov.bigrams(model, top=40)
    assert all(b.token >= 259 and b.next >= 259 for b in bi)
    probe = qkov.induction_probe_tokens(model, seed=1)
    assert (probe[:, 1:] >= 259).all()
    assert (qkov.induction_probe_tokens(model, seed=1, ordinary=False)[:, 1:] < 259).any()


def test_gpt2_style_and_qkov_tokenizers_get_one_start_token() -> None:
    """A tokenizer that adds nothing: qkov prepends the start token (TransformerLens' convention for
    GPT-2), once; a Llama-style one that adds <s>: never a second."""
    gpt2 = gpt2_tokenizer()
    bos = gpt2.token_to_id("<|endoftext|>")
    codec = TextCodec(gpt2, bos)
    assert not codec.tokenizer_adds_bos
    assert codec.encode("return self") == [bos, *gpt2.encode("return self").ids]
    llama = llama_tokenizer(512)
    codec = TextCodec(llama, 1)
    assert codec.tokenizer_adds_bos and codec.encode("Lily") == llama.encode("Lily").ids
    from qkov.training.data import train_tokenizer

    own = train_tokenizer([STORY] * 20, 300)
    codec = TextCodec(own, 0)
    assert codec.encode("Lily had") == [0, *own.encode("Lily had").ids] and codec.special_ids() == [0]
    assert codec.str_tokens(codec.encode("Lily had"))[1:] == [own.decode([i]) for i in own.encode("Lily had").ids]


def test_ablate_each_head_in_turn(llama: Path, tmp_path: Path, capsys: Any) -> None:
    text = tmp_path / "story.txt"
    text.write_text(STORY.strip())
    rc, out, err = run_main(capsys, "ablate", llama, "--heads", "all", "--text", text, "--mode", "zero", "--json")
    assert rc == 0, err
    data = json.loads(out)
    assert [h["head"] for h in data["heads"]] == [f"{l}.{h}" for l in range(2) for h in range(4)]
    one = run_main(capsys, "ablate", llama, "--heads", "1.2", "--text", text, "--mode", "zero", "--draws", "0", "--json")
    assert data["heads"][6]["loss"] == pytest.approx(json.loads(one[1])["ablated"]["loss"], abs=1e-5)
    rc, out, err = run_main(capsys, "ablate", llama, "--heads", "all", "--text", text)
    assert rc == 0 and "each head ablated alone" in out and "text loss" in out and "31 per copy" in out


def test_the_notebook_viewer_names_a_text_it_cannot_read(llama: Path) -> None:
    from qkov.show import attention

    model = qkov.load(llama)
    view = attention(model, STORY.strip())
    assert view.ids.tolist() == _hf_ids(llama, STORY.strip())
    with pytest.raises(qkov.QkovError, match=r"the text is \d+ tokens and the model reads at most 64"):
        attention(model, LONG_STORY)
