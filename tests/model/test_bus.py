"""The residual bus (qkov.model.bus): configs, the training model against the analysis forward, the
special cases that must be the standard model bit for bit, each scheme against a hand computation from
the recorded sites, saving and loading, training, and the refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import qkov
from qkov import ModelConfig, QkovError, Transformer, Weights
from qkov.analysis.forward.tracer import trace
from qkov.model.bus import sinkhorn

from helpers import TINY, run_main, tiny_train, torchrun, train_flags

VARIANTS = {
    "attnres": dict(residual="attnres"),
    "attnres-block": dict(residual="attnres-block", attnres_block=3),
    "hyper": dict(residual="hyper", n_streams=3),
    "hyper-dynamic": dict(residual="hyper", n_streams=2, hyper_dynamic=True),
    "mhc": dict(residual="mhc", n_streams=4),
}
SHAPES = {
    "ln-mlp": dict(d_mlp=32, normalization="layernorm"),
    "attn-only": dict(),
    "parallel-rms": dict(d_mlp=24, parallel=True, normalization="rmsnorm", positional="standard"),
}


def routed(variant: str, shape: str = "ln-mlp", *, seed: int = 0, spread: float = 0.5, **kw: object) -> Transformer:
    """A small routed model whose bus parameters are moved off their (symmetric) initialisation."""
    cfg = ModelConfig(n_layers=3, n_heads=2, d_model=16, d_head=8, d_vocab=40, n_ctx=12, **VARIANTS[variant], **SHAPES[shape], **kw)  # type: ignore[arg-type]
    m = Transformer(cfg, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in m.bus.parameters():  # type: ignore[union-attr]
            p.add_(torch.randn(p.shape, generator=gen) * spread)
    return m


def tokens(seed: int = 0, B: int = 2, T: int = 9) -> torch.Tensor:
    return torch.randint(0, 40, (B, T), generator=torch.Generator().manual_seed(seed))


def test_config_fields_validate_describe_and_count() -> None:
    for bad, msg in [
        (dict(n_streams=2), "n_streams > 1 needs"),
        (dict(residual="attnres-block"), "needs attnres_block"),
        (dict(residual="attnres", attnres_block=2), "attnres_block applies"),
        (dict(residual="mhc", hyper_dynamic=True), "hyper_dynamic"),
        (dict(residual="bus"), "residual must be one of"),
        (dict(residual="mhc", sinkhorn_iters=0), "sinkhorn_iters"),
    ]:
        with pytest.raises(QkovError, match=msg):
            ModelConfig(**bad)  # type: ignore[arg-type]
    old = ModelConfig().to_dict()
    for k in ("residual", "attnres_block", "n_streams", "hyper_dynamic", "sinkhorn_iters"):
        del old[k]
    assert ModelConfig.from_dict(old) == ModelConfig()  # a config.json from before the options
    assert "residual" not in ModelConfig().describe()
    for variant in VARIANTS:
        for shape in SHAPES:
            m = routed(variant, shape)
            assert m.cfg.parameter_count() == m.num_parameters(), (variant, shape)
            assert f"residual {variant.split('-')[0]}" in m.cfg.describe()


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("shape", SHAPES)
def test_analysis_forward_matches_the_training_model(variant: str, shape: str) -> None:
    m, ids = routed(variant, shape), tokens()
    want = torch.log_softmax(m(ids), -1)
    for view in (Weights.from_model(m), Weights.from_model(m, fold_ln=False)):
        got = torch.log_softmax(trace(view, ids).logits, -1)
        # float32 noise: these perturbed buses amplify it to ~2e-5 (the float32 model against itself in float64,
        # seeds 0-11, before and after the bus's faster forms), so 1e-5 was at the edge
        assert (got - want).abs().max() < 3e-5


def _copy_into(std: Transformer, cfg: ModelConfig) -> Transformer:
    other = Transformer(cfg, seed=5)
    missing, unexpected = other.load_state_dict(std.state_dict(), strict=False)
    assert not unexpected and all(k.startswith("bus.") for k in missing)
    return other


@pytest.mark.parametrize("shape", SHAPES)
def test_one_stream_hyper_connections_are_the_standard_model_bit_for_bit(shape: str) -> None:
    base = ModelConfig(n_layers=3, n_heads=2, d_model=16, d_head=8, d_vocab=40, n_ctx=12, **SHAPES[shape])  # type: ignore[arg-type]
    std = Transformer(base, seed=3)
    hyp = _copy_into(std, base.replace(residual="hyper", n_streams=1))
    ids = tokens(1)
    assert torch.equal(std(ids), hyp(ids))
    view = {"center_writing": False}  # a routed model's view never centres (its default would for the LayerNorm one)
    a = trace(Weights.from_model(std, **view), ids, cache=["resid_pre", "attn_out"])
    b = trace(Weights.from_model(hyp, **view), ids, cache=["resid_pre", "attn_out"])
    assert torch.equal(a.logits, b.logits)
    assert all(torch.equal(a["resid_pre", l], b["resid_pre", l]) for l in range(3))


def test_attnres_reads_the_softmax_of_its_pseudo_queries_over_normalised_sources() -> None:
    m = routed("attnres", "attn-only")
    ids = tokens(2)
    r = trace(m, ids, cache=["embed", "attn_out", "resid_pre", "route_attn", "route_final"])
    p = m.bus.tensors()  # type: ignore[union-attr]
    sources = [r["embed"]]
    for l in range(3):
        v = torch.stack(sources, -2)  # [B, T, R, D]
        logits = (v / v.pow(2).mean(-1, keepdim=True).add(m.cfg.ln_eps).sqrt() * p["key_w"][l]) @ p["query"][l]
        alpha = logits.softmax(-1)
        assert torch.allclose(r["route_attn", l], alpha, atol=1e-6)
        assert torch.allclose(r["resid_pre", l], (alpha[..., None] * v).sum(-2), atol=1e-5)
        sources.append(r["attn_out", l])
    assert r["route_final"].shape[-1] == 4


def test_attnres_starts_uniform_and_blocks_sum_their_outputs() -> None:
    m = Transformer(ModelConfig(n_layers=2, d_model=16, d_head=8, d_vocab=40, n_ctx=12, d_mlp=16, residual="attnres"), seed=0)
    r = trace(m, tokens(), cache=["route_attn", "route_mlp", "route_final"])
    for s, (kind, l) in enumerate([("route_attn", 0), ("route_mlp", 0), ("route_attn", 1), ("route_mlp", 1)]):
        assert torch.allclose(r[kind, l], torch.full_like(r[kind, l], 1 / (s + 1)))
    blk = routed("attnres-block", "ln-mlp")
    r = trace(blk, tokens(), cache=["embed", "attn_out", "mlp_out", "resid_pre", "route_attn"])
    # block size 3 over 6 sublayers: layer 2's attention (sublayer 4) reads [emb, block0, partial=mlp_out.1]
    outs = [r["attn_out", 0], r["mlp_out", 0], r["attn_out", 1], r["mlp_out", 1]]
    sources = [r["embed"], outs[0] + outs[1] + outs[2], outs[3]]
    alpha = r["route_attn", 2]
    assert alpha.shape[-1] == 3
    assert torch.allclose(r["resid_pre", 2], sum(a[..., None] * v for a, v in zip(alpha.unbind(-1), sources)), atol=1e-5)


@pytest.mark.parametrize("variant", ["hyper", "hyper-dynamic", "mhc"])
def test_streams_read_mix_and_write_as_recorded(variant: str) -> None:
    """The streams rebuilt by hand from the recorded read/mix/write weights and sublayer outputs give the
    recorded inputs and the logits."""
    m, ids = routed(variant, "attn-only"), tokens(3)
    r = trace(m, ids, cache=["embed", "attn_out", "resid_pre", "route_attn", "mix_attn", "write_attn", "route_final", "final"])
    n = m.cfg.n_streams
    H = r["embed"][:, :, None, :].repeat(1, 1, n, 1)
    for l in range(3):
        assert torch.allclose(r["resid_pre", l], (r["route_attn", l][..., None] * H).sum(-2), atol=1e-5)
        H = r["mix_attn", l] @ H + r["write_attn", l][..., None] * r["attn_out", l][:, :, None, :]
    final = H.sum(-2)
    assert torch.allclose(r["final"], final, atol=1e-5)  # no normalisation in this shape
    if variant == "mhc":
        M = r["mix_attn", 1]
        assert (M >= 0).all() and torch.allclose(M.sum(-1), torch.ones(()), atol=1e-5)  # rows: normalised last
        assert torch.allclose(M.sum(-2), torch.ones(()), atol=1e-3)
        assert ((r["write_attn", 1] > 0) & (r["write_attn", 1] < 2)).all()


def test_sinkhorn_is_doubly_stochastic_and_keeps_what_already_is() -> None:
    g = torch.Generator().manual_seed(0)
    M = sinkhorn(torch.randn(5, 4, 4, generator=g) * 2, 300)
    assert torch.allclose(M.sum(-2), torch.ones(5, 4), atol=1e-5) and torch.allclose(M.sum(-1), torch.ones(5, 4), atol=1e-6)
    one = sinkhorn(torch.tensor([[0.0, 2.0], [1.0, 0.0]]), 1)  # one round by hand: columns, then rows
    e = torch.tensor([[1.0, torch.e**2], [torch.e, 1.0]])
    e = e / e.sum(0, keepdim=True)
    assert torch.allclose(one, e / e.sum(1, keepdim=True))
    P = torch.tensor([[0.7, 0.3], [0.3, 0.7]])
    assert torch.allclose(sinkhorn(P.log(), 3), P, atol=1e-6)


@pytest.mark.parametrize("site", [None, "route_attn.0", "mix_attn.1", "write_attn.2", "route_final"])
@pytest.mark.parametrize("shape", ["ln-mlp", "parallel-rms"])
@pytest.mark.parametrize("built", [False, True], ids=["sources", "rows"])
def test_static_streams_held_any_way_agree(site: str | None, shape: str, built: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Static hyper-connections keep their sources and each stream's coefficients over them, or (``rows``:
    past a number of sources; here from the first write) the built streams; freezing a site at its own value
    written out per position turns them token-major from there on. Every way gives the same inputs and logits."""
    m, ids = routed("hyper", shape), tokens(4)
    want = trace(m, ids, cache=["resid_pre", *([site] if site else [])])  # the sources throughout
    if built:
        monkeypatch.setattr(qkov.model.bus, "SOURCES_PER_STREAM", 0)
    edits = {}
    if site is not None:
        kind, _, layer = site.partition(".")
        value = want[kind, int(layer)] if layer else want[kind]
        assert value.stride(0) == 0  # the static value, broadcast
        edits = {site: value.contiguous()}
    got = trace(m, ids, edits=edits, cache=["resid_pre"])
    assert torch.allclose(got.logits, want.logits, atol=1e-5)
    assert all(torch.allclose(got["resid_pre", l], want["resid_pre", l], atol=1e-5) for l in range(3))


