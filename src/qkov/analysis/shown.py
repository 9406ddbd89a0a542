"""How analysis results show themselves: a plain-text ``repr`` that fits one screen, and rich
HTML in a notebook.

Results inherit :class:`Shown`, which looks its formatters up by type: the text ones are
registered by :mod:`qkov.analysis.shown` (this package), the HTML ones by :mod:`qkov.show`
(which draws with the report's renderers and sits above this package, and is loaded on the first
display: :data:`LOADERS`). Without a registered HTML formatter ``_repr_html_`` returns ``None`` and a
notebook shows the text.

Functions that return several results return a :class:`Shown` dataclass with named fields (the
list-like ones give ``len`` and iteration over their items: :class:`Items`).
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Iterator
from typing import Sequence

from ..finite import finite
from ..model.tokens import token_decoder

__all__ = [
    "decoder",
    "Formatter",
    "HTML",
    "Items",
    "LOADERS",
    "MAX_ROWS",
    "more",
    "num",
    "register",
    "Shown",
    "table",
    "TEXT",
    "token",
]

Formatter = Callable[[Any], str]
TEXT: dict[type, Formatter] = {}
HTML: dict[type, Formatter] = {}
MAX_ROWS = 12  # rows a text or HTML table shows before "... N more"
LOADERS: list[Callable[[], Any]] = []
"""Run once, before the first HTML lookup: what registers the HTML formatters of a layer that loads on
first use (``import qkov`` puts the import of :mod:`qkov.show` here, so ``import qkov`` stays light)."""


def _load_html() -> None:
    """Run (and forget) the :data:`LOADERS`."""
    while LOADERS:
        LOADERS.pop(0)()


def register(table: dict[type, Formatter], *types: type) -> Callable[[Formatter], Formatter]:
    """Decorator: ``fn`` formats every one of ``types`` in ``table`` (:data:`TEXT` or :data:`HTML`)."""

    def deco(fn: Formatter) -> Formatter:
        for t in types:
            table[t] = fn
        return fn

    return deco


def _lookup(table: dict[type, Formatter], obj: Any) -> Formatter | None:
    for cls in type(obj).__mro__:
        if cls in table:
            return table[cls]
    return None


class Shown:
    """Mixin: ``repr`` from :data:`TEXT`, ``_repr_html_`` from :data:`HTML` (dataclasses using it
    pass ``repr=False`` so the dataclass does not write its own)."""

    def __repr__(self) -> str:
        fn = _lookup(TEXT, self)
        return fn(self) if fn is not None else f"<{type(self).__name__}>"

    def _repr_html_(self) -> str | None:
        _load_html()
        fn = _lookup(HTML, self)
        return None if fn is None else fn(self)

    def with_tokens(self, tokens: Any) -> Any:
        """Show token ids as strings too: ``tokens`` is a model (its ``.tokenizer``), a tokenizer,
        or a function ``id -> str``. Returns ``self``."""
        if not callable(tokens) or hasattr(tokens, "tokenizer"):
            tokens = token_decoder(getattr(tokens, "tokenizer", tokens))
        object.__setattr__(self, "decode", tokens)  # frozen dataclasses too
        return self


def decoder(obj: Any) -> Callable[[int], str] | None:
    """The ``id -> str`` function given to ``obj.with_tokens``, if any."""
    return getattr(obj, "decode", None)


class Items:
    """Mixin for a result whose items are the field named by ``ITEMS``: ``len`` and iteration go over
    them (read one by name: ``result.heads[0]``)."""

    ITEMS: ClassVar[str] = "items"

    def __len__(self) -> int:
        return len(getattr(self, self.ITEMS))

    def __iter__(self) -> Iterator[Any]:
        return iter(getattr(self, self.ITEMS))


def more(n: int, shown: int = MAX_ROWS) -> str:
    """The note under a truncated table ("" when nothing was left out)."""
    return f"... {n - shown} more" if n > shown else ""


def num(v: Any, digits: int = 3) -> str:
    """``v`` with ``digits`` decimals; ``n/a`` for None/NaN (a score that does not apply)."""
    x = finite(v)
    return "n/a" if x is None else f"{x:.{digits}f}"


def table(header: Sequence[str], rows: Sequence[Sequence[Any]], total: int | None = None) -> str:
    """Columns padded to their widest cell (first column left, others right), at most
    :data:`MAX_ROWS` rows of ``rows``; ``total`` rows exist (default ``len(rows)``)."""
    cells = [list(map(str, header))] + [list(map(str, r)) for r in rows[:MAX_ROWS]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in cells]
    note = more(len(rows) if total is None else total)
    return "\n".join(lines + ([note] if note else []))


def token(decode: Callable[[int], str] | None, i: int) -> str:
    """``id`` or ``id 'string'`` when a decoder was given."""
    return str(i) if decode is None else f"{i} {decode(i)!r}"
