"""The Python surface as a newcomer meets it (issue 25): import a Hugging Face directory, pass what
``qkov.load`` returns (or the directory itself) to any analysis, and the start token and tokenizer
of the source are used without being asked for.

The start-token checks read results, never the code: every entry point that builds or prepends a
start token gives, with ``bos`` left out, exactly what it gives with ``bos=50256`` passed (GPT-2's
``<|endoftext|>``), something else with ``bos=0``, or tokens that start with 50256.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import qkov
from qkov.analysis.series.measures import Sample, measure

transformers = pytest.importorskip("transformers")
from tokenizers import Tokenizer, models, pre_tokenizers, processors  # noqa: E402

GPT2_BOS = 50256  # <|endoftext|>, the last id of GPT-2's vocabulary of 50257
PARAGRAPH = (
    "the fox saw the dog near the river and the dog saw the fox . the fox ran to the hill and the dog "
    "ran after the fox . when the sun set the fox slept under a tree and the dog slept near the river . "
    "in the morning the dog saw the fox again and the fox saw the dog again , and they ran to the hill ."
)


def _word_tokenizer(words: list[str], specials: dict[str, int]) -> Tokenizer:
    """A word-level tokenizer: ``specials`` at their ids, ``words`` on the lowest free ids."""
    vocab = dict(specials)
    free = (i for i in range(10**6) if i not in specials.values())
    for word in dict.fromkeys(words):
        vocab[word] = next(free)
    tok = Tokenizer(models.WordLevel(vocab, unk_token=next(iter(specials))))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A GPT-2-like directory whose start token is 50256 (vocabulary 50257), with a tokenizer."""
    path = tmp_path_factory.mktemp("gpt2")
    cfg = transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=16, vocab_size=GPT2_BOS + 1, n_positions=32, bos_token_id=GPT2_BOS,
        eos_token_id=GPT2_BOS,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(cfg).eval().save_pretrained(path)
    # as GPT-2's, the tokenizer has a token for every id: the paragraph's words, then fillers
    words = [*dict.fromkeys(PARAGRAPH.split())]
    words += [f"w{i}" for i in range(GPT2_BOS - len(words))]
    tok = _word_tokenizer(words, {"<|endoftext|>": GPT2_BOS})
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama-family directory (rotary positions, RMSNorm, grouped-query attention) with a tokenizer."""
    path = tmp_path_factory.mktemp("llama")
    cfg = transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=48, max_position_embeddings=64, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(path)
    tok = _word_tokenizer(PARAGRAPH.split(), {"<unk>": 0, "<s>": 1, "</s>": 2})
    # as a real Llama tokenizer.json: the post-processor adds <s> itself (qkov must not add a second)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.save(str(path / "tokenizer.json"))
    return path


def _differs(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool((a - b).abs().max() > 1e-6)


def test_the_start_token_and_tokenizer_travel_with_every_source(gpt2_dir: Path, tmp_path: Path) -> None:
    model = qkov.load_any(gpt2_dir)
    assert model.bos_token_id == GPT2_BOS and model.tokenizer is not None
    view = qkov.Weights.from_model(model)
    assert view.bos_token_id == GPT2_BOS and view.tokenizer is model.tokenizer
    assert qkov.as_source(gpt2_dir, where="test").bos_token_id == GPT2_BOS
    assert qkov.Weights.from_source(view).bos_token_id == GPT2_BOS
    qkov.save_checkpoint(model, tmp_path / "ck")
    lazy = qkov.LazyCheckpoint(tmp_path / "ck")
    assert lazy.bos_token_id == GPT2_BOS
    assert lazy.tokenizer is not None and lazy.tokenizer.encode("fox").ids == model.tokenizer.encode("fox").ids
    assert qkov.Weights.from_source(lazy).bos_token_id == GPT2_BOS
    assert model.to_tokens("the fox")[0, 0].item() == GPT2_BOS


def test_every_entry_point_that_builds_a_start_token_uses_the_sources(gpt2_dir: Path) -> None:
    model = qkov.load_any(gpt2_dir)
    w = qkov.Weights.from_model(model)
    for build in (qkov.induction_probe_tokens, qkov.prefix_matching_tokens):
        for holder in (model, w, gpt2_dir):
            toks = build(holder, length=5, seed=1)
            assert (toks[:, 0] == GPT2_BOS).all() and not (toks[:, 1:] == GPT2_BOS).any(), build
            # every id of the whole range, as a bare vocabulary size draws them
            every = build(holder, length=5, seed=1, ordinary=False)
            assert torch.equal(every, build(GPT2_BOS + 1, length=5, seed=1, bos=GPT2_BOS))
            # by default only ordinary text tokens (here: every id but the start token, a special token)
            assert model.codec.ordinary(GPT2_BOS + 1)[toks[:, 1:]].all()
        assert toks.max() < GPT2_BOS + 1
    with pytest.raises(qkov.QkovError, match="a vocabulary size carries no start token: pass bos="):
        qkov.induction_probe_tokens(GPT2_BOS + 1)

    # results: the source's start token (left out) == bos=50256 passed, != bos=0
    def same_and_not_zero(call: Any, read: Any) -> None:
        own, explicit, zero = read(call()), read(call(bos=GPT2_BOS)), read(call(bos=0))
        torch.testing.assert_close(own, explicit, rtol=0, atol=0)
        assert _differs(own, zero)

    for source in (model, w, gpt2_dir):
        same_and_not_zero(lambda **kw: qkov.induction_probe(source, seed=2, **kw), lambda r: r.induction_attention)
    text = model.to_tokens(" ".join(PARAGRAPH.split()[:23]))  # 24 tokens, the start token first
    same_and_not_zero(
        lambda **kw: qkov.head_report(model, text, diag_k=None, icl=False, **kw),
        lambda r: torch.stack([r.scores["prefix_matching"], r.scores["induction"]]),
    )

    def losses(s: Any) -> torch.Tensor:
        return torch.tensor([s.intact.repeat_first, s.intact.repeat_second, s.ablated.repeat_second])

    for mode in ("zero", "mean"):  # mean ablation averages over the probe's tokens without a text
        same_and_not_zero(lambda **kw: qkov.ablation_study(w, None, [(1, 0)], mode=mode, draws=0, **kw), losses)
    same_and_not_zero(
        lambda **kw: qkov.composition_paths(model, (0, 0), (1, 0), batch=2, **kw),
        # the removed shares too: in this small random model the raw prefix scores move by ~1e-6 only
        lambda c: torch.tensor([c.prefix_clean, c.prefix_corrupted, *c.prefix_removed.values()]),
    )
    same_and_not_zero(
        lambda **kw: measure(w, Sample(None, None, **kw)),  # its numbers are rounded to 4 digits: the
        lambda r: torch.tensor([r["induction"], r["repeat_first"], r["repeat_second"]]),  # losses move more
    )


def test_a_llama_family_directory_runs_every_analysis_from_python(llama_dir: Path, tmp_path: Path) -> None:
    """The Python equivalents of info, heads, paths, report and ablate on a rotary/RMSNorm/GQA model
    and a one-paragraph text, passing the model (or the directory) as it is."""
    model = qkov.load_any(llama_dir)  # info
    cfg = model.cfg
    assert (cfg.positional, cfg.normalization, cfg.kv_heads, cfg.n_heads) == ("rotary", "rmsnorm", 2, 4)
    assert model.bos_token_id == 1 and model.tokenizer is not None
    # one short paragraph: 31 tokens on a 64-token context, analysed as one sequence of its own length
    short = " ".join(PARAGRAPH.split()[:30])
    text = model.to_tokens(short)
    assert text[0, 0] == 1 and text.shape[1] == 31 and cfg.n_ctx == 64
    heads = qkov.head_report(llama_dir, text, diag_k=None)  # heads (the directory itself)
    assert heads.icl is None and "the text has 31" in heads.left_out["icl"]  # left out, with its reason
    assert set(heads.scores) >= {"previous_token", "induction", "prefix_matching"}
    assert heads.scores["previous_token"].shape == (2, 4)
    exp = qkov.expand(model, text)  # paths
    assert exp.reconstruction_error() < 1e-3
    torch.testing.assert_close(exp.total_logits(), qkov.trace(model, text).logits, rtol=0, atol=1e-3)
    study = qkov.ablation_study(model, text, [(1, 0)], mode="zero", draws=1)  # ablate
    assert study.intact.loss is not None and study.ablated.loss != study.intact.loss
    # trigrams and bigrams leave out the source's start token (1 here), the other special tokens and the ids
    # the word-level tokenizer has no token for, as exclude=<those ids> would
    left = {1, 0, 2, *range(model.tokenizer.get_vocab_size(), cfg.d_vocab)}
    tri, bi = qkov.skip_trigrams(model, 1, 0, top=30), qkov.bigrams(model, top=30)
    same_tri = qkov.skip_trigrams(model, 1, 0, top=30, exclude=tuple(left))
    assert [t.to_dict() for t in tri] == [t.to_dict() for t in same_tri]
    assert [b.to_dict() for b in bi] == [b.to_dict() for b in qkov.bigrams(model, top=30, exclude=tuple(left))]
    assert not any({t.source, t.destination, t.output} & left for t in tri)
    assert not any({b.token, b.next} & left for b in bi)
    unknown = cfg.d_vocab - model.tokenizer.get_vocab_size()
    assert tri.left_out == bi.left_out == f"the start token, 2 special, {unknown} unknown to the tokenizer (padding) tokens left out"
    assert [b.to_dict() for b in bi] != [b.to_dict() for b in qkov.bigrams(model, top=30, exclude=(0,))]
    (tmp_path / "story.txt").write_text(short)
    from qkov.apps.report import write_report

    report = write_report(llama_dir, tmp_path / "report", text=tmp_path / "story.txt", diag_k=None)  # report
    data = json.loads((tmp_path / "report" / "report.json").read_text())
    assert data["card"] is not None and report is not None
    assert "the text has 31" in data["left_out"]["icl"]  # said, not refused


def test_ablation_study_takes_the_text_then_the_heads() -> None:
    """Positional or named, heads as pairs or ``"L.H"``; the pre-1.0 order (heads second, ``text=``) was
    removed in 1.1 and is a plain ``TypeError``."""
    model = qkov.Transformer(qkov.ModelConfig(n_layers=2, n_heads=2, d_model=16, d_head=8, n_ctx=16, d_vocab=32))
    text = qkov.induction_probe_tokens(model, length=7, batch=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new = qkov.ablation_study(model, text, [(1, 0)], mode="zero", draws=1)
        named = qkov.ablation_study(model, text=text, heads=["1.0"], mode="zero", draws=1)
    assert new.to_dict() == named.to_dict() and new.heads == ["1.0"]
    with pytest.raises(TypeError, match="multiple values for argument 'text'"):
        qkov.ablation_study(model, [(1, 0)], text=text, mode="zero", draws=1)
