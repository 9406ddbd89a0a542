"""Analyses split over processes: Llama-3-8B-shape composition (and copying) under torchrun vs one process.

The Llama-3-8B shape of ``bench_modern.py llama8b`` (random bfloat16 weights written shard by shard,
read memory-mapped), or a slice of its first ``--layers`` layers (``--layers 8``: 28 of the 496
pairs of layers, ~5 GiB on disk; the full model is 16 GiB and ~10 min a run on 2 cores). Each
stage runs in one process (``torch`` on every core) and under ``torchrun --nproc-per-node N``
(each rank on cores / N threads: qkov.apps.ranks), alternately, ``--repeat`` times:

* composition: ``composition_raw(ck, "qkv")``, every Q/K/V pair (Q/K over the default 12 offsets),
  split by pairs of layers;
* copying (``--copying``): ``copying_scores(ck, diag_k=None)``, the eigenvalue copying score of
  every head's full OV circuit, split by heads (``W_U W_E`` is formed on every rank).

Prints each run's time, the ratio one process / N ranks, whether the scores are identical
(``torch.equal``, NaN where no pair) and the per-unit costs docs/real-size.md projects from
(seconds per pair of layers, per head). Timings on a shared machine are noisy: compare the runs
taken in the same minutes.

    python benchmarks/bench_split.py --layers 8            # development: a slice, ~1-2 min a run
    python benchmarks/bench_split.py --ranks 2 --copying   # the full shape (the lead's run)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_modern import ROOT, build_llama

HERE = Path(__file__).resolve()


def worker(stage: str, path: Path, out: Path) -> None:
    """One stage on the checkpoint at ``path`` (under torchrun: this rank's share); rank 0 saves the
    scores to ``out`` and prints its time as JSON."""
    import torch

    from qkov.analysis.circuits.copying import copying_scores
    from qkov.analysis.circuits.composition import composition_raw
    from qkov.apps.ranks import ranks
    from qkov.weights import LazyCheckpoint

    torch.set_grad_enabled(False)
    with ranks(torch.device("cpu")) as (split, _):
        ck = LazyCheckpoint(path)
        t, cpu = time.perf_counter(), time.process_time()
        if stage == "composition":
            scores = composition_raw(ck, "qkv")
        else:
            rows = copying_scores(ck, diag_k=None).heads
            scores = {"eigen": torch.tensor([[h.eigen_score, h.residual_eigen_score] for h in rows])}
        seconds = time.perf_counter() - t
        cpu = sum(split.gather({split.rank: time.process_time() - cpu}, split.world))  # every rank's CPU time
        threads = torch.get_num_threads()
    if split.main:
        torch.save(scores, out)
        print(json.dumps({"seconds": seconds, "cpu_s": cpu, "ranks": split.world, "threads": threads}))


def _run(stage: str, path: Path, ranks: int, out: Path) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # qkov.apps.ranks sets the threads
    cmd = [sys.executable, str(HERE), "--worker", stage, str(path), str(out)]
    if ranks > 1:
        tr = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
        cmd = [*tr, *cmd[1:]]
    res = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
    if res.returncode or not lines:
        raise SystemExit(f"{stage} with {ranks} rank(s) failed (exit {res.returncode}); its stderr is above")
    return json.loads(lines[-1])


def _same(a: dict, b: dict) -> tuple[bool, float]:  # type: ignore[type-arg]
    import torch

    equal = all(torch.equal(a[k].nan_to_num(-7.0), b[k].nan_to_num(-7.0)) for k in a)
    diff = max(float((a[k] - b[k]).nan_to_num(0.0).abs().max()) for k in a)
    return equal, diff


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=None, help="a slice of the first LAYERS layers (default: all 32)")
    ap.add_argument("--ranks", type=int, default=2, help="processes under torchrun (default 2)")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each, alternating (default 1)")
    ap.add_argument("--copying", action="store_true", help="also the eigenvalue copying scores, split by heads")
    ap.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        worker(a.worker[0], Path(a.worker[1]), Path(a.worker[2]))
        return 0
    import torch

    name = "qkov-llama8b" if a.layers in (None, 32) else f"qkov-llama8b-{a.layers}layers"
    path = build_llama(ROOT / name, layers=a.layers)
    L = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    print(f"Llama-3-8B shape, {L} layers ({path}), {os.cpu_count()} cores; one process vs {a.ranks} ranks", flush=True)
    units = {"composition": (L * (L - 1) // 2, "pair of layers"), "copying": (L * 32, "head")}
    with tempfile.TemporaryDirectory() as tmp:
        for stage in ["composition"] + (["copying"] if a.copying else []):
            one, many = [], []
            for i in range(a.repeat):
                one.append(_run(stage, path, 1, Path(tmp) / "one.pt"))
                many.append(_run(stage, path, a.ranks, Path(tmp) / "many.pt"))
                o, m = one[-1], many[-1]
                print(f"  {stage} run {i + 1}: one process {o['seconds']:.1f} s ({o['threads']} threads, CPU "
                      f"{o['cpu_s']:.0f} s), {a.ranks} ranks {m['seconds']:.1f} s ({m['threads']} thread(s) each, "
                      f"CPU {m['cpu_s']:.0f} s in all)", flush=True)  # fmt: skip
            equal, diff = _same(torch.load(Path(tmp) / "one.pt"), torch.load(Path(tmp) / "many.pt"))
            t1, tn = min(r["seconds"] for r in one), min(r["seconds"] for r in many)
            n, unit = units[stage]
            print(f"  {stage}: {t1 / tn:.2f}x faster with {a.ranks} ranks (best runs {t1:.1f} s / {tn:.1f} s); "
                  f"scores {'identical' if equal else 'DIFFERENT'} (max abs difference {diff:.1e}); "
                  f"{t1 / n:.2f} s per {unit} in one process, {tn * a.ranks / n:.2f} rank-seconds per {unit} split", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
