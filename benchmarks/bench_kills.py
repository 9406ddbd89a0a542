"""Kill and resume, thousands of times: is every resumed run the uninterrupted one, bit for bit?

``tests/training/test_runs.py`` kills the tiny training once at each of its atomic writes; this runs the
same training (the test's flags: 2 layers, 20 steps, checkpoints at 10 and 20, snapshots at 0, 5
and 15) ``--kills`` times (default 2000), each killed at a random atomic write through the test
hook ``QKOV_FAULT=kill:N`` (:mod:`qkov.io.atomic`: the process ends as abruptly as SIGKILL when
its N-th write has filled its temporary file), then resumed (``qkov train --resume``) or, when no
complete state was left, started again, and compares every tensor of the training state, the
model, every snapshot and the log with the uninterrupted run's.

Every run is the real command line: ``qkov.apps.cli.main(["train", ...])``, in a child forked from
this process, which imports torch and qkov once (a fresh ``python -m qkov`` spends ~5 s importing;
a forked child trains in ~0.3 s). The parent never computes with torch, so each child starts its
thread pool as a fresh process does; each child also shifts its heap by a random amount, so the
addresses its tensors get vary as they do between processes. ``--fresh-every K`` runs every K-th
kill as two real ``python -m qkov`` processes instead (fresh address layout and hash seed too).

For each kill it also checks the state the killed run left against the first state seen at that
step: a mismatch there means the run before the kill was the odd one, not the resume.

    python benchmarks/bench_kills.py                      # 2000 kills
    python benchmarks/bench_kills.py --kills 300 --fresh-every 50 --json kills.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

# the test's corpus (tests/conftest.py) and flags (tests/helpers.py TINY_FLAGS + test_runs.SHORT)
CORPUS_MODULES = (
    "abc.py bisect.py calendar.py colorsys.py copy.py dataclasses.py fnmatch.py fractions.py functools.py "
    "glob.py heapq.py keyword.py numbers.py operator.py queue.py random.py shlex.py string.py textwrap.py types.py"
).split()
FLAGS = (
    "--layers 2 --heads 2 --d-model 32 --d-head 16 --ctx 32 --vocab 300 --batch 4 --steps 20 --device cpu "
    "--quiet --ckpt-interval 10 --eval-interval 10 --snapshots 0,5,15"
).split()
STATE, MODEL, METRICS = "train_state.safetensors", "model.safetensors", "metrics.jsonl"


# ------------------------------------------------------------------ running qkov
def _child_main(argv: list[str], fault: str | None, err: Path, report: int, heap_seed: int) -> None:
    """In a forked child: the command line, as ``python -m qkov`` runs it; never returns."""
    from qkov.apps.cli import main
    from qkov.io import atomic

    rc = 1
    try:
        os.environ.pop("QKOV_FAULT", None)
        if fault:
            os.environ["QKOV_FAULT"] = fault
        atomic._writes = 0  # the fault counter counts this process's writes, as in a fresh one
        # shift the heap (below glibc's mmap threshold): tensors get other addresses, as between processes
        rnd = random.Random(heap_seed)
        libc = ctypes.CDLL(None)
        libc.malloc.restype = ctypes.c_void_p
        for _ in range(rnd.randint(1, 8)):
            libc.malloc(rnd.randrange(16, 120_000, 16))
        out = os.open(os.devnull, os.O_WRONLY)
        os.dup2(out, 1)
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
        os.write(report, json.dumps({"writes": atomic._writes}).encode())
        os._exit(rc)


def run_forked(argv: list[str], fault: str | None, err: Path, heap_seed: int) -> tuple[int, int]:
    """Run ``qkov argv`` in a forked child; ``(exit status, atomic writes it made)``."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        _child_main(argv, fault, err, w, heap_seed)
    os.close(w)
    with os.fdopen(r) as fh:
        text = fh.read()
    _, status = os.waitpid(pid, 0)
    rc = os.waitstatus_to_exitcode(status)
    writes = json.loads(text)["writes"] if text else -1  # a kill by the hook reports nothing
    return rc, writes


