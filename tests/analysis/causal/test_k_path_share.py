"""The K path's share of the induction head's effect (qkov.analysis.causal.composition.k_path_share): a known
answer on the hand-built induction model, and on every kind of model the architectures study trains (the sum,
routed, gated, looped) each of its losses against an independent computation: the loss by hand from the logits
of a plain run whose edits are written here (the reader's z from the non-repeating run; for the path, what the
reader's layer receives when only the writer's output moves and every routing coefficient and other writer is
frozen, given to the reader's key input alone)."""

from __future__ import annotations

import pytest
import torch

from qkov import QkovError, Weights, trace
from qkov.analysis.causal.composition import k_path_share
from qkov.analysis.heads.probes import induction_probe_tokens

from analysis.causal.test_path_patch_routed import GPT2_LIKE, frozen_bus, moved_weights
from hand_built import hand_built

VARIANTS = {
    "standard": {},
    "attnres": dict(residual="attnres"),
    "mhc": dict(residual="mhc", n_streams=3),
    "gate": dict(gate="elementwise"),
    "loop": dict(loop=2),
}


def test_the_hand_built_induction_heads_effect_runs_through_its_keys() -> None:
    """Known answer: the hand-built induction head 1.0 finds the earlier occurrence only through its keys, which
    read the previous-token head 0.0: noising that path costs most of what noising the head costs; the sink
    head 0.1's path costs nothing."""
    w = Weights.from_model(hand_built())
    got = k_path_share(w, "0.0", "1.0", bos=0)
    assert got.loss_head > got.loss_clean + 3 and got.share is not None and got.share > 0.8
    sink = k_path_share(w, "0.1", "1.0", bos=0)
    assert sink.share == pytest.approx(0.0, abs=1e-6) and sink.loss_head == got.loss_head
    with pytest.raises(QkovError, match="must come before the receiver"):
        k_path_share(w, "1.1", "1.0")


def _loss(logits: torch.Tensor, tokens: torch.Tensor, L: int) -> float:
    at = torch.arange(L + 1, 2 * L)
    lp = logits.float().log_softmax(-1)[:, at]  # as the loss metric reads it: each position's loss in float32,
    return float(-lp.gather(-1, tokens[:, at + 1, None]).double().mean())  # their mean in float64


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_each_loss_of_the_share_equals_a_plain_run_edited_by_hand(variant: str) -> None:
    w = moved_weights(GPT2_LIKE.replace(**VARIANTS[variant]))
    writer, reader = (0, 1), (1, 0)
    got = k_path_share(w, writer, reader, bos=0, batch=2)
    L = got.repeat_length
    clean = induction_probe_tokens(w, length=L, repeats=2, batch=2, seed=0, bos=0)
    corrupted = induction_probe_tokens(w, length=2 * L, repeats=1, batch=2, seed=1, bos=0)
    z = trace(w, corrupted, cache=["z.1"])["z", 1][:, :, reader[1]]

    def noised(v: torch.Tensor, site: object) -> torch.Tensor:
        v = v.clone()
        v[:, :, reader[1]] = z
        return v

    head = _loss(trace(w, clean, edits={"z.1": noised}).logits, clean, L)
    moved = trace(w, clean, edits=frozen_bus(w, clean, corrupted, writer), cache=["resid_pre.1"])["resid_pre", 1]

    def receive(v: torch.Tensor, site: object) -> torch.Tensor:
        v = v.clone()
        v[:, :, reader[1]] = moved
        return v

    path = _loss(trace(w, clean, edits={"k_input.1": receive}).logits, clean, L)
    base = _loss(trace(w, clean).logits, clean, L)
    assert (got.loss_clean, got.loss_head, got.loss_path) == pytest.approx((base, head, path), abs=1e-6)
    assert got.loss_corrupted == pytest.approx(_loss(trace(w, corrupted).logits, clean, L), abs=1e-6)
    assert got.share == pytest.approx((path - base) / (head - base), rel=1e-4)
    assert abs(path - base) > 1e-6 and abs(head - base) > 1e-6  # both do something
    assert set(got.to_dict()) == {*vars(got)}
