"""Every command at real model size, default flags: wall time and peak memory, beside TransformerLens.

The model: GPT-2-small's shape (12 layers x 12 heads, d_model 768, MLP 3072, LayerNorm, vocab
50257, context 1024; 124M parameters), random weights saved by transformers'
``GPT2LMHeadModel.save_pretrained`` (seeded), plus a byte-level BPE ``tokenizer.json`` trained on
Python's standard library (GPT-2's own tokenizer is on the Hub, out of reach offline). The text:
one standard-library module (``argparse.py``, ~26k tokens with that tokenizer).

Each command runs with its default flags in its own process (``qkov circuits DIR``,
``heads DIR --text F``, ``paths DIR --text F``, ``trigrams DIR --head 5.1``, ``report DIR -o OUT
--text F``, ``ablate DIR --heads 5.1,9.4 --text F``: intact, ablated and five random draws, each on the
text's 16 x 1024 tokens, the ICL score and the repeated-token probe); the process reports its wall time and
its peak RSS (``ru_maxrss``: resident pages, the memory-mapped weights included). Beside them, in its own process, TransformerLens 3.9 on the
same weights: load (``convert_gpt2_weights`` + ``load_and_process_state_dict``), ``run_with_cache``
on the same two 1024-token rows ``qkov heads`` scores, and ``detect_head`` for its three built-in
patterns (previous-token, duplicate-token, induction) on the first row; and qkov doing that same
work (load, then its streamed text scores of every head on the same two rows), whose ratio to
TransformerLens is printed. ``qkov heads`` does much more than either (the induction probe, the
ICL score, each head's OV copying scores over the vocabulary).

    python benchmarks/bench_real_size.py                 # builds /tmp/qkov-gpt2s once, then measures
    python benchmarks/bench_real_size.py --only circuits --dir /tmp/qkov-gpt2s
    python benchmarks/bench_real_size.py --only heads paths report --floor
    python benchmarks/bench_real_size.py --only heads report --repeat 2 --baseline /tmp/old/src

``--repeat N`` runs each command N times and prints every wall time and their median (the goal is checked
on the median, the memory on the largest peak). ``--baseline SRC`` also runs each qkov command on another
build (``SRC``: its ``src`` folder, e.g. from ``git worktree add /tmp/old REF``), alternating with this one
run by run, and prints the ratio of their medians: on a shared 2-core machine a command's time moves by 10-15%
from hour to hour, more than most changes, so a change is measured against its baseline in the same minutes.

``--floor`` also counts, in a second run of each command (under ``torch.utils.flop_counter``, which
sees every matrix product the command's torch calls make), its floating-point operations, and
divides them by a measured float32 matmul peak of this machine (the best of square products
and of the analyses' own skinny shapes, each with a preallocated output): the time no
implementation of the same work could beat here, printed beside the measured time and the goal.
The count leaves out fused attention (torch's CPU ``scaled_dot_product_attention`` kernel is not
counted), so the floor is a lower bound.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from matmul_rate import matmul_rate
from peak import peak_mib  # this process's own peak (ru_maxrss counts a forked parent's)

COMMANDS = {
    "circuits": ["circuits", "{dir}"],
    "heads": ["heads", "{dir}", "--text", "{text}"],
    "paths": ["paths", "{dir}", "--text", "{text}"],
    "trigrams": ["trigrams", "{dir}", "--head", "5.1"],
    "report": ["report", "{dir}", "-o", "{out}", "--text", "{text}", "--force"],
    "ablate": ["ablate", "{dir}", "--heads", "5.1,9.4", "--text", "{text}"],
}
PEER = {
    "qkov-detect": ("detect", "qkov: load+text scores (same work)"),
    "transformer-lens": ("tl", "TransformerLens: load+cache+detect"),
}
GOALS_S = {"report": 90.0, "heads": 40.0, "paths": 40.0}  # the text-side goals; the others <= 2 min; all <= 4 GiB
GOAL_S, GOAL_GIB = 120.0, 4.0


def text_file() -> Path:
    return Path(sysconfig.get_paths()["stdlib"]) / "argparse.py"


def build(out: Path) -> None:
    """The GPT-2-small-shaped directory: transformers' random init (seed 0) and a stdlib-trained BPE."""
    if (out / "model.safetensors").exists() and (out / "tokenizer.json").exists():
        return
    import torch
    import transformers

    from qkov.training.data import train_tokenizer

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [p.read_text(errors="replace") for p in sorted(stdlib.glob("*.py"))]
    print(f"building {out}: tokenizer on {len(texts)} stdlib modules, random GPT-2-small weights", flush=True)
    tok = train_tokenizer(texts, 50257, start="<|endoftext|>")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=50257, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save(str(out / "tokenizer.json"))


