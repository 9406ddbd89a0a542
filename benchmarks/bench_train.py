"""Training and forward throughput: qkov vs TransformerLens 3.9.0 on the same model, same run.

Model (the foundation issue's): 2 layers x 8 heads, d_model 256, d_head 32, vocab 4096,
context 256, batch 8, shortformer positions, attention-only, no LayerNorm, AdamW.
Both libraries train on the same random token batches; each measurement runs in its
own subprocess so that peak memory (max RSS) belongs to one library alone. qkov is
measured twice: in float32 (like for like with TransformerLens) and with bf16 matrix
products (``qkov train --precision bf16``; the default is float32); the ratio that compares
like with like is the float32 one.

Against the machine's limit: each qkov run's achieved FLOP/s (tokens/s x
``qkov.analysis.forward.tracer.flops_per_token``, x3 for a training step: forward + backward) is
printed as a share of a measured matmul peak: ``torch.matmul`` into preallocated outputs, timed
in its own subprocess with the same threads, on each of this model's own products alone (the
Q/K/V, output and unembedding projections of batch x context tokens, the batched attention
products, and for training each one's two backward products) and on a 2048-square product, in
float32 and in bfloat16; the peak is the fastest of them (the step's products back to back, the
"mix", are printed beside it: its small attention products run far below the peak).

Then the variants of ``qkov architectures`` (Attention Residuals, hyper-connections, mHC, gated
attention, looped depth; docs/architectures.md) on the same model and batches: each one's training
throughput in float32 beside the standard model's, and the ratio (the cost of its extra).

    python benchmarks/bench_train.py            # both libraries, 3 repeats, medians, then the variants
    python benchmarks/bench_train.py --repeats 5 --json results.json
    python benchmarks/bench_train.py --variants-only   # the variants' table alone
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from matmul_rate import matmul_rate
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
        cfg = qkov.ModelConfig(**CFG)
        if lib.startswith("qkov-variant:"):  # a variant of the architectures study, float32
            from qkov.apps.architectures import variant_config

            cfg = variant_config(lib.split(":", 1)[1], cfg)
        model = qkov.Transformer(cfg, seed=0)
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


def gemm_shapes(task: str) -> list[tuple[int, int, int, int]]:
    """``(batch, m, k, n)`` of every matrix product of one step of the model: ``[batch, m, k] @
    [batch, k, n]``. Forward: Q, K, V and O projections, the attention products per head, the
    unembedding; training adds each product's two backward ones (``dX = dY W^T``, ``dW = X^T dY``)."""
    N, D, HE, V = BATCH * CFG["n_ctx"], CFG["d_model"], CFG["n_heads"] * CFG["d_head"], CFG["d_vocab"]
    T, E, BH = CFG["n_ctx"], CFG["d_head"], BATCH * CFG["n_heads"]
    fwd = [(1, N, D, HE)] * 3 + [(1, N, HE, D), (BH, T, E, T), (BH, T, T, E)]
    fwd = fwd * CFG["n_layers"] + [(1, N, D, V)]
    if task == "forward":
        return fwd
    back = [(b, m, n, k) for b, m, k, n in fwd] + [(b, k, m, n) for b, m, k, n in fwd]
    return fwd + back


def matmul_peak(task: str, dtype_name: str, seconds: float = 1.0) -> dict[str, float]:
    """The device's matmul limit for this model's work (:func:`matmul_rate.matmul_rate`: outputs
    preallocated), timed on each of :func:`gemm_shapes`' distinct products alone and on a 2048-square
    one; ``flops_per_s`` is the best of them (no product of this work runs faster here),
    ``mix_flops_per_s`` the rate of the step's products back to back (the small attention ones drag
    it down)."""
    shapes = gemm_shapes(task)
    matmul_rate(shapes, dtype_name, seconds)  # warm up
    alone = [matmul_rate([s], dtype_name, seconds) for s in sorted(set(shapes))]
    alone.append(matmul_rate([(1, 2048, 2048, 2048)], dtype_name, seconds))
    return {"flops_per_s": max(alone), "mix_flops_per_s": matmul_rate(shapes, dtype_name, seconds)}


def worker(lib: str, task: str, steps: int) -> dict[str, float]:
    import torch

    torch.set_num_threads(max(1, len(__import__("os").sched_getaffinity(0))))
    if lib.startswith("peak-"):
        with torch.no_grad():
            return matmul_peak(task, lib[5:])
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


