"""Named sites: every activation cached with its documented layout, each equal to an independent
recomputation from the weights and its neighbours; names, tuples, globs, TransformerLens aliases
and per-head addresses; one-line errors."""

from __future__ import annotations

import pytest
import torch

from qkov import ModelConfig, QkovError, Transformer, Weights, trace
from qkov.analysis.forward.sites import KINDS, Sites

from helpers import LN_MLP, MODERN, perturb_non_matrices
from reference import reference_forward

CONFIGS = {
    "paper-shortformer": ModelConfig(n_layers=2, n_heads=3, d_model=24, d_head=8, d_vocab=50, n_ctx=16),
    "gpt2-like": LN_MLP.replace(positional="standard", act_fn="gelu_new"),
    "ln-mlp-shortformer": LN_MLP,
    "llama-like": MODERN,
    "neox-parallel": MODERN.replace(normalization="layernorm", gated_mlp=False, act_fn="gelu", parallel=True, n_kv_heads=None),
}


def _setup(name: str):  # type: ignore[no-untyped-def]
    cfg = CONFIGS[name]
    m = perturb_non_matrices(Transformer(cfg, seed=1).double().eval(), 0.1)
    w = Weights.from_model(m, dtype=torch.float64)
    toks = torch.randint(0, cfg.d_vocab, (3, cfg.n_ctx), generator=torch.Generator().manual_seed(0))
    return cfg, m, w, toks