def worker(argv: list[str]) -> dict[str, object]:
    """Run ``qkov ARGV`` in this process; its exit code, wall time and peak RSS."""
    from qkov.apps.cli import main

    t = time.perf_counter()
    try:
        rc = main(argv)
    except SystemExit as exc:
        rc = int(exc.code or 0)
    wall = time.perf_counter() - t
    return {"rc": rc, "wall_s": wall, "peak_gib": peak_mib() / 1024}


def flops_worker(argv: list[str]) -> dict[str, object]:
    """Run ``qkov ARGV`` in this process counting its matrix-product FLOPs (by aten op)."""
    from torch.utils.flop_counter import FlopCounterMode

    from qkov.apps.cli import main

    with FlopCounterMode(display=False) as counter:
        try:
            rc = main(argv)
        except SystemExit as exc:
            rc = int(exc.code or 0)
    by_op = {str(op): n for op, n in counter.get_flop_counts().get("Global", {}).items()}
    return {"rc": rc, "flops": counter.get_total_flops(), "by_op": by_op}


PEAK_SHAPES = [(2048, 2048, 2048), (4096, 768, 4096), (1024, 64, 50257), (2048, 768, 50257)]


def peak_worker(seconds: float = 2.0) -> dict[str, object]:
    """float32 ``torch.matmul`` FLOP/s (:func:`matmul_rate.matmul_rate`: outputs preallocated) of each
    of :data:`PEAK_SHAPES` ``(m, k, n)``: square, the MLP's, a head's ``d_head``-wide product read by
    the unembedding, and a batch of 2 x 1024 tokens unembedded; the best is this machine's peak."""
    rates = {f"{m}x{k}x{n}": matmul_rate([(1, m, k, n)], "float32", seconds) for m, k, n in PEAK_SHAPES}
    return {"rc": 0, "rates": rates, "peak": max(rates.values())}


def tl_worker(path: Path, text: Path) -> dict[str, object]:
    """TransformerLens 3.9 on the same directory: load, run_with_cache on 2 x 1024 tokens, detect_head."""
    import tokenizers
    import torch
    import transformers
    from transformer_lens import HookedTransformer, HookedTransformerConfig
    from transformer_lens.head_detector import detect_head
    from transformer_lens.pretrained.weight_conversions import convert_gpt2_weights

    t0 = time.perf_counter()
    hf = transformers.GPT2LMHeadModel.from_pretrained(path).eval()
    c = hf.config
    cfg = HookedTransformerConfig(
        n_layers=c.n_layer, n_heads=c.n_head, d_model=c.n_embd, d_head=c.n_embd // c.n_head, d_mlp=4 * c.n_embd,
        d_vocab=c.vocab_size, n_ctx=c.n_positions, act_fn="gelu_new", normalization_type="LN",
        default_prepend_bos=True,
    )  # fmt: skip
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer.from_file(str(path / "tokenizer.json")),
        bos_token="<|endoftext|>", eos_token="<|endoftext|>", pad_token="<|endoftext|>",
    )  # fmt: skip
    saved = tempfile.mkdtemp()  # TransformerLens reloads its tokenizer by name: give it a path (kept to the end)
    tok.save_pretrained(saved)
    tok = transformers.AutoTokenizer.from_pretrained(saved)
    model = HookedTransformer(cfg, tokenizer=tok)
    model.load_and_process_state_dict(convert_gpt2_weights(hf, cfg))
    model.eval()
    del hf
    t_load = time.perf_counter() - t0
    ids = tok(text.read_text())["input_ids"]
    rows = torch.tensor([[0, *ids[i * 1023 : (i + 1) * 1023]] for i in range(2)])
    t1 = time.perf_counter()
    with torch.no_grad():
        model.run_with_cache(rows)
    t_cache = time.perf_counter() - t1
    first = tok.decode(rows[0, 1:512].tolist())  # detect_head tokenizes its text itself (prepending BOS)
    t2 = time.perf_counter()
    with torch.no_grad():
        for pattern in ("previous_token_head", "duplicate_token_head", "induction_head"):
            detect_head(model, first, pattern)
    t_detect = time.perf_counter() - t2
    return {
        "rc": 0,
        "wall_s": time.perf_counter() - t0,
        "load_s": t_load,
        "run_with_cache_s": t_cache,
        "detect_head_s": t_detect,
        "peak_gib": peak_mib() / 1024,
    }


