"""Kill and resume, thousands of times, and train one seed in many fresh processes: always the same bits?

Two measurements of one claim (docs/runs.md): a run's final checkpoint is the uninterrupted run's, bit
for bit, however often it is killed; and the same seed gives the same bits in every process.

**Kills.** The tests' tiny training (2 layers, 20 steps, a checkpoint every 5 steps, snapshots at 0, 5
and 15) is started, killed, resumed (``qkov train --resume``) or started again (when no complete state
was left), killed again..., and finally run to its end; then every tensor of its training state, model
and snapshots, and its log, are compared with the uninterrupted run's. Each run is killed 1 to
``--max-repeats`` times (drawn), each kill at a seeded random moment: ``SIGKILL`` after a random delay
(uniform over a run's measured length), or, for ``--at-writes`` of the kills, as abruptly at a random
atomic write (the test hook ``QKOV_FAULT=kill:N``: when the N-th write of the process has filled its
temporary file), so kills inside the writes are as common as kills between steps. A kill that comes
after the process finished is not counted; ``--kills`` counts the kills made.

Every run is the real command line, ``qkov.apps.cli.main(["train", ...])``, in a child forked from this
process, which imports torch and qkov once (a fresh ``python -m qkov`` spends seconds importing; a forked
child trains in a fraction of one). Each child shifts its heap by a random amount, so its tensors get
other addresses. Forked children share what the parent's import settled (MKL's modes and kernels),
which is what a fresh process does differently: so --

**Fresh processes.** ``--fresh`` runs of the same seed (default 20), each a new ``python -m qkov
train``, ``--concurrent`` at a time beside a process that keeps a core busy, every tensor compared
with the first.

    python benchmarks/bench_kills.py                               # 2000 kills, 20 fresh runs
    python benchmarks/bench_kills.py --kills 40 --fresh 4 --json kills.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

# the tests' corpus (tests/conftest.py) and tiny flags (tests/helpers.py TINY_FLAGS)
CORPUS_MODULES = (
    "abc.py bisect.py calendar.py colorsys.py copy.py dataclasses.py fnmatch.py fractions.py functools.py "
    "glob.py heapq.py keyword.py numbers.py operator.py queue.py random.py shlex.py string.py textwrap.py types.py"
).split()
FLAGS = (
    "--layers 2 --heads 2 --d-model 32 --d-head 16 --ctx 32 --vocab 300 --batch 4 --steps 20 --device cpu "
    "--quiet --ckpt-interval 5 --eval-interval 10 --snapshots 0,5,15"
).split()
STATE, MODEL, METRICS = "train_state.safetensors", "model.safetensors", "metrics.jsonl"
SRC = Path(__file__).resolve().parents[1] / "src"


# ------------------------------------------------------------------ running qkov
def _child(argv: list[str], fault: str | None, err: Path, heap_seed: int) -> None:
    """In a forked child: the command line, as ``python -m qkov`` runs it; never returns."""
    rc = 1
    try:
        from qkov.apps.cli import main
        from qkov.io import atomic

        os.environ.pop("QKOV_FAULT", None)
        if fault:
            os.environ["QKOV_FAULT"] = fault
        atomic._writes = 0  # the hook counts this process's writes, as in a fresh one
        rnd = random.Random(heap_seed)  # shift the heap: tensors get other addresses, as between processes
        libc = ctypes.CDLL(None)
        libc.malloc.restype = ctypes.c_void_p
        for _ in range(rnd.randint(1, 8)):
            libc.malloc(rnd.randrange(16, 120_000, 16))
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        fd = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 2)
        rc = main(argv)
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - reported through the exit status and the stderr file
        import traceback

        traceback.print_exc()
        rc = 99
    finally:
        os._exit(rc)


def run_forked(
    argv: list[str], err: Path, heap_seed: int, *, fault: str | None = None, kill_after: float | None = None
) -> int:
    """Run ``qkov argv`` in a forked child, killed with SIGKILL after ``kill_after`` seconds if it is
    still running; its exit status (137 when killed, by the signal or the write hook)."""
    pid = os.fork()
    if pid == 0:
        _child(argv, fault, err, heap_seed)
    if kill_after is not None:
        deadline = time.perf_counter() + kill_after
        while time.perf_counter() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return os.waitstatus_to_exitcode(status)
            time.sleep(min(0.002, max(0.0, deadline - time.perf_counter())))
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    rc = os.waitstatus_to_exitcode(status)
    return 137 if rc == -signal.SIGKILL else rc


def fresh_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("QKOV_FAULT", "MKL_CBWR")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")]))
    return env


def run_fresh(argv: list[str], err: Path) -> subprocess.Popen[bytes]:
    """``python -m qkov argv`` as a new process (started, not waited for)."""
    with open(err, "wb") as fh:
        return subprocess.Popen(
            [sys.executable, "-m", "qkov", *argv], stdout=subprocess.DEVNULL, stderr=fh, env=fresh_env()
        )


# ------------------------------------------------------------------ comparing runs
def _tensors(path: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(path))


def _ulps(a: np.ndarray, b: np.ndarray) -> int:
    """The largest distance in units in the last place between float32 arrays (0 for other dtypes)."""
    if a.dtype != np.float32:
        return 0
    ia, ib = a.view(np.int32).astype(np.int64), b.view(np.int32).astype(np.int64)
    ia = np.where(ia < 0, -(ia & 0x7FFFFFFF), ia)  # sign-magnitude -> a monotonic integer line
    ib = np.where(ib < 0, -(ib & 0x7FFFFFFF), ib)
    return int(np.abs(ia - ib).max())


def diff_tensors(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> dict[str, Any] | None:
    """``None`` when ``a`` and ``b`` hold the same names with bitwise-equal values; else what differs."""
    if a.keys() != b.keys():
        return {"names": sorted(a.keys() ^ b.keys())}
    differ = [k for k in sorted(a) if a[k].shape != b[k].shape or a[k].tobytes() != b[k].tobytes()]
    if not differ:
        return None
    same_shape = [k for k in differ if a[k].shape == b[k].shape]
    return {
        "differ": len(differ),
        "of": len(a),
        "first": differ[:6],
        "max_ulps": max((_ulps(a[k], b[k]) for k in same_shape), default=None),
    }


def _rows(out: Path) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (out / METRICS).read_text().splitlines()]
    return [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in rows]


def compare_runs(ref: Path, out: Path) -> dict[str, Any] | None:
    """``None`` when ``out`` is ``ref`` bit for bit (state, model, snapshots, log, no temporaries)."""
    problems: dict[str, Any] = {}
    for name in (STATE, MODEL):
        d = diff_tensors(_tensors(ref / name), _tensors(out / name))
        if d:
            problems[name] = d
    if _rows(ref) != _rows(out):
        problems["metrics"] = [r for r, s in zip(_rows(ref), _rows(out)) if r != s][:2]
    tmps = [p.name for p in out.iterdir() if p.name.endswith(".tmp")]
    if tmps:
        problems["temporaries"] = tmps
    snaps_a, snaps_b = sorted((ref / "snapshots").glob("*")), sorted((out / "snapshots").glob("*"))
    if [p.name for p in snaps_a] != [p.name for p in snaps_b]:
        problems["snapshot names"] = [p.name for p in snaps_b]
    else:
        for pa, pb in zip(snaps_a, snaps_b):
            d = diff_tensors(_tensors(pa), _tensors(pb))
            if d:
                problems[f"snapshots/{pa.name}"] = d
    return problems or None


# ------------------------------------------------------------------ the kills
class Trials:
    """Runs killed one or more times, and what became of each."""

    def __init__(
        self, work: Path, flags: list[str], ref: Path, full_s: float, n_writes: int, args: argparse.Namespace
    ) -> None:
        self.work, self.flags, self.ref, self.full_s, self.n_writes, self.args = (
            work,
            flags,
            ref,
            full_s,
            n_writes,
            args,
        )
        self.err = work / "stderr.txt"
        self.keep = args.keep or work / "kept"
        self.counts = {
            "kills": 0, "at_a_moment": 0, "at_a_write": 0, "survived": 0, "runs": 0, "not_exact": 0,
            "resumed": 0, "restarted": 0, "started_again": 0,
        }  # fmt: skip
        self.by_repeats: dict[int, int] = {}
        self.failures: list[dict[str, Any]] = []

    def _next_argv(self, out: Path) -> tuple[list[str], str]:
        from qkov.training import rundir

        kind = rundir.inspect(out) if out.exists() else "free"
        if kind == "resumable":
            return ["train", "--resume", "--out", str(out)], "resumed"
        if kind in ("restartable", "free"):
            return ["train", *self.flags, "--out", str(out)], "restarted" if kind == "restartable" else "started_again"
        sys.exit(f"a killed run left a {kind} directory: {out}")

    def one(self, i: int, rnd: random.Random) -> None:
        """Run ``i``: killed ``r`` times (drawn), resumed or restarted after each, then finished and compared."""
        out = self.work / f"run{i}"
        repeats = rnd.randint(1, self.args.max_repeats)
        c, log = self.counts, []
        kills = 0
        argv, how = ["train", *self.flags, "--out", str(out)], "first"
        while kills < repeats:
            if rnd.random() < self.args.at_writes:
                point = rnd.randint(1, self.n_writes)
                rc = run_forked(argv, self.err, rnd.randrange(2**31), fault=f"kill:{point}")
                what = f"write {point}"
            else:
                delay = rnd.uniform(0, self.full_s)
                rc = run_forked(argv, self.err, rnd.randrange(2**31), kill_after=delay)
                what = f"{delay:.3f} s"
            if rc == 0:  # finished before the kill came: not a kill
                c["survived"] += 1
                log.append(f"{how}: finished before {what}")
                break
            if rc != 137:
                sys.exit(f"run {i} ({how}, kill at {what}): exit {rc}: {self.err.read_text()[-2000:]}")
            kills += 1
            c["kills"] += 1
            c["at_a_write" if what.startswith("write") else "at_a_moment"] += 1
            log.append(f"{how}: killed at {what}")
            argv, how = self._next_argv(out)
            c[how] += 1
        else:
            rc = run_forked(argv, self.err, rnd.randrange(2**31))
            if rc != 0:
                sys.exit(f"run {i} ({how}, after {kills} kills): exit {rc}: {self.err.read_text()[-2000:]}")
            log.append(f"{how}: finished")
        c["runs"] += 1
        self.by_repeats[kills] = self.by_repeats.get(kills, 0) + 1
        problems = compare_runs(self.ref, out)
        if not problems:
            shutil.rmtree(out)
            return
        c["not_exact"] += 1
        failure = {"run": i, "kills": kills, "history": log, "problems": problems}
        self.failures.append(failure)
        self.keep.mkdir(parents=True, exist_ok=True)
        shutil.move(str(out), self.keep / out.name)
        print(f"NOT EXACT: {json.dumps(failure, default=str)}", flush=True)

    def line(self, seconds: float) -> str:
        c = self.counts
        return (
            f"kills {c['kills']}/{self.args.kills} in {c['runs']} runs  not exact {c['not_exact']}  "
            f"(at a moment {c['at_a_moment']}, at a write {c['at_a_write']}; then resumed {c['resumed']}, "
            f"restarted {c['restarted']}, started again {c['started_again']}; runs killed 1/2/3+ times "
            f"{self.by_repeats.get(1, 0)}/{self.by_repeats.get(2, 0)}/{self.by_repeats.get(3, 0)})  "
            f"{seconds / 60:.1f} min"
        )


# ------------------------------------------------------------------ fresh processes
def fresh_runs(work: Path, flags: list[str], ref: Path, n: int, concurrent: int, load: bool) -> dict[str, Any]:
    """``n`` fresh ``python -m qkov train`` of the reference's seed, ``concurrent`` at a time (beside a
    busy process with ``load``), each compared with the reference."""
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if load else None
    odd: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    try:
        done = 0
        while done < n:
            wave = list(range(done, min(n, done + concurrent)))
            procs = {
                i: run_fresh(["train", *flags, "--out", str(work / f"fresh{i}")], work / f"fresh{i}.err") for i in wave
            }
            for i, proc in procs.items():
                if proc.wait() != 0:
                    sys.exit(f"fresh run {i} failed: {(work / f'fresh{i}.err').read_text()[-2000:]}")
                problems = compare_runs(ref, work / f"fresh{i}")
                if problems:
                    odd.append({"fresh": i, "problems": problems})
                    print(f"FRESH RUN DIFFERS: {json.dumps(odd[-1], default=str)}", flush=True)
                else:
                    shutil.rmtree(work / f"fresh{i}")
            done += len(wave)
            print(f"fresh runs {done}/{n}: {done - len(odd)} identical to the first", flush=True)
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
    return {
        "fresh_runs": n,
        "fresh_identical": n - len(odd),
        "fresh_minutes": round((time.perf_counter() - t0) / 60, 1),
        "fresh_differ": odd,
    }


# ------------------------------------------------------------------ the benchmark
def _arguments() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=2000, help="kills to make (default 2000)")
    ap.add_argument("--max-repeats", type=int, default=3, help="each run is killed 1 to this many times (default 3)")
    ap.add_argument(
        "--at-writes", type=float, default=0.5, help="share of kills at a random atomic write (default 0.5)"
    )
    ap.add_argument("--fresh", type=int, default=20, help="fresh `python -m qkov train` runs of one seed (default 20)")
    ap.add_argument("--concurrent", type=int, default=2, help="fresh runs at a time (default 2)")
    ap.add_argument("--no-load", action="store_true", help="no busy process beside the fresh runs")
    ap.add_argument("--seed", type=int, default=0, help="seed of the kill moments, repeats and heap shifts")
    ap.add_argument("--every", type=int, default=100, help="a progress line every this many runs")
    ap.add_argument("--keep", type=Path, default=None, help="folder for the runs that were not exact (kept)")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    return ap.parse_args()


def _machine() -> dict[str, Any]:
    """Import qkov (once, for every forked child) and say what this machine is."""
    import torch
    import torch._dynamo  # noqa: F401 - what the optimizer imports on its first step: once, here, not in each child

    import qkov.apps.cli  # noqa: F401
    from qkov.training import environment

    rec = environment.record(torch.device("cpu"), 1, "fp32")
    keep = {k: rec.get(k) for k in ("cpu", "torch", "mkl", "numpy", "mkl_reproducible")}
    return {**keep, "threads": max(1, os.cpu_count() or 1)}  # what qkov train sets


def _setup(work: Path, err: Path, rnd: random.Random) -> tuple[list[str], Path, float, int]:
    """The corpus, the uninterrupted run (fresh, then forked: they must agree), a run's length and writes."""
    corpus = work / "corpus"
    corpus.mkdir()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in CORPUS_MODULES:
        shutil.copy(stdlib / name, corpus / name)
    flags = [*FLAGS, "--corpus", str(corpus)]
    ref = work / "reference"
    if run_fresh(["train", *flags, "--out", str(ref)], err).wait() != 0:  # also fills the token cache
        sys.exit(f"the uninterrupted run failed: {err.read_text()[-2000:]}")
    lengths = []
    for k in range(3):
        t0 = time.perf_counter()
        rc = run_forked(["train", *flags, "--out", str(work / f"forked{k}")], err, rnd.randrange(2**31))
        lengths.append(time.perf_counter() - t0)
        if rc != 0 or compare_runs(ref, work / f"forked{k}") is not None:
            sys.exit("a forked run differs from a fresh `python -m qkov` one: the kills would measure nothing")
        shutil.rmtree(work / f"forked{k}")
    return flags, ref, statistics.median(lengths), _count_writes(work, flags)


