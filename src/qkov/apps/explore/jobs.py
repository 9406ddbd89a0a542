"""The job runner of ``qkov explore``: views run on a few worker threads, never on the HTTP side.

Two lanes, one worker each by default: the quick views (:data:`~qkov.apps.explore.views.QUICK_VIEWS`: the
model, a text, one pattern) and everything else (the heads table, the card, patching), so a long
computation never holds up typing. torch is multi-threaded already; more workers on a CPU only share the
same cores. Each lane's queue is bounded (:class:`Busy`, answered 429, beyond it). A job reports the
library's progress ``(what, done, total)``; cancelling it makes its next progress call raise
:class:`~qkov.apps.explore.context.Cancelled`. Results are kept, as their JSON bytes, in an LRU cache
bounded in bytes; the same request while one is queued or running joins it; finished jobs are forgotten
after ``keep_s`` seconds.
"""

from __future__ import annotations

import json
import queue
import secrets
import sys
import threading
import time
import traceback
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from ...errors import QkovError
from ...finite import to_json
from .context import BadRequest, Cancelled, Explorer

__all__ = ["Busy", "encode_result", "Job", "JobRunner", "KEEP_S", "one_line", "QUEUE_SIZE", "ResultCache"]

QUEUE_SIZE = 16
"""Jobs that may wait per lane; one more is refused (429)."""

KEEP_S = 600.0
"""Seconds a finished job stays readable by id."""


class Busy(BadRequest):
    """Too many jobs waiting: the server answers 429."""

    def __init__(self, message: str) -> None:
        super().__init__(message, status=429)


def encode_result(result: dict[str, Any]) -> bytes:
    """A view's result as strict, compact JSON bytes (NaN/inf as ``null``)."""
    return to_json(result, compact=True).encode()


