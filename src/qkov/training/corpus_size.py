"""How many tokens a corpus holds and needs: the words of the errors that refuse one too short."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import QkovError

__all__ = ["check_examples", "least_tokens", "tokens", "too_short"]

if TYPE_CHECKING:
    from .data import Corpus


def tokens(n: int) -> str:
    """``1 token``, ``2,540 tokens``."""
    return f"{n:,} token" + ("" if n == 1 else "s")


def too_short(what: str, n: int, n_ctx: int) -> str:
    return (
        f"{what} holds {tokens(n)}, fewer than one example needs: an example of n_ctx {n_ctx} is the start "
        f"token and {tokens(n_ctx - 1)}"
    )


def least_tokens(n_ctx: int, val_fraction: float) -> int:
    """The fewest tokens a token file needs for a training and a validation split (its last
    ``val_fraction``) of one example of ``n_ctx`` each."""
    width = n_ctx - 1
    n = max(2 * width, int((width - 1) / val_fraction))  # at most this many short: the split holds < n f + 1
    while n - int(n * (1 - val_fraction)) < width or int(n * (1 - val_fraction)) < width:
        n += 1
    return n


def check_examples(corpus: Corpus, n_ctx: int) -> None:
    """Refuse, before training starts, a corpus whose training or validation split is shorter than
    one example of ``n_ctx``, saying how many tokens it holds and how many it would need."""
    width = n_ctx - 1
    train, val = int(corpus.train.size), int(corpus.val.size)
    if train >= width and val >= width:
        return
    f = corpus.stats.get("val_fraction")
    if f is not None:  # a token file: split by position
        split, need = f"its last {f:.0%}", f"a token file of at least {tokens(least_tokens(n_ctx, f))}"
    else:  # a text corpus: split by file
        split, need = str(corpus.stats.get("split", "by file")), f"at least {tokens(width)} in each split"
    raise QkovError(
        f"corpus: {corpus.source!r} holds {tokens(train + val)}, {train:,} for training and {val:,} for validation "
        f"({split}); an example of n_ctx {n_ctx} is the start token and {tokens(width)}, so a training and a "
        f"validation split of one example each need {need}: give a larger corpus or a shorter context (n_ctx)"
    )
