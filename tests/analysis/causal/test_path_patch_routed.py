"""Path patching on a routed model (Attention Residuals, in blocks, mHC, dynamic hyper-connections): into a
receiver's key, into the logits, and one sender's paths into each of a receiver's q, k, v (composition
paths), each against the bus itself run on the base tokens with its routing frozen at the base run's values,
every other writer frozen too and only the sender's output taken from the source run (float64, 1e-10).
The reference reads no routing coefficient: the patching computes them (qkov.model.bus.route_coefficients),
the reference only runs the bus."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from qkov import ModelConfig, QkovError, Transformer, Weights, trace
from qkov.analysis.causal.composition import composition_paths
from qkov.analysis.causal.metrics import Attention, LogitDiff
from qkov.analysis.causal.path_patch import path_patching
from qkov.analysis.forward.frozen import sites_of
from qkov.analysis.forward.sites import ROUTE_KINDS
from qkov.analysis.heads.probes import induction_probe_tokens

from helpers import LN_MLP

D = torch.float64
GPT2_LIKE = LN_MLP.replace(positional="standard", act_fn="gelu_new")
ROUTED = {
    "attnres": dict(residual="attnres"),
    "attnres-block": dict(residual="attnres-block", attnres_block=3),  # blocks of 3 sublayers: one partial
    "mhc": dict(residual="mhc", n_streams=3),
    "hyper-dynamic": dict(residual="hyper", n_streams=2, hyper_dynamic=True),
}


def routed_weights(variant: str) -> Weights:
    """A small routed model in float64, its biases, norms and bus parameters moved off their initialisation."""
    return moved_weights(GPT2_LIKE.replace(**ROUTED[variant]))


def moved_weights(cfg: Any) -> Weights:
    """The model of ``cfg`` in float64, its biases, norms and bus parameters moved off their initialisation."""
    m = Transformer(cfg, seed=3).double().eval()
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.startswith("bus."):
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.5)
            elif not name.rsplit(".", 1)[-1].startswith("W_"):  # biases and norms
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.2)
    return Weights.from_model(m, dtype=D)


def pair(w: Weights) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    clean = torch.randint(1, w.cfg.d_vocab, (2, 10), generator=g)
    corrupted = clean.clone()
    corrupted[:, 3:6] = torch.randint(1, w.cfg.d_vocab, (2, 3), generator=g)
    return clean, corrupted


def frozen_bus(w: Weights, base: torch.Tensor, source: torch.Tensor, sender: tuple[int, int]) -> dict[str, Any]:
    """Edits of a run of ``base`` in which only ``sender``'s output moves (to its value on ``source``) and
    nothing else can respond to it: every routing coefficient, every other head's output and every MLP
    output held at the base run's values. What the bus then carries anywhere is the base value plus the
    sender's change, routed as on the base run: the path sender -> everything, with no other path."""
    layer, head = sender
    b = trace(w, base, cache=sites_of(w, ROUTE_KINDS) + ["head_out", "mlp_out"])
    s = trace(w, source, cache=[f"head_out.{layer}"])
    edits: dict[str, Any] = dict(b.cache)

    def sender_from_source(v: torch.Tensor, site: object) -> torch.Tensor:
        v = b["head_out", layer].clone()
        v[:, :, head] = s["head_out", layer][:, :, head]
        return v

    edits[f"head_out.{layer}"] = sender_from_source
    return edits


def received(w: Weights, base: torch.Tensor, edits: dict[str, Any], receiver: tuple[int, int], inp: str, metric: Any) -> float:
    """The metric of a plain run of ``base`` whose ``receiver`` reads, at its ``inp`` input, what its layer
    receives under ``edits`` (everything else recomputed)."""
    layer, head = receiver
    got = trace(w, base, edits=edits, cache=[f"resid_pre.{layer}"])["resid_pre", layer]

    def receive(v: torch.Tensor, site: object) -> torch.Tensor:
        v = v.clone()
        v[:, :, head] = got
        return v

    return float(metric(trace(w, base, edits={f"{inp}_input.{layer}": receive}, cache=metric.reads)))


