"""Freeze what qkov computes, then check a later build computes the same (a refactor's safety net).

    python scripts/snapshot_outputs.py make DIR     # train/import the models, save every command's JSON
    python scripts/snapshot_outputs.py check DIR    # rerun on the same checkpoints, compare within 1e-6

``make`` trains small models on a few standard-library modules (0, 1 and 2 attention-only
layers; a 2-layer LayerNorm + MLP model with standard positions), builds a GPT-2-like
Hugging Face directory with LayerNorm, MLPs and biases (random weights, seeded, norms
perturbed) and imports it, then saves the ``--json`` output of ``circuits`` (in memory and
``--lazy``), ``paths``, ``heads``, ``trigrams``, ``ablate`` (zero and mean) and ``dynamics`` (runs
with snapshots) and the report's ``report.json`` for each.
``check`` runs the same commands with the current code on the saved checkpoints and
compares every number (absolute or relative difference <= 1e-6; timings, paths and the writing version
ignored; keys only one side has are listed, not failed), and retrains the models to check
that training gives the same ``metrics.jsonl`` (timings aside). ``report.json`` stores numbers
rounded to 3 or 4 significant digits, so two builds whose values differ by 1e-7 can round to
neighbours (3.2495000 -> 3.25, 3.2494998 -> 3.249): such one-unit-in-the-last-place flips are
listed as ``rounding:`` lines, not failed (the same numbers are compared unrounded in the
commands' JSON); ``dynamics.json`` likewise stores numbers to fixed decimals, and its per-token-loss
trajectory is a PCA of losses stored to 3 decimals, so one flip there moves its components ~1e-6
(see :func:`rounding_flip`).

Only the command line and third-party libraries are used, so the script runs against
any build of qkov. Exit status 1 when something differs.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

# the test suite's small corpus (tests/conftest.py), repeated so that this script needs nothing
# but the command line of whatever build it checks
MODULES = [
    "abc.py",
    "bisect.py",
    "calendar.py",
    "colorsys.py",
    "copy.py",
    "dataclasses.py",
    "fnmatch.py",
    "fractions.py",
    "functools.py",
    "glob.py",
    "heapq.py",
    "keyword.py",
    "numbers.py",
    "operator.py",
    "queue.py",
    "random.py",
    "shlex.py",
    "string.py",
    "textwrap.py",
    "types.py",
]
BASE = [
    "--heads",
    "4",
    "--d-model",
    "64",
    "--d-head",
    "16",
    "--ctx",
    "96",
    "--vocab",
    "400",
    "--batch",
    "8",
    "--steps",
    "150",
    "--device",
    "cpu",
    "--quiet",
]
TRAINED = {
    "attn0": ["--layers", "0"],
    "attn1": ["--layers", "1"],
    "attn2": ["--layers", "2"],
    "lnmlp2": ["--layers", "2", "--norm", "layernorm", "--mlp", "128", "--positional", "standard"],
}
IGNORE = {"seconds", "timings", "wall_s", "tokens_per_s", "path", "name", "imported_from", "corpus", "generator"}
TOL = 1e-6


def qkov(*args: Any, cwd: Path | None = None) -> str:
    res = subprocess.run([sys.executable, "-m", "qkov", *map(str, args)], capture_output=True, text=True, cwd=cwd)
    if res.returncode != 0:
        raise SystemExit(f"qkov {' '.join(map(str, args))} failed ({res.returncode}):\n{res.stderr[-3000:]}")
    return res.stdout


def corpus(root: Path) -> Path:
    out = root / "corpus"
    if not out.exists():
        out.mkdir(parents=True)
        std = Path(sysconfig.get_paths()["stdlib"])
        for name in MODULES:
            shutil.copy(std / name, out / name)
    return out


def text_file(root: Path) -> Path:
    path = root / "text.py"
    path.write_text((Path(sysconfig.get_paths()["stdlib"]) / "colorsys.py").read_text())
    return path


def build_gpt2(root: Path) -> Path:
    """A GPT-2-like directory: LayerNorm, MLPs, biases, norms perturbed, a BPE tokenizer."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out = root / "gpt2-dir"
    texts = [(corpus(root) / m).read_text() for m in MODULES]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    cfg = transformers.GPT2Config(
        vocab_size=tok.get_vocab_size(), n_positions=96, n_embd=64, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "ln" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out)
    tok.save(str(out / "tokenizer.json"))
    return out


