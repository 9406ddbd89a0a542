"""Passes over part of the positions. A pass over a suffix (``trace(..., past=...)``: the keys and values
of the positions before it from a run of the whole sequences) has the suffix's sites and logits of the
whole pass, for every family of model (learned, shortformer and rotary positions, grouped-query attention,
parallel blocks), with the last layer at a few positions, with a start inside the pass and with edits.
Edits marked ``at_rows`` of the last layer's queries, ``z``, MLP input and output and output stream take
those sites at the logits' positions and keep the last layer there, with the whole pass's values."""

from __future__ import annotations

import pytest
import torch

from qkov import QkovError, Weights, trace
from qkov.analysis.forward.edits import at_rows

from test_forward import CONFIGS, _counting_last_block, _model, _tokens


def _past(w: Weights, toks: torch.Tensor, f: int) -> tuple[torch.Tensor, torch.Tensor]:
    rec = trace(w, toks, cache=["k.*", "v.*"])
    return rec.stack("k")[:, :, :f].contiguous(), rec.stack("v")[:, :, :f].contiguous()


@pytest.mark.parametrize("name", CONFIGS)
def test_a_suffix_after_its_past_is_the_whole_pass_there(name: str) -> None:
    cfg = CONFIGS[name]
    w = Weights.from_model(_model(cfg), dtype=torch.float64)
    toks, f, L = _tokens(cfg), 5, cfg.n_layers
    past = _past(w, toks, f)
    full = trace(w, toks, cache=["resid_pre.*", "z.*", "mlp_out.*" if cfg.d_mlp else "attn_out.*"])
    got = trace(w, toks[:, f:], past=past, cache=["resid_pre.*", "z.*"])
    assert (got.logits - full.logits[:, f:]).abs().max() < 1e-12
    for l in range(L):
        assert (got["resid_pre", l] - full["resid_pre", l][:, f:]).abs().max() < 1e-12
        assert (got["z", l] - full["z", l][:, f:]).abs().max() < 1e-12
    at = torch.tensor([0, 3, cfg.n_ctx - f - 1])  # the last layer at a few positions of the suffix
    few = trace(w, toks[:, f:], past=past, positions=at)
    assert (few.logits - full.logits[:, f + at]).abs().max() < 1e-12
    copies = trace(w, toks.repeat(2, 1)[:, f:], past=past, positions=at)  # two copies of the batch read one past
    assert (copies.logits - full.logits[:, f + at].repeat(2, 1, 1)).abs().max() < 1e-12
    start = L - 1  # from a layer's input, the suffix of the whole pass's stream
    mid = trace(w, toks[:, f:], past=past, positions=at, start_at=(start, full["resid_pre", start][:, f:].contiguous()))
    assert (mid.logits - full.logits[:, f + at]).abs().max() < 1e-12
    zero = {"z.0.1": lambda z, site: torch.zeros_like(z)}  # an edit of the suffix: as the whole pass edited there
    edited = trace(w, toks, edits={"z.0.1": lambda z, site: torch.cat([z[:, :f], 0 * z[:, f:]], 1)})
    assert (trace(w, toks[:, f:], past=past, edits=zero).logits - edited.logits[:, f:]).abs().max() < 1e-12
    assert (edited.logits[:, f:] - full.logits[:, f:]).abs().max() > 1e-6  # the edit did change the logits


def test_a_past_of_the_wrong_shape_or_with_patterns_is_refused() -> None:
    cfg = CONFIGS["llama-like"]
    w = Weights.from_model(_model(cfg), dtype=torch.float64)
    toks = _tokens(cfg)
    k, v = _past(w, toks, 4)
    with pytest.raises(QkovError, match="expected keys and values of shape"):
        trace(w, toks[:, 4:], past=(k[:, :2], v[:, :2]))
    with pytest.raises(QkovError, match="exceed the context"):
        trace(w, toks, past=(k, v))
    with pytest.raises(QkovError, match="no scores, pattern or lse"):
        trace(w, toks[:, 4:], past=(k, v), cache=["pattern.0"])


@pytest.mark.parametrize("name", ["ln-mlp-shortformer", "llama-like", "neox-like"])
def test_edits_that_take_the_rows_keep_the_last_layer_at_them(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = CONFIGS[name]
    w = Weights.from_model(_model(cfg), dtype=torch.float64)
    toks, at, last = _tokens(cfg), torch.tensor([2, 7, cfg.n_ctx - 1]), cfg.n_layers - 1
    seen: dict[str, int] = {}

    def scaled(kind: str, c: float):  # type: ignore[no-untyped-def]
        def fn(x: torch.Tensor, site) -> torch.Tensor:  # type: ignore[no-untyped-def]
            seen[kind] = x.shape[1]
            return c * x

        return fn

    kinds = {"q": 1.5, "z": -0.5, "mlp_input": 2.0, "mlp_out": 0.7, "resid_post": 1.3}
    calls = _counting_last_block(monkeypatch)
    marked = trace(w, toks, positions=at, edits={f"{k}.{last}": at_rows(scaled(k, c)) for k, c in kinds.items()})
    assert calls == [last] and seen == {k: len(at) for k in kinds}  # the rows alone, the few-positions block
    full = trace(w, toks, edits={f"{k}.{last}": scaled(k, c) for k, c in kinds.items()})
    plain = trace(w, toks, positions=at)
    assert (marked.logits - full.logits[:, at]).abs().max() < 1e-12
    assert (marked.logits - plain.logits).abs().max() > 1e-6  # the edits did change the logits
    calls.clear()
    trace(w, toks, positions=at, edits={f"q.{last}": scaled("q", 1.5)})  # unmarked: the whole last layer
    assert calls == []
