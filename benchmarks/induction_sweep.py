"""Tokens-to-induction-heads: train 2-layer models and record when induction heads form.

The evidence behind qkov's default training hyper-parameters. For each setting it
trains a fresh model on the built-in corpus and records, at every evaluation, the
best layer-1 head's induction score (attention from the second copy of 50 repeated
random tokens to the token after the earlier occurrence) and validation loss.

    python benchmarks/induction_sweep.py --set lr=1e-2 --set batch=16 --out sweep.jsonl
    python benchmarks/induction_sweep.py --grid default   # the grid behind the defaults

Each result row (one per setting) is appended to ``--out`` as JSON, with the whole
curve, and the first token count at which the score reached 0.1 and 0.3.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import qkov
from qkov.training.config import TrainConfig

MODEL_KEYS = {"n_layers", "n_heads", "d_model", "d_head", "d_vocab", "n_ctx", "positional"}

GRIDS: dict[str, list[dict[str, object]]] = {
    # The settings compared when choosing the defaults (docs/training.md, "The defaults"): constant
    # learning rate after the 100-step warm-up, so the curve shows when heads form, not when
    # a schedule happens to decay. Run with: --grid defaults --steps 4000 --stop-at 0.4
    "defaults": [
        {"schedule": "constant", "lr": 1e-2, "d_vocab": 2048},
        {"schedule": "constant", "lr": 2e-2, "d_vocab": 2048},
        {"schedule": "constant", "lr": 1e-2, "d_vocab": 2048, "batch": 8, "steps": 8000},
        {"schedule": "constant", "lr": 1e-2, "d_vocab": 1024},
        {"schedule": "constant", "lr": 1e-2, "d_vocab": 1024, "n_heads": 8, "d_head": 16},
        {"schedule": "constant", "lr": 1e-2, "d_vocab": 512},
    ],
    # the shipped defaults themselves (warm-up, stable, decay over the last 20%)
    "shipped": [{}],
}


def parse_value(text: str) -> object:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def run_one(setting: dict[str, object], base_steps: int | None, stop_at: float | None = None) -> dict[str, object]:
    model_kw = {k: v for k, v in setting.items() if k in MODEL_KEYS}
    train_kw = {k: v for k, v in setting.items() if k not in MODEL_KEYS}
    if base_steps is not None and "steps" not in train_kw:
        train_kw["steps"] = base_steps
    mcfg = qkov.ModelConfig(**{"n_layers": 2, **model_kw})
    tcfg = TrainConfig(**{"eval_interval": 50, "ckpt_interval": 10**9, **train_kw})
    corpus = qkov.load_corpus(tcfg.corpus, vocab_size=mcfg.d_vocab)
    curve: list[dict[str, object]] = []
    speeds: list[float] = []

    class Reached(Exception):
        pass

    def cb(ev: dict[str, object]) -> None:
        if ev["event"] == "eval":
            curve.append({k: ev[k] for k in ("step", "tokens", "val_loss", "induction_score", "repeat_loss")})
            print(
                f"  step {ev['step']:>5} tokens {ev['tokens'] / 1e6:6.2f}M val {ev['val_loss']:.3f} "
                f"induction {ev['induction_score']:.3f}",
                flush=True,
            )
            if stop_at is not None and float(ev["induction_score"]) >= stop_at:  # type: ignore[arg-type]
                raise Reached
        elif ev["event"] == "log":
            speeds.append(float(ev["tokens_per_s"]))  # type: ignore[arg-type]

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        try:
            qkov.train(Path(tmp) / "run", mcfg, tcfg, device="cpu", corpus=corpus, callback=cb)
        except Reached:
            pass
    wall = time.perf_counter() - t0

    def first(th: float) -> float | None:
        for row in curve:
            if float(row["induction_score"]) >= th:  # type: ignore[arg-type]
                return float(row["tokens"])  # type: ignore[arg-type]
        return None

    speeds.sort()
    return {
        "setting": setting,
        "model": mcfg.to_dict(),
        "train": tcfg.to_dict(),
        "tokens_to_0.1": first(0.1),
        "tokens_to_0.3": first(0.3),
        "final_induction": curve[-1]["induction_score"] if curve else None,
        "final_val_loss": curve[-1]["val_loss"] if curve else None,
        "median_tokens_per_s": speeds[len(speeds) // 2] if speeds else None,
        "wall_s": round(wall, 1),
        "curve": curve,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="one setting to run")
    ap.add_argument("--grid", choices=sorted(GRIDS), help="run a named grid of settings")
    ap.add_argument("--steps", type=int, default=None, help="steps for settings that do not name them")
    ap.add_argument("--stop-at", type=float, default=None, help="stop a run once the score reaches this")
    ap.add_argument("--out", type=Path, default=Path("induction_sweep.jsonl"))
    args = ap.parse_args(argv)
    settings: list[dict[str, object]] = []
    if args.set:
        settings.append({k: parse_value(v) for k, v in (s.split("=", 1) for s in args.set)})
    if args.grid:
        settings.extend(GRIDS[args.grid])
    if not settings:
        settings.append({})
    for setting in settings:
        print(f"setting {setting or '(defaults)'}", flush=True)
        res = run_one(setting, args.steps, args.stop_at)
        with args.out.open("a") as fh:
            fh.write(json.dumps(res) + "\n")
        print(
            f"-> tokens to 0.1: {res['tokens_to_0.1']}, to 0.3: {res['tokens_to_0.3']}, "
            f"final {res['final_induction']:.3f}, val {res['final_val_loss']:.3f}, "
            f"{res['median_tokens_per_s']:.0f} tok/s, {res['wall_s']} s",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
