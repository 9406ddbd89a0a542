"""Path expansion and term importance at the paths issue's size, beside TransformerLens.

Model: 2 layers x 8 heads, d_model 256, d_head 32, vocab 4096, shortformer, random
weights; batch 8 x 256 tokens. qkov: the full per-order expansion with every single-head
and virtual-head term, the paper's term-importance runs, and the loss change of removing
each order-1 term and the 10 largest order-2 terms. TransformerLens has no path
expansion; the nearest operation it offers is ``run_with_cache`` (the patterns and
per-head outputs such an expansion starts from), timed on the same batch for scale.
Each cell runs in its own process (peak RSS is its own).

    python benchmarks/bench_paths.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

from peak import peak_mib  # this process's own peak (ru_maxrss counts a forked parent's)

CFG = dict(n_layers=2, n_heads=8, d_model=256, d_head=32, d_vocab=4096, n_ctx=256)


def worker(lib: str) -> dict[str, float]:
    import torch

    torch.set_grad_enabled(False)
    import qkov
    from qkov.analysis import paths as P
    from qkov.weights import Weights

    model = qkov.Transformer(qkov.ModelConfig(**CFG), seed=0)
    tokens = torch.randint(0, CFG["d_vocab"], (8, CFG["n_ctx"]), generator=torch.Generator().manual_seed(0))
    if lib == "qkov":
        t0 = time.perf_counter()
        w = Weights.from_model(model)
        exp = P.expand(w, tokens, virtual_heads=True)
        ti = P.term_importance(w, tokens)
        P.term_effects(exp, top_virtual=10)
        dt = time.perf_counter() - t0
        extra = {"reconstruction_error": exp.reconstruction_error(), "runs": ti.run_losses}
    else:
        from qkov.io import to_hooked

        hooked = to_hooked(model, dtype=torch.float32)
        hooked.run_with_cache(tokens)
        t0 = time.perf_counter()
        hooked.run_with_cache(tokens)
        dt = time.perf_counter() - t0
        extra = {}
    return {"seconds": dt, "peak_rss_mib": peak_mib(), **extra}


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        print(json.dumps(worker(sys.argv[2])))
        return 0
    rows = {}
    for lib in ("qkov", "transformer_lens"):
        res = subprocess.run([sys.executable, __file__, "--worker", lib], capture_output=True, text=True)
        if res.returncode != 0:
            print(res.stderr[-2000:], file=sys.stderr)
            return 1
        rows[lib] = json.loads(res.stdout.strip().splitlines()[-1])
    q, t = rows["qkov"], rows["transformer_lens"]
    print(f"model {CFG}, batch 8 x 256")
    print(
        f"qkov: expansion (all single and virtual heads) + term importance + term effects: "
        f"{q['seconds']:.2f} s, peak {q['peak_rss_mib']:.0f} MiB, reconstruction error {q['reconstruction_error']:.1e}"
    )
    print(
        f"TransformerLens run_with_cache alone (no expansion): {t['seconds']:.2f} s, peak {t['peak_rss_mib']:.0f} MiB"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
