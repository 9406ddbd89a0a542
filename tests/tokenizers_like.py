"""Tokenizers shaped like the real ones, built offline with ``tokenizers``: what a Llama-family
``tokenizer.json`` looks like (SentencePiece-style BPE with ``▁`` spaces, 256 byte-fallback pieces,
``<unk>``/``<s>``/``</s>``, a post-processor that adds ``<s>`` itself), and a GPT-2-style byte-level
BPE that adds nothing. Tests compare qkov's texts with what ``transformers`` makes of the same
directory.

``llama_tokenizer(style="llama2")`` is the classic layout (a ``Prepend("▁")`` + ``Replace`` normalizer,
no pre-tokenizer, a ``Replace/ByteFallback/Fuse/Strip`` decoder); ``style="metaspace"`` the newer one
(a ``Metaspace`` pre-tokenizer and decoder). ``adds_bos=False`` drops the post-processor.
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path
from typing import Any

STORY = (
    "Once upon a time, there was a little girl named Lily. Lily had a red ball. "
    "She liked to play with Tim in the park. One day, Tim said: \"Lily, can I play with your ball?\" "
    "Lily said yes, and they played all day. When the sun went down, Tim gave the ball back to Lily.\n"
)


def training_texts(n_files: int = 8) -> list[str]:
    """Some English stories and some standard-library sources, the same on every machine."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:n_files]
    return [STORY] * 200 + [f.read_text(encoding="utf-8", errors="replace") for f in files]


def llama_tokenizer(
    vocab_size: int = 512, *, style: str = "llama2", adds_bos: bool = True, texts: list[str] | None = None
) -> Any:
    """A Llama-family tokenizer of ``vocab_size`` ids: 0 ``<unk>``, 1 ``<s>``, 2 ``</s>``, 3-258 the
    byte pieces ``<0x00>``-``<0xFF>``, then ``▁``-prefixed BPE pieces trained on ``texts``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    specials = ["<unk>", "<s>", "</s>"]
    first = len(specials) + 256
    trainer_tok = Tokenizer(models.BPE())
    trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    trainer_tok.train_from_iterator(
        texts if texts is not None else training_texts(),
        trainers.BpeTrainer(vocab_size=vocab_size - first, show_progress=False),
    )
    raw = json.loads(trainer_tok.to_str())["model"]
    vocab = {t: i for i, t in enumerate(specials)}
    vocab.update({f"<0x{b:02X}>": len(specials) + b for b in range(256)})
    for piece, _ in sorted(raw["vocab"].items(), key=lambda kv: kv[1]):
        if piece not in vocab and len(vocab) < vocab_size:
            vocab[piece] = len(vocab)
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in raw["merges"]]
    merges = [m for m in merges if m[0] in vocab and m[1] in vocab and m[0] + m[1] in vocab]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    if style == "llama2":
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
    elif style == "metaspace":
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
        tok.decoder = decoders.Sequence(
            [decoders.ByteFallback(), decoders.Metaspace(replacement="▁", prepend_scheme="first", split=False)]
        )
    else:
        raise ValueError(f"unknown style {style!r}")
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in specials])
    if adds_bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
        )
    return tok


def gpt2_tokenizer(vocab_size: int = 400, texts: list[str] | None = None) -> Any:
    """A GPT-2-style byte-level BPE with ``<|endoftext|>`` as its last id, adding nothing to a text."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.train_from_iterator(
        texts if texts is not None else training_texts(),
        trainers.BpeTrainer(
            vocab_size=vocab_size - 1, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
        ),
    )
    tok.add_special_tokens([AddedToken("<|endoftext|>", normalized=False, special=True)])
    return tok


def write_tokenizer(folder: Path, tok: Any, *, family: str = "llama", add_bos_token: bool | None = None) -> Path:
    """Save ``tok`` as ``tokenizer.json`` with a ``tokenizer_config.json`` as the Hub's directories
    carry (``LlamaTokenizer`` for the Llama family, ``GPT2Tokenizer`` for GPT-2)."""
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    if family == "gpt2":
        cfg: dict[str, Any] = {"tokenizer_class": "GPT2Tokenizer", "bos_token": "<|endoftext|>",
                               "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}
    else:
        cfg = {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    if add_bos_token is not None:
        cfg["add_bos_token"] = add_bos_token
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return folder