def outputs(ckpt: Path, layers: int, text: Path | None, dest: Path) -> None:
    """Every analysis command's JSON for one checkpoint, into ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    extra = ["--text", text] if text is not None else []
    runs: dict[str, list[Any]] = {}
    if layers >= 1:
        runs["circuits"] = ["circuits", ckpt, "--json", "--device", "cpu"]
        runs["circuits-lazy"] = ["circuits", ckpt, "--json", "--device", "cpu", "--lazy"]
        runs["circuits-f64"] = ["circuits", ckpt, "--json", "--device", "cpu", "--float64"]
        runs["paths"] = ["paths", ckpt, "--json", "--device", "cpu", "--batch", "4", *extra]
        runs["heads"] = ["heads", ckpt, "--json", "--device", "cpu", "--batch", "4", "--icl-examples", "16", *extra]
        runs["trigrams"] = ["trigrams", ckpt, "--json", "--device", "cpu", "--head", f"{layers - 1}.1", "--top", "8"]
        runs["trigrams-lazy"] = [*runs["trigrams"], "--lazy"]
        head = ["--heads", f"{layers - 1}.1", "--draws", "2", "--device", "cpu", "--json", *extra]
        runs["ablate-zero"] = ["ablate", ckpt, "--mode", "zero", *head]
        runs["ablate-mean"] = ["ablate", ckpt, "--mode", "mean", *head]
        if (ckpt / "snapshots").is_dir():
            dyn = dest / "dynamics-out"
            runs["dynamics"] = ["dynamics", ckpt, "-o", dyn, "--force", "--draws", "2", "--device", "cpu", "--json"]
    for name, argv in runs.items():
        (dest / f"{name}.json").write_text(qkov(*argv))
    shutil.rmtree(dest / "dynamics-out", ignore_errors=True)
    rep = dest / "report"
    if rep.exists():
        shutil.rmtree(rep)
    qkov(
        "report",
        ckpt,
        "-o",
        rep,
        "--device",
        "cpu",
        "--batch",
        "4",
        "--icl-examples",
        "16",
        "--viewer-tokens",
        "40",
        "--top",
        "8",
        "--quiet",
        *extra,
    )
    shutil.copy(rep / "report.json", dest / "report.json")
    shutil.rmtree(rep)


def models(root: Path) -> dict[str, tuple[Path, int, Path | None]]:
    text = root / "text.py"
    found = {name: (root / "models" / name, int(flags[1]), None) for name, flags in TRAINED.items()}
    found["gpt2-import"] = (root / "models" / "gpt2-import", 2, text)
    return found


def make(root: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    data = corpus(root)
    text_file(root)
    for name, flags in TRAINED.items():
        ckpt = root / "models" / name
        if not ckpt.exists():
            qkov("train", *BASE, *flags, "--corpus", data, "--out", ckpt)
    if not (root / "models" / "gpt2-import").exists():
        qkov("import", build_gpt2(root), "--out", root / "models" / "gpt2-import")
    for name, (ckpt, layers, text) in models(root).items():
        print(f"snapshot: {name}", flush=True)
        outputs(ckpt, layers, text, root / "expected" / name)


def last_place(a: float, b: float) -> bool:
    """``a`` and ``b`` are neighbours at 3 significant digits (a rounding flip)."""
    big = max(abs(a), abs(b))
    return big > 0 and abs(a - b) <= 1.0001 * 10 ** (math.floor(math.log10(big)) - 2)


def last_decimal(a: float, b: float) -> bool:
    """``a`` and ``b`` are neighbours in their last stored decimal place (``dynamics.json`` rounds to
    a fixed number of decimals: 3.77 vs 3.771 is one flip of the third)."""
    places = max(len(repr(float(x)).split(".")[1].rstrip("0")) if "e" not in repr(float(x)) else 0 for x in (a, b))
    return abs(a - b) <= 1.0001 * 10 ** (-places)


def rounding_flip(where: str, a: float, b: float) -> bool:
    """A difference explained by the rounding of stored numbers, not by the computation: a last-place
    flip in ``report.json`` (3-4 significant digits) or ``dynamics.json`` (fixed decimals), or the
    per-token-loss trajectory, a PCA of losses stored to 3 decimals (a flip there moves it ~1e-6)."""
    if "report.json" in where:
        return last_place(a, b)
    if "dynamics.json" in where:
        traj = "trajectory" in where and abs(a - b) <= 1e-4 * max(1.0, abs(a), abs(b))
        return traj or last_decimal(a, b)
    return False


def compare(a: Any, b: Any, where: str, problems: list[str], only: list[str]) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if k in IGNORE:
                continue
            if k not in a or k not in b:
                only.append(f"{where}.{k} only in {'expected' if k in a else 'actual'}")
                continue
            compare(a[k], b[k], f"{where}.{k}", problems, only)
    elif isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            problems.append(f"{where}: length {len(a)} vs {len(b)}")
            return
        for i, (x, y) in enumerate(zip(a, b)):
            compare(x, y, f"{where}[{i}]", problems, only)
    elif isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        if math.isnan(a) and math.isnan(b):
            return
        if not abs(a - b) <= TOL * max(1.0, abs(a), abs(b)):
            rounded = rounding_flip(where, a, b)
            (only if rounded else problems).append(f"{where}: {a!r} vs {b!r}" + (" (rounding)" if rounded else ""))
    elif a != b:
        problems.append(f"{where}: {a!r} vs {b!r}")


def metrics(ckpt: Path) -> list[dict[str, Any]]:
    """The rows of ``metrics.jsonl``, timings left out."""
    lines = (ckpt / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in IGNORE} for line in lines]


def check(root: Path) -> int:
    problems: list[str] = []
    only: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, (ckpt, layers, text) in models(root).items():
            print(f"check: {name}", flush=True)
            got = Path(tmp) / name
            outputs(ckpt, layers, text, got)
            for f in sorted((root / "expected" / name).glob("*.json")):
                a, b = json.loads(f.read_text()), json.loads((got / f.name).read_text())
                compare(a, b, f"{name}/{f.name}", problems, only)
        for name, flags in TRAINED.items():
            print(f"check: retrain {name}", flush=True)
            ckpt = Path(tmp) / "retrain" / name
            qkov("train", *BASE, *flags, "--corpus", corpus(root), "--out", ckpt)
            compare(metrics(root / "models" / name), metrics(ckpt), f"{name}/metrics.jsonl", problems, only)
    for line in only:
        print("rounding:" if line.endswith("(rounding)") else "schema:", line)
    for line in problems[:200]:
        print("DIFFERS:", line)
    kinds: dict[str, int] = {}
    for line in problems:  # which fields differ, indices folded: "attn2/heads.json.heads[].eigen_copying"
        key = re.sub(r"\[\d+\]", "[]", line.split(": ")[0])
        kinds[key] = kinds.get(key, 0) + 1
    for key, n in sorted(kinds.items(), key=lambda kv: -kv[1]):
        print(f"differs: {n:5d} x {key}")
    flips = sum(line.endswith("(rounding)") for line in only)
    print(
        f"{len(problems)} difference(s) beyond {TOL:g}; {len(only) - flips} key(s) on one side only; "
        f"{flips} rounding flip(s) in report.json / dynamics.json"
    )
    return 1 if problems else 0


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("make", "check"):
        raise SystemExit(__doc__)
    sys.exit(make(Path(sys.argv[2])) if sys.argv[1] == "make" else check(Path(sys.argv[2])))