def test_sinkhorn_gradient_is_the_gradient_of_its_rounds() -> None:
    """The Sinkhorn rounds' written-out gradient: against finite differences (float64) and against autograd
    through the rounds written plainly."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 4, 4, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: sinkhorn(t, 5), (x,))

    def plain(logits: torch.Tensor, iters: int) -> torch.Tensor:
        m = torch.exp(logits - logits.amax(dim=(-2, -1), keepdim=True))
        for _ in range(iters):
            m = m / m.sum(dim=-2, keepdim=True)
            m = m / m.sum(dim=-1, keepdim=True)
        return m

    y, w = torch.randn(6, 5, 3, 3, generator=g, requires_grad=True), torch.randn(6, 5, 3, 3, generator=g)
    (got,) = torch.autograd.grad((sinkhorn(y, 20) * w).sum(), y)
    (want,) = torch.autograd.grad((plain(y, 20) * w).sum(), y)
    assert torch.allclose(sinkhorn(y, 20), plain(y, 20), atol=1e-6) and torch.allclose(got, want, atol=1e-5)


def test_routing_sites_are_edits_and_a_frozen_route_is_used() -> None:
    m, ids = routed("attnres", "attn-only"), tokens()
    r = trace(m, ids, cache=["embed", "attn_out"])
    first = torch.tensor([1.0, 0.0])  # layer 1 reads only the embedding
    e = trace(m, ids, edits={"route_attn.1": first}, cache=["resid_pre"])
    assert torch.allclose(e["resid_pre", 1], r["embed"])
    with pytest.raises(QkovError, match="expected a tensor of shape"):
        trace(m, ids, edits={"route_attn.1": torch.ones(3)})


def test_save_load_and_the_lazy_view_keep_the_bus(tmp_path: Path) -> None:
    for variant in ("attnres-block", "hyper-dynamic", "mhc"):
        m = routed(variant)
        qkov.io.save_checkpoint(m, tmp_path / variant)
        back = qkov.load(tmp_path / variant)
        ids = tokens()
        assert torch.equal(back(ids), m(ids))
        lazy = qkov.LazyCheckpoint(tmp_path / variant)
        assert torch.allclose(trace(lazy, ids).logits, trace(back, ids).logits, atol=1e-5)
    cfg = json.loads((tmp_path / "mhc" / "config.json").read_text())["model"]
    assert cfg["residual"] == "mhc" and cfg["n_streams"] == 4


def test_what_a_routed_model_cannot_mean_is_refused() -> None:
    m, ids = routed("attnres", "attn-only"), tokens()
    with pytest.raises(QkovError, match="no single stream"):
        trace(m, ids, start_at=(1, torch.zeros(2, 9, 16)))
    with pytest.raises(QkovError, match="no one stream after a block"):
        trace(m, ids, cache=["resid_post.0"])
    with pytest.raises(QkovError, match="routing"):
        Weights.from_model(routed("hyper", "ln-mlp"), center_writing=True)
    with pytest.raises(QkovError, match="privileged basis"):
        Weights.from_model(m).rotate(torch.eye(16))
    with pytest.raises(QkovError, match="residual 'attnres'"):
        qkov.io.tl.tl_config_dict(m.cfg)


def test_routed_models_train(tmp_path: Path, small_corpus: Path) -> None:
    for variant in ("attnres", "hyper-dynamic", "mhc"):
        cfg = ModelConfig(n_layers=2, n_heads=2, d_model=16, d_head=8, d_vocab=300, n_ctx=12, d_mlp=16, **VARIANTS[variant])  # type: ignore[arg-type]
        out = tmp_path / variant
        qkov.train(out, cfg, tiny_train(small_corpus, steps=6, eval_interval=3, ckpt_interval=3), device="cpu")
        m = qkov.load(out)
        assert m.cfg.residual == cfg.residual
        init = Transformer(cfg, seed=0)
        assert not torch.equal(m.bus.tensors()[next(iter(m.bus.tensors()))], init.bus.tensors()[next(iter(init.bus.tensors()))])  # type: ignore[union-attr]


def test_train_flags(tmp_path: Path, small_corpus: Path, capsys: pytest.CaptureFixture[str]) -> None:
    flags = train_flags(steps=2, eval_interval=2, ckpt_interval=2)
    out = tmp_path / "hc"
    rc, _, err = run_main(capsys, "train", *flags, "--corpus", small_corpus, "--residual", "hyper", "--streams", "2", "--hyper-dynamic", "--out", out, "--quiet")
    assert rc == 0, err
    cfg = qkov.load(out).cfg
    assert (cfg.residual, cfg.n_streams, cfg.hyper_dynamic) == ("hyper", 2, True)
    rc, _, err = run_main(capsys, "train", *flags, "--corpus", small_corpus, "--streams", "2", "--out", tmp_path / "bad")
    assert rc == 2 and "n_streams > 1 needs" in err and "Traceback" not in err


def test_a_routed_gated_looped_model_trains_the_same_under_torchrun(tmp_path: Path, small_corpus: Path) -> None:
    """Two ranks (gloo on CPU) of ``qkov train`` with every option at once reach the single process's weights:
    the bus's and the gates' parameters are in the gradient reduction (a parameter the ranks did not share
    would make them drift)."""
    env = {**os.environ, "QKOV_CACHE": str(tmp_path / "cache")}
    extra = ["--residual", "mhc", "--streams", "2", "--gate", "elementwise", "--loop", "2"]
    flags = [*train_flags(steps=10, ckpt_interval=5, eval_interval=5), "--corpus", str(small_corpus), *extra]
    single, ddp = tmp_path / "single", tmp_path / "ddp"
    subprocess.run([sys.executable, "-m", "qkov", "train", *flags, "--out", str(single)], env=env, check=True, capture_output=True)
    res = torchrun(["train", *flags, "--out", str(ddp)], env)
    assert res.returncode == 0, res.stderr[-3000:]
    a, b = qkov.load(single), qkov.load(ddp)
    assert b.cfg == a.cfg and (b.cfg.residual, b.cfg.gate, b.cfg.loop) == ("mhc", "elementwise", 2)
    _same_trained_weights(a, b)


# every other variant, each on its own: one torchrun launch trains them all (one process group)
DDP_VARIANTS: dict[str, dict[str, object]] = {
    "attnres": dict(residual="attnres", d_mlp=32),
    "attnres-block": dict(residual="attnres-block", attnres_block=2, d_mlp=32),
    "hyper": dict(residual="hyper", n_streams=3),
    "hyper-dynamic": dict(residual="hyper", n_streams=2, hyper_dynamic=True),
    "gate-headwise": dict(gate="headwise"),
}
SEVERAL_RUNS = """
import json, os, sys
from pathlib import Path
import torch.distributed as dist
import qkov
corpus, out, variants = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
ranked = "RANK" in os.environ  # under torchrun: the script joins the group; every run uses it and leaves it joined
if ranked:
    dist.init_process_group("gloo")