def _norm(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(normalised, divisor) as the view's normalisation defines it, written out."""
    if kind == "none":
        return x, torch.ones_like(x[..., :1])
    if kind == "scale":
        s = (x.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt()
        return x / s, s
    c = x - x.mean(-1, keepdim=True)
    s = (c.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt()
    return c / s, s


@pytest.mark.parametrize("name", CONFIGS)
def test_every_site_is_cached_in_its_layout_and_equals_its_definition(name: str) -> None:
    cfg, m, w, toks = _setup(name)
    copies = ["q_input.*", "k_input.*", "v_input.*"] + (["mlp_input.*"] if cfg.d_mlp else [])
    out = trace(w, toks, cache=["*", *copies])  # a wildcard kind leaves the copies out
    assert not any(k.split(".")[0].endswith("_input") for k in trace(w, toks, cache="*").keys())
    sites = Sites(cfg, w.norm)
    B, T = toks.shape
    assert set(out.keys()) == set(sites.layer_names)
    for key in out.keys():
        assert tuple(out[key].shape) == sites.shape(key.split(".")[0], B, T), key
    # caching every site (the per-head input copies included) changes nothing
    assert (out.logits - trace(w, toks).logits).abs().max() < 1e-10
    ref_logits, ref_patterns = reference_forward(w, toks)
    assert (out.logits - ref_logits).abs().max() < 1e-10 and (out["logits"] - out.logits).abs().max() == 0
    assert torch.equal(out["embed"], w.W_E[toks])
    group = cfg.n_heads // cfg.kv_heads
    for l in range(cfg.n_layers):
        att, x = w.attention(l, expand_kv=False), out["resid_pre", l]
        assert (out["pattern", l] - ref_patterns[l]).abs().max() < 1e-12
        assert (out["scores", l].softmax(-1) - out["pattern", l]).abs().max() < 1e-12
        assert ((out["scores", l] - out["lse", l][..., None]).exp() - ref_patterns[l]).abs().max() < 1e-12
        assert bool(torch.isinf(out["scores", l].triu(1)[..., 0, 1:]).all())  # masked after the query
        v_in, s = _norm(x, w.norm)
        assert (out["attn_in", l] - v_in).abs().max() < 1e-12
        if w.norm != "none":
            assert (out["attn_scale", l] - s).abs().max() < 1e-12
        qk_src = x + w.W_pos[:T] if cfg.positional == "shortformer" else x
        assert (out["q_input", l] - x[:, :, None]).abs().max() == 0  # positions are added after it
        assert (out["qk_in", l] - _norm(qk_src, w.norm)[0]).abs().max() < 1e-12
        v = torch.einsum("btd,kde->btke", v_in, att.W_V) + att.b_V
        assert (out["v", l] - v).abs().max() < 1e-12
        z = torch.einsum("bhqk,bkhe->bqhe", out["pattern", l], out["v", l].repeat_interleave(group, dim=2))
        assert (out["z", l] - z).abs().max() < 1e-12
        assert (out["head_out", l] - torch.einsum("bthe,hed->bthd", z, att.W_O)).abs().max() < 1e-12
        assert (out["attn_out", l] - out["head_out", l].sum(2) - att.b_O).abs().max() < 1e-12
        after = x + out["attn_out", l]
        if cfg.d_mlp is not None:
            mlp = w.mlp(l)
            read = x if cfg.parallel else out["resid_mid", l]
            if not cfg.parallel:
                assert (out["resid_mid", l] - after).abs().max() < 1e-12
            assert torch.equal(out["mlp_input", l], read)  # the MLP's own copy of what it reads
            assert (out["mlp_in", l] - _norm(read, w.norm)[0]).abs().max() < 1e-12
            assert (out["mlp_out", l] - (out["mlp_hidden", l] @ mlp.W_out + mlp.b_out)).abs().max() < 1e-12
            after = after + out["mlp_out", l]
        assert (out["resid_post", l] - after).abs().max() < 1e-12
        if l + 1 < cfg.n_layers:
            assert torch.equal(out["resid_post", l], out["resid_pre", l + 1])
    final = out["resid_post", cfg.n_layers - 1]
    assert (out["final"] - _norm(final, w.norm)[0]).abs().max() < 1e-12
    assert (out["final"] @ w.W_U + w.b_U - out.logits).abs().max() < 1e-12


def test_names_tuples_globs_aliases_and_heads_address_the_same_tensors() -> None:
    cfg, _, w, toks = _setup("gpt2-like")
    out = trace(w, toks, cache=["pattern.*", ("z", 0), "blocks.1.hook_resid_pre", "hook_embed", "ln_final.hook_scale"])
    assert set(out.keys()) == {"embed", "pattern.0", "pattern.1", "z.0", "resid_pre.1", "final_scale"}
    assert out["blocks.1.attn.hook_pattern"] is out["pattern", 1] is out["pattern.1"]
    assert torch.equal(out["z.0.1"], out["z", 0][:, :, 1]) and torch.equal(out[("z", 0, 1)], out["z", 0][:, :, 1])
    assert torch.equal(out["pattern.1.0"], out["pattern", 1][:, 0])
    assert out.stack("pattern").shape == (2, 3, cfg.n_heads, cfg.n_ctx, cfg.n_ctx)
    assert "pattern.0" in out and ("z", 1) not in out
    sites = Sites(cfg, w.norm)
    assert [a.name for a in sites.resolve("*.1")][:3] == ["resid_pre.1", "attn_scale.1", "attn_in.1"]
    assert sites.resolve(("attn_scores", 1))[0].name == "scores.1" and sites.resolve(("result", 0))[0].name == "head_out.0"
    assert [a.name for a in sites.resolve("resid_*.0")] == ["resid_pre.0", "resid_mid.0", "resid_post.0"]
    assert {k.tl for k in KINDS if k.tl} >= {"blocks.{l}.attn.hook_z", "hook_embed", "unembed.hook_out"}


def test_a_kind_alone_is_that_kind_at_every_layer() -> None:
    cfg, _, w, toks = _setup("gpt2-like")
    every = trace(w, toks, cache=["pattern", ("z",), "attn_scores", "hook_resid_pre"])
    assert set(every.keys()) == {f"{k}.{l}" for k in ("pattern", "z", "scores", "resid_pre") for l in range(cfg.n_layers)}
    assert torch.equal(every.stack("pattern"), trace(w, toks, cache=["pattern.*"]).stack("pattern"))
    silenced = trace(w, toks, edits={"z": torch.zeros(())}, cache=["attn_out"])  # an edit of every layer's z
    for l in range(cfg.n_layers):
        assert (silenced["attn_out", l] - w.b_O[l]).abs().max() < 1e-12
    with pytest.raises(QkovError, match=r"'pattern' names 2 sites; index one at a time \(out\['pattern', layer\] or out.stack"):
        every["pattern"]
    _, _, attn_only, toks2 = _setup("paper-shortformer")
    with pytest.raises(QkovError, match="no site 'mlp_out' in this model"):
        trace(attn_only, toks2, cache=["mlp_out"])
    with pytest.raises(QkovError, match="'blocks.0.hook_attn_in': not the TransformerLens hook of a qkov site"):
        trace(w, toks, cache=["blocks.0.hook_attn_in"])


def test_divisors_are_read_from_their_sites_and_the_old_layouts_are_gone() -> None:
    """``Trace.divisor`` names a reader's normalisation divisor and reads it from its site (the query/key
    input has its own under shortformer positions); the pre-1.1 layouts (``patterns``, ``scales``, ...)
    and ``record=`` are gone."""
    _, _, w, toks = _setup("ln-mlp-shortformer")
    r = trace(w, toks, cache=["*_scale*"])
    assert r.divisor("attn_v", 1) is r["attn_scale", 1] and r.divisor("attn_qk", 1) is r["qk_scale", 1]
    assert r.divisor("mlp", 0) is r["mlp_scale", 0] and r.divisor("final") is r["final_scale"]
    assert not torch.equal(r["attn_scale", 1], r["qk_scale", 1])  # positions enter the query/key input only
    with pytest.raises(QkovError, match=r"attn_scale.0 was not cached"):
        trace(w, toks).divisor("attn_v", 0)
    for old in ("patterns", "scales", "head_outputs", "values", "mlp_outputs", "qk_inputs"):
        assert not hasattr(r, old), old
    with pytest.raises(TypeError):
        trace(w, toks, record=("patterns",))  # type: ignore[call-arg]


def test_bad_sites_and_edits_are_one_line_errors() -> None:
    cfg, _, w, toks = _setup("gpt2-like")
    cases = [
        (dict(cache=["patern.1"]), "no site 'patern.1'.*did you mean pattern"),
        (dict(cache=["pattern.2"]), "layer in 0..1"),
        (dict(cache=["pattern.1.7"]), "head 7 out of range"),
        (dict(cache=["resid_pre.0.1"]), "has no head index"),
        (dict(cache=["embed.0"]), "embed has no layer"),
        (dict(cache=["nothing*"]), "no site matches"),
        (dict(cache=[("pattern", "x")]), "must be integers"),
        (dict(cache=["qk_scale.0"]), "no site 'qk_scale.0' in this model"),
        (dict(edits={"resid_pre.1": torch.zeros(5)}), r"edit of resid_pre.1: expected a tensor of shape \[3, 12, 16\]"),
        (dict(edits={"pattern.0": lambda v, s: v[:, :1]}), "the function returned shape"),
        (dict(edits={"pattern.0": lambda v, s: 3}), "returned int"),
        (dict(edits={"pattern.0": 3}), "give a tensor or a function"),
    ]
    for kwargs, says in cases:
        with pytest.raises(QkovError, match=says):
            trace(w, toks, **kwargs)
    with pytest.raises(QkovError, match="z.1 was not cached"):
        trace(w, toks, cache="z.0")["z", 1]
    rotary = Weights.from_model(Transformer(MODERN, seed=0))
    with pytest.raises(QkovError, match="before rotary.*hook_rot_q"):
        trace(rotary, torch.zeros(1, 4, dtype=torch.long), cache="blocks.0.attn.hook_q")
    with pytest.raises(QkovError, match=r"^qkov\.trace: 'no/such/model' does not exist"):
        trace("no/such/model", toks)
    with pytest.raises(TypeError, match=r"^qkov\.trace expects a model \(qkov\.Transformer.*a path .*; got None$"):
        trace(None, toks)  # type: ignore[arg-type]
    with pytest.raises(QkovError, match=r"positions: every position must be in -12..11"):
        trace(w, toks, positions=torch.tensor([3, 12]))
    with pytest.raises(QkovError, match=r"start_at: expected a stream of shape \[3, 12, 16\]"):
        trace(w, toks, start_at=(1, torch.zeros(3, 12, 8)))
