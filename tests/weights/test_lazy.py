"""Memory-mapped checkpoints: the same analyses as on the in-memory view (the same code, another
WeightSource), only the needed tensors read."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import qkov
from qkov import ModelConfig, QkovError, Transformer, trace
from qkov.analysis import circuits as C
from qkov.analysis.circuits import composition as Cm
from qkov.analysis import paths as P
from qkov.analysis.circuits import trigrams as T
from qkov.apps.cli import main
from qkov.analysis.circuits.rotary import offset_qk
from qkov.io.tensorfile import TensorFile
from qkov.weights import LazyCheckpoint, Weights

from helpers import LN_MLP, MODERN, perturb_non_matrices

LN = LN_MLP.replace(n_layers=4, n_heads=3, positional="standard")  # LayerNorm, MLPs, biases
ATTN_ONLY = ModelConfig(n_layers=3, n_heads=4, d_model=32, d_head=8, d_vocab=60, n_ctx=20)  # shortformer
# rotary, RMSNorm, grouped-query attention, gated MLP, biases; and the parallel NeoX form
MODERN3 = MODERN.replace(n_layers=4)
NEOX = MODERN3.replace(normalization="layernorm", gated_mlp=False, act_fn="gelu", parallel=True, rotary_dim=2)
CASES = {"layernorm-mlp": LN, "attn-only": ATTN_ONLY, "modern": MODERN3, "neox": NEOX}
ATTN_FIELDS = ("W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V", "b_O")


def _save(path: Path, cfg: ModelConfig, seed: int = 1) -> Transformer:
    model = perturb_non_matrices(Transformer(cfg, seed=seed), 0.3)
    qkov.save_checkpoint(model, path)
    return model


@pytest.fixture(params=sorted(CASES))
def saved(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Weights, Path]:
    model = _save(tmp_path / "ck", CASES[request.param])
    return Weights.from_model(model, dtype=torch.float64), tmp_path / "ck"


def _close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-10) -> bool:
    return (
        a.shape == b.shape
        and torch.equal(a.isnan(), b.isnan())
        and torch.allclose(a.nan_to_num(), b.nan_to_num(), atol=tol)
    )


def test_reader_agrees_with_safetensors(saved: tuple[Weights, Path]) -> None:
    path = saved[1] / "model.safetensors"
    mine = TensorFile(path)
    with safe_open(str(path), framework="pt") as ref:  # the independent reader
        assert sorted(ref.keys()) == sorted(mine.entries)
        for name in ref.keys():
            t = ref.get_tensor(name)
            assert torch.equal(mine.read(name), t)
            assert torch.equal(mine.read(name, 1), t[1])
            assert torch.equal(mine.read(name, slice(1, 2)), t[1:2])
            assert torch.equal(mine.read(name, cols=slice(1, 3)), t[..., 1:3])
    half = tmp = saved[1] / "half.safetensors"
    tmp.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(QkovError, match="truncated or corrupt"):
        TensorFile(half)


def test_layers_fold_exactly_as_the_whole_model(saved: tuple[Weights, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    w, path = saved
    ck = LazyCheckpoint(path, dtype=torch.float64)
    for layer in range(w.n_layers):
        att, ref = ck.attention(layer), w.attention(layer)  # per query head (grouped K/V repeated)
        for f in ATTN_FIELDS:
            assert _close(getattr(att, f), getattr(ref, f)), (layer, f)
        one, ref = ck.attention(layer, 2), w.attention(layer, 2)
        for f in ATTN_FIELDS:
            assert _close(getattr(one, f), getattr(ref, f)), (layer, f)
        packed, ref = ck.attention(layer, expand_kv=False), w.attention(layer, expand_kv=False)
        assert packed.W_K.shape[0] == w.cfg.kv_heads  # grouped K/V once per key/value head
        for f in ATTN_FIELDS:
            assert _close(getattr(packed, f), getattr(ref, f)), (layer, f)
        if w.W_in is not None:
            mlp = ck.mlp(layer)
            assert _close(mlp.W_in, w.W_in[layer]) and _close(mlp.b_in, w.b_in[layer])  # type: ignore[index]
            assert _close(mlp.W_out, w.W_out[layer]) and _close(mlp.b_out, w.b_out[layer])  # type: ignore[index]
            if w.W_gate is not None:
                assert _close(mlp.W_gate, w.W_gate[layer]) and _close(mlp.b_gate, w.b_gate[layer])  # type: ignore[index]
        else:
            assert ck.mlp(layer) is None
    U = ck.unembed()
    assert _close(U.W_U, w.W_U) and _close(U.b_U, w.b_U) and _close(ck.embed(), w.W_E)
    assert _close(ck.embed(slice(3, 9)), w.W_E[3:9]) and _close(ck.unembed(slice(3, 9)).W_U, w.W_U[:, 3:9])
    monkeypatch.setattr("qkov.weights.lazy._BLOCK", 7 * w.cfg.d_model)  # W_U folded 7 columns at a time
    assert _close(ck.unembed().W_U, w.W_U) and _close(ck.unembed().b_U, w.b_U)
    assert _close(C.unembed_embed(ck, block=7), w.W_U @ w.W_E)
    assert _close(C.full_ov(ck, 2, 1).materialize(), C.full_ov(w, 2, 1).materialize())
    if w.cfg.positional == "rotary":
        assert _close(offset_qk(ck, 2, 1, 3).materialize(), offset_qk(w, 2, 1, 3).materialize())
    else:
        assert _close(C.full_qk(ck, 2, 1).materialize(), C.full_qk(w, 2, 1).materialize())
    with pytest.raises(QkovError, match="no head 4.0"):
        ck.attention(4, 0)


def test_analyses_match_the_in_memory_path(saved: tuple[Weights, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    w, path = saved
    ck = LazyCheckpoint(path, dtype=torch.float64)
    ref = C.circuits_report(w, diag_k=3)
    for writer_bytes, product_bytes in ((1, 1), (1 << 30, 1), (1 << 30, 1 << 30)):
        # one writer layer per pass (3 passes) or all in one; pair norms of one writer layer or all at once
        monkeypatch.setattr(Cm, "PRODUCT_BYTES", product_bytes)
        got = C.circuits_report(ck, diag_k=3, writer_bytes=writer_bytes)
        for a, b in zip(ref.copying, got.copying, strict=True):
            assert (a.layer, a.head, a.diag_topk_rate) == (b.layer, b.head, b.diag_topk_rate)
            assert a.eigen_score == pytest.approx(b.eigen_score, abs=1e-9)
            assert a.residual_eigen_score == pytest.approx(b.residual_eigen_score, abs=1e-9)
        for kind in "qkv":
            assert _close(got.composition[kind].raw, ref.composition[kind].raw)
            assert got.composition[kind].baseline == ref.composition[kind].baseline
        assert got.to_dict()["bandwidth"] == ref.to_dict()["bandwidth"]
    eig_only = C.copying_scores(ck, diag_k=None)  # the streamed W_U @ W_E
    assert [c.eigen_score for c in eig_only] == pytest.approx([c.eigen_score for c in ref.copying], abs=1e-9)
    pairs = [(("embed",), ("q", 0, 1)), (("head", 0, 2), ("k", 2, 1)), (("head", 1, 0), ("unembed",))]
    if w.W_pos is not None:  # positions reach every reader (standard) or only queries and keys (shortformer)
        pairs += [(("pos",), ("v" if w.cfg.positional == "standard" else "k", 1, 0))]
    pairs += (
        [(("mlp", 0), ("mlp", 3)), (("head", 1 if w.cfg.parallel else 2, 2), ("mlp", 2)), (("mlp", 1), ("unembed",))]
        if w.W_in is not None
        else []
    )
    for writer, reader in pairs:  # against the materialised product of the view's own tensors
        got = C.virtual_weights(ck, writer, reader).materialize()
        assert _close(got, C.virtual_weights(w, writer, reader).materialize())
    assert _close(
        C.virtual_weights(ck, ("head", 0, 2), ("k", 2, 1)).materialize(), w.W_O[0, 2] @ w.attention(2, 1).W_K[0]
    )
    for writer, reader, msg in [
        (("head", 1, 0), ("k", 1, 1), "does not come after"),
        (("x",), ("unembed",), "unknown writer"),
    ]:
        with pytest.raises(QkovError, match=msg):
            C.virtual_weights(ck, writer, reader)
    lazy_tri, ref_tri = T.skip_trigrams(ck, 1, 2, top=15), T.skip_trigrams(w, 1, 2, top=15)
    assert [(t.source, t.destination, t.output) for t in lazy_tri] == [
        (t.source, t.destination, t.output) for t in ref_tri
    ]
    assert [t.score for t in lazy_tri] == pytest.approx([t.score for t in ref_tri], rel=1e-9)
    assert [(b.token, b.next) for b in T.bigrams(ck, top=10)] == [(b.token, b.next) for b in T.bigrams(w, top=10)]


def test_forward_and_paths_stream_the_same_model(saved: tuple[Weights, Path]) -> None:
    """The analysis forward reads a memory-mapped checkpoint layer by layer: same logits, patterns
    and path expansion as the in-memory view."""
    w, path = saved
    ck = LazyCheckpoint(path, dtype=torch.float64)
    toks = torch.randint(0, w.cfg.d_vocab, (2, 10), generator=torch.Generator().manual_seed(4))
    a, b = trace(ck, toks, cache=["pattern", "head_out"]), trace(w, toks, cache=["pattern", "head_out"])
    assert _close(a.logits, b.logits) and _close(a.stack("pattern"), b.stack("pattern"))
    assert _close(a.stack("head_out"), b.stack("head_out"))
    assert P.expand(ck, toks).reconstruction_error() < 1e-10


def test_a_gradient_through_the_streamed_forward_is_the_in_memory_views_and_holds_no_layer(
    saved: tuple[Weights, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """trace(grad=True) on a LazyCheckpoint: every cached site's gradient, the input's and the logits are the
    in-memory view's, with an edit inside a block (applied again when the backward replays it); after the
    forward no layer's weights and no block of W_U is alive (each block recomputed in the backward pass)."""
    import gc
    import weakref

    from qkov.analysis.forward import tracer

    monkeypatch.setattr(tracer, "VOCAB_BLOCK", 16)
    w, path = saved
    ck = LazyCheckpoint(path, dtype=torch.float64)
    alive: list[weakref.ref] = []
    for name in ("attention", "mlp", "unembed"):
        real = getattr(ck, name)

        def reading(*a, real=real, **k):  # type: ignore[no-untyped-def]
            got = real(*a, **k)
            alive.extend(weakref.ref(t) for t in vars(got).values() if isinstance(t, torch.Tensor))
            return got

        monkeypatch.setattr(ck, name, reading)
    toks = torch.randint(0, w.cfg.d_vocab, (2, 9), generator=torch.Generator().manual_seed(6))
    sites = ["resid_pre", "q", "v", "z"] + (["mlp_input"] if w.cfg.d_mlp else [])
    edits = {"z.1": lambda value, site: value * 1.5}
    grads = []
    for source in (ck, w):
        out = trace(source, toks, cache=sites, edits=edits, grad=True)
        if source is ck:
            gc.collect()
            assert alive and not [r for r in alive if r() is not None]
        (out.logits[:, -3:].logsumexp(-1).sum() + out.logits[:, 2, 7].sum()).backward()
        grads.append((out.logits.detach(), [out[k, l].grad for k in sites for l in range(w.cfg.n_layers)]))
    (la, ga), (lb, gb) = grads
    assert _close(la, lb)
    assert all(a is not None and _close(a, b) for a, b in zip(ga, gb))