@pytest.mark.parametrize("variant", list(ROUTED))
def test_path_patching_into_a_key_through_the_routes_equals_the_frozen_bus(variant: str) -> None:
    w = routed_weights(variant)
    clean, corrupted = pair(w)
    metric = LogitDiff(correct=clean[:, -1], incorrect=3)
    got = path_patching(w, clean, corrupted, receivers=[(1, 0)], input="k", metric=metric)
    for h in range(w.cfg.n_heads):
        want = received(w, corrupted, frozen_bus(w, corrupted, clean, (0, h)), (1, 0), "k", metric)
        assert got.values[0, h] == pytest.approx(want, abs=1e-10)
        assert got.values[0, h] != pytest.approx(got.base, abs=1e-6)  # the path does something


@pytest.mark.parametrize("variant", list(ROUTED))
def test_path_patching_into_the_logits_through_the_routes_equals_the_frozen_bus(variant: str) -> None:
    """Every head of both layers into the logits: the base final read plus the sender's change scaled by its
    coefficient in the final read (point S), through the final normalisation and the unembedding."""
    w = routed_weights(variant)
    clean, corrupted = pair(w)
    metric = LogitDiff(correct=clean[:, -1], incorrect=3)
    got = path_patching(w, clean, corrupted, receivers="logits", metric=metric)
    for l in range(w.cfg.n_layers):
        for h in range(w.cfg.n_heads):
            want = float(metric(trace(w, corrupted, edits=frozen_bus(w, corrupted, clean, (l, h)))))
            assert got.values[l, h] == pytest.approx(want, abs=1e-10), (l, h)
            assert got.values[l, h] != pytest.approx(got.base, abs=1e-6)


@pytest.mark.parametrize("variant", list(ROUTED))
def test_composition_paths_through_the_routes_equal_the_frozen_bus(variant: str) -> None:
    """One sender's path into each of the receiver's q, k, v (composition paths: noised, the receiver's
    prefix matching on repeated random tokens), each against the frozen bus."""
    w = routed_weights(variant)
    got = composition_paths(w, "0.1", "1.0", bos=0, batch=2)
    L = got.repeat_length
    clean = induction_probe_tokens(w, length=L, repeats=2, batch=2, seed=0, bos=0)
    corrupted = induction_probe_tokens(w, length=2 * L, repeats=1, batch=2, seed=1, bos=0)
    m = Attention(layer=1, head=0, queries=list(range(L + 1, 2 * L + 1)), offset=L - 1)
    base, target = (float(m(trace(w, t, cache=m.reads))) for t in (clean, corrupted))
    assert (got.prefix_clean, got.prefix_corrupted) == pytest.approx((base, target), abs=1e-12)
    edits = frozen_bus(w, clean, corrupted, (0, 1))
    for inp in ("q", "k", "v"):
        want = (received(w, clean, edits, (1, 0), inp, m) - base) / (target - base)
        assert got.prefix_removed[inp] == pytest.approx(want, abs=1e-10), inp
    assert len({round(v, 6) for v in got.prefix_removed.values()}) == 3  # three different paths


def test_a_routed_model_starts_at_its_final_read_and_nowhere_else() -> None:
    """``resid_final`` (the final read) is a site of a routed model; a pass started there with it gives the
    logits of the whole pass bit for bit (only the final normalisation and the unembedding run); an earlier
    start is refused."""
    w = routed_weights("mhc")
    ids = pair(w)[0]
    whole = trace(w, ids, cache=["resid_final"])
    again = trace(w, ids, start_at=(w.cfg.n_layers, whole["resid_final"]))
    assert torch.equal(again.logits, whole.logits)
    with pytest.raises(QkovError, match="before its final read"):
        trace(w, ids, start_at=(1, whole["resid_final"]))
    with pytest.raises(QkovError, match="no one stream after a block"):
        trace(w, ids, cache=["resid_post.1"])


def test_paths_into_the_logits_refuse_a_metric_read_inside_the_blocks() -> None:
    """A path into the logits changes nothing a pattern metric reads: one line saying so, not a cache error."""
    model = Transformer(ModelConfig(n_layers=2, n_heads=2, d_model=16, d_head=8, d_vocab=20, n_ctx=16), seed=0)
    g = torch.Generator().manual_seed(0)
    clean, corrupted = (torch.randint(0, 20, (2, 8), generator=g) for _ in range(2))
    metric = Attention(layer=1, head=0, queries=[5, 6], offset=1)
    with pytest.raises(QkovError, match="changes only the logits"):
        path_patching(model, clean, corrupted, receivers="logits", metric=metric)