def run_fresh(argv: list[str], fault: str | None, err: Path) -> tuple[int, int]:
    """Run ``python -m qkov argv`` as a new process; ``(exit status, -1)``."""
    env = {k: v for k, v in os.environ.items() if k != "QKOV_FAULT"}
    if fault:
        env["QKOV_FAULT"] = fault
    with open(err, "w") as fh:
        res = subprocess.run([sys.executable, "-m", "qkov", *argv], stdout=subprocess.DEVNULL, stderr=fh, env=env)
    return res.returncode, -1


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
    worst = max(
        (float(np.abs(a[k].astype(np.float64) - b[k].astype(np.float64)).max()), k)
        for k in differ
        if a[k].shape == b[k].shape
    )
    return {
        "differ": len(differ),
        "of": len(a),
        "first": differ[:6],
        "largest": worst,
        "max_ulps": max(_ulps(a[k], b[k]) for k in differ if a[k].shape == b[k].shape),
    }


def _rows(out: Path) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (out / METRICS).read_text().splitlines()]
    return [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in rows]


def compare_runs(ref: Path, out: Path) -> dict[str, Any] | None:
    """``None`` when ``out`` is ``ref`` bit for bit (as tests/training/test_runs.py's ``_same_run``); else what differs."""
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


def _step_of(state: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(state), framework="numpy") as fh:
        return int((fh.metadata() or {})["step"])


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


# ------------------------------------------------------------------ the benchmark
def _arguments() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=2000, help="kills to make (default 2000)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the kill points and heap shifts")
    ap.add_argument("--fresh-every", type=int, default=0, help="every K-th kill in real `python -m qkov` processes")
    ap.add_argument("--every", type=int, default=25, help="a progress line every this many kills")
    ap.add_argument("--keep", type=Path, default=None, help="folder for the runs that were not exact (kept)")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument(
        "--mkl-cnr",
        choices=("auto", "off"),
        default="auto",
        help="MKL's reproducible mode in the runs: auto (what importing qkov sets) or off (MKL's own "
        "default, as before qkov set it; forked runs only)",
    )
    args = ap.parse_args()
    if args.mkl_cnr == "off" and args.fresh_every:
        ap.error("--mkl-cnr off applies to forked runs only: a fresh `python -m qkov` sets auto")
    return args


def _machine(cnr: str) -> dict[str, Any]:
    """Import qkov (once, for every child), set MKL's mode, and say what this machine is."""
    import torch._dynamo  # noqa: F401 - what the optimizer imports on first use: once, here
    import qkov.apps.cli  # noqa: F401
    from qkov import device

    mkl = device._mkl_cnr_functions()
    if cnr == "off" and (mkl is None or mkl[1](device._CBWR_BRANCH_OFF) != 0):
        sys.exit("--mkl-cnr off: MKL's mode cannot be set here")
    return {
        "cpu": _cpu_model(),
        "threads": max(1, os.cpu_count() or 1),  # what qkov train sets (one process per machine)
        "mkl_cnr_mode": None if mkl is None else mkl[0](device._CBWR_ALL),  # 1 off, 2 auto (mkl_cbwr.h)
        "torch": __import__("torch").__version__,
    }


