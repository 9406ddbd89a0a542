"""Calls that a method of the model hands to a package above :mod:`qkov.model`.

``Transformer.run_with_cache`` and ``Transformer.run_with_hooks`` (TransformerLens' habits) run the
analysis forward, which lives in :mod:`qkov.analysis`: a later package in the layer order
(errors < ... < model < ... < weights < analysis, tests/test_layout.py), which :mod:`qkov.model` may not
import. So the implementation is written once, in :mod:`qkov.analysis.forward.lens`, as plain functions of any
weights source; that module registers them here when it is imported, and the model's methods are
thin: they look their implementation up by name and call it with the model. ``import qkov`` imports
:mod:`qkov.analysis` (and so does importing any ``qkov.*`` module: Python runs the package's
``__init__`` first), so by the time a user holds a model its methods are registered; :func:`call`
still refuses in one line if they are not.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

from ..errors import QkovError

__all__ = ["call", "CALLS", "register"]

F = TypeVar("F", bound=Callable[..., Any])

CALLS: dict[str, Callable[..., Any]] = {}
"""Method name -> the function that implements it (first argument: the model)."""


def register(name: str) -> Callable[[F], F]:
    """Decorator: ``fn`` implements the model method ``name`` (``fn(model, ...)``)."""

    def deco(fn: F) -> F:
        CALLS[name] = fn
        return fn

    return deco


def call(name: str, model: Any, *args: Any, **kwargs: Any) -> Any:
    """Run the registered implementation of method ``name`` on ``model``.

    Raises:
        QkovError: nothing registered ``name`` (the analysis package was never imported).
    """
    fn = CALLS.get(name)
    if fn is None:
        raise QkovError(f"model.{name} is implemented by qkov.analysis, which is not loaded: import qkov first")
    return fn(model, *args, **kwargs)
