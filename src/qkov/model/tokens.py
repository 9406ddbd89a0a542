"""Token ids in and token strings out: the checks every entry point applies to ids, and the one
codec of texts (:class:`TextCodec`: a text to ids with exactly one start token, an id to a readable
string, which ids are ordinary text tokens, a word to its one token)."""

from __future__ import annotations

import re
from typing import Any, Callable

import torch
from torch import Tensor

from ..errors import QkovError
from .config import ModelConfig

__all__ = [
    "check_tokens",
    "is_text",
    "left_out_tokens",
    "source_codec",
    "SPACE_PIECE",
    "text_codec",
    "TextCodec",
    "token_decoder",
]


def check_tokens(tokens: Tensor | Any, cfg: ModelConfig) -> Tensor:
    """Validate token ids for ``cfg`` and return them as a ``[batch, seq]`` long tensor.

    Accepts ``[seq]`` or ``[batch, seq]`` integers (a tensor, array or nested list).

    Raises:
        QkovError: not integers, wrong rank, empty, longer than ``n_ctx``, or an id outside
            ``[0, d_vocab)``.
    """
    if not isinstance(tokens, Tensor):
        try:
            tokens = torch.as_tensor(tokens)
        except (TypeError, ValueError) as exc:
            raise QkovError(f"tokens: expected integer ids, got {type(tokens).__name__}") from exc
    if tokens.dtype.is_floating_point or tokens.dtype == torch.bool or tokens.is_complex():
        raise QkovError(f"tokens: expected integer ids, got dtype {tokens.dtype}")
    if tokens.ndim == 1:
        tokens = tokens[None]
    if tokens.ndim != 2:
        raise QkovError(f"tokens: expected shape [batch, seq] or [seq], got {tuple(tokens.shape)}")
    if tokens.shape[1] == 0:
        raise QkovError("tokens: empty sequence")
    if tokens.shape[1] > cfg.n_ctx:
        raise QkovError(f"tokens: sequence of {tokens.shape[1]} is longer than n_ctx={cfg.n_ctx}")
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0 or hi >= cfg.d_vocab:
        bad = lo if lo < 0 else hi
        raise QkovError(f"tokens: id {bad} out of range [0, {cfg.d_vocab})")
    return tokens.long()


def token_decoder(tokenizer: Any | None) -> Callable[[int], str]:
    """``decode(id) -> str`` for one token: its readable string (:meth:`TextCodec.token_str`:
    SentencePiece's ``▁`` a space, byte tokens by name, special tokens kept), or ``"<id>"`` when
    there is no tokenizer."""
    if tokenizer is None:
        return lambda i: f"<{int(i)}>"
    return text_codec(tokenizer, 0).token_str


# --------------------------------------------------------------------------- texts
def is_text(value: Any) -> bool:
    """Whether ``value`` is a text or a non-empty list (or tuple) of texts, not token ids."""
    return isinstance(value, str) or (
        isinstance(value, (list, tuple)) and bool(value) and all(isinstance(t, str) for t in value)
    )


SPACE_PIECE = "\u2581"  # "▁": SentencePiece's space, the first character of a word's piece
_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def _decoder_spec(tokenizer: Any) -> str:
    """The tokenizer's decoder as its JSON text ("" when it has none)."""
    dec = getattr(tokenizer, "decoder", None)
    if dec is None:
        return ""
    try:
        state = dec.__getstate__()
    except Exception:  # noqa: BLE001 - a decoder without a serialisable state: assume none of the known kinds
        return ""
    return state.decode("utf-8", errors="replace") if isinstance(state, bytes) else str(state)


