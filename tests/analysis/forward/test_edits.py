"""Edits, gradients, starting mid-model and the residual-stream decompositions, each checked against
something independent: the training model with plain torch hooks, its autograd, or the forward."""

from __future__ import annotations

import copy

import pytest
import torch

from qkov import Transformer, Weights, trace
from qkov.model.ops import next_token_loss

from helpers import LN_MLP, MODERN, perturb_non_matrices
from reference import reference_forward

GPT2_LIKE = LN_MLP.replace(positional="standard", act_fn="gelu_new")


def _model(cfg=GPT2_LIKE, seed: int = 1) -> Transformer:  # type: ignore[no-untyped-def]
    return perturb_non_matrices(Transformer(cfg, seed=seed).double().eval(), 0.1)


def _tokens(cfg=GPT2_LIKE, batch: int = 3):  # type: ignore[no-untyped-def]
    return torch.randint(0, cfg.d_vocab, (batch, cfg.n_ctx), generator=torch.Generator().manual_seed(0))


def _raw(m: Transformer) -> Weights:
    """The view whose sites are the training model's own activations (nothing folded or centred)."""
    return Weights.from_model(m, dtype=torch.float64, fold_ln=False, center_unembed=False)


def test_edits_equal_the_training_model_with_torch_hooks() -> None:
    m, toks = _model(), _tokens()
    w = _raw(m)
    vec = torch.randn(GPT2_LIKE.d_model, dtype=torch.float64)
    # add a vector to the stream after block 0: a forward hook on the block
    got = trace(w, toks, edits={"resid_post.0": lambda x, site: x + vec}).logits
    hm = copy.deepcopy(m)
    hk = hm.blocks[0].register_forward_hook(lambda _m, _i, out: out + vec)
    with torch.no_grad():
        want = hm(toks)
    hk.remove()
    assert (got - want).abs().max() < 1e-10
    # silence MLP neuron 3 of layer 1: its W_out row zeroed in the training model
    got = trace(w, toks, edits={"mlp_hidden.1": lambda h, site: h.index_fill(-1, torch.tensor([3]), 0.0)}).logits
    hm = copy.deepcopy(m)
    with torch.no_grad():
        hm.blocks[1].mlp.W_out[3] = 0
        want = hm(toks)
    assert (got - want).abs().max() < 1e-10
    # replace the attention input of layer 1 at every position by a fixed tensor (broadcast over the batch)
    fixed = torch.randn(1, GPT2_LIKE.n_ctx, GPT2_LIKE.d_model, dtype=torch.float64)
    got = trace(w, toks, edits={"blocks.1.hook_resid_pre": fixed}).logits
    hm = copy.deepcopy(m)
    hk = hm.blocks[1].register_forward_pre_hook(lambda _m, args: (fixed.expand_as(args[0]), *args[1:]))
    with torch.no_grad():
        want = hm(toks)
    hk.remove()
    assert (got - want).abs().max() < 1e-10


def test_head_edits_touch_one_head_and_in_place_functions_work() -> None:
    m, toks = _model(), _tokens()
    w = _raw(m)
    base = trace(w, toks, cache=["z.0", "head_out.0"])
    out = trace(w, toks, cache=["z.0", "head_out.0"], edits={"z.0.1": torch.zeros(())})
    assert torch.equal(out["z", 0][:, :, 0], base["z", 0][:, :, 0]) and out["z", 0][:, :, 1].abs().max() == 0
    # the same through the training model: head 0.1's W_O zeroed
    hm = copy.deepcopy(m)
    with torch.no_grad():
        hm.blocks[0].attn.W_O[1] = 0
        assert (out.logits - hm(toks)).abs().max() < 1e-10

    def in_place(v: torch.Tensor, site) -> None:  # type: ignore[no-untyped-def]
        v[:, :, 1] = 0

    again = trace(w, toks, edits={"z.0": in_place})
    # the two runs cache different sites (another order of the float64 sums): equal to the last bits
    assert (again.logits - out.logits).abs().max() < 1e-12
    # per-head input copies: an in-place edit of one head's copy equals a tensor edit of its address
    in_place_q = trace(w, toks, edits={"q_input.1": in_place}, cache="q.1")
    by_address = trace(w, toks, edits={"q_input.1.1": torch.zeros(())}, cache="q.1")
    assert torch.equal(in_place_q.logits, by_address.logits) and (in_place_q.logits - base.logits).abs().max() > 1e-6
    base_q = trace(w, toks, cache="q.1")["q", 1]
    assert (in_place_q["q", 1][:, :, 0] - base_q[:, :, 0]).abs().max() < 1e-12  # head 0 reads its own copy
    assert (in_place_q["q", 1][:, :, 1] - base_q[:, :, 1]).abs().max() > 1e-3
    # a pattern given as a tensor and one returned by a function both reach the logits as the
    # independent einsum forward with those patterns computes them
    P = torch.tril(torch.ones(GPT2_LIKE.n_ctx, GPT2_LIKE.n_ctx, dtype=torch.float64))
    P = (P / P.sum(-1, keepdim=True)).expand(3, GPT2_LIKE.n_heads, -1, -1)
    by_edit = trace(w, toks, edits={"pattern.0": P, "pattern.1": lambda p, s: P})
    want, _ = reference_forward(w, toks, patterns=torch.stack([P, P]))
    assert (by_edit.logits - want).abs().max() < 1e-10


