"""Weight-based analysis of a checkpoint far larger than the memory it is given.

Writes a synthetic GPT-2-style checkpoint (default: 24 layers x 16 heads, d_model 2048,
d_head 128, MLP 8192, vocab 50257, LayerNorm, biases; ~5.6 GB of float32) one tensor at a
time, in row blocks, so the writer never holds the model. Then, each in its own process
under a data-size limit (``RLIMIT_DATA``, set with ``resource.setrlimit``: it caps the
process's private address space — heap, anonymous maps, private writable file maps — but
not a read-only shared map of the file, whose pages belong to the reclaimable page cache.
``MALLOC_ARENA_MAX=2``: glibc otherwise reserves address space per thread, which the limit
counts though it is never used — without it (b) failed in 1 of 2 runs at 1.5 GiB):

  (a) ``qkov circuits CKPT --json --diag-k 0`` (lazy automatically: the file is > 1 GiB):
      eigenvalue copying scores of all heads, Q/K/V composition of all pairs, bandwidth;
  (b) the top-50 skip-trigrams of one head (12.7) (``skip_trigrams`` on the ``LazyCheckpoint``: it reads
      that head, then ``W_E`` and ``W_U`` one after the other);
  (c) one virtual weight ``W_O^{0.5} @ W_K^{23.2}`` and its norm;
  (d) the control: ``qkov.load`` (the in-memory path) under the same limit, expected to fail;
  (e) an independent reference without a limit (``safetensors.safe_open``, LayerNorm folded
      by its formula, dense float64 products) for the eigen copying scores of two heads of
      the middle layer, one K-composition score and the virtual weight's norm; the differences
      from (a) and (c) are printed.

Each worker reports wall time, peak RSS (``VmHWM``, which also counts mapped file pages)
and peak anonymous RSS (``RssAnon`` of /proc/self/status, sampled every 10 ms by a thread).
The file is deleted at the end unless ``--keep``.

    python benchmarks/bench_bigger_than_memory.py --dir /tmp/qkov-big --cap-gib 1.5
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from peak import peak_mib  # this process's own peak (ru_maxrss counts a forked parent's)

SHAPE = dict(
    n_layers=24,
    n_heads=16,
    d_model=2048,
    d_head=128,
    d_vocab=50257,
    n_ctx=1024,
    d_mlp=8192,
    normalization="layernorm",
    positional="standard",
    bias=True,
)


def write_checkpoint(out: Path, shape: dict[str, object], block_bytes: int = 64 * 2**20) -> int:
    """Write ``model.safetensors`` + ``config.json`` tensor by tensor; returns the file size.

    Shapes and names come from a model built on the meta device (nothing allocated);
    values are N(0, 0.02) (LayerNorm gains 1 + N(0, 0.02)), drawn per block of rows.
    """
    import numpy as np
    import torch

    from qkov import ModelConfig, Transformer
    from qkov.io.atomic import atomic_write, atomic_write_text

    cfg = ModelConfig(**shape)  # type: ignore[arg-type]
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in Transformer(cfg, seed=0).state_dict().items()}
    header: dict[str, object] = {"__metadata__": {"format": "qkov"}}
    offset = 0
    for name, s in shapes.items():
        n = int(np.prod(s)) * 4
        header[name] = {"dtype": "F32", "shape": list(s), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned

    def fill(tmp: str) -> None:
        g = torch.Generator().manual_seed(0)
        with open(tmp, "wb") as fh:
            fh.write(len(raw).to_bytes(8, "little") + raw)
            for name, s in shapes.items():
                rows = s[0] if len(s) > 1 else 1
                per_row = int(np.prod(s)) // rows
                step = max(1, block_bytes // (4 * per_row))
                for lo in range(0, rows, step):
                    block = torch.randn(min(step, rows - lo) * per_row, generator=g) * 0.02
                    if name.endswith(("ln1.w", "ln2.w", "ln_final.w")):
                        block += 1
                    fh.write(block.numpy().tobytes())

    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "model.safetensors", fill)
    config = {"model": cfg.to_dict(), "tokenizer": {"bos_token_id": 0, "file": None}, "training": {}}
    atomic_write_text(out / "config.json", json.dumps(config, indent=2))
    return (out / "model.safetensors").stat().st_size


class AnonPeak:
    """Samples ``RssAnon`` every 10 ms in a thread; ``peak`` in MiB."""

    def __init__(self) -> None:
        self.peak = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            time.sleep(0.01)

    def sample(self) -> None:
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                self.peak = max(self.peak, int(line.split()[1]) / 1024)

    def __enter__(self) -> "AnonPeak":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


def worker(task: str, ckpt: str, cap_bytes: int) -> dict[str, object]:
    import torch

    torch.set_grad_enabled(False)
    resource.setrlimit(resource.RLIMIT_DATA, (cap_bytes, cap_bytes))
    result: dict[str, object] = {}
    layers = json.loads((Path(ckpt) / "config.json").read_text())["model"]["n_layers"]
    mid, last = layers // 2, layers - 1
    t0 = time.perf_counter()
    with AnonPeak() as anon:
        if task == "circuits":
            import contextlib
            import io

            from qkov.apps.cli import main

            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                rc = main(["circuits", ckpt, "--json", "--diag-k", "0"])
            data = json.loads(buf.getvalue())
            k = data["composition"]["k"]
            result = {
                "rc": rc,
                "heads": len(data["copying"]),
                "pairs_per_kind": len(k["pairs"]),
                "k_baseline": k["baseline"]["mean"],
                "max_abs_eigen_score": max(abs(c["eigen_score"]) for c in data["copying"]),
                "check": {
                    "eigen_scores_mid_layer": [c["eigen_score"] for c in data["copying"] if c["layer"] == mid][:2],
                    "k_composition_0.5_last.2": next(
                        p["raw"] for p in k["pairs"] if (p["writer"], p["reader"]) == ("0.5", f"{last}.2")
                    ),
                },
            }
        elif task == "trigrams":
            from qkov.analysis.circuits.trigrams import skip_trigrams
            from qkov.weights import LazyCheckpoint

            ck = LazyCheckpoint(ckpt)
            result = {"top3": [t.score for t in skip_trigrams(ck, mid, 7, top=50)[:3]]}
        elif task == "virtual":
            from qkov.analysis.circuits.qk_ov import virtual_weights
            from qkov.weights import LazyCheckpoint

            ck = LazyCheckpoint(ckpt)
            result = {"check": {"virtual_norm": float(virtual_weights(ck, ("head", 0, 5), ("k", last, 2)).norm())}}
        elif task == "reference":
            result = {"check": reference(ckpt)}
        else:  # the control: the in-memory path under the same limit
            import qkov

            try:
                qkov.load(ckpt)
                result = {"loaded": True}
            except (MemoryError, RuntimeError) as exc:
                result = {"loaded": False, "error": f"{type(exc).__name__}: {str(exc)[:120]}"}
    result.update(
        seconds=time.perf_counter() - t0,
        peak_rss_mib=peak_mib(),
        peak_anon_mib=anon.peak,
    )
    return result


def reference(ckpt: str) -> dict[str, object]:
    """The checked numbers computed independently, with no memory limit: tensors read with
    ``safetensors.safe_open``, LayerNorm folded by its formula, products materialised, float64."""
    import torch
    from safetensors import safe_open

    with safe_open(str(Path(ckpt) / "model.safetensors"), framework="pt") as f:
        get = lambda name: f.get_tensor(name).double()  # noqa: E731
        n = json.loads((Path(ckpt) / "config.json").read_text())["model"]["n_layers"]
        mid, last = n // 2, n - 1

        def fold(W: torch.Tensor, layer: str) -> torch.Tensor:  # LN gain into a reader, then centre it
            W = W * get(f"{layer}.w")[:, None]
            return W - W.mean(0, keepdim=True)

        W_U = fold(get("W_U"), "ln_final")
        G = W_U @ get("W_E")
        del W_U
        scores = []
        for h in range(2):  # a dense 2048 x 2048 eigendecomposition each: two heads
            W_OV = fold(get(f"blocks.{mid}.attn.W_V")[h], f"blocks.{mid}.ln1") @ get(f"blocks.{mid}.attn.W_O")[h]
            ev = torch.linalg.eigvals(G @ W_OV)  # the d_model x d_model twin of W_E W_OV W_U
            scores.append(float(ev.sum().real / ev.abs().sum()))
        OV1 = fold(get("blocks.0.attn.W_V")[5], "blocks.0.ln1") @ get("blocks.0.attn.W_O")[5]
        K2 = fold(get(f"blocks.{last}.attn.W_K")[2], f"blocks.{last}.ln1")
        QK2 = fold(get(f"blocks.{last}.attn.W_Q")[2], f"blocks.{last}.ln1") @ K2.T
        k_comp = (OV1 @ QK2.T).norm() / (OV1.norm() * QK2.norm())
        virtual = (get("blocks.0.attn.W_O")[5] @ K2).norm()
    return {
        "eigen_scores_mid_layer": scores,
        "k_composition_0.5_last.2": float(k_comp),
        "virtual_norm": float(virtual),
    }


def measure(task: str, ckpt: Path, cap_bytes: int) -> dict[str, object]:
    cap = str(cap_bytes if task != "reference" else resource.RLIM_INFINITY)
    cmd = [sys.executable, __file__, "--worker", task, str(ckpt), cap]
    res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "MALLOC_ARENA_MAX": "2"})
    if res.returncode != 0:
        return {"failed": res.returncode, "stderr": res.stderr[-400:]}
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/qkov-bigger-than-memory"), help="where to write it")
    ap.add_argument("--cap-gib", type=float, default=1.5, help="RLIMIT_DATA of each worker, GiB (default 1.5)")
    ap.add_argument("--tasks", default="circuits,trigrams,virtual,in-memory,reference", help="comma-separated")
    ap.add_argument(
        "--layers", type=int, default=SHAPE["n_layers"], help="layers (default 24; fewer for a quick check)"
    )
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint afterwards")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker[0], args.worker[1], int(args.worker[2]))))
        return 0
    need = 6.5 * 2**30
    if shutil.disk_usage(args.dir.parent).free < need:
        print(f"needs {need / 2**30:.1f} GiB free next to {args.dir}", file=sys.stderr)
        return 2
    cap = int(args.cap_gib * 2**30)
    shape = {**SHAPE, "n_layers": args.layers}
    rows: dict[str, object] = {"shape": shape, "cap_gib": args.cap_gib}
    try:
        t0 = time.perf_counter()
        size = write_checkpoint(args.dir, shape)
        rows["file_gib"], rows["write_seconds"] = size / 2**30, time.perf_counter() - t0
        print(f"wrote {size / 2**30:.2f} GiB in {rows['write_seconds']:.0f} s: {shape}")
        print(f"each task in its own process under RLIMIT_DATA = {args.cap_gib:g} GiB, MALLOC_ARENA_MAX=2")
        for task in args.tasks.split(","):
            r = measure(task, args.dir, cap)
            rows[task] = r
            if "failed" in r:
                print(f"{task:<10} FAILED (exit {r['failed']}): {r['stderr']}")
                continue
            extra = {k: v for k, v in r.items() if k not in ("seconds", "peak_rss_mib", "peak_anon_mib")}
            print(
                f"{task:<10} {r['seconds']:>7.1f} s  peak RSS {r['peak_rss_mib']:>6.0f} MiB  "
                f"peak anon {r['peak_anon_mib']:>6.0f} MiB  {extra}"
            )
        tasks = [t for t in args.tasks.split(",") if t != "reference"]
        checks = {k: v for t in tasks for k, v in rows[t].get("check", {}).items()}  # type: ignore[union-attr]
        ref = rows.get("reference", {}).get("check", {})  # type: ignore[union-attr]
        for name, value in ref.items():
            if (got := checks.get(name)) is None:
                continue
            pairs = zip(got, value) if isinstance(got, list) else [(got, value)]
            diff = max(abs(a - b) for a, b in pairs)
            rows.setdefault("max_abs_diff", {})[name] = diff  # type: ignore[union-attr]
            print(f"{name}: qkov (capped, streamed) vs independent reference (safe_open, dense, float64): {diff:.1e}")
    finally:
        if not args.keep:
            shutil.rmtree(args.dir, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
