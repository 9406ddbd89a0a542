"""Why two fresh processes could train the same seed into different bits: MKL's vector-math (VML)
first-call race, counted over many fresh processes, with and without qkov's warm-up.

torch computes ``exp``, ``log``, ``sqrt``... of a large float tensor on an x86 CPU by splitting it
between its threads, each calling MKL VML (``vmsExp(n, in, out, VML_HA | ...)``) on its part. MKL
picks each function's kernel on that function's first call; when the first call comes from two
threads at once, MKL 2024.2 (in torch 2.x wheels) can compute one thread's part with its AVX2
``VML_EP`` kernel (errors of hundreds to thousands of units in the last place). The next call is
right, so a rerun in the same process looks clean.

Each child here is a fresh ``python``: it sets the thread count, runs one parallel region (so the
worker threads exist and start together, as in a training step), then calls every function of
:data:`qkov.device.VECTOR_MATH` twice on the same 1M floats and reports the functions whose first
call differs from the second. ``--mode torch`` imports torch alone (and sets MKL's reproducible mode
as qkov does, so only the warm-up differs); ``--mode qkov`` imports qkov first, whose import calls
:func:`qkov.device.settle_vector_math`. Children run ``--concurrent`` at a time (load makes the race
likelier).

    python benchmarks/vml_race.py --mode torch --processes 400
    python benchmarks/vml_race.py --mode qkov --processes 400
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

CHILD = r"""
import ctypes, json, os, sys
from pathlib import Path
import torch
if sys.argv[1] == "qkov":
    import qkov
    from qkov.device import VECTOR_MATH
else:
    lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
    lib.mkl_serv_cbwr_set(2)  # MKL's reproducible mode (CNR AUTO), as qkov sets it: only the warm-up differs
    VECTOR_MATH = tuple(sys.argv[3].split(","))
torch.set_num_threads(int(sys.argv[2]))
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(8, 4, 128, 16, generator=g) for _ in range(3))
torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # the worker threads exist and spin
x = torch.rand(1 << 20, generator=g) * 0.98 + 0.01  # in every function's domain
bad = {}
for name in VECTOR_MATH:
    fn = getattr(torch, name)
    first, second = fn(x), fn(x)
    differ = first != second
    if bool(differ.any()):
        ulps = (first.view(torch.int32).long() - second.view(torch.int32).long()).abs().max()
        bad[name] = {"elements": int(differ.sum()), "max_ulps": int(ulps)}
print(json.dumps(bad))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=("torch", "qkov"), required=True)
    ap.add_argument("--processes", type=int, default=200)
    ap.add_argument("--concurrent", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    src = Path(__file__).resolve().parents[1] / "src"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(src), os.environ.get("PYTHONPATH")]))}
    env.pop("MKL_CBWR", None)
    sys.path.insert(0, str(src))
    from qkov.device import VECTOR_MATH

    argv = [sys.executable, "-c", CHILD, args.mode, str(args.threads), ",".join(VECTOR_MATH)]
    per_function: Counter[str] = Counter()
    worst: dict[str, int] = {}
    hit, done, t0 = 0, 0, time.perf_counter()
    while done < args.processes:
        wave = min(args.concurrent, args.processes - done)
        procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env) for _ in range(wave)]
        for p in procs:
            out, _ = p.communicate()
            if p.returncode != 0:
                sys.exit(f"a child failed ({p.returncode})")
            bad = json.loads(out.strip().splitlines()[-1])
            hit += bool(bad)
            for name, what in bad.items():
                per_function[name] += 1
                worst[name] = max(worst.get(name, 0), what["max_ulps"])
        done += wave
    result = {
        "mode": args.mode,
        "processes": done,
        "processes_with_a_wrong_first_call": hit,
        "wrong_first_calls": sum(per_function.values()),
        "first_calls": done * len(VECTOR_MATH),
        "by_function": dict(per_function),
        "max_ulps": worst,
        "threads": args.threads,
        "concurrent": args.concurrent,
        "torch": __import__("torch").__version__,
        "minutes": round((time.perf_counter() - t0) / 60, 1),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