def qkov_detect_worker(path: Path, text: Path) -> dict[str, object]:
    """qkov doing what the TransformerLens worker does: load, then the streamed text scores
    (previous-token, self, sink, positional, ...) of every head on the same two 1024-token rows."""
    import torch

    from qkov.analysis.heads.pattern_scores import text_scores
    from qkov.io.sources import load_any
    from qkov.weights import Weights

    t0 = time.perf_counter()
    model = load_any(path).eval()
    w = Weights.from_model(model)
    ids = model.tokenizer.encode(text.read_text()).ids
    del model
    t_load = time.perf_counter() - t0
    rows = torch.tensor([[0, *ids[i * 1023 : (i + 1) * 1023]] for i in range(2)])
    t1 = time.perf_counter()
    text_scores(w, rows)
    return {
        "rc": 0,
        "wall_s": time.perf_counter() - t0,
        "load_s": t_load,
        "scores_s": time.perf_counter() - t1,
        "peak_gib": peak_mib() / 1024,
    }


def measure(kind: str, args: list[str], src: Path | None = None) -> dict[str, object]:
    """One worker process of ``kind`` on ``args``; ``src``: import qkov from that source folder instead."""
    env = dict(os.environ, MALLOC_ARENA_MAX="2")
    if src is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(src), *filter(None, [os.environ.get("PYTHONPATH")])])
    cmd = [sys.executable, __file__, "--worker", kind, "--", *args]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith('{"rc"')]
    if not lines:
        return {"rc": res.returncode, "wall_s": float("nan"), "peak_gib": float("nan"), "err": res.stderr[-400:]}
    out = json.loads(lines[-1])
    if out["rc"]:
        out["err"] = res.stderr.strip().splitlines()[-1:] if res.stderr.strip() else []
    return out


def walls(runs: list[dict[str, object]]) -> str:
    """The wall times of runs, as printed."""
    return " ".join(f"{float(r['wall_s']):.1f}" for r in runs)  # type: ignore[arg-type]