class Kills:
    """The kills made so far, and what each left."""

    def __init__(self, work: Path, flags: list[str], ref: Path, n_writes: int, keep: Path) -> None:
        self.work, self.flags, self.ref, self.n_writes, self.keep = work, flags, ref, n_writes, keep
        self.err = work / "stderr.txt"
        self.first_state: dict[int, dict[str, np.ndarray]] = {}  # the first training state seen at each step
        self.counts = {"kills": 0, "resumed": 0, "restarted": 0, "fresh": 0, "not_exact": 0, "state_differs": 0}
        self.by_write = {k: 0 for k in range(1, n_writes + 1)}
        self.failures: list[dict[str, Any]] = []

    def one(self, i: int, point: int, fresh: bool, heap_seeds: random.Random) -> None:
        """Kill run ``i`` at atomic write ``point``, resume or restart it, compare it with the reference."""
        from qkov.training import rundir

        out = self.work / f"k{i}"

        def run(argv: list[str], fault: str | None) -> int:
            if fresh:
                return run_fresh(argv, fault, self.err)[0]
            return run_forked(argv, fault, self.err, heap_seeds.randrange(2**31))[0]

        rc = run(["train", *self.flags, "--out", str(out)], f"kill:{point}")
        if rc != 137:
            sys.exit(f"kill {i} at write {point}: exit {rc}, expected 137: {self.err.read_text()[-2000:]}")
        kind = rundir.inspect(out)
        left: dict[str, Any] | None = None
        if kind == "resumable":
            step, state = _step_of(out / STATE), _tensors(out / STATE)
            if step not in self.first_state:
                self.first_state[step] = state
            else:
                left = diff_tensors(self.first_state[step], state)
            again = ["train", "--resume", "--out", str(out)]
        elif kind == "restartable":
            again = ["train", *self.flags, "--out", str(out)]
        else:
            sys.exit(f"kill {i} at write {point} left a {kind} directory")
        rc = run(again, None)
        if rc != 0:
            sys.exit(f"kill {i} at write {point} ({kind}): the second run exited {rc}: {self.err.read_text()[-2000:]}")
        problems = compare_runs(self.ref, out)
        c = self.counts
        c["kills"] += 1
        c["resumed" if kind == "resumable" else "restarted"] += 1
        c["fresh"] += fresh
        c["state_differs"] += left is not None
        self.by_write[point] += 1
        if not problems:
            shutil.rmtree(out)
            return
        c["not_exact"] += 1
        failure = {"kill": i, "write": point, "kind": kind, "fresh": fresh, "problems": problems, "state_at_kill": left}
        self.failures.append(failure)
        self.keep.mkdir(parents=True, exist_ok=True)
        shutil.move(str(out), self.keep / out.name)
        print(f"NOT EXACT: {json.dumps(failure, default=str)}", flush=True)

    def line(self, total: int, seconds: float) -> str:
        c = self.counts
        return (
            f"kills {c['kills']}/{total}  not exact {c['not_exact']}  killed state differs {c['state_differs']}  "
            f"(resumed {c['resumed']}, restarted {c['restarted']}, fresh processes {c['fresh']})  "
            f"{seconds / 60:.1f} min, {seconds / max(1, c['kills']):.2f} s per kill"
        )


def main() -> None:
    args = _arguments()
    work = Path(tempfile.mkdtemp(prefix="qkov-kills-"))
    corpus = work / "corpus"
    corpus.mkdir()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in CORPUS_MODULES:
        shutil.copy(stdlib / name, corpus / name)
    os.environ["QKOV_CACHE"] = str(work / "cache")
    flags = [*FLAGS, "--corpus", str(corpus)]
    err = work / "stderr.txt"
    machine = _machine(args.mkl_cnr)
    print(f"machine: {json.dumps(machine)}", flush=True)

    rnd = random.Random(args.seed)
    fresh_ref = work / "reference-fresh"  # also fills the token cache: later runs write only the run's files
    rc, _ = run_fresh(["train", *flags, "--out", str(fresh_ref)], None, err)
    if rc != 0:
        sys.exit(f"the uninterrupted run failed ({rc}): {err.read_text()[-2000:]}")
    ref = work / "reference"
    rc, n_writes = run_forked(["train", *flags, "--out", str(ref)], None, err, rnd.randrange(2**31))
    same = rc == 0 and compare_runs(ref, fresh_ref) is None
    print(f"{n_writes} atomic writes per run; a fresh `python -m qkov` run equals the forked one: {same}", flush=True)
    if not same and args.mkl_cnr == "auto":
        sys.exit("the forked harness does not reproduce a fresh process's run: its results would mean nothing")

    kills = Kills(work, flags, ref, n_writes, args.keep or work / "kept")
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # `kill PID` ends it with the summary
    t0 = time.perf_counter()
    try:
        for i in range(1, args.kills + 1):
            point = rnd.randint(1, n_writes)
            kills.one(i, point, args.fresh_every > 0 and i % args.fresh_every == 0, rnd)
            if i % args.every == 0 or i == args.kills:
                print(kills.line(args.kills, time.perf_counter() - t0), flush=True)
    except KeyboardInterrupt:
        print(f"stopped: {kills.line(args.kills, time.perf_counter() - t0)}", flush=True)
    result = {
        **kills.counts,
        "writes_per_run": n_writes,
        "kills_by_write": kills.by_write,
        "minutes": round((time.perf_counter() - t0) / 60, 1),
        **machine,
        "failures": kills.failures,
    }
    print(json.dumps({k: v for k, v in result.items() if k != "failures"}), flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=str))
    if kills.failures:
        print(f"runs that were not exact are kept in {kills.keep}", flush=True)
    else:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
