"""Corpora and the tokenizer: text files -> byte-level BPE -> a cached token stream.

Corpus sources (the ``--corpus`` value):

* ``stdlib`` (default): the ``.py`` files of the running Python's standard library
  (no download; every machine that runs qkov has them), site-packages excluded.
* a directory (all files below it), a glob (``'notes/**/*.md'``) or one text file.
* a pre-tokenised file: ``.npy`` (1-D integer array) or ``.bin`` (raw uint16, as
  nanoGPT writes). A ``tokenizer.json`` beside it is used when present.

Text corpora are split into train / validation **by file**, deterministically: a
file goes to validation when the first byte of the SHA-1 of its relative path is
below ``256 * val_fraction``. Token files are split by position (the last
``val_fraction`` of the stream). Documents are joined with the start token
``<|bos|>``, and every training example begins with it.
"""

from __future__ import annotations

import glob as globlib
import hashlib
import io
import json
import os
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ..errors import QkovError
from ..io.atomic import atomic_write_bytes, atomic_write_text
from ..progress import Progress, tick
from .corpus_size import tokens, too_short

__all__ = [
    "Batches",
    "BOS_TOKEN",
    "Corpus",
    "CORPUS_STEPS",
    "default_cache_dir",
    "is_val_file",
    "load_corpus",
    "read_texts",
    "split_texts",
    "stdlib_files",
    "TextFile",
    "TOKENIZER_VERSION",
    "train_tokenizer",
    "val_batches",
]

BOS_TOKEN = "<|bos|>"
TOKENIZER_VERSION = 1  # bump when the tokenizer recipe changes (invalidates caches)
CORPUS_STEPS = 3  # what load_corpus reports: reading the files, training the tokenizer, tokenising


@dataclass
class TextFile:
    path: Path
    rel: str


@dataclass
class Corpus:
    """A tokenised corpus: train and validation token streams and the tokenizer."""

    train: np.ndarray  # [n_train_tokens] uint16/int32
    val: np.ndarray  # [n_val_tokens]
    tokenizer_json: str | None
    bos_token_id: int
    d_vocab: int
    source: str
    stats: dict = field(default_factory=dict)
    vocab_trained: bool = False  # the tokenizer was trained here, to the vocabulary size asked for

    def tokenizer(self) -> Tokenizer | None:
        if self.tokenizer_json is None:
            return None
        return Tokenizer.from_str(self.tokenizer_json)


