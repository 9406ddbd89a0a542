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
