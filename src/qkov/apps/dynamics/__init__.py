"""The dynamics study, in one place: :func:`dynamics` measures every snapshot of a series and reads
the phase change ([I]); ``qkov dynamics`` (:mod:`qkov.apps.cli.dynamics_cmds`) is its command.

* :mod:`.series` — a series of snapshots, from any of the places they live (a qkov run, checkpoints,
  Hub revisions);
* :mod:`.study` — measure each snapshot, read the series, ablate the induction heads, write
  (:func:`dynamics`, :func:`write_dynamics`, :class:`DynamicsResult`);
* :mod:`.page` — the offline HTML page of a result;
* :mod:`.phase` — the tour's phase-change section: [I]'s dynamic claims judged from results, and
  their curves (also the static SVG of a notebook display).
"""

from __future__ import annotations

from .phase import phase_charts, phase_claims, svg_dynamics
from .study import DynamicsResult, dynamics, write_dynamics

__all__ = ["DynamicsResult", "dynamics", "phase_charts", "phase_claims", "svg_dynamics", "write_dynamics"]
