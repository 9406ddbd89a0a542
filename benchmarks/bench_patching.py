"""Activation patching at GPT-2-small shape: qkov vs TransformerLens 3.9.0's ``patching`` module, same run.

A GPT-2-small-shaped model (12 layers x 12 heads, d_model 768, d_mlp 3072, vocab 50257, LayerNorm,
biases; random weights, seeded) is written once to disk, as a qkov checkpoint and as a
TransformerLens state-dict file of the same weights. Each library loads it its usual way (qkov:
``Weights.from_source(LazyCheckpoint(path))``, the folded view read layer by layer from the memory
map; TransformerLens: ``HookedTransformer`` + ``load_state_dict`` + ``process_weights_``), then patches a 64-token clean/corrupted pair (the
corrupted one differs at 8 positions) with a logit-difference metric at the last position:

  (a) every head's output, all positions: 144 patches (TransformerLens:
      ``get_act_patch_attn_head_out_all_pos``; qkov: ``activation_patching(site="z")``);
  (b) the residual stream by layer and position: 12 x 64 = 768 patches
      (``get_act_patch_resid_pre``; qkov: ``site="resid_pre"``).

Both give the same numbers (the largest difference is printed). Every measurement runs in its own
subprocess, so its peak memory (max RSS, the loaded model included) is its own; the time is the
patching call alone, the load is printed beside it. The model is built in a subprocess too and this
process never imports torch: Linux carries a forked parent's resident size into the child's
``ru_maxrss``, which would count the parent's model in every measurement.

    python benchmarks/bench_patching.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from peak import peak_mib  # this process's own peak (ru_maxrss counts a forked parent's)

SHAPE = dict(
    n_layers=12, n_heads=12, d_model=768, d_head=64, d_mlp=3072, d_vocab=50257, n_ctx=1024,
    normalization="layernorm", positional="standard", act_fn="gelu_new", bias=True,
)  # fmt: skip
SEQ, CHANGED = 64, 8
TASKS = {"head_out": "get_act_patch_attn_head_out_all_pos", "resid_pre": "get_act_patch_resid_pre"}


def build(root: Path) -> None:
    """The model, once: a qkov checkpoint and a TransformerLens file of the same weights."""
    import torch

    import qkov
    from qkov.io import save_tl

    model = qkov.Transformer(qkov.ModelConfig(**SHAPE), seed=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.rsplit(".", 1)[-1].startswith("W_"):
                p.add_(torch.randn_like(p) * 0.05)
    qkov.save_checkpoint(root / "qkov", model)
    save_tl(model, root / "tl.safetensors")


def tokens():  # type: ignore[no-untyped-def]
    import torch

    g = torch.Generator().manual_seed(1)
    clean = torch.randint(1, SHAPE["d_vocab"], (1, SEQ), generator=g)
    corrupted = clean.clone()
    at = torch.randperm(SEQ - 1, generator=g)[:CHANGED] + 1
    corrupted[0, at] = torch.randint(1, SHAPE["d_vocab"], (CHANGED,), generator=g)
    return clean, corrupted, int(clean[0, -1]), int(clean[0, 5])


def worker(lib: str, task: str, root: Path) -> dict[str, object]:
    import torch

    torch.set_grad_enabled(False)
    clean, corrupted, a, b = tokens()
    t0 = time.perf_counter()
    if lib == "qkov":
        import qkov
        from qkov.analysis.causal.metrics import LogitDiff

        w = qkov.Weights.from_source(qkov.LazyCheckpoint(root / "qkov"))  # read layer by layer, no model beside it
        loaded = time.perf_counter() - t0
        t1 = time.perf_counter()
        site = "z" if task == "head_out" else "resid_pre"
        out = qkov.activation_patching(w, clean, corrupted, site=site, metric=LogitDiff(correct=a, incorrect=b)).values
    else:
        from safetensors.torch import load_file
        from transformer_lens import HookedTransformer, HookedTransformerConfig, patching
        from safetensors import safe_open

        with safe_open(str(root / "tl.safetensors"), "pt") as f:
            config = json.loads(f.metadata()["transformer_lens_config"])
        model = HookedTransformer(HookedTransformerConfig(**config))
        model.load_state_dict(load_file(str(root / "tl.safetensors")))
        model.process_weights_(fold_ln=True, center_writing_weights=True, center_unembed=True)
        model.eval()
        loaded = time.perf_counter() - t0
        _, clean_cache = model.run_with_cache(clean)

        def metric(logits: torch.Tensor) -> torch.Tensor:
            return logits[0, -1, a] - logits[0, -1, b]

        t1 = time.perf_counter()
        out = getattr(patching, TASKS[task])(model, corrupted, clean_cache, metric)
    seconds = time.perf_counter() - t1
    peak = peak_mib()
    return {"seconds": seconds, "load_s": loaded, "peak_rss_mib": peak, "out": out.flatten().tolist()}


def measure(lib: str, task: str, root: Path) -> dict[str, object]:
    res = subprocess.run([sys.executable, __file__, "--worker", lib, task, str(root)], capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"{lib} {task} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=1, help="runs of each cell (default 1)")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--build", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker[0], args.worker[1], Path(args.worker[2]))))
        return 0
    if args.build:
        build(Path(args.build))
        return 0
    if importlib.util.find_spec("transformer_lens") is None:
        print("transformer-lens is not installed: pip install -e '.[peer]'", file=sys.stderr)
        return 2
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        subprocess.run([sys.executable, __file__, "--build", str(root)], check=True)
        print(f"GPT-2-small shape, random weights; {SEQ}-token clean/corrupted pair ({CHANGED} positions differ)")
        print(f"{'task':<10} {'qkov s':>8} {'TL s':>8} {'ratio':>7} {'qkov MiB':>9} {'TL MiB':>8} {'mem':>6} {'max diff':>9}")
        for _ in range(args.repeat):
            for task in TASKS:
                q, t = measure("qkov", task, root), measure("transformer_lens", task, root)
                diff = max(abs(x - y) for x, y in zip(q.pop("out"), t.pop("out")))  # type: ignore[arg-type]
                row = {"task": task, "qkov": q, "transformer_lens": t, "max_abs_diff": diff}
                row["ratio"] = t["seconds"] / q["seconds"]  # type: ignore[operator]
                row["memory_ratio"] = q["peak_rss_mib"] / t["peak_rss_mib"]  # type: ignore[operator]
                rows.append(row)
                print(
                    f"{task:<10} {q['seconds']:>8.2f} {t['seconds']:>8.2f} {row['ratio']:>6.1f}x "
                    f"{q['peak_rss_mib']:>9.0f} {t['peak_rss_mib']:>8.0f} {row['memory_ratio']:>5.2f}x {diff:>9.1e}"
                )
        print("(load, not counted: qkov %.1f s, TransformerLens %.1f s)" % (rows[-1]["qkov"]["load_s"], rows[-1]["transformer_lens"]["load_s"]))  # type: ignore[index]
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
