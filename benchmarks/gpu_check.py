"""GPU check (run on a machine with an NVIDIA GPU): the main job (``qkov tour``) on the GPU.

Runs ``qkov tour --device cuda``: trains the default 0-, 1- and 2-layer attention-only
models on the built-in corpus and writes their reports on the GPU, then prints the tour's
wall time, each run's training tokens/s, validation loss and induction score, and the
claims. With ``--ddp N`` it also runs the 2-layer model under ``torchrun --nproc_per_node N``
(N GPUs on this node) and prints the same figures, so scaling can be read off directly.
First, in seconds: the attention entries ``dynamics`` reads from the ``lse`` site (on the GPU the
log-sum-exp of the scores, on the CPU the flash kernel's) against the GPU's own patterns and the CPU's.
Then circuit discovery at GPT-2-small shape (random weights; 64 prompt pairs of 24 tokens, the corrupted
twins differing from position 8, as ``bench_circuit.py``'s goals): EAP and exact patching of 1,000 random
edges timed on the GPU (issue 37's goals: EAP within 1.5x its FLOP floor, exact patching of 1,000 edges
<= 60 s, out of reach of a 2-core CPU's arithmetic), their scores against the CPU's on the first edges.
``--discovery-only`` runs that part alone (``--device cpu`` tries the script where there is no GPU).

    python benchmarks/gpu_check.py --out /tmp/qkov-gpu [--ddp 2]
    python benchmarks/gpu_check.py --discovery-only [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def run(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        print(res.stderr[-3000:], file=sys.stderr)
        raise SystemExit(res.returncode)
    return time.perf_counter() - t0


def summary(path: Path) -> dict[str, object]:
    cfg = json.loads((path / "config.json").read_text())["training"]
    rows = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
    speeds = sorted(r["tokens_per_s"] for r in rows if "tokens_per_s" in r)
    return {
        "val_loss": cfg.get("val_loss"),
        "induction": cfg.get("induction_score"),
        "median_tokens_per_s": speeds[len(speeds) // 2] if speeds else None,
        "train_s": cfg.get("wall_s"),
    }


def entries_check() -> float:
    """The largest difference between the attention entries read from ``q``, ``k`` and ``lse`` on the GPU
    and the GPU's recorded pattern, and the CPU's entries (float32; the tests bound it by 1e-5)."""
    import torch

    import qkov
    from qkov.analysis.heads.entries import attention_entries

    cfg = qkov.ModelConfig(n_layers=2, n_heads=4, d_model=128, d_head=32, d_vocab=1024, n_ctx=256)
    model = qkov.Transformer(cfg, seed=0).eval()
    toks = torch.randint(1, cfg.d_vocab, (4, cfg.n_ctx), generator=torch.Generator().manual_seed(0))
    queries, keys = torch.tril_indices(cfg.n_ctx, cfg.n_ctx)
    got = {}
    for dev in ("cuda", "cpu"):
        w = qkov.Weights.from_model(model.to(dev))
        r = qkov.trace(w, toks, cache=["q", "k", "lse", "pattern"] if dev == "cuda" else ["q", "k", "lse"])
        got[dev] = [attention_entries(r["q", l], r["k", l], r["lse", l], queries, keys).cpu() for l in range(cfg.n_layers)]
        if dev == "cuda":
            patterns = [r["pattern", l][:, :, queries.cuda(), keys.cuda()].cpu() for l in range(cfg.n_layers)]
    return max(
        max(float((a - b).abs().max()), float((a - c).abs().max()))
        for a, b, c in zip(got["cuda"], patterns, got["cpu"])
    )


def discovery_check(device: str, edges: int = 1000, prompts: int = 64, tokens: int = 24) -> None:
    """EAP and exact patching of ``edges`` random edges at GPT-2-small shape on ``device``: seconds, and the
    largest difference of the scores from the same work on the CPU (EAP: every edge; exact: the first 20)."""
    import torch

    import qkov
    from qkov.analysis.discovery import Task, edge_scores, graph_of

    shape = dict(n_layers=12, n_heads=12, d_model=768, d_head=64, d_mlp=3072, d_vocab=50257, n_ctx=64,
                 normalization="layernorm", positional="standard", act_fn="gelu_new", bias=True)  # fmt: skip
    model = qkov.Transformer(qkov.ModelConfig(**shape), seed=0).eval()
    g = torch.Generator().manual_seed(5)
    clean = torch.randint(0, shape["d_vocab"], (prompts, tokens), generator=g)
    corrupted = clean.clone()
    corrupted[:, tokens // 3] = torch.randint(0, shape["d_vocab"], (prompts,), generator=g)
    answers, wrong = (torch.randint(0, shape["d_vocab"], (prompts, 1), generator=g) for _ in range(2))
    task = Task("goal", clean, corrupted, answers, wrong)
    chosen = torch.randperm(graph_of(model.cfg).n_edges, generator=g)[:edges]
    w = qkov.as_source(model.to(device))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    edge_scores(w, task.take(2))  # warm up
    got = {}
    for method, kw in (("eap", {}), ("exact", {"edges": chosen, "batch": prompts})):
        sync()
        t0 = time.perf_counter()
        got[method] = edge_scores(w, task, method=method, **kw).scores.cpu()  # type: ignore[arg-type]
        sync()
        print(f"  {method}{f' of {edges} edges' if method == 'exact' else ''}: {time.perf_counter() - t0:.1f} s on {device}")
    if device != "cpu":
        cpu = qkov.as_source(model.to("cpu"))
        eap = edge_scores(cpu, task).scores
        few = chosen[:20]
        exact = edge_scores(cpu, task, method="exact", edges=few, batch=prompts).scores
        print(f"  against the CPU: EAP {float((eap - got['eap']).abs().max()):.1e}, exact (20 edges) "
              f"{float((exact[few] - got['exact'][few]).abs().max()):.1e} (scores up to {float(eap.abs().max()):.2f})")  # fmt: skip


def main() -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("gpu-check"))
    ap.add_argument("--ddp", type=int, default=0, help="also run the 2-layer model on this many GPUs")
    ap.add_argument("--discovery-only", action="store_true", help="circuit discovery's goals alone")
    ap.add_argument("--device", default="cuda", help="where --discovery-only runs (default cuda)")
    ap.add_argument("--edges", type=int, default=1000, help="edges exact patching measures (default 1000)")
    args = ap.parse_args()
    if args.discovery_only:
        print(f"circuit discovery at GPT-2-small shape, 64 prompt pairs of 24 tokens, on {args.device}:")
        discovery_check(args.device, args.edges)
        return 0
    if not torch.cuda.is_available():
        print("no CUDA GPU here: this check is for a GPU machine", file=sys.stderr)
        return 2
    print(f"GPU: {torch.cuda.get_device_name(0)}; torch {torch.__version__}")
    print(f"attention entries from lse (dynamics): largest difference {entries_check():.1e} (tests: <= 1e-5)")
    print("circuit discovery at GPT-2-small shape, 64 prompt pairs of 24 tokens, on the GPU:")
    discovery_check("cuda", args.edges)
    # the main job on the GPU: trains the 0/1/2-layer models and writes every report there
    wall = run([sys.executable, "-m", "qkov", "tour", "--device", "cuda", "--out", str(args.out), "--quiet"])
    for layers in (0, 1, 2):
        print(f"{layers} layers: {summary(args.out / f'qkov-{layers}l')}")
    claims = json.loads((args.out / "tour.json").read_text())["claims"]
    for c in claims:
        print(f"  [{c['holds']}] {c['claim']}: {c['measured']}")
    print(f"qkov tour on the GPU (3 models + 3 reports + comparison page): {wall:.1f} s")
    if args.ddp > 1:
        out = args.out / f"qkov-2l-ddp{args.ddp}"
        wall = run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node",
                str(args.ddp),
                "-m",
                "qkov",
                "train",
                "--layers",
                "2",
                "--device",
                "cuda",
                "--out",
                str(out),
                "--quiet",
            ]
        )
        print(f"2 layers on {args.ddp} GPUs: {wall:.1f} s wall, {summary(out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
