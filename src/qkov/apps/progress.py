"""Progress displays: training, and staged analyses (rich bars on a terminal).

Both are the ``progress`` of the library's long functions (:class:`qkov.progress.Progress`,
``progress(what, done, total)``: :func:`qkov.train`'s steps, the analyses' stages); training's
display also reads :func:`qkov.train`'s event log (:meth:`TrainProgress.event`). The library
itself never prints.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.progress import Progress as Bars

__all__ = ["StageProgress", "TrainProgress"]


def _start_bar(console: Console, title: str, *extra: Any) -> Bars:
    """A started rich progress display: title, bar, done/total, ``extra`` columns, elapsed and remaining time."""
    bar = Bars(
        TextColumn(title),
        BarColumn(),
        MofNCompleteColumn(),
        *extra,
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
    )
    bar.__enter__()
    return bar


class TrainProgress:
    """Training's display: ``progress(what, done, total)`` for :func:`qkov.train`'s ``progress`` (the
    corpus stages as lines, the steps as a bar) and :meth:`event` for its ``callback`` (the losses,
    evaluations and the summary). Use as a context manager."""

    def __init__(self, *, quiet: bool = False, console: Console | None = None) -> None:
        self.quiet = quiet
        self.console = console or Console(stderr=True)
        self.live = self.console.is_terminal and not quiet
        self.bars: Bars | None = None
        self.task: Any = None
        self.fields = {"loss": "-", "val": "-", "ind": "-", "tps": "-"}
        self.stage = ""  # the corpus stage said last
        self.first: tuple[int, float] | None = None  # the step training started at, and when
        self.timed = False  # the first step's time was looked at
        self.clock = time.perf_counter

    def __enter__(self) -> "TrainProgress":
        if self.live:
            self.bars = _start_bar(
                self.console,
                "[bold]train",
                TextColumn("loss {task.fields[loss]}  val {task.fields[val]}  induction {task.fields[ind]}"),
                TextColumn("{task.fields[tps]} tok/s"),
            )
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.bars is not None:
            self.bars.__exit__(*exc)

    def say(self, text: str) -> None:
        if not self.quiet:
            self.console.print(text, highlight=False, soft_wrap=True)

    def __call__(self, what: str, done: int, total: int) -> None:
        if what != "train":  # building the corpus: each stage said once
            if what != self.stage:
                self.stage = what
                self.say(what)
            return
        if self.bars is not None:
            if self.task is None:
                self.task = self.bars.add_task("train", total=total, completed=done, **self.fields)
            self.bars.update(self.task, completed=done)
        now = self.clock()
        if self.first is None:
            self.first = (done, now)
        elif not self.timed:
            self._first_step(now - self.first[1], total - done)

    def _first_step(self, seconds: float, left: int) -> None:
        """When the first step of a run is slow, say how long the run will take."""
        self.timed = True
        if seconds >= 2 and left > 0:
            eta = seconds * left
            when = f"{eta / 3600:.1f} h" if eta >= 3600 else f"{eta / 60:.0f} min" if eta >= 60 else f"{eta:.0f} s"
            self.say(f"the first step took {seconds:.1f} s: about {when} for the {left:,} steps left")

    def event(self, ev: dict[str, Any]) -> None:
        """One event of :func:`qkov.train`'s event log."""
        kind = ev["event"]
        if kind == "message":
            self.say(ev["text"])
        elif kind == "start":
            what = "resuming at step" if ev["resumed"] else "starting at step"
            self.say(
                f"{what} {ev['step']} of {ev['steps']}: {ev['params']:,} parameters on {ev['device']} "
                f"({ev['precision']}), {ev['train_tokens']:,} training tokens"
            )
        elif kind == "log":
            self.fields["loss"] = f"{ev['train_loss']:.3f}"
            self.fields["tps"] = f"{ev['tokens_per_s']:,.0f}"
            self._show_fields()
        elif kind == "eval":
            self.fields["val"] = f"{ev['val_loss']:.3f}"
            if "induction_score" in ev:
                self.fields["ind"] = f"{ev['induction_score']:.2f}"
            line = f"step {ev['step']:>6}  tokens {ev['tokens']:>11,}  val loss {ev['val_loss']:.4f}"
            if "induction_score" in ev:
                line += f"  induction {ev['induction_score']:.3f}"
            self._show_fields()
            if self.bars is not None:
                self.bars.console.print(line, highlight=False)
            elif not self.quiet:
                print(line, file=sys.stderr, flush=True)
        elif kind == "done" and not self.quiet:
            self.say(f"done: step {ev['step']}, val loss {ev['val_loss']}, {ev['wall_s']:.0f} s of training")

    def _show_fields(self) -> None:
        if self.bars is not None and self.task is not None:
            self.bars.update(self.task, **self.fields)


class StageProgress:
    """Callable ``(stage, done, total)`` for the ``progress`` argument of the long analyses
    (:func:`qkov.analysis.circuits.report.circuits_report`, ...). Use as a context manager.

    On a terminal it draws one rich progress bar per stage (stderr). Elsewhere (a log file, CI)
    it writes plain lines instead, so long work is never silent: once the command has run
    ``quiet`` seconds, a line when a stage starts, every ``every`` seconds while it runs
    (done/total, elapsed, estimated time left) and when it ends. Quick commands stay silent.
    """

    def __init__(self, *, console: Console | None = None, every: float = 30.0, quiet: float = 10.0) -> None:
        self.console = console or Console(stderr=True)
        self.bars: Bars | None = None
        self.tasks: dict[str, Any] = {}
        self.every, self.quiet = every, quiet
        self.t0 = time.monotonic()
        self.started: dict[str, float] = {}
        self.said: dict[str, float] = {}

    def __enter__(self) -> "StageProgress":
        self.t0 = time.monotonic()
        if self.console.is_terminal:
            self.bars = _start_bar(self.console, "[bold]{task.description}")
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.bars is not None:
            self.bars.__exit__(*exc)

    def __call__(self, stage: str, done: int, total: int) -> None:
        if self.bars is None:
            self._line(stage, done, total)
            return
        if stage not in self.tasks:
            self.tasks[stage] = self.bars.add_task(stage, total=total)
        self.bars.update(self.tasks[stage], completed=done, total=total)

    def _line(self, stage: str, done: int, total: int) -> None:
        now = time.monotonic()
        first = stage not in self.started
        if first:
            self.started[stage] = self.said[stage] = now
        loud = now - self.t0 >= self.quiet
        elapsed = now - self.started[stage]
        say = lambda text: self.console.print(text, highlight=False, soft_wrap=True)  # noqa: E731
        if done >= total:
            if loud:
                say(f"{stage}: done in {elapsed:.1f} s")
        elif first:
            if loud:
                say(f"{stage}: started ({total:,} steps)")
        elif loud and done > 0 and now - self.said[stage] >= self.every:
            self.said[stage] = now
            left = elapsed / done * (total - done)
            say(f"{stage}: {done:,}/{total:,} after {elapsed:.0f} s, about {left:.0f} s left")