def _report(results: dict[str, dict[str, dict[str, float]]], repeats: int) -> None:
    from qkov import ModelConfig
    from qkov.analysis.forward.tracer import flops_per_token

    per_token = flops_per_token(ModelConfig(**CFG))
    print(f"model: {CFG}, batch {BATCH}, medians of {repeats} interleaved runs")
    print(f"flops_per_token {per_token:,} (forward; a training step counts 3x); matmul peak: the fastest")
    print("torch.matmul of this model's own products (or 2048-square), same threads (TL's share: at the float32 peak)")
    head = f"{'task':<8} {'qkov':<5} {'qkov tok/s':>11} {'TL tok/s':>10} {'ratio':>7} {'qkov MiB':>9} {'TL MiB':>8}"
    print(head + f" {'GFLOP/s':>8} {'peak':>8} {'mix':>6} {'share':>6} {'TL share':>8}")
    for task, r in results.items():
        t, mult = r["transformer_lens"], 3 if task == "train" else 1
        for variant, peak in (("qkov-fp32", "peak-float32"), ("qkov-bf16", "peak-bfloat16")):
            q = r[variant]
            ratio = q["tokens_per_s"] / t["tokens_per_s"]
            q["ratio_vs_tl"] = ratio
            q["flops_per_s"] = q["tokens_per_s"] * per_token * mult
            q["share_of_peak"] = q["flops_per_s"] / r[peak]["flops_per_s"]
            tl_share = t["tokens_per_s"] * per_token * mult / r["peak-float32"]["flops_per_s"]
            print(
                f"{task:<8} {variant[5:]:<5} {q['tokens_per_s']:>11,.0f} {t['tokens_per_s']:>10,.0f} {ratio:>6.2f}x "
                f"{q['peak_rss_mib']:>9.0f} {t['peak_rss_mib']:>8.0f} {q['flops_per_s'] / 1e9:>8.1f} "
                f"{r[peak]['flops_per_s'] / 1e9:>8.1f} {r[peak]['mix_flops_per_s'] / 1e9:>6.1f} "
                f"{q['share_of_peak']:>6.1%} {tl_share:>8.1%}"
            )


def variants_table(repeats: int, steps: int) -> dict[str, dict[str, float]]:
    """Training throughput of every variant of ``qkov architectures`` beside the standard model's."""
    from qkov.apps.architectures import VARIANTS

    runs: dict[str, list[dict[str, float]]] = {name: [] for name in VARIANTS}
    for _ in range(repeats):  # interleaved, as above
        for name in runs:
            runs[name].append(measure(f"qkov-variant:{name}", "train", steps))
    out = {name: {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
                  "peak_rss_mib": max(r["peak_rss_mib"] for r in rs)} for name, rs in runs.items()}  # fmt: skip
    base = out["standard"]["tokens_per_s"]
    print(f"\nqkov architectures variants: training, float32, model {CFG}, batch {BATCH}, medians of {repeats}")
    print(f"{'variant':<15} {'config':<48} {'tok/s':>9} {'vs standard':>12} {'MiB':>6}")
    for name, r in out.items():
        r["vs_standard"] = r["tokens_per_s"] / base
        conf = ", ".join(f"{k}={v}" for k, v in VARIANTS[name].items()) or "-"
        print(f"{name:<15} {conf:<48} {r['tokens_per_s']:>9,.0f} {r['vs_standard']:>11.2f}x {r['peak_rss_mib']:>6.0f}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--train-steps", type=int, default=15)
    ap.add_argument("--forward-steps", type=int, default=30)
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--variants-only", action="store_true", help="only the architectures variants' table")
    ap.add_argument("--no-variants", action="store_true", help="skip the architectures variants' table")
    ap.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        lib, task, steps = args.worker
        print(json.dumps(worker(lib, task, int(steps))))
        return 0
    if args.variants_only:
        variants = variants_table(args.repeats, args.train_steps)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"variants": variants}, fh, indent=2)
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
        runs |= {"peak-float32": [], "peak-bfloat16": []}
        for _ in range(args.repeats):  # interleave the libraries so machine noise hits both
            for lib in runs:
                runs[lib].append(measure(lib, task, steps))
        for lib, rs in runs.items():
            pick = {k: max if k == "peak_rss_mib" else statistics.median for k in rs[0]}
            results[task][lib] = {k: f(r[k] for r in rs) for k, f in pick.items()}
    _report(results, args.repeats)
    if not args.no_variants:
        results["variants"] = variants_table(args.repeats, args.train_steps)  # type: ignore[assignment]
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
