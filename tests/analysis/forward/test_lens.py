"""TransformerLens' habits on a qkov model, each against TransformerLens 3.9 on the same weights (a GPT-2-like
LayerNorm + MLP model with a tokenizer): the text helpers, ``model(tokens)`` and its loss,
``run_with_cache`` (every hook, the name filters, stacking), ``run_with_hooks`` (replacing, editing in
place, filters, ``hook.layer()``; refusals), gradients where TransformerLens uses backward hooks,
``generate`` (greedy, sampled from the same seed, stopping at the end token), the decompositions and
``logit_attrs(..., pos_slice=)``, and the unprocessed model. The last test checks that every row of
docs/interventions.md's "Coming from TransformerLens" table is one of these (or of the patching tests)."""

from __future__ import annotations

import re
import warnings
from typing import Any

import pytest
import torch

import qkov
from qkov import QkovError, Transformer, Weights, trace
from qkov.io import to_hooked
from qkov.training.data import train_tokenizer

from helpers import ROOT, LN_MLP, perturb_non_matrices

tl = pytest.importorskip("transformer_lens", reason="transformer-lens is a test extra: pip install -e '.[dev]'")
warnings.filterwarnings("ignore", category=DeprecationWarning)

ROOT = ROOT
TEXT = "When Mary and John went to the store, John gave a drink to"
TOL = 1e-5


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The qkov model (with a tokenizer), TransformerLens models of its weights (unprocessed, and processed
    as the model's habits read it: LayerNorm folded, writers centred, unembedding left), and tokens."""
    from transformers import PreTrainedTokenizerFast

    texts = [TEXT + " Mary.\n"] * 40 + ["def f(self):\n    return self.x\n"] * 40
    tok = train_tokenizer(texts, 300)
    cfg = LN_MLP.replace(positional="standard", act_fn="gelu_new", d_vocab=300, n_ctx=32)
    m = perturb_non_matrices(Transformer(cfg, seed=1).eval(), 0.1)
    m.tokenizer, m.bos_token_id = tok, 0
    folder = tmp_path_factory.mktemp("tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|bos|>").save_pretrained(folder)
    raw = to_hooked(m)
    raw.set_tokenizer(PreTrainedTokenizerFast.from_pretrained(folder))
    raw.cfg.default_prepend_bos = True
    processed = to_hooked(m)
    processed.load_and_process_state_dict(
        processed.state_dict(), fold_ln=True, center_writing_weights=True, center_unembed=False, fold_value_biases=False
    )
    processed.set_use_attn_result(True)
    toks = torch.randint(1, 300, (3, 10), generator=torch.Generator().manual_seed(0))
    return dict(m=m, raw=raw, processed=processed.eval(), toks=toks)


def _close(ours: torch.Tensor, theirs: torch.Tensor, what: str, tol: float = TOL) -> None:
    assert ours.shape == theirs.shape, (what, ours.shape, theirs.shape)
    inf = torch.isinf(theirs)
    assert torch.equal(torch.isinf(ours), inf), what
    gap = (ours[~inf] - theirs[~inf]).abs().max()
    assert gap <= tol * max(1.0, float(theirs[~inf].abs().max())), (what, float(gap))


# ------------------------------------------------------------------ texts, logits, loss
def test_text_helpers_equal_transformerlens(pair: dict[str, Any]) -> None:
    m, raw = pair["m"], pair["raw"]
    assert torch.equal(m.to_tokens(TEXT), raw.to_tokens(TEXT))
    assert m.to_tokens(TEXT)[0, 0] == 0 and not bool((m.to_tokens(TEXT)[0, 1:] == 0).any())  # one start token
    assert m.to_str_tokens(TEXT) == raw.to_str_tokens(TEXT)
    assert m.to_single_token(" Mary") == raw.to_single_token(" Mary") == m.to_single_token("Mary")
    ids = m.to_tokens(TEXT)[0]
    assert m.to_string(ids) == raw.to_string(ids)


def test_logits_and_loss_equal_transformerlens(pair: dict[str, Any]) -> None:
    m, raw, toks = pair["m"], pair["raw"], pair["toks"]
    with torch.no_grad():
        _close(m(toks), raw(toks), "logits")
        loss = m.run_with_hooks(toks, return_type="loss")
        _close(loss, raw(toks, return_type="loss"), "loss")
        logits, both_loss = m.run_with_hooks(toks, return_type="both")
        _close(logits, raw(toks), "both: logits")
    assert float(both_loss) == float(loss) and m.run_with_hooks(toks, return_type=None) is None
    with pytest.raises(QkovError, match="return_type must be one of"):
        m.run_with_hooks(toks, return_type="embeds")


# ------------------------------------------------------------------ run_with_cache
def test_run_with_cache_equals_transformerlens(pair: dict[str, Any]) -> None:
    from transformer_lens.utils import get_act_name

    m, h, toks = pair["m"], pair["processed"], pair["toks"]
    logits, cache = m.run_with_cache(toks)
    with torch.no_grad():
        tl_logits, tl_cache = h.run_with_cache(toks)
    assert isinstance(cache, qkov.Trace)
    _close(logits, tl_logits, "logits")
    _close(logits, m(toks).detach(), "logits are the model's own")
    for hook, theirs in tl_cache.items():
        _close(cache[hook], theirs, hook)  # every hook TransformerLens caches, by its own name
    assert cache["pattern", 1] is cache["blocks.1.attn.hook_pattern"] is cache["pattern.1"]
    assert cache[get_act_name("resid_pre", 1)] is cache[("resid_pre", 1)] is cache["resid_pre.1"]
    _close(cache.stack("pattern"), tl_cache.stack_activation("pattern"), "stack")
    text_logits, text_cache = m.run_with_cache(TEXT)  # a text: one start token, as to_tokens
    assert torch.equal(text_cache.tokens, m.to_tokens(TEXT))
    with torch.no_grad():
        _close(text_logits, h(m.to_tokens(TEXT)), "text logits")


def test_run_with_cache_name_filters_keep_what_transformerlens_keeps(pair: dict[str, Any]) -> None:
    m, h, toks = pair["m"], pair["processed"], pair["toks"]
    filters: list[Any] = [
        lambda name: name.endswith("hook_pattern"),
        lambda name: name.startswith("blocks.1.") and "resid" in name,
        "blocks.0.attn.hook_z",
        ["blocks.0.hook_resid_pre", "blocks.1.mlp.hook_post"],
    ]
    for names_filter in filters:
        _, ours = m.run_with_cache(toks, names_filter=names_filter)
        with torch.no_grad():
            _, theirs = h.run_with_cache(toks, names_filter=names_filter)
        assert {ours.address(k).name for k in theirs.keys()} == set(ours.keys()), names_filter
        for hook, value in theirs.items():
            _close(ours[hook], value, hook)
    # a kind alone is every layer, as the first filter
    by_kind = trace(Weights.from_model(m), toks, cache=["pattern"])
    assert set(by_kind.keys()) == {"pattern.0", "pattern.1"}
    _close(by_kind.stack("pattern"), m.run_with_cache(toks, names_filter=filters[0])[1].stack("pattern"), "kind")
    with pytest.raises(QkovError, match="names_filter must be"):
        m.run_with_cache(toks, names_filter=3)


# ------------------------------------------------------------------ run_with_hooks
def _hooks(seen: dict[str, Any]) -> list[tuple[Any, Any]]:
    """Hook functions a TransformerLens user writes: replace, edit in place, read only, by filter."""

    def silence_head(z: torch.Tensor, hook: Any) -> torch.Tensor:
        z = z.clone()
        z[:, :, 1] = 0
        return z

    def sharpen(pattern: torch.Tensor, hook: Any) -> None:
        pattern.mul_(0.5)  # in place; returns nothing
        seen.setdefault("layers", []).append(hook.layer())

    def push(resid: torch.Tensor, hook: Any) -> torch.Tensor:
        return resid + 0.3 * torch.arange(resid.shape[-1], dtype=resid.dtype)

    def read(x: torch.Tensor, hook: Any) -> None:
        seen.setdefault("names", []).append(hook.name)

    return [
        ("blocks.0.attn.hook_z", silence_head),
        (lambda name: name.endswith("hook_pattern"), sharpen),
        ("blocks.1.hook_resid_pre", push),
        ("blocks.1.mlp.hook_post", read),
        ("blocks.1.hook_resid_pre", read),  # a second function at a site runs after the first
    ]


def test_run_with_hooks_equals_transformerlens(pair: dict[str, Any]) -> None:
    m, h, toks = pair["m"], pair["processed"], pair["toks"]
    ours_seen: dict[str, Any] = {}
    theirs_seen: dict[str, Any] = {}
    ours = m.run_with_hooks(toks, fwd_hooks=_hooks(ours_seen))
    with torch.no_grad():
        theirs = h.run_with_hooks(toks, fwd_hooks=_hooks(theirs_seen))
    _close(ours, theirs, "hooked logits")
    assert (ours - m(toks)).abs().max() > 0.1  # the hooks changed something
    assert ours_seen == theirs_seen == {"layers": [0, 1], "names": ["blocks.1.hook_resid_pre", "blocks.1.mlp.hook_post"]}
    # on a weights view, the same functions are edits (the logits there are centred over the vocabulary)
    w = Weights.from_model(m, center_unembed=False)
    edits = {"blocks.0.attn.hook_z": _hooks({})[0][1], "blocks.1.hook_resid_pre": _hooks({})[2][1]}
    via_trace = trace(w, toks, edits=edits).logits
    _close(via_trace, m.run_with_hooks(toks, fwd_hooks=[(k, f) for k, f in edits.items()]), "trace edits")


def test_run_with_hooks_refuses_hook_points_qkov_lacks_in_one_line(pair: dict[str, Any]) -> None:
    m, toks = pair["m"], pair["toks"]
    for name in ("blocks.0.hook_attn_in", "blocks.0.attn.hook_nothing"):
        with pytest.raises(QkovError, match=rf"run_with_hooks: no site '{re.escape(name)}': not the TransformerLens hook") as e:
            m.run_with_hooks(toks, fwd_hooks=[(name, lambda x, hook: x)])
        assert "\n" not in str(e.value)
    with pytest.raises(QkovError, match="backward hooks are not supported: trace"):
        m.run_with_hooks(toks, bwd_hooks=[("blocks.0.hook_resid_pre", lambda g, hook: None)])
    with pytest.raises(QkovError, match=r"each of fwd_hooks is \(name, fn"):
        m.run_with_hooks(toks, fwd_hooks=["blocks.0.hook_resid_pre"])


def test_gradients_equal_transformerlens_backward_hooks(pair: dict[str, Any]) -> None:
    m, h, toks = pair["m"], pair["processed"], pair["toks"]
    names = ["blocks.0.hook_resid_post", "blocks.1.attn.hook_pattern"]
    grads: dict[str, torch.Tensor] = {}

    def keep(grad: torch.Tensor, hook: Any) -> None:
        grads[hook.name] = grad.detach().clone()

    with h.hooks(bwd_hooks=[(n, keep) for n in names]):
        h(toks, return_type="loss").backward()
    h.zero_grad(set_to_none=True)
    out = trace(Weights.from_model(m, center_unembed=False), toks, cache=names, grad=True)
    qkov.model.ops.next_token_loss(out.logits, toks).backward()
    for n in names:
        _close(out[n].grad, grads[n], f"grad {n}")


# ------------------------------------------------------------------ generate
def test_generate_greedy_and_sampled_equal_transformerlens(pair: dict[str, Any]) -> None:
    m, raw, toks = pair["m"], pair["raw"], pair["toks"]
    kw = dict(stop_at_eos=False, verbose=False)
    with torch.no_grad():
        theirs = raw.generate(toks, max_new_tokens=8, do_sample=False, **kw)
    assert torch.equal(m.generate(toks, 8, temperature=0), theirs)
    assert torch.equal(m.generate(toks, 8, do_sample=False, stop_at_eos=False), theirs)
    for seed, top_k, temperature in [(0, None, 1.0), (1, 5, 0.7), (2, 3, 2.0)]:
        torch.manual_seed(seed)
        with torch.no_grad():
            theirs = raw.generate(toks, max_new_tokens=8, top_k=top_k, temperature=temperature, **kw)
        ours = m.generate(toks, 8, top_k=top_k, temperature=temperature, seed=seed, stop_at_eos=False)
        assert torch.equal(ours, theirs), (seed, top_k, temperature)
    again = m.generate(toks, 8, top_k=5, temperature=0.7, generator=torch.Generator().manual_seed(1), stop_at_eos=False)
    assert torch.equal(again, m.generate(toks, 8, top_k=5, temperature=0.7, seed=1, stop_at_eos=False))
    # a text: one start token, the text back as TransformerLens gives it
    with torch.no_grad():
        theirs_text = raw.generate(TEXT, max_new_tokens=6, do_sample=False, **kw)
    assert m.generate(TEXT, 6, temperature=0, stop_at_eos=False) == theirs_text
    ids = m.generate(TEXT, 6, temperature=0, stop_at_eos=False, return_type="tokens")
    assert ids[0, 0] == 0 and torch.equal(ids[:, : m.to_tokens(TEXT).shape[1]], m.to_tokens(TEXT))


def test_generate_stops_at_the_end_token_as_transformerlens_does(pair: dict[str, Any]) -> None:
    m, toks = pair["m"], pair["toks"]
    ender = perturb_non_matrices(Transformer(m.cfg, seed=4).eval(), 0.1)
    with torch.no_grad():
        ender.b_U[7] += 8.0  # token 7 becomes likely: some sequences end early
    theirs = to_hooked(ender)
    for seed in (0, 1, 2):
        torch.manual_seed(seed)
        with torch.no_grad():
            want = theirs.generate(toks, max_new_tokens=10, stop_at_eos=True, eos_token_id=7, verbose=False)
        got = ender.generate(toks, 10, eos_token_id=7, seed=seed)
        assert torch.equal(got, want), seed
    assert bool((got[:, toks.shape[1] :] == 7).any())
    with torch.no_grad():
        ender.b_U[7] += 100.0  # now always: every sequence ends at once
    assert torch.equal(ender.generate(toks, 10, eos_token_id=[7, 9], temperature=0)[:, -1], torch.full((3,), 7))
    assert ender.generate(toks, 10, eos_token_id=7, temperature=0).shape[1] == toks.shape[1] + 1
    assert ender.generate(toks, 10, eos_token_id=7, temperature=0, stop_at_eos=False).shape[1] == toks.shape[1] + 10


def test_generate_refuses_what_it_cannot_do_in_one_line(pair: dict[str, Any]) -> None:
    m, toks = pair["m"], pair["toks"]
    cases = [
        (dict(max_new_tokens=30), "exceed the context of 32 tokens"),
        (dict(temperature=-1.0), "temperature must be a number >= 0"),
        (dict(top_k=0), "top_k must be None or an integer >= 1"),
        (dict(seed=1, generator=torch.Generator()), "seed or generator, not both"),
        (dict(return_type="embeds"), "return_type must be one of input, str, tokens"),
        (dict(max_new_tokens=-1), "max_new_tokens must be a non-negative integer"),
        (dict(eos_token_id=300), "eos_token_id must be a token id in 0..299"),
    ]
    for kw, says in cases:
        with pytest.raises(QkovError, match=says):
            m.generate(toks, **kw)
    with pytest.raises(QkovError, match="expected a text, a list of texts or token ids"):
        m.generate(3.5)


# ------------------------------------------------------------------ decompositions, logit attribution
def test_decompositions_and_logit_attrs_with_pos_slice_equal_transformerlens(pair: dict[str, Any]) -> None:
    m, h, toks = pair["m"], pair["processed"], pair["toks"]
    _, cache = m.run_with_cache(toks)
    with torch.no_grad():
        _, tl_cache = h.run_with_cache(toks)
    resid, labels = tl_cache.decompose_resid(return_labels=True)
    ours = cache.decompose_resid()
    assert ours.labels == [{"pos_embed": "pos"}.get(label, label) for label in labels]
    _close(ours.values, resid, "decompose_resid")
    _close(cache.accumulated_resid().values, tl_cache.accumulated_resid(), "accumulated_resid")
    _close(cache.stack_head_results().values, tl_cache.stack_head_results(), "stack_head_results")
    _close(ours.apply_ln().values, tl_cache.apply_ln_to_stack(resid, layer=-1), "apply_ln")
    answer, wrong = toks[:, 3], toks[:, 5]
    with torch.no_grad():
        last = tl_cache.logit_attrs(tl_cache.decompose_resid(pos_slice=-1), answer, wrong, pos_slice=-1)
        nxt = tl_cache.logit_attrs(tl_cache.decompose_resid(pos_slice=(0, -1)), toks[:, 1:], pos_slice=(0, -1))
    _close(ours.logit_attrs(answer, incorrect=wrong, pos_slice=-1), last, "pos_slice=-1")  # [C, B]
    _close(ours.logit_attrs(toks[:, 1:], pos_slice=(0, -1)), nxt, "pos_slice=(0, -1)")  # [C, B, T-1]
    _close(ours.logit_attrs(toks[:, 1:], pos_slice=slice(0, -1)), nxt, "pos_slice=slice")
    # summed over components: each position's logit of its next token, minus b_U
    logits, b_U = cache.logits, Weights.from_model(m, center_unembed=False).b_U
    want = logits[:, :-1].gather(-1, toks[:, 1:, None])[..., 0] - b_U[toks[:, 1:]]
    _close(ours.logit_attrs(toks[:, 1:], pos_slice=slice(0, -1)).sum(0), want, "sums to the logits")
    picked = ours.logit_attrs(answer, pos_slice=[4, 2])
    _close(picked, ours.logit_attrs(answer)[:, :, [4, 2]], "a list of positions, in its order")


def test_logit_attrs_pos_slice_refusals_are_one_line(pair: dict[str, Any]) -> None:
    m, toks = pair["m"], pair["toks"]
    stack = m.run_with_cache(toks)[1].decompose_resid()
    cases = [
        (dict(tokens=toks[:, 3], pos_slice=10), "pos_slice 10 is outside the 10 positions"),
        (dict(tokens=toks[:, 3], pos_slice=[1, 12]), r"pos_slice \[1, 12\] reaches outside"),
        (dict(tokens=toks[:, 3], pos_slice=slice(5, 5)), "picks no position"),
        (dict(tokens=toks[:, 3], pos_slice=1.5), "pos_slice must be None, an int"),
        (dict(tokens=toks, pos_slice=-1), r"tokens must be one id or \[batch\]"),
        (dict(tokens=toks, pos_slice=slice(0, -1)), r"positions picked 9\); got \[3, 10\]"),
    ]
    for kw, says in cases:
        with pytest.raises(QkovError, match=says):
            stack.logit_attrs(kw.pop("tokens"), **kw)


# ------------------------------------------------------------------ the unprocessed model
def test_unprocessed_transformerlens_is_the_uncentred_stream(pair: dict[str, Any]) -> None:
    m, raw, toks = pair["m"], pair["raw"], pair["toks"]
    raw.set_use_attn_result(True)
    with torch.no_grad():
        _, theirs = raw.run_with_cache(toks)
    unprocessed = Weights.from_model(m, fold_ln=False, center_writing=False, center_unembed=False)
    as_is = trace(unprocessed, toks, cache="*")
    for hook, value in theirs.items():
        if hook.endswith("hook_normalized"):  # TransformerLens' is before the gain and bias, qkov's after them
            parts = hook.split(".")
            prefix = {"ln1": "ln1", "ln2": "ln2", "ln_final": "lnf"}[parts[-2]]
            gain, bias = getattr(unprocessed, f"{prefix}_w"), getattr(unprocessed, f"{prefix}_b")
            if parts[0] == "blocks":
                gain, bias = gain[int(parts[1])], bias[int(parts[1])]
            value = value * gain + bias
        _close(as_is[hook], value, hook)  # every hook TransformerLens caches
    _, own = m.run_with_cache(toks, stream="model")
    _, centred = m.run_with_cache(toks)
    for kind in ("hook_resid_pre", "hook_attn_out", "hook_mlp_out", "hook_resid_post"):
        for l in range(m.cfg.n_layers):
            hook = f"blocks.{l}.{kind}"
            _close(own[hook], theirs[hook], f"stream='model' {hook}")
            assert (centred[hook] - theirs[hook]).abs().max() > 1e-3, hook  # the default view is centred


# ------------------------------------------------------------------ the documented table
ROWS: dict[str, str] = {
    # the TransformerLens column of docs/interventions.md's table -> the test that runs the qkov call
    "HookedTransformer.from_pretrained(name)": "analysis/causal/test_patching_tl.py::test_every_transformerlens_hook_equals_the_qkov_site_of_its_name",
    "HookedTransformer.from_pretrained_no_processing(name)": "analysis/forward/test_lens.py::test_unprocessed_transformerlens_is_the_uncentred_stream",
    "model.to_tokens(text)": "analysis/forward/test_lens.py::test_text_helpers_equal_transformerlens",
    "model.to_str_tokens(text), model.to_single_token(\" Mary\"), model.to_string(toks)": "analysis/forward/test_lens.py::test_text_helpers_equal_transformerlens",
    "model(toks)": "analysis/forward/test_lens.py::test_logits_and_loss_equal_transformerlens",
    "model(toks, return_type=\"loss\")": "analysis/forward/test_lens.py::test_logits_and_loss_equal_transformerlens",
    "logits, cache = model.run_with_cache(toks)": "analysis/forward/test_lens.py::test_run_with_cache_equals_transformerlens",
    "cache[\"pattern\", 1], cache[\"blocks.1.attn.hook_z\"]": "analysis/forward/test_lens.py::test_run_with_cache_equals_transformerlens",
    "utils.get_act_name(\"resid_pre\", 3)": "analysis/forward/test_lens.py::test_run_with_cache_equals_transformerlens",
    "cache.stack_activation(\"pattern\")": "analysis/forward/test_lens.py::test_run_with_cache_equals_transformerlens",
    "model.run_with_cache(toks, names_filter=lambda n: n.endswith(\"hook_pattern\"))": "analysis/forward/test_lens.py::test_run_with_cache_name_filters_keep_what_transformerlens_keeps",
    "model.run_with_hooks(toks, fwd_hooks=[(name, fn)])": "analysis/forward/test_lens.py::test_run_with_hooks_equals_transformerlens",
    "model.run_with_hooks(toks, bwd_hooks=[(name, fn)])": "analysis/forward/test_lens.py::test_gradients_equal_transformerlens_backward_hooks",
    "model.generate(text, max_new_tokens=n, do_sample=False)": "analysis/forward/test_lens.py::test_generate_greedy_and_sampled_equal_transformerlens",
    "torch.manual_seed(s); model.generate(toks, n, top_k=k, temperature=t)": "analysis/forward/test_lens.py::test_generate_greedy_and_sampled_equal_transformerlens",
    "model.generate(toks, n, eos_token_id=e)": "analysis/forward/test_lens.py::test_generate_stops_at_the_end_token_as_transformerlens_does",
    "cache.decompose_resid(), cache.accumulated_resid(), cache.stack_head_results()": "analysis/forward/test_lens.py::test_decompositions_and_logit_attrs_with_pos_slice_equal_transformerlens",
    "cache.apply_ln_to_stack(stack, layer=-1)": "analysis/forward/test_lens.py::test_decompositions_and_logit_attrs_with_pos_slice_equal_transformerlens",
    "cache.logit_attrs(stack, answer, wrong, pos_slice=-1)": "analysis/forward/test_lens.py::test_decompositions_and_logit_attrs_with_pos_slice_equal_transformerlens",
    "patching.get_act_patch_resid_pre(model, corrupted, clean_cache, metric)": "analysis/causal/test_patching_tl.py::test_patching_sweeps_equal_transformerlens_patching",
    "patching.get_act_patch_attn_head_out_all_pos / ..._by_pos": "analysis/causal/test_patching_tl.py::test_patching_sweeps_equal_transformerlens_patching",
}


def _table_rows() -> list[str]:
    text = (ROOT / "docs" / "interventions.md").read_text(encoding="utf-8")
    section = text.split("\n## Coming from TransformerLens\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return [row.split(" | ")[0].removeprefix("| ").replace("`", "") for row in rows]


def test_every_row_of_the_transformerlens_table_is_tested() -> None:
    rows = _table_rows()
    assert len(rows) == len(ROWS), f"the table has {len(rows)} rows, ROWS {len(ROWS)}"
    for row in rows:
        assert row in ROWS, f"docs/interventions.md row {row!r} has no test in ROWS"
        file, name = ROWS[row].split("::")
        assert f"def {name}(" in (ROOT / "tests" / file).read_text(encoding="utf-8"), ROWS[row]
