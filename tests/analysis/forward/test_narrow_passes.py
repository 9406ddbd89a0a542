"""Passes that compute less than the whole model: logits at a few vocabulary entries (``trace(..., vocab=)``,
from a model in memory and from one streamed from disk a block of columns at a time) equal those entries of
the whole logits; an attention output given outright (a tensor edit of ``attn_out``) is not computed, unless
a site inside that attention is read or written."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from qkov import LazyCheckpoint, QkovError, Transformer, Weights, save_checkpoint, trace
from qkov.weights.parts import VOCAB_BLOCK

from helpers import LN_MLP
from test_forward import CONFIGS, _model, _tokens


@pytest.mark.parametrize("name", ["ln-mlp-shortformer", "llama-like"])
def test_logits_at_a_few_vocabulary_entries_are_those_of_the_whole_logits(name: str) -> None:
    cfg = CONFIGS[name]
    w = Weights.from_model(_model(cfg), dtype=torch.float64)
    toks = _tokens(cfg)
    full = trace(w, toks).logits
    vocab = torch.tensor([7, 0, cfg.d_vocab - 1, 7, 3])  # unsorted, repeated, both ends
    got = trace(w, toks, vocab=vocab)
    assert got.logits.shape == (*toks.shape, len(vocab))
    assert (got.logits - full[..., vocab]).abs().max() < 1e-13
    at = torch.tensor([2, cfg.n_ctx - 1])
    few = trace(w, toks, vocab=vocab, positions=at).logits
    assert (few - full[:, at][..., vocab]).abs().max() < 1e-13
    assert trace(w, toks, vocab=vocab[:0]).logits.shape == (*toks.shape, 0)
    assert trace(w, toks, vocab=vocab, positions=at[:0]).logits.shape == (toks.shape[0], 0, len(vocab))
    assert trace(w, toks, vocab=vocab, logits=False, cache=["z.0"]).logits.shape == (toks.shape[0], 0, len(vocab))


def test_a_streamed_source_reads_the_blocks_that_hold_the_entries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A vocabulary of three blocks of columns: entries from the first and the last block, out of order, read
    those two blocks alone."""
    cfg = LN_MLP.replace(d_vocab=2 * VOCAB_BLOCK + 100)
    save_checkpoint(Transformer(cfg, seed=3), tmp_path / "m")
    lazy = LazyCheckpoint(tmp_path / "m")
    toks = _tokens(cfg, batch=2)
    full = trace(lazy, toks).logits
    read: list[object] = []
    real = type(lazy).unembed
    monkeypatch.setattr(type(lazy), "unembed", lambda self, cols=None: read.append(cols) or real(self, cols))
    vocab = torch.tensor([cfg.d_vocab - 1, 5, 2 * VOCAB_BLOCK + 3, 0])
    got = trace(lazy, toks, vocab=vocab).logits
    assert (got - full[..., vocab]).abs().max() < 1e-5
    assert [c.start for c in read] == [0, 2 * VOCAB_BLOCK]  # type: ignore[attr-defined]
    assert trace(lazy, toks, vocab=vocab[:0]).logits.shape == (*toks.shape, 0)


def test_vocabulary_entries_out_of_range_or_with_the_logits_site_are_refused() -> None:
    cfg = CONFIGS["ln-mlp-shortformer"]
    w, toks = Weights.from_model(_model(cfg)), _tokens(cfg)
    with pytest.raises(QkovError, match=r"vocab: every id must be in 0\.\.29"):
        trace(w, toks, vocab=torch.tensor([0, cfg.d_vocab]))
    with pytest.raises(QkovError, match="vocab: expected a 1-D tensor"):
        trace(w, toks, vocab=torch.tensor([[1, 2]]))
    with pytest.raises(QkovError, match="the logits site holds the whole vocabulary"):
        trace(w, toks, vocab=torch.tensor([1]), cache=["logits"])


@pytest.mark.parametrize("name", ["ln-mlp-shortformer", "llama-like", "neox-like"])
def test_an_attention_output_given_outright_is_not_computed(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Layer 0's attention weights made unreadable: a pass given that layer's ``attn_out`` runs without them
    and equals the pass that computes the attention and then replaces its output; observing ``z.0`` (or an
    edit of it) makes the pass compute the attention again."""
    cfg = CONFIGS[name]
    w = Weights.from_model(_model(cfg), dtype=torch.float64)
    toks = _tokens(cfg)
    given = torch.randn(*toks.shape, cfg.d_model, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    replaced = trace(w, toks, edits={"attn_out.0": lambda v, site: given}).logits  # computed, then replaced
    real = Weights.attention

    def unreadable(self, layer, *a, **k):  # type: ignore[no-untyped-def]
        if layer == 0:
            raise RuntimeError("layer 0's attention was computed")
        return real(self, layer, *a, **k)

    monkeypatch.setattr(Weights, "attention", unreadable)
    got = trace(w, toks, edits={"attn_out.0": given})
    assert (got.logits - replaced).abs().max() < 1e-12
    bias = given[0, 0]  # a value that broadcasts: cached at the site's shape, as a computed one
    held = trace(w, toks, edits={"attn_out.0": bias}, cache=["attn_out.0"])["attn_out", 0]
    assert held.shape == (*toks.shape, cfg.d_model) and torch.equal(held, bias.expand_as(held))
    with pytest.raises(RuntimeError, match="was computed"):
        trace(w, toks, edits={"attn_out.0": given}, cache=["z.0"])
    with pytest.raises(RuntimeError, match="was computed"):
        trace(w, toks, edits={"attn_out.0": given, "q.0": lambda v, site: v * 2})