def _count_writes(work: Path, flags: list[str]) -> int:
    """Atomic writes of an uninterrupted run: the largest N whose ``QKOV_FAULT=kill:N`` still kills it."""
    lo, hi = 1, 64
    while lo < hi:
        mid = (lo + hi + 1) // 2
        out = work / f"probe{mid}"
        killed = run_forked(["train", *flags, "--out", str(out)], work / "probe.err", 0, fault=f"kill:{mid}") == 137
        shutil.rmtree(out, ignore_errors=True)
        lo, hi = (mid, hi) if killed else (lo, mid - 1)
    return lo


def main() -> None:
    args = _arguments()
    sys.path.insert(0, str(SRC))  # this checkout's qkov, in this process and so in every forked child
    work = Path(tempfile.mkdtemp(prefix="qkov-kills-"))
    os.environ["QKOV_CACHE"] = str(work / "cache")
    err = work / "stderr.txt"
    machine = _machine()
    print(f"machine: {json.dumps(machine)}", flush=True)
    rnd = random.Random(args.seed)
    flags, ref, full_s, n_writes = _setup(work, err, rnd)
    print(f"a forked run takes {full_s:.2f} s and makes {n_writes} atomic writes", flush=True)

    fresh = fresh_runs(work, flags, ref, args.fresh, args.concurrent, not args.no_load) if args.fresh else {}
    trials = Trials(work, flags, ref, full_s, n_writes, args)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # `kill PID` ends it with the summary
    t0 = time.perf_counter()
    try:
        i = 0
        while trials.counts["kills"] < args.kills:
            i += 1
            trials.one(i, rnd)
            if i % args.every == 0:
                print(trials.line(time.perf_counter() - t0), flush=True)
    except KeyboardInterrupt:
        print("stopped:", flush=True)
    print(trials.line(time.perf_counter() - t0), flush=True)
    result = {
        **trials.counts,
        "runs_by_kills": dict(sorted(trials.by_repeats.items())),
        "run_seconds": round(full_s, 3),
        "writes_per_run": n_writes,
        "kill_minutes": round((time.perf_counter() - t0) / 60, 1),
        **{k: v for k, v in fresh.items() if k != "fresh_differ"},
        **machine,
        "failures": trials.failures,
        "fresh_differ": fresh.get("fresh_differ", []),
    }
    print(json.dumps({k: v for k, v in result.items() if k not in ("failures", "fresh_differ")}), flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=str))
    if trials.failures or result["fresh_differ"]:
        print(f"runs that were not exact are kept in {trials.keep} and {work}", flush=True)
    else:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
