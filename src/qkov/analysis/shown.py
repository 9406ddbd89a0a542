"""How analysis results show themselves: a plain-text ``repr`` that fits one screen, and rich
HTML in a notebook.

Results inherit :class:`Shown`, which looks its formatters up by type: the text ones are
registered by :mod:`qkov.analysis.reprs` (this package), the HTML ones by :mod:`qkov.show`
(which draws with the report's renderers and sits above this package, and is loaded on the first
display: :data:`LOADERS`). Without a registered HTML formatter ``_repr_html_`` returns ``None`` and a
notebook shows the text.

Functions that return several results return a :class:`Shown` container — a ``list`` or
``dict`` subclass, so existing code that indexes or iterates them is unchanged.
"""

from __future__ import annotations

from typing import Any, Callable

from ..model.tokens import token_decoder

Formatter = Callable[[Any], str]
TEXT: dict[type, Formatter] = {}
HTML: dict[type, Formatter] = {}
MAX_ROWS = 12  # rows a text or HTML table shows before "... N more"
LOADERS: list[Callable[[], Any]] = []
"""Run once, before the first HTML lookup: what registers the HTML formatters of a layer that loads on
first use (``import qkov`` puts the import of :mod:`qkov.show` here, so ``import qkov`` stays light)."""


def load_html() -> None:
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
        load_html()
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


class CopyingScores(Shown, list):
    """The list of :class:`~qkov.analysis.circuits.HeadCopying` that
    :func:`~qkov.analysis.circuits.copying_scores` returns; ``k`` is the top-k of the diagonal rate."""

    def __init__(self, items: Any = (), k: int | None = None) -> None:
        super().__init__(items)
        self.k = k


class CompositionScores(Shown, dict):
    """``{kind: Composition}`` as :func:`~qkov.analysis.composition.composition_scores` returns it."""


class SkipTrigrams(Shown, list):
    """The :class:`~qkov.analysis.trigrams.SkipTrigram` list of head ``head`` (``"layer.head"``),
    strongest first, as :func:`~qkov.analysis.trigrams.skip_trigrams` returns it."""

    def __init__(self, items: Any = (), head: str = "") -> None:
        super().__init__(items)
        self.head = head


class Bigrams(Shown, list):
    """The :class:`~qkov.analysis.trigrams.Bigram` list :func:`~qkov.analysis.trigrams.bigrams` returns."""


def more(n: int, shown: int = MAX_ROWS) -> str:
    """The note under a truncated table ("" when nothing was left out)."""
    return f"... {n - shown} more" if n > shown else ""