@pytest.mark.parametrize("centre", [True, False])
def test_the_streamed_forward_reads_the_tokens_rows_and_the_unembedding_in_blocks(
    centre: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """trace on a LazyCheckpoint reads W_E's rows of the tokens present only (a run of consecutive ids as one
    read) and W_U a block of columns at a time, never either whole (with centring, the vocabulary mean is one
    pass more, in the checkpoint's own blocks), and gives the in-memory view's logits and streams."""
    from qkov.analysis.forward import tracer

    model = _save(tmp_path / "ck", LN.replace(d_vocab=90))
    monkeypatch.setattr(tracer, "VOCAB_BLOCK", 16)
    ck = LazyCheckpoint(tmp_path / "ck", dtype=torch.float64, center_unembed=centre)
    seen: list[tuple[str, object, object]] = []
    real = ck.file.read
    monkeypatch.setattr(ck.file, "read", lambda name, index=None, cols=None: seen.append((name, index, cols)) or real(name, index, cols))
    toks = torch.tensor([[3, 4, 5, 9, 3, 80], [7, 8, 4, 4, 4, 81]])
    got = trace(ck, toks, cache=["resid_pre"])
    want = trace(Weights.from_model(model, dtype=torch.float64, center_unembed=centre), toks, cache=["resid_pre"])
    assert _close(got.logits, want.logits) and _close(got.stack("resid_pre"), want.stack("resid_pre"))
    rows = [i for name, i, _ in seen if name == "W_E"]
    assert rows == [slice(3, 6), slice(7, 10), slice(80, 82)]
    blocks = [c for name, _, c in seen if name == "W_U"]
    whole = slice(0, 90)  # the vocabulary mean's pass (90 columns fit one of the checkpoint's blocks)
    assert [c for c in blocks if c != whole] == [slice(lo, min(90, lo + 16)) for lo in range(0, 90, 16)]
    assert blocks.count(whole) == int(centre)


def test_a_view_read_from_the_memory_map_is_the_loaded_models(saved: tuple[Weights, Path]) -> None:
    """Weights.from_source(LazyCheckpoint(path)) (layer by layer, no model beside it) holds the same
    tensors, options and forward as Weights.from_model(load(path)); from_source of a view is itself."""
    import dataclasses

    w, path = saved
    for got in (Weights.from_source(LazyCheckpoint(path, dtype=torch.float64)), Weights.from_source(w)):
        for f in dataclasses.fields(w):
            a, b = getattr(got, f.name), getattr(w, f.name)
            assert _close(a, b) if isinstance(a, torch.Tensor) else a == b, f.name
    unfolded = Weights.from_model(qkov.load(path), dtype=torch.float64, fold_ln=False)
    again = Weights.from_source(unfolded)
    assert again.norm == unfolded.norm and (again.ln1_w is None) == (unfolded.ln1_w is None)
    toks = torch.randint(0, w.cfg.d_vocab, (2, 10), generator=torch.Generator().manual_seed(4))
    assert _close(trace(again, toks).logits, trace(unfolded, toks).logits)


def test_attention_analyses_never_read_mlps_and_one_head_reads_one_head(tmp_path: Path) -> None:
    cfg = ModelConfig(
        n_layers=4, n_heads=4, d_model=64, d_head=16, d_vocab=500, n_ctx=16, d_mlp=4096, normalization="layernorm"
    )
    _save(tmp_path / "ck", cfg)
    ck = LazyCheckpoint(tmp_path / "ck")
    C.circuits_report(ck, diag_k=None)
    mlp_bytes = cfg.n_layers * 2 * cfg.d_model * cfg.d_mlp * 4  # type: ignore[operator]
    assert mlp_bytes > (tmp_path / "ck" / "model.safetensors").stat().st_size * 0.8
    assert not [k for k in ck.file.reads if ".mlp." in k or ".ln2." in k]
    attn = [k for k in ck.file.reads if ".attn.W_" in k]
    assert len(attn) == 16 and all(ck.file.reads[k] == 2 for k in attn)  # copying pass + one composition pass
    # per pass; W_E once, W_U twice (its mean over the vocabulary for centring, then its use)
    attn_bytes, embed_bytes = 4 * (4 * 4 * 64 * 16) * 4, 3 * 500 * 64 * 4
    assert ck.file.bytes_read < 2 * attn_bytes + embed_bytes + 16384  # + biases and LayerNorms
    for centre in (True, False):
        ck = LazyCheckpoint(tmp_path / "ck", center_unembed=centre)
        T.TrigramTable(ck, 2, 3)  # everything the skip-trigram table of head 2.3 needs
        assert {k for k in ck.file.reads if k.startswith("blocks.")} <= {
            f"blocks.2.{p}" for p in ("ln1.w", "ln1.b", "attn.W_Q", "attn.W_K", "attn.W_V", "attn.W_O")
        }
        reads = 2 if centre else 1  # the vocabulary mean of W_U is one more pass (with the final LN)
        assert ck.file.reads["W_E"] == 1 and ck.file.reads["W_U"] == reads
        # one head, W_E, W_U, ln1, ln_final
        assert ck.file.bytes_read == (4 * 64 * 16 + (1 + reads) * 500 * 64 + (1 + reads) * 2 * 64) * 4


def test_non_finite_values_are_refused_and_huge_finite_ones_are_not(tmp_path: Path) -> None:
    """Each read is checked by its sum (finite: every value is), and value by value when the sum is not: an
    infinity is refused, finite values whose sum overflows float32 are read as they are."""
    ck = tmp_path / "ck"
    _save(ck, ATTN_ONLY)
    with safe_open(str(ck / "model.safetensors"), framework="pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}
    huge = torch.full((4, 8, 32), 3e38)
    save_file({**state, "blocks.2.attn.W_O": huge}, str(ck / "model.safetensors"))
    got = LazyCheckpoint(ck, center_writing=False).attention(2).W_O
    assert torch.equal(got, huge) and not got.sum().isfinite()
    bad = huge.clone()
    bad[1, 2, 3] = -math.inf
    save_file({**state, "blocks.2.attn.W_O": bad}, str(ck / "model.safetensors"))
    with pytest.raises(QkovError, match="blocks.2.attn.W_O holds NaN or infinite values"):
        LazyCheckpoint(ck).attention(2)


def test_bad_checkpoints_are_one_line_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ck = tmp_path / "ck"
    _save(ck, ATTN_ONLY)
    state = {}
    with safe_open(str(ck / "model.safetensors"), framework="pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}
    cases = {
        "missing weight(s) blocks.1.attn.W_K": {k: v for k, v in state.items() if k != "blocks.1.attn.W_K"},
        "unexpected weight(s) extra": {**state, "extra": torch.zeros(2)},
        "has shape (3, 32, 8)": {**state, "blocks.0.attn.W_Q": torch.zeros(3, 32, 8)},
        "NaN": {**state, "blocks.2.attn.W_O": torch.full((4, 8, 32), math.nan)},
    }
    for needle, tensors in cases.items():
        save_file(tensors, str(ck / "model.safetensors"))
        assert main(["circuits", str(ck), "--lazy"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("qkov: error:") and needle in err[0], err
    (ck / "model.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{nope")
    with pytest.raises(QkovError, match="not a safetensors file"):
        LazyCheckpoint(ck)
    (ck / "model.safetensors").unlink()
    with pytest.raises(QkovError, match="has no model.safetensors"):
        LazyCheckpoint(ck)


def _json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def _assert_same(a: object, b: object, where: str = "") -> None:
    """Parsed JSON equal in structure, keys, strings and integers, floats within 1e-5."""
    assert type(a) is type(b) or {type(a), type(b)} <= {int, float}, (where, a, b)
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where  # type: ignore[union-attr]
        for k in a:
            _assert_same(a[k], b[k], f"{where}.{k}")  # type: ignore[index]
    elif isinstance(a, list):
        assert len(a) == len(b), where  # type: ignore[arg-type]
        for i, (x, y) in enumerate(zip(a, b)):  # type: ignore[call-overload]
            _assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, float):
        assert a == pytest.approx(b, abs=1e-5), (where, a, b)
    else:
        assert a == b, (where, a, b)


def test_cli_lazy_matches_in_memory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from tokenizers import Tokenizer, models

    from qkov.apps.cli import weights_cmds

    ck = tmp_path / "ck"
    _save(ck, LN)
    vocab = {"<|bos|>": 0, **{f"w{i}": i for i in range(1, LN.d_vocab)}}
    Tokenizer(models.WordLevel(vocab, unk_token="<|bos|>")).save(str(ck / "tokenizer.json"))
    eager = {}
    for cmd in (["circuits", str(ck), "--json"], ["trigrams", str(ck), "--head", "1.2", "--source", "w7", "--json"]):
        eager[cmd[0]] = _json([*cmd, "--device", "cpu"], capsys)
        _assert_same(eager[cmd[0]], _json([*cmd, "--lazy", "--device", "auto"], capsys))
    assert len(eager["circuits"]["copying"]) == 12 and len(eager["trigrams"]["trigrams"]) == 20
    assert "one-layer (direct) view" in eager["trigrams"]["note"]  # head 1.2 is beyond layer 0
    opened = []
    monkeypatch.setattr("qkov.weights.lazy.AUTO_LAZY_BYTES", 0)  # every file is "big": the lazy path is automatic
    monkeypatch.setattr(weights_cmds, "LazyCheckpoint", lambda *a, **kw: opened.append(a) or LazyCheckpoint(*a, **kw))
    _assert_same(_json(["circuits", str(ck), "--json"], capsys), eager["circuits"])
    assert len(opened) == 1


@pytest.mark.parametrize("command", [["circuits"], ["paths"], ["heads"], ["trigrams", "--head", "0.0"]])
def test_device_option(command: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ck = tmp_path / "ck"  # devices are checked before the checkpoint is even read
    bad = [("nonsense", "unknown device 'nonsense'"), ("tpu", "unknown device 'tpu'")]
    if not torch.cuda.is_available():
        bad += [("cuda", "no CUDA GPU is available"), ("cuda:1", "no CUDA GPU is available")]
    for device, needle in bad:
        assert main([command[0], str(ck), *command[1:], "--device", device]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0], err


def test_stage_progress_draws_on_a_terminal() -> None:
    from rich.console import Console

    from qkov.apps.progress import StageProgress

    out = io.StringIO()
    with StageProgress(console=Console(file=out, force_terminal=True, width=100)) as p:
        for i in range(3):
            p("composition", i + 1, 3)
    assert "composition" in out.getvalue() and "3/3" in out.getvalue()
    # elsewhere (a log): after `quiet` s, plain lines when a stage starts, while it runs and when it ends
    quick = io.StringIO()
    with StageProgress(console=Console(file=quick, force_terminal=False)) as p:
        p("copying", 1, 2)
        p("copying", 2, 2)
    assert quick.getvalue() == "", "a command that ends within `quiet` seconds prints nothing"
    log = io.StringIO()
    with StageProgress(console=Console(file=log, force_terminal=False, width=200), every=0.0, quiet=0.0) as p:
        p("copying", 0, 4)
        p("copying", 1, 4)
        p("copying", 4, 4)
        p("bigrams", 1, 1)  # a one-step stage: one line
    lines = log.getvalue().splitlines()
    assert lines[0] == "copying: started (4 steps)" and lines[1].startswith("copying: 1/4 after")
    assert "left" in lines[1] and lines[2].startswith("copying: done in") and lines[3].startswith("bigrams: done in")
    assert len(lines) == 4


def test_composition_baseline_refuses_a_generator_that_skips_unlike_its_normals(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first pass moves the generator on by uniforms; if that ever stops matching torch's normals, the
    sample raises at its end instead of handing on values drawn from the wrong place."""
    shapes = [(10, 32, 8), (10, 8, 32)]
    monkeypatch.setattr(Cm, "_skip_normals", lambda g, numel: torch.empty(numel // 2, dtype=torch.float64).uniform_(generator=g))
    with pytest.raises(QkovError, match="draws normals unlike uniforms"):
        list(Cm._seeded_normals(torch.Generator().manual_seed(3), shapes, max_bytes=8 * 4 * 256 * 3))


def test_composition_baseline_draws_in_blocks_with_the_same_values() -> None:
    def whole(seed: int, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]

    for shapes in ([(10, 32, 8), (10, 8, 32)] * 2, [(7, 5, 3), (7, 3, 5)]):
        blocks = list(Cm._seeded_normals(torch.Generator().manual_seed(3), shapes, max_bytes=8 * 4 * 256 * 3))
        assert len(blocks) == (4 if shapes[0][1] == 32 else 1)  # 3 samples a block; 15 values a sample: whole
        for got, ref in zip(zip(*blocks), whole(3, shapes), strict=True):
            assert torch.equal(torch.cat(got), ref)
    # the memory-bounded baseline is the paper's formula on materialised matrices (V1, O1, A, then B
    # or RB, each drawn whole): K-composition ||W_OV1 W_QK2^T|| / (||W_OV1|| ||W_QK2||), W_QK2^T = A B^T
    V1, O1, A, B = whole(0, [(40, 32, 8), (40, 8, 32), (40, 32, 8), (40, 32, 8)])
    fro = torch.linalg.matrix_norm
    ov, qk_t = V1 @ O1, A @ B.mT
    ref = fro(ov @ qk_t) / (fro(ov) * fro(qk_t))
    got = Cm.composition_baseline(32, 8, "k", samples=40)
    assert (got.mean, got.std) == pytest.approx((float(ref.mean()), float(ref.std())), rel=1e-12)


def test_vocabulary_products_stream_in_blocks(saved: tuple[Weights, Path]) -> None:
    """A streamed source's ``W_E @ M`` and ``M @ W_U`` are taken a block of tokens at a time and
    equal the in-memory products (so a 128k-token vocabulary is never held whole in float32)."""
    from qkov.analysis.circuits.vocab import embed_product, unembed_product

    w, path = saved
    ck = LazyCheckpoint(path, dtype=torch.float64)
    M = torch.randn(w.cfg.d_model, 5, dtype=torch.float64)
    assert _close(embed_product(ck, M, block=7), w.W_E @ M)
    assert _close(embed_product(ck, M, block=7, rows=lambda x: 2 * x), 2 * w.W_E @ M)
    assert _close(unembed_product(ck, M.T, block=7), M.T @ w.W_U)
    before = ck.file.bytes_read
    unembed_product(ck, M.T, block=7)
    assert ck.file.bytes_read - before >= w.W_U.numel() * 4  # it read W_U, in blocks
