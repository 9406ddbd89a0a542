"""Corpora, tokenizer, cache and deterministic batches."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from qkov import QkovError, load_corpus
from qkov.training.data import BOS_TOKEN, Batches, is_val_file, stdlib_files, val_batches


def test_stdlib_corpus_is_found_without_download() -> None:
    root, files = stdlib_files()
    assert len(files) > 500, "the running Python's standard library should hold hundreds of modules"
    assert all(f.rel.endswith(".py") for f in files)
    assert not any("site-packages" in f.rel for f in files)
    # the same files, in the same order, as every .py under the root outside installed packages
    every = [p for p in sorted(root.rglob("*.py")) if not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts)]
    assert [f.path for f in files] == every and [f.rel for f in files] == [p.relative_to(root).as_posix() for p in every]


def test_split_by_file_puts_each_file_whole_on_one_side(tmp_path: Path) -> None:
    """Each file's text lands whole in exactly one split (the one its name's hash picks), about
    val_fraction of the files go to validation, and a file keeps its side when others are added."""
    root = tmp_path / "docs"
    root.mkdir()
    for i in range(60):
        (root / f"doc{i:02d}.txt").write_text(f"zq{i:02d}xq " * 8)

    def sides(spec: Path) -> tuple[dict[str, str], object]:
        c = load_corpus(str(spec), vocab_size=300, val_fraction=0.2, cache_dir=tmp_path / "cache")
        tok = c.tokenizer()
        train, val = tok.decode(c.train.tolist()), tok.decode(c.val.tolist())
        out = {}
        for f in sorted(spec.iterdir()):
            marker = f.read_text()[:6]
            assert (marker in train) != (marker in val), f.name  # whole, on one side only
            out[f.name] = "val" if marker in val else "train"
        return out, c

    first, corpus = sides(root)
    assert {n for n, side in first.items() if side == "val"} == {n for n in first if is_val_file(n, 0.2)}
    assert 0.05 < list(first.values()).count("val") / len(first) < 0.4
    assert corpus.stats["val_files"] == list(first.values()).count("val")
    for i in range(60, 80):
        (root / f"doc{i:02d}.txt").write_text(f"zq{i:02d}xq " * 8)
    second, _ = sides(root)
    assert {n: second[n] for n in first} == first


def test_directory_corpus_tokenises_with_bos_and_caches(small_corpus: Path, tmp_path: Path) -> None:
    messages: list[str] = []
    hear = lambda what, done, total: messages.append(what)  # noqa: E731  (the progress protocol)
    c = load_corpus(str(small_corpus), vocab_size=512, progress=hear, cache_dir=tmp_path)
    tok = c.tokenizer()
    assert tok is not None and tok.token_to_id(BOS_TOKEN) == c.bos_token_id == 0
    assert c.d_vocab == 512
    assert c.train[0] == c.bos_token_id and c.val[0] == c.bos_token_id
    assert c.train.max() < 512
    # round trip: decoding the first document gives back source text
    first_doc_end = int(np.nonzero(c.train[1:] == c.bos_token_id)[0][0]) + 1
    text = tok.decode(c.train[1:first_doc_end].tolist())
    assert "def " in text or "import" in text
    assert any("training a byte-level BPE" in m for m in messages)
    # second load comes from the cache, identical
    again: list[str] = []
    c2 = load_corpus(str(small_corpus), vocab_size=512, progress=lambda w, d, n: again.append(w), cache_dir=tmp_path)
    assert any("cached" in m for m in again)
    assert np.array_equal(c.train, c2.train) and np.array_equal(c.val, c2.val)
    # a different vocabulary is a different cache entry
    c3 = load_corpus(str(small_corpus), vocab_size=300, cache_dir=tmp_path)
    assert c3.d_vocab == 300


def test_bad_utf8_and_binary_files_are_counted_not_fatal(tmp_path: Path) -> None:
    (tmp_path / "good.txt").write_text("def f(x):\n    return x + 1\n" * 200)
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 = 1\n".encode("latin-1") * 100)
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01\x02" * 100)
    (tmp_path / "empty.txt").write_text("")
    c = load_corpus(str(tmp_path), vocab_size=300)
    assert c.stats["replaced_utf8"] == 1
    assert c.stats["unreadable"] == 1
    assert c.stats["empty"] == 1
    assert c.train.size > 0 and c.val.size > 0


def test_glob_and_single_file(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("hello world " * 300)
    (tmp_path / "b.md").write_text("goodbye world " * 300)
    c = load_corpus(str(tmp_path / "*.md"), vocab_size=280)
    assert c.train.size > 0
    c1 = load_corpus(str(tmp_path / "a.md"), vocab_size=280)
    assert c1.train.size > 0 and c1.val.size > 0


@pytest.mark.parametrize("spec", ["/no/such/dir", "/no/such/*.txt"])
def test_missing_corpus_is_a_user_error(spec: str) -> None:
    with pytest.raises(QkovError, match="corpus"):
        load_corpus(spec)


def test_empty_corpus_is_a_user_error(tmp_path: Path) -> None:
    (tmp_path / "x.txt").write_text("   \n")
    with pytest.raises(QkovError, match="no non-empty"):
        load_corpus(str(tmp_path))
    empty = tmp_path / "nothing"
    empty.mkdir()
    with pytest.raises(QkovError, match="holds no files"):
        load_corpus(str(empty))


def test_pretokenised_npy_and_bin(tmp_path: Path) -> None:
    arr = np.arange(1000, dtype=np.int64) % 97
    np.save(tmp_path / "toks.npy", arr)
    c = load_corpus(str(tmp_path / "toks.npy"))
    assert c.d_vocab == 97 and c.tokenizer_json is None
    assert np.array_equal(np.concatenate([c.train, c.val]), arr)
    arr.astype(np.uint16).tofile(tmp_path / "toks.bin")
    c2 = load_corpus(str(tmp_path / "toks.bin"))
    assert np.array_equal(np.concatenate([c2.train, c2.val]), arr)
    np.save(tmp_path / "bad.npy", np.zeros((3, 3)))
    with pytest.raises(QkovError, match="1-D integer"):
        load_corpus(str(tmp_path / "bad.npy"))
    (tmp_path / "junk.npy").write_bytes(b"not numpy")
    with pytest.raises(QkovError, match="cannot read"):
        load_corpus(str(tmp_path / "junk.npy"))


def test_batches_are_a_pure_function_of_seed_and_step() -> None:
    stream = np.arange(10_000, dtype=np.uint16)
    b = Batches(stream, n_ctx=17, batch=4, seed=3, bos=0)
    x = b.step(5)
    assert x.shape == (4, 17) and (x[:, 0] == 0).all()
    # windows are contiguous slices of the stream
    assert (np.diff(x[:, 1:], axis=1) == 1).all()
    assert np.array_equal(Batches(stream, 17, 4, 3, 0).step(5), x)
    assert not np.array_equal(Batches(stream, 17, 4, 4, 0).step(5), x)
    # ranks take disjoint halves of the same global batch
    assert np.array_equal(np.concatenate([b.step(5, 0, 2), b.step(5, 1, 2)]), x)
    # one epoch visits every window exactly once
    starts = sorted(int(b.examples(i, 1)[0, 1]) for i in range(b.n_windows))
    assert starts == [w * 16 for w in range(b.n_windows)]


def test_val_batches_shape_and_errors() -> None:
    v = val_batches(np.arange(100, dtype=np.uint16), n_ctx=11, bos=0, max_examples=4)
    assert v.shape == (4, 11) and (v[:, 0] == 0).all()
    # a stream shorter than one window is one sequence of its own length, the start token first
    short = val_batches(np.arange(1, 6, dtype=np.uint16), n_ctx=11, bos=7, max_examples=4)
    assert short.tolist() == [[7, 1, 2, 3, 4, 5]]
    with pytest.raises(QkovError, match=r"^the text holds no tokens$"):
        val_batches(np.zeros(0, dtype=np.uint16), n_ctx=11, bos=0, max_examples=4, what="the text")