base = qkov.ModelConfig(n_layers=2, n_heads=2, d_model=32, d_head=16, d_vocab=300, n_ctx=32)
tc = qkov.TrainConfig(steps=10, batch=4, corpus=corpus, ckpt_interval=5, eval_interval=5)
for name, change in variants.items():
    qkov.train(out / name, base.replace(**change), tc, device="cpu")
    assert dist.is_initialized() == ranked, "qkov.train left a process group it did not join"
if ranked:
    dist.destroy_process_group()
"""


def test_every_other_variant_trains_the_same_under_torchrun(tmp_path: Path, small_corpus: Path) -> None:
    """AttnRes (full and in blocks, with MLPs), static and dynamic hyper-connections and headwise gates: two
    ranks reach one process's weights, every bus and gate parameter trained; ``qkov.train`` called several
    times in a script that joined the process group itself leaves the group joined."""
    env = {**os.environ, "QKOV_CACHE": str(tmp_path / "cache")}
    script = tmp_path / "several_runs.py"
    script.write_text(SEVERAL_RUNS)
    args = [str(script), str(small_corpus), "", json.dumps(DDP_VARIANTS)]
    args[2] = str(tmp_path / "single")
    one = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=600)
    assert one.returncode == 0, one.stderr[-3000:]
    args[2] = str(tmp_path / "ddp")
    res = torchrun(args, env, script=True)
    assert res.returncode == 0, res.stderr[-3000:]
    for name, change in DDP_VARIANTS.items():
        a, b = qkov.load(tmp_path / "single" / name), qkov.load(tmp_path / "ddp" / name)
        assert b.cfg == a.cfg == TINY.replace(**change), name  # type: ignore[arg-type]
        _same_trained_weights(a, b)


def _same_trained_weights(a: Transformer, b: Transformer) -> None:
    """``b`` (two ranks) holds ``a``'s (one process) weights to float noise, and every bus and gate
    parameter left its initialisation."""
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.allclose(sa[k], sb[k], atol=1e-4), (b.cfg.describe(), k)
    init = Transformer(b.cfg, seed=0).state_dict()
    extras = [k for k in sb if k.startswith("bus.") or k.endswith(("W_G", "b_G"))]
    assert extras, b.cfg.describe()
    for k in extras:  # the routing and the gates trained
        assert not torch.equal(sb[k], init[k]), (b.cfg.describe(), k)
