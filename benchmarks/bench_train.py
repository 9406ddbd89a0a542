"""Training and forward throughput: qkov vs TransformerLens 3.9.0 on the same model, same run.

Model (the foundation issue's): 2 layers x 8 heads, d_model 256, d_head 32, vocab 4096,
context 256, batch 8, shortformer positions, attention-only, no LayerNorm, AdamW.
Both libraries train on the same random token batches; each measurement runs in its
own subprocess so that peak memory (max RSS) belongs to one library alone. qkov is
measured twice: in float32 (like for like with TransformerLens) and with bf16 matrix
products (``qkov train --precision bf16``, the default where the CPU has AMX or the GPU
has bf16); the ratio that compares like with like is the float32 one.

    python benchmarks/bench_train.py            # both libraries, 3 repeats, medians
    python benchmarks/bench_train.py --repeats 5 --json results.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from peak import peak_mib  # this process's own peak (ru_maxrss counts a forked parent's)

CFG = dict(n_layers=2, n_heads=8, d_model=256, d_head=32, d_vocab=4096, n_ctx=256)
BATCH = 8


def _tokens(n: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, CFG["d_vocab"], (BATCH, CFG["n_ctx"]), generator=g) for _ in range(n)]


def _build(lib: str):
    import torch

    if lib.startswith("qkov"):
        import qkov
        from qkov.device import tune_cpu_allocator
        from qkov.training.losses import model_loss

        tune_cpu_allocator()  # part of qkov's training path on CPU (so is flushing denormals)
        torch.set_flush_denormal(True)
        model = qkov.Transformer(qkov.ModelConfig(**CFG), seed=0)
        bf16 = lib == "qkov-bf16"

        def loss(toks):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                return model_loss(model, toks)

        def fwd(toks):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                return model(toks)

        return model, loss, fwd
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    cfg = HookedTransformerConfig(
        n_layers=CFG["n_layers"],
        n_heads=CFG["n_heads"],
        d_model=CFG["d_model"],
        d_head=CFG["d_head"],
        d_vocab=CFG["d_vocab"],
        n_ctx=CFG["n_ctx"],
        attn_only=True,
        normalization_type=None,
        positional_embedding_type="shortformer",
        device="cpu",
        seed=0,
    )
    model = HookedTransformer(cfg)

    def loss(toks):
        return model(toks, return_type="loss")

    return model, loss, lambda toks: model(toks)


def worker(lib: str, task: str, steps: int) -> dict[str, float]:
    import torch

    torch.set_num_threads(max(1, len(__import__("os").sched_getaffinity(0))))
    model, loss_fn, fwd = _build(lib)
    batches = _tokens(steps + 3, seed=1)
    if task == "train":
        # each library's own choice: qkov train uses the fused AdamW kernel
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=lib.startswith("qkov"))
        for i, toks in enumerate(batches):
            if i == 3:
                t0 = time.perf_counter()
            loss = loss_fn(toks)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            float(loss.detach())
    else:
        with torch.no_grad():
            for i, toks in enumerate(batches):
                if i == 3:
                    t0 = time.perf_counter()
                fwd(toks).sum().item()
    dt = time.perf_counter() - t0
    rss_mib = peak_mib()
    return {"tokens_per_s": steps * BATCH * CFG["n_ctx"] / dt, "peak_rss_mib": rss_mib}


def measure(lib: str, task: str, steps: int) -> dict[str, float]:
    res = subprocess.run(
        [sys.executable, __file__, "--worker", lib, task, str(steps)], capture_output=True, text=True, check=False
    )
    if res.returncode != 0:
        raise RuntimeError(f"{lib} {task} failed:\n{res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--train-steps", type=int, default=15)
    ap.add_argument("--forward-steps", type=int, default=30)
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        lib, task, steps = args.worker
        print(json.dumps(worker(lib, task, int(steps))))
        return 0
    try:
        import transformer_lens  # noqa: F401
    except ImportError:
        print("transformer-lens is not installed: pip install -e '.[peer]'", file=sys.stderr)
        return 2
    results: dict[str, dict[str, dict[str, float]]] = {}
    for task, steps in (("train", args.train_steps), ("forward", args.forward_steps)):
        results[task] = {}
        runs: dict[str, list[dict[str, float]]] = {"qkov-fp32": [], "qkov-bf16": [], "transformer_lens": []}
        for _ in range(args.repeats):  # interleave the libraries so machine noise hits both
            for lib in runs:
                runs[lib].append(measure(lib, task, steps))
        for lib, rs in runs.items():
            results[task][lib] = {
                "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
                "peak_rss_mib": max(r["peak_rss_mib"] for r in rs),
            }
    print(f"model: {CFG}, batch {BATCH}, medians of {args.repeats} interleaved runs")
    print(f"{'task':<8} {'qkov':<5} {'qkov tok/s':>11} {'TL tok/s':>10} {'ratio':>7} {'qkov MiB':>9} {'TL MiB':>8}")
    for task, r in results.items():
        t = r["transformer_lens"]
        for variant in ("qkov-fp32", "qkov-bf16"):
            q = r[variant]
            ratio = q["tokens_per_s"] / t["tokens_per_s"]
            q["ratio_vs_tl"] = ratio
            print(
                f"{task:<8} {variant[5:]:<5} {q['tokens_per_s']:>11,.0f} {t['tokens_per_s']:>10,.0f} {ratio:>6.2f}x "
                f"{q['peak_rss_mib']:>9.0f} {t['peak_rss_mib']:>8.0f}"
            )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
