"""Every benchmark of docs/benchmarks.md, in turn, with one command.

    python3 -m pip install -e '.[peer]'                  # TransformerLens 3.9.0 (TL below), the peer
    python3 benchmarks/run_all.py                        # all of them: hours on a 2-core CPU
    python3 benchmarks/run_all.py --only train,circuits  # some of them
    python3 benchmarks/run_all.py --skip llama8b,kills   # all but these (the Llama-3-8B shape writes 15 GiB to /tmp)
    python3 benchmarks/run_all.py --list                 # the commands, run nothing

Each benchmark runs as its own process, from the repository root, one after the other (timings taken
while other work shares the machine are noise: run them on a quiet one). What each prints is shown
and kept in ``--out`` (default ``bench-results/DATE/NAME.txt``); the end is a summary of every
benchmark's exit status and wall time, and the exit status is 1 when any failed. A benchmark whose
input is missing (the tour's run for ``dynamics``, a GPU for ``gpu``) is skipped with the reason.
"""

from __future__ import annotations

import argparse
import datetime
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Bench:
    name: str
    argv: tuple[str, ...]
    what: str
    needs: str = ""  # a path under the repository that must exist, or "cuda" / "torchrun"


BENCHES = (
    Bench("train", ("bench_train.py",), "training and forward tokens/s vs TransformerLens, share of the matmul peak"),
    Bench("circuits", ("bench_circuits.py",), "copying, composition, top-k, skip-trigrams at GPT-2-small shape vs TL"),
    Bench("paths", ("bench_paths.py",), "path expansion + term importance + term effects"),
    Bench("real-size", ("bench_real_size.py", "--floor"), "every command at GPT-2-small size vs TL, FLOP floors"),
    Bench("patching", ("bench_patching.py", "--repeat", "3"), "activation patching at GPT-2-small shape vs TL"),
    Bench("circuit", ("bench_circuit.py", "--size", "gpt2"), "circuit discovery at GPT-2-small shape vs AutoCircuit 1.0.1"),
    Bench("interop", ("bench_interop.py",), "import and export at GPT-2-small shape: time, logit agreement"),
    Bench("pythia", ("bench_modern.py", "pythia"), "Pythia-160M shape: copying + composition vs TransformerLens"),
    Bench("llama8b", ("bench_modern.py", "llama8b"), "Llama-3-8B shape (15 GiB bfloat16 under /tmp) memory-mapped"),
    Bench("bigger-than-memory", ("bench_bigger_than_memory.py",), "a 5.3 GiB checkpoint under a 1.5 GiB limit"),
    Bench("dynamics", ("bench_dynamics.py",), "qkov dynamics over the tour's 2-layer snapshots; core work vs TL",
          needs="runs/tour/qkov-2l/snapshots"),
    Bench("explore", ("bench_explore.py",), "qkov explore's views at GPT-2-small shape, through HTTP"),
    Bench("explore-8b", ("bench_explore.py", "--size", "llama3-8b", "--card"),
          "qkov explore streaming a Llama-3-8B shape (15 GiB bfloat16 under /tmp): first text, peak memory"),
    Bench("split", ("bench_split.py", "--layers", "8"), "Llama-3-8B-shape composition split over 2 torchrun ranks",
          needs="torchrun"),
    Bench("null-scores", ("null_scores.py",), "head scores of untrained models (behind the role thresholds)"),
    Bench("kills", ("bench_kills.py",), "2,000 kills of a training run, each resume compared bit for bit"),
    Bench("induction-sweep", ("induction_sweep.py", "--grid", "defaults", "--steps", "4000", "--stop-at", "0.4"),
          "tokens to induction heads for the training settings compared (docs/training.md)"),
    Bench("gpu", ("gpu_check.py",), "the default models trained on a GPU: tokens/s, the tour's time", needs="cuda"),
)


def missing(bench: Bench) -> str:
    """Why ``bench`` cannot run here ("" when it can)."""
    if bench.needs == "torchrun":
        return "" if shutil.which("torchrun") else "torchrun is not on the path"
    if bench.needs == "cuda":
        import torch  # only to ask for a GPU

        return "" if torch.cuda.is_available() else "no CUDA GPU"
    if bench.needs and not (ROOT / bench.needs).exists():
        return f"{bench.needs} is missing (run `qkov tour` first)"
    return ""


def command(bench: Bench) -> list[str]:
    return [sys.executable, str(ROOT / "benchmarks" / bench.argv[0]), *bench.argv[1:]]


def run_one(bench: Bench, out: Path) -> tuple[str, float]:
    """Runs one benchmark, its output shown and written to ``out/NAME.txt``: (status, seconds)."""
    why = missing(bench)
    if why:
        print(f"== {bench.name}: skipped ({why})", flush=True)
        return f"skipped: {why}", 0.0
    print(f"== {bench.name}: {' '.join(command(bench)[1:])}", flush=True)
    start = time.perf_counter()
    with open(out / f"{bench.name}.txt", "w", encoding="utf-8") as log:
        proc = subprocess.Popen(command(bench), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            log.write(line)
        code = proc.wait()
    return ("ok" if code == 0 else f"failed (exit {code})"), time.perf_counter() - start


def chosen(only: str, skip: str) -> tuple[list[Bench], list[str]]:
    """The benchmarks ``--only`` and ``--skip`` leave, and the names they give that are not benchmarks."""
    names = {b.name for b in BENCHES}
    want = {n for n in only.split(",") if n} or names
    drop = {n for n in skip.split(",") if n}
    return [b for b in BENCHES if b.name in want and b.name not in drop], sorted((want | drop) - names)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="comma-separated names to run (default: all)")
    ap.add_argument("--skip", default="", help="comma-separated names to leave out")
    ap.add_argument("--out", type=Path, default=None, help="folder for the outputs (default bench-results/DATE)")
    ap.add_argument("--list", action="store_true", help="print each benchmark's name and command, run nothing")
    args = ap.parse_args(argv)
    benches, unknown = chosen(args.only, args.skip)
    if unknown:
        ap.error(f"unknown benchmark {', '.join(unknown)} (known: {', '.join(b.name for b in BENCHES)})")
    if args.list:
        for b in benches:
            print(f"{b.name:20} python3 benchmarks/{' '.join(b.argv):60} {b.what}")
        return 0
    out = args.out or ROOT / "bench-results" / datetime.date.today().isoformat()
    out.mkdir(parents=True, exist_ok=True)
    results = [(b, *run_one(b, out)) for b in benches]
    print("\n== summary (outputs in %s)" % out)
    for b, status, seconds in results:
        print(f"{b.name:20} {status:30} {seconds:8.0f} s")
    return 1 if any(status.startswith("failed") for _, status, _ in results) else 0


if __name__ == "__main__":
    sys.exit(main())