@dataclass
class Job:
    """One run of a view: ``state`` is ``queued``, ``running``, ``done``, ``error`` or ``cancelled``."""

    id: str
    view: str
    args: dict[str, Any]
    key: str
    state: str = "queued"
    what: str = ""
    done: int = 0
    total: int = 0
    result: bytes | None = None
    error: str | None = None
    status: int = 200
    finished: float | None = None
    cancel: threading.Event = field(default_factory=threading.Event)
    finished_event: threading.Event = field(default_factory=threading.Event)
    callbacks: list[Callable[["Job"], None]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def progress(self, what: str, done: int, total: int) -> None:
        """The library's progress protocol; raises :class:`Cancelled` once the job was cancelled."""
        if self.cancel.is_set():
            raise Cancelled(self.id)
        self.what, self.done, self.total = str(what), int(done), int(total)

    def finish(self, state: str, *, result: bytes | None = None, error: str | None = None, status: int = 200) -> None:
        with self.lock:
            if self.finished_event.is_set():
                return
            self.state, self.result, self.error, self.status = state, result, error, status
            self.finished = time.monotonic()
            self.finished_event.set()
            callbacks, self.callbacks = self.callbacks, []
        for fn in callbacks:
            fn(self)

    def on_finish(self, fn: Callable[["Job"], None]) -> None:
        """Call ``fn(job)`` once the job has finished (at once if it has)."""
        with self.lock:
            if not self.finished_event.is_set():
                self.callbacks.append(fn)
                return
        fn(self)

    def to_json(self) -> bytes:
        """The job as the API's JSON object (the result embedded as it was encoded)."""
        head = {"id": self.id, "view": self.view, "state": self.state, "what": self.what, "done": self.done,
                "total": self.total}
        if self.error is not None:
            head["error"] = self.error
        text = json.dumps(head, ensure_ascii=False, separators=(",", ":")).encode()
        if self.result is None:
            return text
        return text[:-1] + b',"result":' + self.result + b"}"


class ResultCache:
    """Results (JSON bytes) by request key, least recently used dropped first beyond ``max_bytes``."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = int(max_bytes)
        self.bytes = 0
        self.items: OrderedDict[str, bytes] = OrderedDict()
        self.lock = threading.Lock()

    def get(self, key: str) -> bytes | None:
        with self.lock:
            value = self.items.get(key)
            if value is not None:
                self.items.move_to_end(key)
            return value

    def put(self, key: str, value: bytes) -> None:
        if len(value) > self.max_bytes:
            return  # larger than the whole cache: served once, not kept
        with self.lock:
            old = self.items.pop(key, None)
            self.bytes -= 0 if old is None else len(old)
            self.items[key] = value
            self.bytes += len(value)
            while self.bytes > self.max_bytes:
                _, dropped = self.items.popitem(last=False)
                self.bytes -= len(dropped)


def _request_key(view: str, args: Mapping[str, Any]) -> str:
    return view + "|" + json.dumps(args, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


class JobRunner:
    """Runs views of one :class:`Explorer` on worker threads (see the module docstring).

    ``views``: name -> view; ``quick``: the names run in the quick lane; ``cache_bytes``: the result
    cache's bound; ``workers``: threads per lane."""

    def __init__(
        self,
        ex: Explorer,
        views: Mapping[str, Any],
        *,
        quick: set[str] | frozenset[str] = frozenset(),
        cache_bytes: int = 256 * 2**20,
        workers: int = 1,
        queue_size: int = QUEUE_SIZE,
        keep_s: float = KEEP_S,
    ) -> None:
        self.ex, self.views, self.quick, self.keep_s = ex, views, set(quick), keep_s
        self.cache = ResultCache(cache_bytes)
        self.jobs: dict[str, Job] = {}
        self.running: dict[str, Job] = {}  # request key -> the unfinished job for it
        self.lock = threading.Lock()
        self.lanes = {lane: queue.Queue(maxsize=queue_size) for lane in ("quick", "slow")}
        self.threads = [
            threading.Thread(target=self._work, args=(q,), name=f"qkov-explore-{lane}-{i}", daemon=True)
            for lane, q in self.lanes.items()
            for i in range(workers)
        ]
        self.closed = False
        for t in self.threads:
            t.start()

    def submit(self, view: str, args: Any) -> Job:
        """A job for ``view`` on ``args``: done at once from the result cache, the unfinished job of the same
        request, or a new queued one.

        Raises:
            BadRequest: no such view (404), ``args`` not an object (400); :class:`Busy` (429): the lane is full.
        """
        if view not in self.views:
            raise BadRequest(f"no view {view!r}; the views are {', '.join(sorted(self.views))}", status=404)
        if not isinstance(args, dict):
            raise BadRequest("the view's arguments must be a JSON object")
        key = _request_key(view, args)
        job = Job(id=secrets.token_hex(8), view=view, args=args, key=key)
        cached = self.cache.get(key)
        with self.lock:
            self._forget_old()
            if cached is None and key in self.running:
                return self.running[key]
            self.jobs[job.id] = job
            if cached is not None:
                job.finish("done", result=cached)
                return job
            try:
                self.lanes["quick" if view in self.quick else "slow"].put_nowait(job)
            except queue.Full:
                del self.jobs[job.id]
                lane = self.lanes["quick" if view in self.quick else "slow"]
                raise Busy(f"too many jobs waiting ({lane.maxsize}); try again when some have finished") from None
            self.running[key] = job
        return job

    def get(self, job_id: str) -> Job:
        with self.lock:
            self._forget_old()
            job = self.jobs.get(job_id)
        if job is None:
            raise BadRequest(f"no job {job_id!r} (finished jobs are forgotten after {self.keep_s:g} s)", status=404)
        return job

    def cancel(self, job_id: str) -> Job:
        """Cancel a queued or running job (a finished one stays as it was): it reads ``cancelled`` at once; a
        running view stops at its next progress call, and what it would have returned is dropped."""
        job = self.get(job_id)
        job.cancel.set()
        self._end(job, "cancelled", error="cancelled")
        return job

    def close(self) -> None:
        """Stop the workers (jobs still queued are cancelled)."""
        self.closed = True
        for q in self.lanes.values():
            for _ in self.threads:
                try:
                    q.put_nowait(None)
                except queue.Full:
                    pass

    def _forget_old(self) -> None:
        now = time.monotonic()
        old = [i for i, j in self.jobs.items() if j.finished is not None and now - j.finished > self.keep_s]
        for i in old:
            del self.jobs[i]

    def _end(self, job: Job, state: str, **kw: Any) -> None:
        with self.lock:
            if self.running.get(job.key) is job:
                del self.running[job.key]
        job.finish(state, **kw)

    def _work(self, q: "queue.Queue[Job | None]") -> None:
        while True:
            job = q.get()
            if job is None or self.closed:
                return
            if job.cancel.is_set() or job.finished_event.is_set():
                self._end(job, "cancelled", error="cancelled")
                continue
            job.state = "running"
            self._run(job)

    def _run(self, job: Job) -> None:
        try:
            result = self.views[job.view](self.ex, job.args, job.progress)
            data = encode_result(result)
        except Cancelled:
            self._end(job, "cancelled", error="cancelled")
        except BadRequest as exc:
            self._end(job, "error", error=one_line(exc), status=exc.status)
        except Exception as exc:  # a QkovError is the user's (400); anything else is a bug (500, logged)
            if isinstance(exc, QkovError):
                self._end(job, "error", error=one_line(exc), status=400)
            else:
                sys.stderr.write(f"qkov explore: view {job.view!r} failed:\n{traceback.format_exc()}")
                self._end(job, "error", error=f"internal error in view {job.view!r}: {one_line(exc)}", status=500)
        else:
            if not job.cancel.is_set():
                self.cache.put(job.key, data)
            self._end(job, "done", result=data)


def one_line(exc: BaseException) -> str:
    """An exception as one line of text."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 500 else text[:497] + "..."
