"""Loading without copies: a Hugging Face directory's parameters are views of its files, mapped
copy-on-write (editing or training the model never changes the files), equal to the stored
tensors; ``Weights.from_model`` folds and centres its own copies in place with the numbers of the
out-of-place methods; the NaN check still reads every tensor, strided views included."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from qkov import QkovError, Weights
from qkov.io import load_hf

transformers = pytest.importorskip("transformers", reason="transformers is a test extra: pip install -e '.[dev]'")
linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self (Linux)")


def _neox(folder: Path, hidden: int = 32, vocab: int = 96, tied: bool = False) -> Path:
    torch.manual_seed(0)
    cfg = transformers.GPTNeoXConfig(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=4, intermediate_size=2 * hidden,
        max_position_embeddings=64, rotary_pct=0.25, initializer_range=0.15, tie_word_embeddings=tied,
    )  # fmt: skip
    transformers.GPTNeoXForCausalLM(cfg).save_pretrained(folder)
    return folder


def _mapped(path: Path) -> list[tuple[int, int]]:
    """The address ranges at which this process maps ``path`` (from /proc/self/maps)."""
    out = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and Path(parts[5]) == path.resolve():
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            out.append((lo, hi))
    return out


def _rss_anon_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    raise AssertionError("no RssAnon in /proc/self/status")


def _by_hand(path: Path, H: int) -> dict[str, torch.Tensor]:
    """The qkov tensors of a NeoX file, rearranged here from the stored ones (a reference)."""
    sd = load_file(str(path / "model.safetensors"))
    out = {"W_E": sd["gpt_neox.embed_in.weight"], "W_U": sd["embed_out.weight"].T}
    for l in range(2):
        h = f"gpt_neox.layers.{l}."
        qkv = sd[h + "attention.query_key_value.weight"]  # rows ordered (head, q/k/v, d_head)
        D = qkv.shape[1]
        e = D // H
        for i, n in enumerate("QKV"):
            rows = [qkv[(hd * 3 + i) * e : (hd * 3 + i + 1) * e] for hd in range(H)]
            out[f"blocks.{l}.attn.W_{n}"] = torch.stack([r.T for r in rows])
        dense = sd[h + "attention.dense.weight"]  # [D, H * e]: head hd's columns hd*e ...
        out[f"blocks.{l}.attn.W_O"] = torch.stack([dense[:, hd * e : (hd + 1) * e].T for hd in range(H)])
        out[f"blocks.{l}.mlp.W_in"] = sd[h + "mlp.dense_h_to_4h.weight"].T
        out[f"blocks.{l}.mlp.W_out"] = sd[h + "mlp.dense_4h_to_h.weight"].T
        out[f"blocks.{l}.ln1.w"] = sd[h + "input_layernorm.weight"]
    return out


@linux
def test_parameters_are_views_of_the_mapped_file(tmp_path: Path) -> None:
    folder = _neox(tmp_path / "neox")
    model = load_hf(folder)
    ranges = _mapped(folder / "model.safetensors")
    assert ranges, "the weights file is not mapped"
    state = model.state_dict()
    for name, t in state.items():
        inside = any(lo <= t.data_ptr() < hi for lo, hi in ranges)
        assert inside == (name != "b_U"), name  # b_U is not in the file (zeros)
    for name, want in _by_hand(folder, 4).items():
        assert torch.equal(state[name], want), name


@linux
def test_loading_does_not_copy(tmp_path: Path) -> None:
    """Private (anonymous) memory grows by far less than the file: nothing was copied out of the map."""
    folder = _neox(tmp_path / "neox", hidden=128, vocab=8192)  # a file of ~10 MB
    size_kib = (folder / "model.safetensors").stat().st_size // 1024
    before = _rss_anon_kib()
    model = load_hf(folder)
    grew = _rss_anon_kib() - before
    assert grew < size_kib / 4, (grew, size_kib)
    assert model.W_E.shape == (8192, 128)


def test_a_tied_unembedding_is_a_parameter_of_its_own(tmp_path: Path) -> None:
    model = load_hf(_neox(tmp_path / "tied", tied=True))
    assert torch.equal(model.W_U, model.W_E.T)
    assert model.W_U.data_ptr() != model.W_E.data_ptr()
    with torch.no_grad():
        model.W_U.zero_()
    assert model.W_E.abs().sum() > 0


def test_editing_and_training_never_touch_the_file(tmp_path: Path) -> None:
    folder = _neox(tmp_path / "neox")
    digest = hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()
    model = load_hf(folder)
    first = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.blocks[0].attn.W_Q.add_(1.0)  # a strided view of the fused Q/K/V
        model.W_E[3] = 7.0
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tokens = torch.randint(0, 96, (2, 16))
    loss = torch.nn.functional.cross_entropy(model(tokens)[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    opt.step()
    assert not torch.equal(model.W_U, first["W_U"])  # trained
    assert hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest() == digest
    again = load_hf(folder).state_dict()
    assert all(torch.equal(again[k], first[k]) for k in first)


def test_a_non_finite_value_in_a_strided_view_is_refused(tmp_path: Path) -> None:
    folder = _neox(tmp_path / "neox")
    sd = load_file(str(folder / "model.safetensors"))
    name = "gpt_neox.layers.1.attention.query_key_value.weight"
    for bad in (float("nan"), float("inf"), -float("inf")):
        t = sd[name].clone()
        t[40, 5] = bad  # inside head 1's K rows: W_K is a strided view of this tensor
        save_file({**sd, name: t}, str(folder / "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(QkovError, match="holds NaN or infinite values"):
            load_hf(folder)


def test_from_model_in_place_equals_the_methods(tmp_path: Path) -> None:
    """The in-place folding and centring of ``from_model`` give the numbers of the public
    (out-of-place) methods applied one after another, and leave the model as it was."""
    model = load_hf(_neox(tmp_path / "neox"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    w = Weights.from_model(model)
    raw = Weights.from_model(model, fold_ln=False, center_writing=False, center_unembed=False)
    raw_copy = {k: v.clone() for k, v in vars(raw).items() if isinstance(v, torch.Tensor)}
    stepwise = raw.fold_ln().center_writing_weights().center_unembed()
    for k, v in vars(w).items():
        other = getattr(stepwise, k)
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, other), k
        elif k != "tokenizer":
            assert v == other, k
    assert all(torch.equal(getattr(raw, k), v) for k, v in raw_copy.items())  # the methods copy
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
