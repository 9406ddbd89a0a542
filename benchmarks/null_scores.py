"""Null distributions of the head scores: what freshly initialised heads score.

The role thresholds in ``qkov.analysis.heads.report.THRESHOLDS`` must sit well above these, so that a
role means trained structure, not chance. Runs ``head_report`` on untrained models of the
default shape (2 layers x 4 heads, d_model 128, vocab 1024, ctx 256) for several seeds on
validation text of the built-in corpus, and prints each score's mean, std and max.

    python benchmarks/null_scores.py [--seeds 8]
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

import qkov
from qkov.analysis.heads.report import THRESHOLDS, head_report
from qkov.training.data import val_batches


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=8)
    args = ap.parse_args()
    cfg = qkov.ModelConfig()
    corpus = qkov.load_corpus("stdlib", vocab_size=cfg.d_vocab)
    text = torch.from_numpy(val_batches(corpus.val, cfg.n_ctx, corpus.bos_token_id, 8))
    freqs = np.bincount(corpus.train, minlength=cfg.d_vocab)
    pooled: dict[str, list[float]] = {}
    for seed in range(args.seeds):
        model = qkov.Transformer(cfg, seed=seed).eval()
        rep = head_report(qkov.Weights.from_model(model), text, frequencies=freqs, seed=seed, diag_k=None)
        for k, v in rep.scores.items():
            pooled.setdefault(k, []).extend(v.flatten().tolist())
    print(f"untrained heads: {args.seeds} seeds x {cfg.n_layers * cfg.n_heads} heads")
    print(f"{'score':<22} {'mean':>8} {'std':>8} {'min':>8} {'max':>8}")
    for k, vals in pooled.items():
        a = np.asarray(vals)
        print(f"{k:<22} {a.mean():>8.3f} {a.std():>8.3f} {a.min():>8.3f} {a.max():>8.3f}")
    print("thresholds:", THRESHOLDS)


if __name__ == "__main__":
    main()
