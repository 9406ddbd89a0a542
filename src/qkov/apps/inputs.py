"""The text an analysis runs on: a user's file, or the validation split of the corpus a
checkpoint was trained on, as ``[batch, n_ctx]`` token ids starting with the start token."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..errors import QkovError
from ..io.checkpoint import read_config
from ..io.sources import source_kind
from ..model.transformer import Transformer
from ..training.data import Corpus, load_corpus, val_batches


def analysis_text(
    ckpt: Path, model: Transformer, text: Path | None, batch: int, *, want_corpus: bool = False
) -> tuple[torch.Tensor, np.ndarray | None]:
    """``[batch, n_ctx]`` token ids from ``text`` (with the model's tokenizer) or from the
    validation split of the checkpoint's training corpus, and the training split's token
    counts ``[d_vocab]`` (``None`` without a corpus).

    With ``text`` the corpus is loaded only when ``want_corpus`` (e.g. for token frequencies),
    and then only if it can be: loading may mean tokenising the whole corpus.

    Raises:
        QkovError: no text and no recorded corpus (hint ``text``), a text but no tokenizer, or
            an unreadable file.
    """
    corpus: Corpus | None = None
    training = read_config(ckpt).get("training", {}) if source_kind(ckpt) == "qkov" else {}
    spec = training.get("corpus")
    if spec and (text is None or want_corpus):
        try:
            val_fraction = training.get("config", {}).get("val_fraction", 0.05)
            corpus = load_corpus(spec, vocab_size=model.cfg.d_vocab, val_fraction=val_fraction)
        except QkovError:
            if text is None:
                raise
    if text is not None:
        if model.tokenizer is None:
            raise QkovError("a text file needs a model with a tokenizer")
        try:
            ids = model.tokenizer.encode(text.read_text(encoding="utf-8", errors="replace")).ids
        except OSError as exc:
            raise QkovError(f"cannot read the text {str(text)!r} ({exc.strerror})") from None
        stream = np.asarray(ids, dtype=np.int64)
    elif corpus is not None:
        stream = corpus.val
    else:
        raise QkovError("the checkpoint records no training corpus to take text from", hint="text")
    freqs = None if corpus is None else np.bincount(np.asarray(corpus.train), minlength=model.cfg.d_vocab)
    return torch.from_numpy(val_batches(stream, model.cfg.n_ctx, model.bos_token_id, batch)), freqs
