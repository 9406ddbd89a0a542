"""Attention at a few entries from the attention kernel's log-sum-exp (the ``lse`` site): the pattern's
own entries (float64 to 1e-12: the formula is exact; float32 to 1e-5: the kernel and the softmax round
scores of up to 40 apart by a few float32 ulps each), the forward unchanged by reading it, and the
induction probe that reads it equal to its pattern definition (the previous-token scores that read it:
tests/analysis/series/test_measures.py)."""

from __future__ import annotations

import pytest
import torch

from qkov import QkovError, Transformer, Weights, trace
from qkov.analysis.causal.ablation import ablation_edits
from qkov.analysis.heads.entries import EntryWatch, attention_entries
from qkov.analysis.heads.probes import induction_attention, induction_entries, induction_probe, induction_probe_tokens

from hand_built import V, hand_built
from helpers import LN_MLP, MODERN
from reference import reference_forward

MODELS = {
    "hand-built": hand_built,  # shortformer, attention only, scores up to 40 (sharp heads)
    "gpt2-like": lambda: Transformer(LN_MLP.replace(positional="standard"), seed=1).eval(),
    "llama-like": lambda: Transformer(MODERN, seed=1).eval(),  # rotary, grouped-query keys
}
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5}


def _views(name: str) -> tuple[Weights, Weights]:
    """The model's view in float32 and in float64 (the reference's precision)."""
    m = MODELS[name]()
    return Weights.from_model(m), Weights.from_model(m.double(), dtype=torch.float64)


def _tokens(w: Weights, batch: int = 3, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, w.cfg.d_vocab, (batch, w.cfg.n_ctx), generator=gen)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_entries_from_the_kernels_lse_are_the_patterns_own(name: str, dtype: torch.dtype) -> None:
    w32, w64 = _views(name)
    w = w64 if dtype == torch.float64 else w32
    toks = _tokens(w)
    r = trace(w, toks, cache=["q", "k", "lse", "z"])
    plain = trace(w, toks, cache=["z"])
    # reading the log-sum-exp changes nothing: the same kernel gives the same z and logits, bit for bit
    assert torch.equal(r.logits, plain.logits) and torch.equal(r.stack("z"), plain.stack("z"))
    _, patterns = reference_forward(w64, toks)  # [L, B, H, T, T], written out independently in float64
    T = toks.shape[1]
    queries, keys = torch.tril_indices(T, T)  # every entry at or before its query
    for l in range(w.cfg.n_layers):
        assert r["lse", l].shape == (3, w.cfg.n_heads, T)
        got = attention_entries(r["q", l], r["k", l], r["lse", l], queries, keys)  # [B, H, N]
        assert (got.double() - patterns[l][:, :, queries, keys]).abs().max() < TOLERANCE[dtype]
        later = attention_entries(r["q", l], r["k", l], r["lse", l], torch.tensor([0, 3]), torch.tensor([1, 5]))
        assert torch.equal(later, torch.zeros_like(later))  # a key after its query: 0, as in the pattern
    # where the scores are formed (asked for), the site is their log-sum-exp: the same numbers
    explicit = trace(w, toks, cache=["scores", "lse"])
    for l in range(w.cfg.n_layers):
        assert torch.equal(explicit["lse", l], explicit["scores", l].logsumexp(-1))
        assert (explicit["lse", l] - r["lse", l]).abs().max() < 1e3 * TOLERANCE[dtype]


def test_the_watch_hands_on_each_layers_entries_and_changes_nothing() -> None:
    w, w64 = _views("llama-like")
    toks = _tokens(w)
    queries, keys = torch.tensor([5, 7, 7, 11]), torch.tensor([4, 0, 7, 3])
    seen: dict[int, torch.Tensor] = {}
    r = trace(w, toks, edits=EntryWatch(w.cfg.n_layers, queries, keys, seen.__setitem__).edits())
    assert torch.equal(r.logits, trace(w, toks).logits) and sorted(seen) == list(range(w.cfg.n_layers))
    _, patterns = reference_forward(w64, toks)
    for l, got in seen.items():
        assert got.shape == (3, w.cfg.n_heads, 4)
        assert (got.double() - patterns[l][:, :, queries, keys]).abs().max() < 1e-5


def test_the_probe_reads_entries_and_an_edited_pattern_where_one_is_written() -> None:
    w, w64 = _views("hand-built")
    L = 20
    toks = induction_probe_tokens(V, length=L, batch=4, seed=2, bos=0)
    probe = induction_probe(w, length=L, batch=4, seed=2)
    want = induction_attention(reference_forward(w64, toks)[1], L)
    assert (probe.induction_attention.double() - want).abs().max() < 1e-6 and probe.best > 0.7
    # ablating the previous-token head (z edits): still read at the entries, equal to the recorded patterns
    edits = ablation_edits([(0, 0)], "zero")
    ablated = induction_probe(w, length=L, batch=4, seed=2, edits=edits)
    recorded = induction_attention(trace(w, toks, cache="pattern.*", edits=edits).stack("pattern"), L)
    assert (ablated.induction_attention - recorded).abs().max() < 1e-6 and ablated.best < 0.5 * probe.best
    # a pattern written into layer 1 (uniform over the keys so far) is what the edited pass attends with
    T = toks.shape[1]
    uniform = torch.ones(T, T).tril() / torch.arange(1, T + 1)[:, None]
    written = induction_probe(w, length=L, batch=4, seed=2, edits={"pattern.1": uniform})
    q, k = induction_entries(T, L)
    assert torch.allclose(written.induction_attention[1], uniform[q, k].mean().expand(2), atol=1e-7)


def test_lse_is_not_patched_nothing_reads_it_back() -> None:
    from qkov.analysis.causal.patching import activation_patching

    w, _ = _views("hand-built")
    clean, corrupted = _tokens(w, 2, seed=1), _tokens(w, 2, seed=2)
    with pytest.raises(QkovError, match="nothing reads it back: patch scores or pattern"):
        activation_patching(w, clean, corrupted, site="lse")
