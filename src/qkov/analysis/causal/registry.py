"""The registry of sweeps: what a patching study runs, and what every surface shows.

A :class:`Sweep` names one causal method as a study runs it: its ``name`` (the ``method`` its
results carry), a one-line ``summary``, the :class:`Option` s it reads (each a keyword of
:func:`~qkov.analysis.causal.studies.patch_study`, a flag of ``qkov patch`` and an argument of the
explorer's ``patch`` view, all made from the one declaration), ``when`` it runs (a function of the
options), ``run`` (the results it adds to the study) and, optionally, ``needs`` (the sites its run reads
from the study's two recordings, :class:`Needs`: the study then records the base and source runs once, with
every sweep's sites, and the sweeps share them). :func:`register_sweep` adds one to
:data:`SWEEPS`; the study, ``qkov patch``, the report, the explorer and the notebook iterate it, so
adding a causal method is one module and one registration (docs/dev/plugging-in.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from ...errors import QkovError
from ...progress import Progress
from .contrast import Contrast
from .result import PatchResult

__all__ = ["Needs", "Option", "register_sweep", "study_options", "StudyRun", "Sweep", "SWEEPS"]


@dataclass(frozen=True)
class Option:
    """One setting of a sweep: ``name`` (the study's keyword; the flag ``--name`` with dashes unless
    ``flag`` says otherwise), its ``default``, ``help``, and ``read``: the value from the command line's
    text or the explorer's JSON value (``None``: a switch, ``True`` or ``False``; a switch on by default
    is written ``--no-name``). ``choices``: the values allowed, if few."""

    name: str
    default: Any
    help: str
    read: Callable[[Any], Any] | None = None
    flag: str | None = None
    choices: tuple[str, ...] = ()
    metavar: str | None = None

    @property
    def switch(self) -> bool:
        return self.read is None

    @property
    def cli_flag(self) -> str:
        """The command-line flag: ``--by-pos``, or ``--no-attribution`` for a switch on by default."""
        if self.flag is not None:
            return self.flag
        dashed = self.name.replace("_", "-")
        return f"--no-{dashed}" if self.switch and self.default else f"--{dashed}"

    def value(self, given: Any) -> Any:
        """``given`` (text, or a JSON value) as this option's value; a one-line :class:`QkovError`."""
        if self.switch:
            if not isinstance(given, bool):
                raise QkovError(f"{self.name}: expected true or false, got {given!r}")
            return given
        value = self.read(given)  # type: ignore[misc]
        if self.choices and value not in self.choices:
            raise QkovError(f"{self.name}: expected one of {', '.join(self.choices)}, got {given!r}")
        return value


@dataclass
class StudyRun:
    """What a sweep's ``run`` gets: the study's :class:`~qkov.analysis.causal.contrast.Contrast`
    (checked, not yet run: each method runs what it needs), every option's value, the results of
    the sweeps before it, the agreement table (``{site: r}``) it may add to, and ``progress``."""

    contrast: Contrast
    options: dict[str, Any]
    results: list[PatchResult] = field(default_factory=list)
    agreement: dict[str, float] = field(default_factory=dict)
    progress: Progress | None = None

    def inputs(self) -> dict[str, Any]:
        """The arguments every patching function takes: ``source, clean, corrupted`` (as a dict for
        ``**``) with ``metric`` and ``direction``."""
        c = self.contrast
        return {
            "source": c.weights, "clean": c.clean, "corrupted": c.corrupted, "metric": c.metric, "direction": c.direction,
        }  # fmt: skip


@dataclass(frozen=True)
class Needs:
    """What a sweep reads from the study's recordings (:meth:`~qkov.analysis.causal.contrast.Contrast.record`'s
    arguments): ``cache`` (sites both recordings keep), ``base_only`` (sites the base recording alone keeps),
    ``grad`` (the base recording keeps its graph, for the metric's gradient)."""

    cache: tuple[str, ...] = ()
    base_only: tuple[str, ...] = ()
    grad: bool = False

    def __or__(self, other: "Needs") -> "Needs":
        """Both sweeps' needs, as one recording."""
        seen = lambda *parts: tuple(dict.fromkeys(x for p in parts for x in p))  # noqa: E731
        return Needs(seen(self.cache, other.cache), seen(self.base_only, other.base_only), self.grad or other.grad)


@dataclass(frozen=True)
class Sweep:
    """One method as a study runs it: see the module docstring. ``run(study)`` returns the results
    it adds (in the order they show); ``when(options)``: whether the study runs it; ``needs(study)``: the
    sites ``run`` reads from ``study.contrast``'s recordings (``None``: it records what it needs itself)."""

    name: str
    summary: str
    run: Callable[[StudyRun], list[PatchResult]]
    options: tuple[Option, ...] = ()
    when: Callable[[Mapping[str, Any]], bool] = lambda options: True
    needs: Callable[[StudyRun], Needs] | None = None


SWEEPS: dict[str, Sweep] = {}
"""Every registered sweep by name, in the order a study runs them and shows their results."""


def register_sweep(sweep: Sweep) -> Sweep:
    """Add ``sweep`` to :data:`SWEEPS` (after those already there). Refuses a name already taken
    and an option whose name another sweep's option has. Returns ``sweep``."""
    if sweep.name in SWEEPS:
        raise QkovError(f"register_sweep: a sweep named {sweep.name!r} is registered already")
    taken = study_options()
    for opt in sweep.options:
        if opt.name in taken:
            raise QkovError(f"register_sweep: the option {opt.name!r} of {sweep.name} is another sweep's")
    SWEEPS[sweep.name] = sweep
    return sweep


def study_options() -> dict[str, Option]:
    """Every registered sweep's options, by name, in registration order."""
    return {o.name: o for s in SWEEPS.values() for o in s.options}
