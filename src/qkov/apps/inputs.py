"""The tokens an analysis runs on, and what they are.

In order of preference: token ids the user gives (a ``.npy`` array, a raw uint16 ``.bin``
file, or a text file of whitespace-separated integers), a text file encoded with the model's
tokenizer, the validation split of the corpus a qkov checkpoint was trained on, or, for a model
with none of these (an imported model without a tokenizer or corpus), seeded random tokens.
Random tokens serve the detectors that only need attention patterns; the in-context-learning
score, which needs text with structure, is left out on them, and every output says which
tokens it used.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..analysis.causal.metrics import parse_metric
from ..analysis.heads.probes import default_icl_examples, random_ids, token_pool
from ..analysis.series.measures import Sample
from ..errors import QkovError
from ..io.checkpoint import read_config
from ..io.sources import source_kind
from ..model.tokens import source_codec
from ..model.transformer import Transformer
from ..training.data import Corpus, load_corpus, val_batches

__all__ = [
    "analysis_inputs",
    "AnalysisInput",
    "patching_inputs",
    "patching_pair",
    "PatchingInputs",
    "random_tokens",
    "read_sequences",
    "read_token_file",
    "sample_for",
    "TEXT_SEQUENCES",
    "text_windows",
]

TEXT_SEQUENCES = 16  # validation sequences for the loss, per-token losses and previous-token scores of a Sample


@dataclass
class AnalysisInput:
    """``tokens [batch, <= n_ctx]`` (start token first), the training split's token counts
    ``[d_vocab]`` (``None`` without a corpus), what the tokens are (``source``, for outputs), and
    whether they are natural text (``False`` for seeded random tokens)."""

    tokens: torch.Tensor
    frequencies: np.ndarray | None
    source: str
    natural: bool = True


def read_token_file(path: Path, d_vocab: int) -> np.ndarray:
    """Token ids from ``path``: ``.npy`` (a 1-D stream or 2-D ``[sequences, positions]`` integer
    array), ``.bin`` (a raw uint16 stream, as nanoGPT writes) or text of whitespace-separated
    integers (one sequence per line when the lines have equal lengths, else one stream).

    Raises:
        QkovError: unreadable, empty, not integers, or an id outside ``[0, d_vocab)``.
    """
    where = f"token file {str(path)!r}"
    try:
        if path.suffix == ".npy":
            arr = np.load(path, allow_pickle=False)
        elif path.suffix == ".bin":
            arr = np.fromfile(path, dtype=np.uint16)
        else:
            lines = [line.split() for line in path.read_text().splitlines() if line.strip()]
            rows = [[int(x) for x in line] for line in lines]
            same = len({len(r) for r in rows}) == 1 and len(rows) > 1
            arr = np.array(rows if same else [x for r in rows for x in r], dtype=np.int64)
    except OSError as exc:
        raise QkovError(f"cannot read the {where} ({exc.strerror})") from None
    except ValueError as exc:
        raise QkovError(f"{where}: expected integer token ids ({exc})") from None
    if not np.issubdtype(arr.dtype, np.integer) or arr.ndim not in (1, 2) or arr.size == 0:
        raise QkovError(f"{where}: expected a 1-D or 2-D array of integer ids, got {arr.dtype} {arr.shape}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= d_vocab:
        raise QkovError(f"{where}: id {lo if lo < 0 else hi} out of range [0, {d_vocab})")
    return arr.astype(np.int64)


def random_tokens(
    d_vocab: int, n_ctx: int, batch: int, *, bos: int, seed: int = 0, model: Transformer | None = None
) -> torch.Tensor:
    """``[batch, n_ctx]`` seeded uniform random ids, the start token ``bos`` first and never elsewhere;
    with a ``model`` that has a tokenizer, drawn from its ordinary text tokens only
    (:func:`~qkov.analysis.heads.probes.token_pool`)."""
    g = torch.Generator().manual_seed(seed)
    pool = None if model is None else token_pool(model, d_vocab, bos)
    if pool is None:
        ids = torch.randint(0, max(1, d_vocab - 1), (batch, n_ctx), generator=g)
        ids = ids + (ids >= bos).long()  # skip the start token's id
    else:
        ids = random_ids(pool, 0, d_vocab, (batch, n_ctx), g)
    ids[:, 0] = bos
    return ids


def _shape(seqs: torch.Tensor, n_ctx: int) -> str:
    """How the tokens were cut, for the ``source`` line: ``8 sequences of 64 tokens`` or, for a
    text shorter than the context, ``one sequence of 31 tokens (its own length; the context is 64)``."""
    B, T = seqs.shape
    if T < n_ctx and B == 1:
        return f"one sequence of {T} tokens (its own length; the context is {n_ctx})"
    return f"{B} sequence{'s' if B != 1 else ''} of {T} tokens"


def text_windows(ids: list[int] | np.ndarray, model: Transformer, batch: int) -> tuple[torch.Tensor, str]:
    """A text's ids (no start token) as the sequences the model reads, and what they cover.

    Consecutive windows from the start, each of ``n_ctx`` tokens with the start token first (when the
    model prepends one: :attr:`~qkov.Transformer.default_prepend_bos`), at most ``batch`` of them; a
    text shorter than one window is one sequence of its own length. The note says what was not read
    (``"381 of 474 tokens read; the last 93 not read: 3 windows of 127 text tokens (context 128)"``)."""
    ids = np.asarray(ids, dtype=np.int64)
    bos = model.bos_token_id if model.default_prepend_bos else None
    start = [] if bos is None else [bos]
    width = model.cfg.n_ctx - len(start)
    if len(ids) == 0:
        raise QkovError("the text holds no tokens")
    n = min(len(ids) // width, batch) if len(ids) > width else 1
    if len(ids) <= width:
        return torch.tensor([[*start, *ids.tolist()]], dtype=torch.long), f"all {len(ids):,} tokens read"
    rows = np.stack([np.concatenate([start, ids[i * width : (i + 1) * width]]) for i in range(n)]).astype(np.int64)
    read = n * width
    if read == len(ids):
        return torch.from_numpy(rows), f"all {len(ids):,} tokens read"
    why = f"{n} window{'s' if n != 1 else ''} of {width} text tokens (context {model.cfg.n_ctx})"
    if n == batch and len(ids) // width > batch:
        why += f"; at most {batch} sequences are read (batch)"
    return torch.from_numpy(rows), f"{read:,} of {len(ids):,} tokens read; the last {len(ids) - read:,} not read: {why}"


def _sequences(arr: np.ndarray, model: Transformer, batch: int, where: str) -> torch.Tensor:
    """``[batch, T]`` sequences of ``arr``: a 2-D array's rows as given; a 1-D stream cut into
    context-length windows, each started with the start token, or one sequence of its own length
    (start token first) when it is shorter than one window (:func:`~qkov.training.data.val_batches`)."""
    if arr.ndim == 2:
        if arr.shape[1] > model.cfg.n_ctx:
            raise QkovError(f"{where}: sequences of {arr.shape[1]} tokens are longer than n_ctx={model.cfg.n_ctx}")
        return torch.from_numpy(arr[:batch])
    return torch.from_numpy(val_batches(arr, model.cfg.n_ctx, model.bos_token_id, batch, what=where))


def _corpus(ckpt: Path, model: Transformer, needed: bool) -> Corpus | None:
    """The corpus a qkov checkpoint was trained on; ``None`` when it records none (or, when not
    ``needed``, when it cannot be loaded)."""
    training = read_config(ckpt).get("training", {}) if source_kind(ckpt) == "qkov" else {}
    spec = training.get("corpus")
    if not spec:
        return None
    try:
        val_fraction = training.get("config", {}).get("val_fraction", 0.05)
        return load_corpus(spec, vocab_size=model.cfg.d_vocab, val_fraction=val_fraction)
    except QkovError:
        if needed:
            raise
        return None


def analysis_inputs(
    ckpt: Path,
    model: Transformer,
    *,
    text: Path | None = None,
    tokens: Path | None = None,
    batch: int = 8,
    want_corpus: bool = False,
    seed: int = 0,
) -> AnalysisInput:
    """The ``batch`` sequences an analysis of ``model`` (loaded from ``ckpt``) runs on; see the
    module docstring for the order of preference. With ``text`` or ``tokens`` the corpus is
    loaded only when ``want_corpus`` (for token frequencies), and then only if it can be.

    Raises:
        QkovError: both ``text`` and ``tokens``; a text but no tokenizer; an unreadable file; a
            recorded corpus that cannot be loaded when it is the only source of text.
    """
    if text is not None and tokens is not None:
        raise QkovError("give either a text file or a token file, not both")
    given = text is not None or tokens is not None
    corpus = _corpus(ckpt, model, needed=not given) if (want_corpus or not given) else None
    freqs = None if corpus is None else np.bincount(np.asarray(corpus.train), minlength=model.cfg.d_vocab)
    if tokens is not None:
        arr = read_token_file(tokens, model.cfg.d_vocab)
        seqs = _sequences(arr, model, batch, f"token file {str(tokens)!r}")
        return AnalysisInput(seqs, freqs, f"token ids from {tokens}: {_shape(seqs, model.cfg.n_ctx)}")
    if text is not None:
        if model.tokenizer is None:
            raise QkovError("a text file needs a model with a tokenizer (give token ids instead)")
        try:
            ids = source_codec(model).plain(text.read_text(encoding="utf-8", errors="replace"))
        except OSError as exc:
            raise QkovError(f"cannot read the text {str(text)!r} ({exc.strerror})") from None
        if not ids:
            raise QkovError(f"text {str(text)!r} holds no tokens")
        seqs, covered = text_windows(ids, model, batch)
        return AnalysisInput(seqs, freqs, f"text from {text}: {_shape(seqs, model.cfg.n_ctx)} ({covered})")
    if corpus is not None:
        seqs = torch.from_numpy(val_batches(corpus.val, model.cfg.n_ctx, model.bos_token_id, batch))
        return AnalysisInput(seqs, freqs, f"validation split of the training corpus ({corpus.source})")
    seqs = random_tokens(model.cfg.d_vocab, model.cfg.n_ctx, batch, bos=model.bos_token_id, seed=seed, model=model)
    which = "" if model.tokenizer is None else ", ordinary text tokens only"
    return AnalysisInput(
        seqs, None, f"seeded random tokens (seed {seed}{which}): no text, token ids or training corpus given",
        natural=False,
    )


def sample_for(origin: Path, model: Transformer, *, text: Path | None, tokens: Path | None, seed: int) -> Sample:
    """The fixed tokens ``model`` (loaded from ``origin``) is measured on: the validation text of
    the corpus ``origin`` records (or a given text / token file); with none, seeded random tokens,
    on which loss, ICL and previous-token scores are left out. Serves ``qkov dynamics`` and ``qkov ablate``."""
    n_icl = default_icl_examples(model.cfg)
    inp = analysis_inputs(
        origin, model, text=text, tokens=tokens, batch=max(TEXT_SEQUENCES, n_icl), want_corpus=True, seed=seed
    )
    bos, freqs = model.bos_token_id, inp.frequencies
    if not inp.natural:
        return Sample(None, None, bos, seed, inp.source + " (loss, ICL and previous-token left out)", freqs)
    ids = inp.tokens
    return Sample(ids[:TEXT_SEQUENCES], ids[:n_icl], bos, seed, inp.source, freqs)


def read_sequences(path: Path, model: Any) -> torch.Tensor:
    """The sequences of a patching input ``path``: a token file as :func:`read_token_file` reads it
    (``.npy``, ``.bin``, or text made only of integers; a 1-D stream is one sequence, ids as given),
    else text with one sequence per non-empty line, each encoded with the tokenizer of ``model`` (a model
    or a weights view: anything with ``cfg``, ``tokenizer`` and ``bos_token_id``) and started with its
    start token. ``[sequences, tokens]``; one-line errors for lines of different lengths or sequences
    longer than the context."""
    where = f"{str(path)!r}"
    try:
        raw = path.read_bytes() if path.suffix not in (".npy", ".bin") else b""
    except OSError as exc:
        raise QkovError(f"cannot read {where} ({exc.strerror})") from None
    lines = [ln for ln in raw.decode("utf-8", errors="replace").splitlines() if ln.strip()]
    numeric = all(all(t.lstrip("-").isdigit() for t in ln.split()) for ln in lines)
    if path.suffix in (".npy", ".bin") or (lines and numeric):
        arr = read_token_file(path, model.cfg.d_vocab)
        seqs = [arr] if arr.ndim == 1 else list(arr)
    elif not lines:
        raise QkovError(f"{where} is empty")
    elif model.tokenizer is None:
        raise QkovError(f"{where} is text, and the model has no tokenizer: give token ids (.npy, .bin or integers)")
    else:
        codec = source_codec(model)
        seqs = [np.asarray(codec.encode(ln), dtype=np.int64) for ln in lines]
    lengths = sorted({len(s) for s in seqs})
    if len(lengths) > 1:
        raise QkovError(f"{where}: every sequence must have the same number of tokens; got lengths {lengths}")
    if lengths[0] > model.cfg.n_ctx:
        raise QkovError(f"{where}: sequences of {lengths[0]} tokens are longer than the context ({model.cfg.n_ctx})")
    return torch.from_numpy(np.stack(seqs))


def patching_pair(clean: Path, corrupted: Path, model: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The clean and corrupted sequences of ``qkov patch`` (:func:`read_sequences`; ``model``: a model or a
    weights view), checked to have the same shape."""
    a, b = read_sequences(clean, model), read_sequences(corrupted, model)
    if a.shape != b.shape:
        shown = ""
        if a.shape[0] == b.shape[0] and model.tokenizer is not None:  # say how the first sequences split
            words = [source_codec(model).str_tokens(x[0])[1:] for x in (a, b)]
            shown = "; they split as " + " vs ".join(repr("|".join(w)) for w in words)
        raise QkovError(
            f"the clean and corrupted inputs must have the same number of sequences and tokens: "
            f"{list(a.shape)} vs {list(b.shape)} (sequences x tokens){shown}"
        )
    return a, b


@dataclass
class PatchingInputs:
    """A clean/corrupted pair read (and its metric parsed) before the analysis, so bad input fails first."""

    clean: torch.Tensor
    corrupted: torch.Tensor
    metric: Any
    decode: Any
    names: tuple[str, str]


def patching_inputs(model: Any, clean: Path, corrupted: Path, metric: str | None, device: Any) -> PatchingInputs:
    """The pair (:func:`patching_pair`) on ``device``, its metric parsed (token strings through the
    tokenizer of ``model``, a model or a weights view) and a decoder for position labels: what ``qkov patch``
    and the report read."""
    c, x = patching_pair(clean, corrupted, model)
    codec = None if model.tokenizer is None else source_codec(model)
    m = parse_metric(metric, c.to(device), codec, model.cfg.d_vocab)
    decode = None if codec is None else codec.token_str
    return PatchingInputs(c.to(device), x.to(device), m, decode, (str(clean), str(corrupted)))