def test_gradients_equal_the_training_models_autograd() -> None:
    """grad=True: the loss's gradient with respect to every weight of the view equals the training
    model's parameter gradients, and a cached activation's .grad equals the gradient torch computes
    at the same point of the training model (a block's input)."""
    for cfg in (GPT2_LIKE, MODERN):
        m, toks = _model(cfg), _tokens(cfg)
        w = _raw(m)
        w = w.replace(W_Q=w.W_Q.clone().requires_grad_(), W_in=w.W_in.clone().requires_grad_())
        out = trace(w, toks, cache=["resid_pre.1"], grad=True)
        next_token_loss(out.logits, toks).backward()
        mm = copy.deepcopy(m)
        seen = {}

        def grab(_m, args):  # type: ignore[no-untyped-def]
            args[0].retain_grad()
            seen["x"] = args[0]

        hk = mm.blocks[1].register_forward_pre_hook(grab)
        next_token_loss(mm(toks), toks).backward()
        hk.remove()
        want_q = torch.stack([b.attn.W_Q.grad for b in mm.blocks])
        want_in = torch.stack([b.mlp.W_in.grad for b in mm.blocks])
        assert (w.W_Q.grad - want_q).abs().max() < 1e-10 * max(1.0, float(want_q.abs().max()))
        assert (w.W_in.grad - want_in).abs().max() < 1e-10 * max(1.0, float(want_in.abs().max()))
        assert (out["resid_pre", 1].grad - seen["x"].grad).abs().max() < 1e-12
    assert not trace(w, toks).logits.requires_grad  # grad=False builds no graph, even with weights that require grad


def test_starting_mid_model_gives_the_same_logits() -> None:
    m, toks = _model(), _tokens()
    w = Weights.from_model(m, dtype=torch.float64)
    full = trace(w, toks, cache=["resid_pre.1", "resid_post.1"])
    from_1 = trace(w, toks, start_at=(1, full["resid_pre", 1]), cache="pattern.*")
    assert (from_1.logits - full.logits).abs().max() < 1e-12 and set(from_1.keys()) == {"pattern.1"}
    from_end = trace(w, toks, start_at=(2, full["resid_post", 1]))
    assert (from_end.logits - full.logits).abs().max() < 1e-12


def test_decompositions_add_up_to_the_stream_and_the_logits() -> None:
    m, toks = _model(), _tokens()
    w = Weights.from_model(m, dtype=torch.float64)
    out = trace(w, toks, cache=["embed", "pos", "resid_*", "attn_out.*", "mlp_out.*", "head_out.*", "*_scale*"])
    final = out["resid_post", 1]
    parts = out.decompose_resid()
    assert parts.labels == ["embed", "pos", "0_attn_out", "0_mlp_out", "1_attn_out", "1_mlp_out"]
    assert (parts.total() - final).abs().max() < 1e-12
    assert (out.decompose_resid(1).total() - out["resid_pre", 1]).abs().max() < 1e-12
    acc = out.accumulated_resid(incl_mid=True)
    assert acc.labels == ["0_pre", "0_mid", "1_pre", "1_mid", "final"] and torch.equal(acc.values[-1], final)
    heads = out.stack_head_results()
    assert heads.labels == ["0.0", "0.1", "1.0", "1.1"]
    rebuilt = heads.total() + out["embed"] + out["pos"] + w.b_O.sum(0) + out["mlp_out", 0] + out["mlp_out", 1]
    assert (rebuilt - final).abs().max() < 1e-12
    # direct logit attribution: the normalised components' logits sum to the logits minus b_U
    t = toks[:, 1]  # one token id per sequence
    attrs = parts.logit_attrs(t)  # [C, B, T]
    want = out.logits.gather(-1, t[:, None, None].expand(-1, toks.shape[1], 1))[..., 0] - w.b_U[t][:, None]
    assert (attrs.sum(0) - want).abs().max() < 1e-10
    diff = parts.logit_attrs(t, incorrect=3)
    assert (diff.sum(0) - (want - out.logits[..., 3] + w.b_U[3])).abs().max() < 1e-10
    # pos_slice: each position against its own next token, or the last position alone
    nxt = parts.logit_attrs(toks[:, 1:], pos_slice=slice(0, -1))  # [C, B, T-1]
    own = out.logits[:, :-1].gather(-1, toks[:, 1:, None])[..., 0] - w.b_U[toks[:, 1:]]
    assert nxt.shape == (len(parts), *toks[:, 1:].shape) and (nxt.sum(0) - own).abs().max() < 1e-10
    last = parts.logit_attrs(t, pos_slice=-1)  # [C, B]
    assert last.shape == (len(parts), toks.shape[0]) and torch.equal(last, attrs[:, :, -1])
    direction = torch.randn(GPT2_LIKE.d_model, dtype=torch.float64)
    assert (parts.project(direction).sum(0) - final @ direction).abs().max() < 1e-10
    with pytest.raises(Exception, match="apply_ln needs a weights view with the normalisation folded"):
        trace(_raw(m), toks, cache=["resid_*", "embed", "pos", "attn_out.*", "mlp_out.*", "*_scale*"]).decompose_resid().apply_ln()
