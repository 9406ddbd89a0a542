"""Progress displays: training, and staged analyses (rich bars on a terminal).

Used by the CLI as the ``callback`` of :func:`qkov.train` and the ``progress`` of the
long analyses (:class:`qkov.progress.Progress`); the library itself never prints.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


def _start_bar(console: Console, title: str, *extra: Any) -> Progress:
    """A started rich progress display: title, bar, done/total, ``extra`` columns, elapsed and remaining time."""
    bar = Progress(
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
    """Callable that renders training events. Use as a context manager."""

    def __init__(self, *, quiet: bool = False, console: Console | None = None) -> None:
        self.quiet = quiet
        self.console = console or Console(stderr=True)
        self.live = self.console.is_terminal and not quiet
        self.progress: Progress | None = None
        self.task: Any = None
        self.fields = {"loss": "-", "val": "-", "ind": "-", "tps": "-"}
        self.timed = False  # the first step's time was looked at

    def __enter__(self) -> "TrainProgress":
        if self.live:
            self.progress = _start_bar(
                self.console,
                "[bold]train",
                TextColumn("loss {task.fields[loss]}  val {task.fields[val]}  induction {task.fields[ind]}"),
                TextColumn("{task.fields[tps]} tok/s"),
            )
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.progress is not None:
            self.progress.__exit__(*exc)

    def say(self, text: str) -> None:
        if not self.quiet:
            self.console.print(text, highlight=False, soft_wrap=True)

    def __call__(self, ev: dict[str, Any]) -> None:
        kind = ev["event"]
        if kind == "message":
            self.say(ev["text"])
        elif kind == "start":
            what = "resuming at step" if ev["resumed"] else "starting at step"
            self.say(
                f"{what} {ev['step']} of {ev['steps']}: {ev['params']:,} parameters on {ev['device']} "
                f"({ev['precision']}), {ev['train_tokens']:,} training tokens"
            )
            if self.progress is not None:
                self.task = self.progress.add_task("train", total=ev["steps"], completed=ev["step"], **self.fields)
        elif kind == "step":
            self._step(ev)
        elif kind == "log":
            self.fields["loss"] = f"{ev['train_loss']:.3f}"
            self.fields["tps"] = f"{ev['tokens_per_s']:,.0f}"
            if self.progress is not None:
                self.progress.update(self.task, completed=ev["step"], **self.fields)
        elif kind == "eval":
            self.fields["val"] = f"{ev['val_loss']:.3f}"
            if "induction_score" in ev:
                self.fields["ind"] = f"{ev['induction_score']:.2f}"
            line = f"step {ev['step']:>6}  tokens {ev['tokens']:>11,}  val loss {ev['val_loss']:.4f}"
            if "induction_score" in ev:
                line += f"  induction {ev['induction_score']:.3f}"
            if self.progress is not None:
                self.progress.update(self.task, **self.fields)
                self.progress.console.print(line, highlight=False)
            elif not self.quiet:
                print(line, file=sys.stderr, flush=True)
        elif kind == "done" and not self.quiet:
            self.say(f"done: step {ev['step']}, val loss {ev['val_loss']}, {ev['wall_s']:.0f} s of training")

    def _step(self, ev: dict[str, Any]) -> None:
        """Move the bar every step; when the first step of a run is slow, say how long the run will take."""
        if self.progress is not None:
            self.progress.update(self.task, completed=ev["step"])
        if not self.timed:
            self.timed = True
            left = ev["steps"] - ev["step"]
            if ev["seconds"] >= 2 and left > 0:
                eta = ev["seconds"] * left
                when = f"{eta / 3600:.1f} h" if eta >= 3600 else f"{eta / 60:.0f} min" if eta >= 60 else f"{eta:.0f} s"
                self.say(f"the first step took {ev['seconds']:.1f} s: about {when} for the {left:,} steps left")


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
        self.progress: Progress | None = None
        self.tasks: dict[str, Any] = {}
        self.every, self.quiet = every, quiet
        self.t0 = time.monotonic()
        self.started: dict[str, float] = {}
        self.said: dict[str, float] = {}

    def __enter__(self) -> "StageProgress":
        self.t0 = time.monotonic()
        if self.console.is_terminal:
            self.progress = _start_bar(self.console, "[bold]{task.description}")
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.progress is not None:
            self.progress.__exit__(*exc)

    def __call__(self, stage: str, done: int, total: int) -> None:
        if self.progress is None:
            self._line(stage, done, total)
            return
        if stage not in self.tasks:
            self.tasks[stage] = self.progress.add_task(stage, total=total)
        self.progress.update(self.tasks[stage], completed=done, total=total)

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