def default_cache_dir() -> Path:
    env = os.environ.get("QKOV_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "qkov"


def stdlib_files() -> tuple[Path, list[TextFile]]:
    root = Path(sysconfig.get_paths()["stdlib"]).resolve()
    found = []
    for folder, dirs, names in os.walk(root):  # installed packages pruned, not walked (1.9 s -> 0.04 s here)
        dirs[:] = [d for d in dirs if d not in ("site-packages", "dist-packages")]
        found += [Path(folder) / n for n in names if n.endswith(".py")]
    return root, [TextFile(p, p.relative_to(root).as_posix()) for p in sorted(found)]


def _text_files(spec: str) -> tuple[Path, list[TextFile]]:
    if spec == "stdlib":
        return stdlib_files()
    path = Path(spec)
    if path.is_dir():
        root = path.resolve()
        found = sorted(
            p for p in root.rglob("*") if p.is_file() and not any(s.startswith(".") for s in p.relative_to(root).parts)
        )
        return root, [TextFile(p, p.relative_to(root).as_posix()) for p in found]
    if path.is_file():
        return path.resolve().parent, [TextFile(path.resolve(), path.name)]
    matches = sorted(Path(m).resolve() for m in globlib.glob(spec, recursive=True) if Path(m).is_file())
    if not matches:
        raise QkovError(f"corpus: {spec!r} is not a file, a directory, a glob that matches files, or 'stdlib'")
    root = Path(os.path.commonpath([str(m.parent) for m in matches]))
    return root, [TextFile(m, m.relative_to(root).as_posix()) for m in matches]


def is_val_file(rel: str, val_fraction: float) -> bool:
    return hashlib.sha1(rel.encode()).digest()[0] < 256 * val_fraction


def read_texts(files: list[TextFile]) -> tuple[list[tuple[str, str]], dict]:
    """Decode files as UTF-8; bad bytes become U+FFFD and the file is counted, never a crash."""
    texts: list[tuple[str, str]] = []
    stats = {"files": 0, "bytes": 0, "replaced_utf8": 0, "unreadable": 0, "empty": 0}
    for f in files:
        try:
            raw = f.path.read_bytes()
        except OSError:
            stats["unreadable"] += 1
            continue
        if b"\x00" in raw[:8192]:  # binary file: skip, count
            stats["unreadable"] += 1
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = raw.decode("utf-8", errors="replace")
            stats["replaced_utf8"] += 1
        if not text.strip():
            stats["empty"] += 1
            continue
        stats["files"] += 1
        stats["bytes"] += len(raw)
        texts.append((f.rel, text))
    return texts, stats


def split_texts(texts: list[tuple[str, str]], val_fraction: float) -> tuple[list[str], list[str], str]:
    """Training and validation documents, and how they were split.

    By file (:func:`is_val_file`) when that leaves both sides a file; with several files but
    one side empty, one file is moved across; a single file is split inside its text (the last
    ``val_fraction`` of it is validation).
    """
    train = [t for rel, t in texts if not is_val_file(rel, val_fraction)]
    val = [t for rel, t in texts if is_val_file(rel, val_fraction)]
    if train and val:
        return train, val, "by file"
    if len(texts) > 1:
        moved = texts[-1][0]
        if not val:
            return train[:-1], train[-1:], f"the last file ({moved}) held out for validation"
        return val[-1:], val[:-1], f"the last file ({moved}) moved to training"
    only = texts[0][1]
    cut = int(len(only) * (1 - val_fraction))
    return [only[:cut]], [only[cut:]], f"one file: its last {val_fraction:.0%} is validation"


def _fingerprint(files: list[TextFile]) -> str:
    h = hashlib.sha256()
    for f in files:
        st = f.path.stat()
        h.update(f"{f.rel}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def train_tokenizer(
    texts: list[str], vocab_size: int, *, start: str = BOS_TOKEN, alphabet: list[str] | None = None
) -> Tokenizer:
    """Byte-level BPE (GPT-2 style) trained on ``texts``, with ``start`` (default ``<|bos|>``) as token 0.

    ``alphabet`` replaces the 256 byte symbols the merges start from (tests use a few
    characters to get a tiny vocabulary); with the full byte alphabet the vocabulary
    must hold at least 258 tokens.
    """
    if alphabet is None and vocab_size < 257 + 1:
        raise QkovError(f"vocab: a byte-level BPE needs at least 258 tokens, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[start],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet() if alphabet is None else alphabet,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def _encode_stream(tok: Tokenizer, texts: list[str], bos: int) -> np.ndarray:
    """Documents joined by the start token: ``[bos] doc0 [bos] doc1 ...``."""
    dtype = np.uint16 if tok.get_vocab_size() <= 65536 else np.int32
    parts: list[np.ndarray] = []
    batch = 64
    for i in range(0, len(texts), batch):
        for enc in tok.encode_batch(texts[i : i + batch]):
            parts.append(np.array([bos], dtype=dtype))
            parts.append(np.asarray(enc.ids, dtype=dtype))
    if not parts:
        return np.zeros(0, dtype=dtype)
    return np.concatenate(parts)


def load_corpus(
    spec: str = "stdlib",
    *,
    vocab_size: int = 2048,
    val_fraction: float = 0.05,
    cache_dir: Path | None = None,
    progress: Progress | None = None,
) -> Corpus:
    """Load (or build and cache) a tokenised corpus. See the module docstring for ``spec``.

    ``progress(what, done, total)`` (:class:`qkov.progress.Progress`) hears each step of building
    it, ``what`` saying what is being done."""
    say = lambda what, done=0: tick(progress, what, done, CORPUS_STEPS)  # noqa: E731
    if not 0.0 < val_fraction < 0.5:
        raise QkovError(f"val_fraction must be in (0, 0.5), got {val_fraction}")
    if spec.endswith((".npy", ".bin")):
        return _load_token_file(Path(spec), val_fraction)
    root, files = _text_files(spec)
    if not files:
        raise QkovError(f"corpus: {spec!r} holds no files")
    key_src = json.dumps(
        {
            "v": TOKENIZER_VERSION,
            "root": str(root),
            "files": _fingerprint(files),
            "vocab": vocab_size,
            "val": val_fraction,
        }
    )
    key = hashlib.sha256(key_src.encode()).hexdigest()[:16]
    cdir = (cache_dir or default_cache_dir()) / f"corpus-{key}"
    meta_path = cdir / "meta.json"
    if meta_path.exists():
        try:
            meta = json.loads(meta_path.read_text())
            train = np.load(cdir / "train.npy", allow_pickle=False)
            val = np.load(cdir / "val.npy", allow_pickle=False)
            tok_json = (cdir / "tokenizer.json").read_text()
            say(f"corpus: cached tokens from {cdir}", CORPUS_STEPS)
            return Corpus(train, val, tok_json, meta["bos_token_id"], meta["d_vocab"], spec, meta["stats"], True)
        except (OSError, ValueError, KeyError, json.JSONDecodeError):
            say("corpus: cache unreadable, rebuilding")
    say(f"corpus: reading {len(files)} files under {root}")
    texts, stats = read_texts(files)
    if not texts:
        raise QkovError(f"corpus: {spec!r} holds no non-empty text files")
    train_docs, val_docs, how = split_texts(texts, val_fraction)
    stats["split"] = how
    if how != "by file":
        say(f"corpus: too few files to split by file: {how}", 1)
    say(f"corpus: training a byte-level BPE tokenizer (vocab {vocab_size}) on {len(train_docs)} files", 1)
    tok = train_tokenizer(train_docs, vocab_size)
    bos = tok.token_to_id(BOS_TOKEN)
    say("corpus: tokenising", 2)
    train = _encode_stream(tok, train_docs, bos)
    val = _encode_stream(tok, val_docs, bos)
    stats.update(
        train_files=len(train_docs), val_files=len(val_docs), train_tokens=int(train.size), val_tokens=int(val.size)
    )
    meta = {"bos_token_id": bos, "d_vocab": tok.get_vocab_size(), "stats": stats, "source": spec}
    cdir.mkdir(parents=True, exist_ok=True)
    _save_npy(cdir / "train.npy", train)
    _save_npy(cdir / "val.npy", val)
    atomic_write_text(cdir / "tokenizer.json", tok.to_str())
    atomic_write_text(meta_path, json.dumps(meta, indent=1))  # written last: marks the cache complete
    return Corpus(train, val, tok.to_str(), bos, tok.get_vocab_size(), spec, stats, True)


def _save_npy(path: Path, arr: np.ndarray) -> None:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    atomic_write_bytes(path, buf.getvalue())


def _load_token_file(path: Path, val_fraction: float) -> Corpus:
    if not path.is_file():
        raise QkovError(f"corpus: token file {str(path)!r} not found")
    try:
        if path.suffix == ".npy":
            arr = np.load(path, allow_pickle=False, mmap_mode="r")
        else:
            size = path.stat().st_size
            if size % 2 or size == 0:
                raise QkovError(
                    f"corpus: token file {str(path)!r} has {size:,} byte(s), not a whole number of token ids: a .bin "
                    "token file is a raw stream of uint16 ids, 2 bytes each"
                )
            arr = np.memmap(path, dtype=np.uint16, mode="r")
    except (ValueError, OSError) as exc:
        raise QkovError(f"corpus: cannot read token file {str(path)!r}: {exc}") from None
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise QkovError(f"corpus: token file must hold a 1-D integer array, got {arr.dtype} {arr.shape}")
    if arr.size < 16:
        raise QkovError(f"corpus: token file {str(path)!r} holds only {tokens(arr.size)}")
    arr = np.asarray(arr)
    if int(arr.min()) < 0:
        raise QkovError("corpus: token file holds negative ids")
    tok_path = path.parent / "tokenizer.json"
    tok_json = tok_path.read_text() if tok_path.is_file() else None
    bos = 0
    d_vocab = int(arr.max()) + 1
    if tok_json is not None:
        try:
            tok = Tokenizer.from_str(tok_json)
        except Exception as exc:  # tokenizers raises its own Exception type
            raise QkovError(f"corpus: {str(tok_path)!r} beside the token file is not a tokenizer ({exc})") from None
        found = tok.token_to_id(BOS_TOKEN)
        bos = 0 if found is None else found
        d_vocab = max(d_vocab, tok.get_vocab_size())
    cut = int(arr.size * (1 - val_fraction))
    stats = {"train_tokens": cut, "val_tokens": int(arr.size - cut), "val_fraction": val_fraction}
    return Corpus(arr[:cut], arr[cut:], tok_json, bos, d_vocab, str(path), stats)


class Batches:
    """Deterministic training batches: a pure function of ``(seed, step)``.

    The train stream is cut into non-overlapping windows of ``n_ctx - 1`` tokens;
    each epoch visits them in a permutation seeded by ``(seed, epoch)``; each example
    is ``[bos] + window``. Step ``s`` takes global examples ``s*batch .. (s+1)*batch``,
    so resuming needs only the step number, and ranks of a distributed run can take
    disjoint slices of the same global batch.
    """

    def __init__(self, stream: np.ndarray, n_ctx: int, batch: int, seed: int, bos: int) -> None:
        self.stream = stream
        self.width = n_ctx - 1
        self.n_windows = len(stream) // self.width
        if self.n_windows < 1:
            raise QkovError(f"corpus: {too_short('the training split', len(stream), n_ctx)}")
        self.batch = batch
        self.seed = seed
        self.bos = bos
        self._perm_epoch = -1
        self._perm: np.ndarray | None = None

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)
            self._perm_epoch = epoch
        assert self._perm is not None
        return self._perm

    def examples(self, start: int, count: int) -> np.ndarray:
        """Global examples ``start .. start+count`` as ``[count, n_ctx]`` int64."""
        out = np.empty((count, self.width + 1), dtype=np.int64)
        out[:, 0] = self.bos
        for i in range(count):
            g = start + i
            epoch, j = divmod(g, self.n_windows)
            w = int(self._permutation(epoch)[j])
            out[i, 1:] = self.stream[w * self.width : (w + 1) * self.width]
        return out

    def step(self, step: int, rank: int = 0, world: int = 1) -> np.ndarray:
        """This rank's share ``[batch // world, n_ctx]`` of global step ``step``."""
        per = self.batch // world
        return self.examples(step * self.batch + rank * per, per)


def val_batches(
    stream: np.ndarray, n_ctx: int, bos: int, max_examples: int, *, what: str = "corpus: the validation split"
) -> np.ndarray:
    """Fixed examples of ``stream``, each starting with bos: evenly spaced windows ``[n, n_ctx]``,
    or, for a stream shorter than one window, the whole stream as one sequence ``[1, len + 1]``
    (a one-paragraph text is analysed at its own length, as TransformerLens runs it). ``what``
    names the stream in the error when it holds no token."""
    width = n_ctx - 1
    n = len(stream) // width
    if len(stream) == 0:
        raise QkovError(f"{what} holds no tokens")
    if n < 1:
        return np.concatenate([[bos], np.asarray(stream, dtype=np.int64)]).astype(np.int64)[None]
    idx = np.linspace(0, n - 1, num=min(n, max_examples)).astype(np.int64)
    out = np.empty((len(idx), n_ctx), dtype=np.int64)
    out[:, 0] = bos
    for i, w in enumerate(idx):
        out[i, 1:] = stream[w * width : (w + 1) * width]
    return out
