"""Renamed public names keep working for one release: the old name warns and hands out the new one.

Every rename of a public name (listed in the CHANGELOG's table) goes through this module, so an old
name always says the same thing: ``DeprecationWarning: qkov.run is deprecated: use qkov.trace (the
old name is removed in 1.1)``.

* :func:`module_getattr` — a PEP 562 module ``__getattr__`` for names moved or renamed in a module;
* :func:`renamed_property` — an old attribute name of a result that reads the new one;
* :func:`warn_renamed` — the warning itself (for a module that moved: its old path imports the new).
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Mapping

REMOVED_IN = "1.1"
"""The release that removes the old names of this one."""


def warn_renamed(old: str, new: str, *, stacklevel: int = 3) -> None:
    """Warn (``DeprecationWarning``) that ``old`` is now ``new``."""
    warnings.warn(
        f"{old} is deprecated: use {new} (the old name is removed in {REMOVED_IN})",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


def module_getattr(module: str, renamed: Mapping[str, tuple[str, Callable[[], Any]]]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that serves old names: ``renamed[old] = (new name, get the object)``.

    Accessing ``module.old`` (or ``from module import old``) warns and returns the object under its
    new name; any other missing name raises the usual ``AttributeError``.
    """

    def __getattr__(name: str) -> Any:
        if name in renamed:
            new, get = renamed[name]
            warn_renamed(f"{module}.{name}", new)
            return get()
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__


def renamed_property(old: str, new: str, owner: str) -> property:
    """A read-only attribute ``owner.old`` that warns and reads ``owner.new``."""

    def get(self: Any) -> Any:
        warn_renamed(f"{owner}.{old}", f"{owner}.{new}")
        return getattr(self, new)

    return property(get, doc=f"Deprecated: the old name of :attr:`{new}` (removed in {REMOVED_IN}).")


class DictAccess:
    """Mixin for a result that was a JSON-like ``dict`` before qkov 1.0 and is now a dataclass with
    ``to_dict()``: ``result["key"]`` (and ``get``, ``in``, ``keys``, iteration over the keys) still
    reads the JSON form, warning with the attribute to use instead, until :data:`REMOVED_IN`."""

    def _old_json(self, key: str, stacklevel: int = 4) -> Any:
        name = type(self).__name__
        new = f"{name}.{key} (or .to_dict()[{key!r}] for the JSON form)"
        warn_renamed(f"{name}[{key!r}]", new, stacklevel=stacklevel)
        return self.to_dict()[key]  # type: ignore[attr-defined]

    def __getitem__(self, key: str) -> Any:
        return self._old_json(key)

    def get(self, key: str, default: Any = None) -> Any:
        """Deprecated: read the attribute (or ``to_dict()``)."""
        return self._old_json(key) if key in self.to_dict() else default  # type: ignore[attr-defined]

    def __contains__(self, key: object) -> bool:
        return key in self.to_dict()  # type: ignore[attr-defined]

    def keys(self) -> Any:
        """Deprecated: the keys of ``to_dict()``."""
        warn_renamed(f"{type(self).__name__}.keys()", f"{type(self).__name__}.to_dict().keys()")
        return self.to_dict().keys()  # type: ignore[attr-defined]

    def __iter__(self) -> Any:
        warn_renamed(f"iterating over a {type(self).__name__}", f"{type(self).__name__}.to_dict()")
        return iter(self.to_dict())  # type: ignore[attr-defined]
