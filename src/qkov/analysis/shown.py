"""How analysis results show themselves: a plain-text ``repr`` that fits one screen, and rich
HTML in a notebook.

Results inherit :class:`Shown`, which looks its formatters up by type: the text ones are
registered by :mod:`qkov.analysis.reprs` (this package), the HTML ones by :mod:`qkov.show`
(which draws with the report's renderers and sits above this package, and is loaded on the first
display: :data:`LOADERS`). Without a registered HTML formatter ``_repr_html_`` returns ``None`` and a
notebook shows the text.

Functions that return several results return a :class:`Shown` dataclass with named fields (the
list-like ones keep ``len``, iteration and, deprecated, indexing: :class:`ListAccess`; the one that was a
``dict``, :class:`CompositionScores`, keeps its views and, deprecated, indexing).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterator

from ..deprecated import warn_renamed

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


class ListAccess:
    """Mixin for a result that was a ``list`` subclass before qkov 1.0 and is now a dataclass whose
    items are the field named by ``ITEMS``: ``len`` and iteration still go over the items (silently),
    indexing and slicing too, with a ``DeprecationWarning`` naming the field, until 1.1."""

    ITEMS: ClassVar[str] = "items"

    def __len__(self) -> int:
        return len(getattr(self, self.ITEMS))

    def __iter__(self) -> Iterator[Any]:
        return iter(getattr(self, self.ITEMS))

    def __getitem__(self, i: Any) -> Any:
        name = type(self).__name__
        warn_renamed(f"indexing a {name}", f"{name}.{self.ITEMS}[...]")
        return getattr(self, self.ITEMS)[i]


@dataclass(repr=False, eq=False)
class CopyingScores(ListAccess, Shown):
    """What :func:`~qkov.analysis.circuits.copying_scores` returns: ``heads``, one
    :class:`~qkov.analysis.circuits.HeadCopying` per head in layer-major order, and ``k``, the top-k of
    the diagonal rate (``None`` when it was skipped)."""

    ITEMS: ClassVar[str] = "heads"
    heads: list[Any] = field(default_factory=list)
    k: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"k": self.k, "heads": [c.to_dict() for c in self.heads]}


@dataclass(repr=False, eq=False)
class SkipTrigrams(ListAccess, Shown):
    """What :func:`~qkov.analysis.trigrams.skip_trigrams` returns: ``trigrams``, the
    :class:`~qkov.analysis.trigrams.SkipTrigram` list of head ``head`` (``"layer.head"``), strongest first."""

    ITEMS: ClassVar[str] = "trigrams"
    trigrams: list[Any] = field(default_factory=list)
    head: str = ""
    left_out: str = ""  # which tokens the search left out ("the start token, 3 special ... left out")

    def to_dict(self, decode: Callable[[int], str] | None = None) -> dict[str, Any]:
        """``decode`` (``id -> str``; default: the one given to :meth:`with_tokens`) adds token strings."""
        d = decode or decoder(self)
        return {"head": self.head, "left_out": self.left_out, "trigrams": [t.to_dict(d) for t in self.trigrams]}


@dataclass(repr=False, eq=False)
class Bigrams(ListAccess, Shown):
    """What :func:`~qkov.analysis.trigrams.bigrams` returns: ``bigrams``, the
    :class:`~qkov.analysis.trigrams.Bigram` list, strongest first."""

    ITEMS: ClassVar[str] = "bigrams"
    bigrams: list[Any] = field(default_factory=list)
    left_out: str = ""  # which tokens the table left out

    def to_dict(self, decode: Callable[[int], str] | None = None) -> dict[str, Any]:
        """``decode`` (``id -> str``; default: the one given to :meth:`with_tokens`) adds token strings."""
        d = decode or decoder(self)
        return {"left_out": self.left_out, "bigrams": [b.to_dict(d) for b in self.bigrams]}


@dataclass(repr=False, eq=False)
class CompositionScores(Shown):
    """What :func:`~qkov.analysis.composition.composition_scores` returns: ``kinds``, one
    :class:`~qkov.analysis.composition.Composition` per kind asked for (``"q"``, ``"k"``, ``"v"``), also
    read as ``.q``, ``.k``, ``.v`` (``None`` when that kind was not asked for). ``keys()``, ``values()``,
    ``items()``, ``len``, ``in`` and iteration go over ``kinds``; indexing (a ``dict`` before qkov 1.0)
    still works with a ``DeprecationWarning`` naming ``kinds``, until 1.1."""

    kinds: dict[str, Any] = field(default_factory=dict)

    @property
    def q(self) -> Any:
        return self.kinds.get("q")

    @property
    def k(self) -> Any:
        return self.kinds.get("k")

    @property
    def v(self) -> Any:
        return self.kinds.get("v")

    def keys(self) -> Any:
        return self.kinds.keys()

    def values(self) -> Any:
        return self.kinds.values()

    def items(self) -> Any:
        return self.kinds.items()

    def __len__(self) -> int:
        return len(self.kinds)

    def __iter__(self) -> Iterator[str]:
        return iter(self.kinds)

    def __contains__(self, kind: object) -> bool:
        return kind in self.kinds

    def __getitem__(self, kind: str) -> Any:
        warn_renamed("indexing a CompositionScores", f"CompositionScores.kinds[{kind!r}] (or .{kind})")
        return self.kinds[kind]

    def to_dict(self) -> dict[str, Any]:
        return {kind: c.to_dict() for kind, c in self.kinds.items()}


def more(n: int, shown: int = MAX_ROWS) -> str:
    """The note under a truncated table ("" when nothing was left out)."""
    return f"... {n - shown} more" if n > shown else ""