def _added_around(tokenizer: Any) -> tuple[list[int], list[int]]:
    """The ids the tokenizer's post-processor adds before and after a text: ``([1], [])`` for a
    Llama-style ``<s> $A`` template, ``([], [])`` for GPT-2's byte-level processor."""
    with_special = tokenizer.encode("a", add_special_tokens=True).ids
    plain = tokenizer.encode("a", add_special_tokens=False).ids
    n = len(plain)
    for k in range(len(with_special) - n + 1):
        if with_special[k : k + n] == plain:
            return with_special[:k], with_special[k + n :]
    return [], []  # a processor that rewrites the text's own ids: nothing recognisably added


class TextCodec:
    """A tokenizer as qkov reads text with it: the one place where a text becomes ids and an id
    becomes a readable string.

    * **One start token, decided once.** :meth:`encode` asks the tokenizer for the text's ids
      without any special token, then puts the start token ``bos`` first when ``prepend_bos`` is
      true: never two, whatever the tokenizer's post-processor adds (a Llama-style
      ``tokenizer.json`` adds ``<s>`` itself; GPT-2's adds nothing). ``prepend_bos=None`` is the
      model's default (:attr:`default_prepend_bos`).
    * **Readable tokens.** :meth:`token_str` keeps SentencePiece's ``▁`` as a space and byte-fallback
      tokens as their ``<0x0A>`` names (a piece decoded alone loses its leading space); byte-level
      (GPT-2-style) tokens decode as the tokenizer decodes them.
    * **Ordinary tokens.** :meth:`ordinary` marks the ids that are neither special (added special
      tokens, the unknown token), nor byte-fallback pieces, nor beyond the tokenizer's vocabulary
      (a model's padded rows): what vocabulary-wide tables and random-token probes draw from.
    * **Words.** :meth:`single_token` resolves a word with or without its leading space to one token,
      or says what it splits into.
    """

    def __init__(self, tokenizer: Any, bos: int, *, default_prepend_bos: bool = True) -> None:
        self.tokenizer = tokenizer
        before, after = _added_around(tokenizer)
        # the tokenizer's own start token is the one its model read texts with
        self.bos: int = int(before[-1]) if before else int(bos)
        self.tokenizer_adds_bos: bool = bool(before)
        self.tokenizer_adds_eos: bool = bool(after)
        self.default_prepend_bos = bool(default_prepend_bos)
        spec = _decoder_spec(tokenizer)
        self.sentencepiece: bool = SPACE_PIECE in spec or "\\u2581" in spec or '"Metaspace"' in spec
        self._strings: dict[int, str] = {}
        self._ordinary: dict[int, Tensor] = {}

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer knows (with its added tokens)."""
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    # ---------------------------------------------------------------- text -> ids
    def encode(self, text: str, *, prepend_bos: bool | None = None) -> list[int]:
        """``text`` -> ids: the tokenizer's ids of the text alone, the start token first when
        ``prepend_bos`` (``None``: :attr:`default_prepend_bos`)."""
        if not isinstance(text, str):
            raise QkovError(f"expected a text (str), got {type(text).__name__}")
        ids = list(self.tokenizer.encode(text, add_special_tokens=False).ids)
        if self.default_prepend_bos if prepend_bos is None else prepend_bos:
            ids.insert(0, self.bos)
        return ids

    def encode_texts(self, text: Any, *, prepend_bos: bool | None = None, where: str = "to_tokens") -> Tensor:
        """A text -> ``[1, seq]``, a list of texts of equal token counts -> ``[batch, seq]`` (each as
        :meth:`encode`); ``where`` names the caller in the one-line error for anything else."""
        texts = [text] if isinstance(text, str) else list(text) if isinstance(text, (list, tuple)) else []
        if not texts or not all(isinstance(t, str) for t in texts):
            raise QkovError(f"{where}: expected a text or a list of texts, got {type(text).__name__}")
        rows = [self.encode(t, prepend_bos=prepend_bos) for t in texts]
        lengths = sorted({len(r) for r in rows})
        if len(lengths) > 1:
            raise QkovError(f"{where}: the texts have different token counts {lengths}; give them one at a time")
        return torch.tensor(rows, dtype=torch.long)

    def plain(self, text: str) -> list[int]:
        """The ids of ``text`` with no start token."""
        return self.encode(text, prepend_bos=False)

    # ---------------------------------------------------------------- ids -> strings
    def token_str(self, i: int) -> str:
        """One token as a reader should see it (cached per id): a SentencePiece ``▁`` is a space,
        a byte-fallback piece keeps its ``<0xNN>`` name, a special token its name."""
        i = int(i)
        s = self._strings.get(i)
        if s is None:
            piece = self.tokenizer.id_to_token(i)
            if piece is None:
                s = f"<{i}>"
            elif self.sentencepiece and not _BYTE_PIECE.fullmatch(piece):
                s = piece.replace(SPACE_PIECE, " ")
            elif self.sentencepiece:
                s = piece
            else:
                s = self.tokenizer.decode([i], skip_special_tokens=False)
            self._strings[i] = s
        return s

    def str_tokens(self, ids: Any) -> list[str]:
        """:meth:`token_str` of each id of a ``[seq]`` (or ``[1, seq]``) sequence."""
        flat = torch.as_tensor(ids).reshape(-1).tolist()
        return [self.token_str(i) for i in flat]

    def decode(self, ids: Any) -> str:
        """A sequence of ids as the tokenizer decodes it (special tokens kept)."""
        return self.tokenizer.decode([int(i) for i in torch.as_tensor(ids).reshape(-1).tolist()], skip_special_tokens=False)

    # ---------------------------------------------------------------- which ids
    def special_ids(self) -> list[int]:
        """Added special tokens and the unknown token."""
        ids = {int(i) for i, t in self.tokenizer.get_added_tokens_decoder().items() if getattr(t, "special", False)}
        unk = getattr(self.tokenizer.model, "unk_token", None)
        if unk is not None and self.tokenizer.token_to_id(unk) is not None:
            ids.add(int(self.tokenizer.token_to_id(unk)))
        return sorted(ids)

    def byte_ids(self) -> list[int]:
        """Byte-fallback pieces (``<0x00>`` ... ``<0xFF>``) of a tokenizer that falls back to bytes."""
        if not (self.sentencepiece or getattr(self.tokenizer.model, "byte_fallback", False)):
            return []
        return sorted(int(i) for p, i in self.tokenizer.get_vocab(with_added_tokens=False).items() if _BYTE_PIECE.fullmatch(p))

    def known(self, d_vocab: int) -> Tensor:
        """``[d_vocab]`` bool: the ids the tokenizer has a token for (a model's padded rows past its
        vocabulary, or the gaps of a sparse one, have none)."""
        mask = torch.zeros(d_vocab, dtype=torch.bool)
        ids = torch.tensor([i for i in self.tokenizer.get_vocab(with_added_tokens=True).values() if i < d_vocab])
        if ids.numel():
            mask[ids] = True
        return mask

    def ordinary(self, d_vocab: int) -> Tensor:
        """``[d_vocab]`` bool: ids that are ordinary text tokens (known to the tokenizer, not special,
        not byte fallback)."""
        mask = self._ordinary.get(d_vocab)
        if mask is None:
            mask = self.known(d_vocab)
            drop = [i for i in (*self.special_ids(), *self.byte_ids()) if i < d_vocab]
            mask[drop] = False
            self._ordinary[d_vocab] = mask
        return mask.clone()

    # ---------------------------------------------------------------- words
    def _one(self, spelling: str) -> int | None:
        """The id ``spelling`` is as one token: the text the tokenizer encodes to a single id, else
        the vocabulary piece of that name (``▁Tim``, ``ĠTim``, ``<0x0A>``)."""
        ids = self.plain(spelling)
        if len(ids) == 1:
            return ids[0]
        piece = self.tokenizer.token_to_id(spelling.replace(" ", SPACE_PIECE) if self.sentencepiece else spelling)
        return None if piece is None else int(piece)

    def single_token(self, word: str) -> int:
        """The one token that ``word`` is: as typed (a text the tokenizer makes one token of, with
        SentencePiece's own leading ``▁``; or a piece named as in the vocabulary, ``▁Tim`` or
        ``<0x0A>``), else the word with a leading space, else without one.

        Raises:
            QkovError: no spelling is one token; the message shows how it splits.
        """
        if not isinstance(word, str) or not word:
            raise QkovError(f"expected a word (a non-empty str), got {word!r}")
        bare = word.strip() or word
        for spelling in dict.fromkeys([word, " " + bare, bare]):
            found = self._one(spelling)
            if found is not None:
                return found
        splits = " / ".join(
            "[" + ", ".join(repr(t) for t in self.str_tokens(self.plain(w))) + "]" for w in dict.fromkeys([word, " " + bare])
        )
        raise QkovError(f"{word!r} is not one token: it splits into {splits}; give a token id instead")


_CODECS: dict[tuple[int, int, bool], tuple[Any, TextCodec]] = {}


def text_codec(tokenizer: Any, bos: int, *, default_prepend_bos: bool | None = None) -> TextCodec:
    """The :class:`TextCodec` of ``tokenizer`` with start token ``bos`` (made once per tokenizer
    object and kept while it lives). ``default_prepend_bos=None`` means true."""
    prepend = True if default_prepend_bos is None else bool(default_prepend_bos)
    key = (id(tokenizer), int(bos), prepend)
    hit = _CODECS.get(key)
    if hit is None or hit[0] is not tokenizer:
        if len(_CODECS) > 64:
            _CODECS.clear()
        hit = (tokenizer, TextCodec(tokenizer, bos, default_prepend_bos=prepend))
        _CODECS[key] = hit
    return hit[1]


def source_codec(source: Any, *, where: str = "text") -> TextCodec:
    """The codec of anything that carries ``tokenizer`` and ``bos_token_id`` (a model, a weights
    view, a lazy checkpoint), with its ``default_prepend_bos``.

    Raises:
        QkovError: the source has no tokenizer.
    """
    tok = getattr(source, "tokenizer", None)
    if tok is None:
        raise QkovError(f"{where}: this model has no tokenizer (give token ids instead)")
    bos = getattr(source, "bos_token_id", None)
    return text_codec(tok, 0 if bos is None else int(bos), default_prepend_bos=getattr(source, "default_prepend_bos", None))


def left_out_tokens(source: Any, d_vocab: int) -> tuple[tuple[int, ...], str]:
    """The ids a vocabulary-wide table or a random-token probe leaves out by default, and how to say
    it: the source's start token and, when it carries a tokenizer, every id that is not an ordinary
    text token (:meth:`TextCodec.ordinary`: special tokens, byte-fallback pieces, ids past the
    tokenizer's vocabulary). ``((), "")`` for a source with neither."""
    bos = getattr(source, "bos_token_id", None)
    tok = getattr(source, "tokenizer", None)
    ids = set() if bos is None else {int(bos)}
    if tok is None:
        return tuple(sorted(ids)), ("the start token left out" if ids else "")
    codec = text_codec(tok, 0 if bos is None else int(bos))
    special = {i for i in codec.special_ids() if i < d_vocab} - ids
    byte = {i for i in codec.byte_ids() if i < d_vocab}
    unknown = set((~codec.known(d_vocab)).nonzero().squeeze(-1).tolist()) - ids
    ids |= special | byte | unknown
    parts = ["the start token"] if bos is not None else []
    parts += [f"{len(special)} special"] if special else []
    parts += [f"{len(byte)} byte-fallback"] if byte else []
    parts += [f"{len(unknown):,} unknown to the tokenizer (padding)"] if unknown else []
    return tuple(sorted(ids)), ", ".join(parts) + " tokens left out" if len(parts) > 1 else parts[0] + " left out"
