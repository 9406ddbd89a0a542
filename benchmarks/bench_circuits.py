"""Weight-based circuit analysis at GPT-2-small shape: qkov vs TransformerLens 3.9.0, same run.

Random weights of GPT-2-small shape (12 layers x 12 heads, d_model 768, d_head 64,
vocab 50257; attention weights only, which is all these analyses read), identical in
both libraries (same seed). Tasks:

  (a) eigenvalue copying scores of all 144 heads' full OV circuits W_E W_OV W_U
      (TransformerLens: ``(model.W_E @ model.OV @ model.W_U).eigenvalues``);
  (b) all-pairs Q-, K- and V-composition scores (TL: ``all_composition_scores``);
  (c) the top-50 entries of one head's full 50257 x 50257 OV circuit (qkov only: TL has
      no factored top-k; it would have to materialise the 10 GB matrix);
  (d) the top-50 skip-trigrams of one head over the whole vocabulary (qkov only).

Every measurement runs in its own subprocess, so its peak memory (max RSS) is its own.

    python benchmarks/bench_circuits.py
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from peak import peak_mib  # this process's own peak (ru_maxrss counts a forked parent's)

SHAPE = dict(n_layers=12, n_heads=12, d_model=768, d_head=64, d_vocab=50257, n_ctx=1024)


def _tensors():
    import torch

    g = torch.Generator().manual_seed(0)
    L, H, D, E, V, T = (SHAPE[k] for k in ("n_layers", "n_heads", "d_model", "d_head", "d_vocab", "n_ctx"))
    s = 0.02
    return {
        "W_E": torch.randn(V, D, generator=g) * s,
        "W_pos": torch.randn(T, D, generator=g) * s,
        "W_Q": torch.randn(L, H, D, E, generator=g) * s,
        "W_K": torch.randn(L, H, D, E, generator=g) * s,
        "W_V": torch.randn(L, H, D, E, generator=g) * s,
        "W_O": torch.randn(L, H, E, D, generator=g) * s,
        "W_U": torch.randn(D, V, generator=g) * s,
    }


def _qkov_weights():
    import torch

    import qkov
    from qkov.weights import Weights

    t = _tensors()
    L, H, D, E = SHAPE["n_layers"], SHAPE["n_heads"], SHAPE["d_model"], SHAPE["d_head"]
    cfg = qkov.ModelConfig(**SHAPE)
    return Weights(
        cfg=cfg,
        W_E=t["W_E"],
        W_pos=t["W_pos"],
        W_Q=t["W_Q"],
        W_K=t["W_K"],
        W_V=t["W_V"],
        W_O=t["W_O"],
        b_Q=torch.zeros(L, H, E),
        b_K=torch.zeros(L, H, E),
        b_V=torch.zeros(L, H, E),
        b_O=torch.zeros(L, D),
        W_U=t["W_U"],
        b_U=torch.zeros(SHAPE["d_vocab"]),
    )


def _tl_model():
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    cfg = HookedTransformerConfig(
        **SHAPE,
        attn_only=True,
        normalization_type=None,
        act_fn=None,
        positional_embedding_type="standard",
        device="cpu",
    )
    model = HookedTransformer(cfg)
    t = _tensors()
    sd = dict(model.state_dict())
    sd.update({"embed.W_E": t["W_E"], "pos_embed.W_pos": t["W_pos"], "unembed.W_U": t["W_U"]})
    for layer in range(SHAPE["n_layers"]):
        for n in ("W_Q", "W_K", "W_V", "W_O"):
            sd[f"blocks.{layer}.attn.{n}"] = t[n][layer]
    model.load_state_dict(sd)
    del t, sd
    return model


def worker(lib: str, task: str) -> dict[str, object]:
    import torch

    torch.set_grad_enabled(False)
    if lib == "qkov":
        from qkov.analysis import circuits as C
        from qkov.analysis.circuits.composition import composition_raw
        from qkov.analysis.circuits.trigrams import skip_trigrams

        w = _qkov_weights()
        t0 = time.perf_counter()
        if task == "copying":
            out = C.eigen_copying_score(C.ov_eigenvalues(w)).flatten().tolist()
        elif task == "composition":
            # all scores computed; the first writer head's row (valid pairs, invalid ones 0 like TL) is compared
            raw = composition_raw(w, "qkv")
            out = {k: raw[k].nan_to_num(0.0)[0, 0].flatten().tolist() for k in ("q", "k", "v")}
        elif task == "topk":
            top = C.full_ov(w, 5, 7).topk(50)
            out = top.values[:3].tolist()
        else:
            out = [t.score for t in skip_trigrams(w, 5, 7, top=50)[:3]]
    else:
        model = _tl_model()
        t0 = time.perf_counter()
        if task == "copying":
            ev = (model.W_E @ model.OV @ model.W_U).eigenvalues
            out = (ev.sum(-1).real / ev.abs().sum(-1)).flatten().tolist()
        elif task == "composition":
            out = {k.lower(): model.all_composition_scores(k)[0, 0].flatten().tolist() for k in ("Q", "K", "V")}
        else:
            raise SystemExit(3)
    dt = time.perf_counter() - t0
    return {"seconds": dt, "peak_rss_mib": peak_mib(), "out": out}


def measure(lib: str, task: str) -> dict[str, object]:
    res = subprocess.run([sys.executable, __file__, "--worker", lib, task], capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"{lib} {task} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(*args.worker)))
        return 0
    try:
        import transformer_lens  # noqa: F401
    except ImportError:
        print("transformer-lens is not installed: pip install -e '.[peer]'", file=sys.stderr)
        return 2
    rows = {}
    for task in ("copying", "composition", "topk", "trigrams"):
        q = measure("qkov", task)
        t = measure("transformer_lens", task) if task in ("copying", "composition") else None
        if t is not None:  # same weights, same answers
            if task == "copying":
                diff = max(abs(a - b) for a, b in zip(q["out"], t["out"]))  # type: ignore[arg-type]
            else:
                diff = max(abs(a - b) for k in q["out"] for a, b in zip(q["out"][k], t["out"][k]))  # type: ignore[index]
            t["max_abs_diff_vs_qkov"] = diff
        rows[task] = {"qkov": q, "transformer_lens": t}
    print(f"GPT-2-small shape {SHAPE}, random weights; each cell its own process")
    print(f"{'task':<13} {'qkov s':>8} {'TL s':>8} {'ratio':>8} {'qkov MiB':>9} {'TL MiB':>8} {'max diff':>9}")
    for task, r in rows.items():
        q, t = r["qkov"], r["transformer_lens"]
        if t is None:
            print(f"{task:<13} {q['seconds']:>8.3f} {'-':>8} {'-':>8} {q['peak_rss_mib']:>9.0f} {'-':>8} {'-':>9}")
            continue
        ratio = t["seconds"] / q["seconds"]
        r["ratio"] = ratio
        print(
            f"{task:<13} {q['seconds']:>8.3f} {t['seconds']:>8.3f} {ratio:>7.1f}x {q['peak_rss_mib']:>9.0f} "
            f"{t['peak_rss_mib']:>8.0f} {t['max_abs_diff_vs_qkov']:>9.1e}"
        )
    if args.json:
        for r in rows.values():
            for v in r.values():
                if isinstance(v, dict):
                    v.pop("out", None)
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