def summary(runs: list[dict[str, object]]) -> dict[str, object]:
    """Runs of one command as one: the median wall time, the largest peak, the first failure's exit and error."""
    times = [float(r["wall_s"]) for r in runs]  # type: ignore[arg-type]
    out = dict(next((r for r in runs if r["rc"]), runs[0]))
    out["wall_s"] = statistics.median(times)
    out["peak_gib"] = max(float(r["peak_gib"]) for r in runs)  # type: ignore[arg-type]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "qkov-gpt2s")
    ap.add_argument("--only", nargs="*", choices=[*COMMANDS, *PEER], help="run only these")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("rest", nargs="*", help=argparse.SUPPRESS)
    ap.add_argument("--floor", action="store_true", help="also count each command's FLOPs: its floor at the matmul peak")
    ap.add_argument("--repeat", type=int, default=1, help="run each command this many times (median shown)")
    ap.add_argument("--baseline", type=Path, help="another build's src folder, run alternately with this one")
    a = ap.parse_args(argv)
    if a.repeat < 1:
        ap.error("--repeat must be at least 1")
    if a.baseline is not None and not (a.baseline / "qkov" / "__init__.py").is_file():
        ap.error(f"--baseline {a.baseline}: not a source folder holding qkov/__init__.py")
    if a.worker == "qkov":
        print(json.dumps(worker(a.rest)))
        return 0
    if a.worker == "flops":
        print(json.dumps(flops_worker(a.rest)))
        return 0
    if a.worker == "peak":
        print(json.dumps(peak_worker()))
        return 0
    if a.worker in ("tl", "detect"):
        fn = tl_worker if a.worker == "tl" else qkov_detect_worker
        print(json.dumps(fn(Path(a.rest[0]), Path(a.rest[1]))))
        return 0
    build(a.dir)
    text = text_file()
    todo = a.only or [*COMMANDS, *PEER]
    print(f"GPT-2-small shape at {a.dir}; text {text.name}; {os.cpu_count()} CPU cores; default flags\n")
    peak = None
    if a.floor:
        rates = measure("peak", [])
        peak = float(rates["peak"])  # type: ignore[arg-type]
        shown = ", ".join(f"{s} {r / 1e9:.0f}" for s, r in rates["rates"].items())  # type: ignore[union-attr]
        print(f"float32 matmul GFLOP/s ({shown}): peak {peak / 1e9:.1f}\n")
    print(f"{'command':<34} {'exit':>4} {'wall s':>8} {'peak GiB':>9}  goal")
    results: dict[str, dict[str, object]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in todo:
            if name in PEER:
                r = measure(PEER[name][0], [str(a.dir), str(text)])
                label = PEER[name][1]
            else:
                args = [s.format(dir=a.dir, text=text, out=Path(tmp) / "report") for s in COMMANDS[name]]
                args += ["--json"] if name in ("circuits", "heads", "paths", "trigrams", "ablate") else ["--quiet"]
                runs, base = [], []
                for _ in range(a.repeat):  # this build and the baseline in turn: the same minutes for both
                    runs.append(measure("qkov", args))
                    if a.baseline is not None:
                        base.append(measure("qkov", args, a.baseline))
                r = summary(runs)
                label = f"qkov {name}"
            results[name] = r
            goal = GOALS_S.get(name, GOAL_S)
            met = r["rc"] == 0 and r["wall_s"] <= goal and r["peak_gib"] <= GOAL_GIB
            ok = "" if name in PEER else ("ok" if met else "MISSED")
            print(f"{label:<34} {r['rc']:>4} {r['wall_s']:>8.1f} {r['peak_gib']:>9.2f}  {ok} {r.get('err', '')}")
            if name not in PEER and a.repeat > 1:
                print(f"{'':<34}      runs {walls(runs)} s (median above)")
            if name not in PEER and base:
                b = summary(base)
                print(
                    f"{'  baseline ' + str(a.baseline):<34} {b['rc']:>4} {b['wall_s']:>8.1f} {b['peak_gib']:>9.2f}  "
                    f"runs {walls(base)} s; this build / baseline {r['wall_s'] / b['wall_s']:.3f}"
                )
            if peak is not None and name not in PEER:
                f = measure("flops", args)
                if f["rc"] == 0:
                    flops = float(f["flops"])  # type: ignore[arg-type]
                    top = sorted(f["by_op"].items(), key=lambda kv: -kv[1])[:3]  # type: ignore[union-attr]
                    ops = ", ".join(f"{op} {n / 1e12:.2f}" for op, n in top)
                    print(
                        f"{'':<34}      {flops / 1e12:.2f} TFLOP of matrix products ({ops}): "
                        f"floor {flops / peak:.1f} s at the peak (goal {goal:.0f} s)"
                    )
                else:
                    print(f"{'':<34}      FLOP count failed: {f.get('err', '')}")
            if name == "transformer-lens" and r["rc"] == 0:
                print(
                    f"{'':<34}      load {r['load_s']:.1f} s, run_with_cache {r['run_with_cache_s']:.1f} s, "
                    f"detect_head x3 {r['detect_head_s']:.1f} s"
                )
            if name == "qkov-detect" and r["rc"] == 0:
                print(f"{'':<34}      load {r['load_s']:.1f} s, text scores {r['scores_s']:.1f} s")
    if "qkov-detect" in results and "transformer-lens" in results:
        q, t = results["qkov-detect"], results["transformer-lens"]
        print(
            f"\nsame work (load, the model on 2 x 1024 tokens, head scores on them): TransformerLens / qkov time "
            f"{t['wall_s'] / q['wall_s']:.2f}x, peak memory {t['peak_gib'] / q['peak_gib']:.2f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
