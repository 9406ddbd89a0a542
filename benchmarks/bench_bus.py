"""The residual bus before and after a change to it: each variant of ``qkov architectures`` trained with
another version of ``qkov/model/bus.py`` (``--before``, e.g. one written out by ``git show REV:src/qkov/model/bus.py``)
and with this checkout's, step by step alternated in one process, so that both see the same machine.

    git show 62dd763:src/qkov/model/bus.py > /tmp/bus_before.py
    python benchmarks/bench_bus.py --before /tmp/bus_before.py                 # the study's model, 1 thread
    python benchmarks/bench_bus.py --before /tmp/bus_before.py --shape bench   # bench_train.py's model

With one thread (the default) each step is timed in CPU time (``time.process_time``), which other work on a
shared machine does not inflate as much as it does wall time; with more threads, wall time (a quiet machine
only). Prints each variant's tokens/s before and after, each against the standard model's, and after/before.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time

import torch

import qkov.model.transformer as transformer
from qkov import ModelConfig, Transformer
from qkov.apps.architectures import VARIANTS, variant_config
from qkov.device import flush_denormals, settle_vector_math, tune_cpu_allocator
from qkov.training.losses import model_loss

BENCH = dict(n_layers=2, n_heads=8, d_model=256, d_head=32, d_vocab=4096, n_ctx=256)  # bench_train.py's model
SHAPES = {"study": (None, 16), "bench": (BENCH, 8)}  # the base model (None: the study's) and the batch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, help="the other bus.py")
    ap.add_argument("--shape", choices=SHAPES, default="study")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--pairs", type=int, default=8, help="steps timed per version and variant (medians)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tune_cpu_allocator()  # as training does
    flush_denormals()
    settle_vector_math()
    spec = importlib.util.spec_from_file_location("qkov.model._bus_before", args.before)
    before = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(before)  # type: ignore[union-attr]
    versions = {"before": before.make_pass, "after": transformer.make_pass}
    base, batch = SHAPES[args.shape]
    cfg0 = ModelConfig(**base) if base else None
    gen = torch.Generator().manual_seed(0)
    vocab = cfg0.d_vocab if cfg0 else ModelConfig().d_vocab
    batches = [torch.randint(0, vocab, (batch, 256), generator=gen) for _ in range(4)]
    clock = time.process_time if args.threads == 1 else time.perf_counter
    names = args.variants.split(",")
    print(f"model: {args.shape}, batch {batch} x 256, {args.threads} thread(s), medians of {args.pairs} steps")
    std: tuple[float, float] | None = None
    for name in ["standard", *[n for n in names if n != "standard"]]:
        model = Transformer(variant_config(name, cfg0), seed=0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        times: dict[str, list[float]] = {"before": [], "after": []}
        for i in range(args.pairs + 1):  # the first pair warms up; the order alternates
            for version in ("after", "before") if i % 2 else ("before", "after"):
                transformer.make_pass = versions[version]
                t0 = clock()
                loss = model_loss(model, batches[i % 4])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                float(loss.detach())
                if i:
                    times[version].append(clock() - t0)
        transformer.make_pass = versions["after"]
        b, a = statistics.median(times["before"]), statistics.median(times["after"])
        std = std or (b, a)
        rate = batch * 256
        print(
            f"{name:<14} before {rate / b:>9,.0f} tok/s ({std[0] / b:.2f}x standard)   "
            f"after {rate / a:>9,.0f} tok/s ({std[1] / a:.2f}x standard)   after/before {b / a:.2f}"
        )


if __name__ == "__main__":
    main()
