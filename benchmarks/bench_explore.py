"""``qkov explore``'s views and ``qkov patch`` at GPT-2-small shape: each view's time and peak memory, beside
TransformerLens 3.9.0 doing the same work where it can, and the server timed through HTTP.

The model: GPT-2-small's shape (12 layers x 12 heads, d_model 768, MLP 3072, LayerNorm, biases, vocab
50257, context 1024; random weights, seeded, biases and gains moved off their init), written once as a
qkov checkpoint and as a TransformerLens file of the same weights (as ``bench_patching.py`` does). The
text: 256 seeded random token ids (the checkpoint has no tokenizer).

Every measurement runs in its own subprocess (its peak RSS, ``VmHWM``, is its own, the loaded model
included); the time is the view's call alone (the load is printed beside it; qkov's includes the session's
folded weights, built on a thread from start, which a user's first text finds ready). qkov runs the views
through ``VIEWS`` on ``open_explorer(checkpoint)``, exactly what the server calls:

  model, text (256 tokens: loss per token, top predictions), attention (one head, 256 tokens), heads (the
  heads table, ``qkov heads``' work on its default inputs), card (one head; ``tables=false`` and with the
  vocabulary-wide tables: top full-OV / full-QK entries and skip-trigrams), composition (all pairs),
  terms (path expansion and term effects at one position of a 64-token text), ablate (zero and mean,
  two heads, 256 tokens), patch (activation patching of a 16-token pair: the residual stream by layer and
  position, every head's output by layer and head, the loss on the clean tokens; attribution off, as
  TransformerLens' patching module has none). ``+text``: the view called after the text view on the same
  text in the same session, as the page calls it (the session keeps the text's clean run: the ablation
  starts at its first ablated layer from the kept stream, the pattern is one layer's attention); the time is
  the second view's alone.

TransformerLens (same weights; LayerNorm folded, writers and unembedding centred, value biases NOT folded,
see below): text = ``model(tokens, return_type="loss",
loss_per_token=True)``; attention = ``run_with_cache`` and the head's pattern; card spectrum = the
``FactoredMatrix`` eigenvalues of ``W_E OV W_U`` and ``W_E QK W_E^T`` of the head; composition =
``all_composition_scores`` for Q, K and V; ablate zero = the loss per token of ``model(tokens)`` and of
``run_with_hooks`` zeroing the heads' ``hook_z`` (the view shows both); patch = ``run_with_cache`` of the clean
tokens, ``patching.get_act_patch_resid_pre`` and ``get_act_patch_attn_head_out_all_pos`` with the same loss.
The largest difference between the two results is printed beside the ratio, relative for values over 1 (the
views round to 6 significant digits: a loss of 10.9 is shown to 1e-4).

``qkov patch`` (``patch-cli``): the command with its defaults on a 64-token clean/corrupted pair of token ids
differing at 8 positions (``bench_patching.py``'s), ``--receivers 5.1``: the loss metric over every position,
``resid_pre`` by layer and position, head outputs, attribution, and path patching into 5.1; run in its own
process (``qkov.apps.cli.main``), timed whole (load included), its own peak memory.

Why ``fold_value_biases=False`` (so ``load_and_process_state_dict``, not ``process_weights_``, which always
folds them): TransformerLens' default processing moves each head's value bias into the layer's output bias
(``b_O += sum_h b_V[h] @ W_O[h]``; exact, since a pattern row sums to 1). Every forward pass, pattern, OV/QK
circuit and composition score is unchanged, but ``hook_z`` then no longer holds ``b_V``: zeroing it leaves
``b_V[h] @ W_O[h]`` written at every position, which is not zero ablation. qkov keeps ``b_V`` in ``z`` (as
Hugging Face's GPT-2 does), so its zero ablation is the head writing nothing, the same as zeroing the head's
rows of ``attn.c_proj.weight`` by hand. Measured with the folded biases at this shape (random GPT-2-like HF
model, two heads, 256 tokens): per-token losses 0.017 nats off both qkov and the hand-zeroed model, while qkov
and the hand-zeroed model agree to 5e-5 (the view's 6 significant digits) and TransformerLens without the
folding agrees with the hand-zeroed model to 1.2e-6 (tests/analysis/causal/test_ablation.py checks qkov against it).

HTTP: ``qkov explore CHECKPOINT --port 0 --no-cache`` in its own process: the seconds from starting it
to the first page (``GET /``), then a head card and a 256-token attention through ``POST /api/views/...``,
and the server's peak RSS. Timings on a shared machine are noisy: compare within one run.

``--size llama3-8b``: the explorer on a Llama-3-8B-shape model it cannot hold (random bfloat16 weights of the
real shape, ~15 GiB, built under /tmp by ``bench_modern.py``'s writer, or reused from ``--dir``), streamed from
the memory map: the first page, the first text view through the job API (its progress lines), a last-layer
pattern from the kept run, optionally a head card (``--card``), and the server's peak RSS; the model is deleted
afterwards unless ``--keep`` (or it was there already).

    python benchmarks/bench_explore.py [--dir /tmp/qkov-explore-bench] [--skip heads,terms] [--only text,patch]
    python benchmarks/bench_explore.py --size llama3-8b [--seq 64] [--card] [--keep] [--dir /tmp/qkov-llama8b]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from peak import peak_mib  # this process's own peak (ru_maxrss counts a forked parent's)

SHAPE = dict(
    n_layers=12, n_heads=12, d_model=768, d_head=64, d_mlp=3072, d_vocab=50257, n_ctx=1024,
    normalization="layernorm", positional="standard", act_fn="gelu_new", bias=True,
)  # fmt: skip
SEQ, TERMS_SEQ, PATCH_SEQ, HEAD, ABLATE = 256, 64, 16, (5, 1), [(5, 1), (9, 4)]
GOALS = {"first page": 10.0, "card-quick": 5.0, "card": 10.0, "patch-cli": 30.0}  # seconds; card: with tables
FASTER = {"text", "attention", "ablate-zero", "patch"}  # issue 39: each at least 2x faster than TransformerLens
QKOV_TASKS = [
    "model", "text", "attention", "attention+text", "heads", "card-quick", "card", "composition", "terms",
    "ablate-zero", "ablate-zero+text", "ablate-mean", "patch", "patch-cli",
]  # fmt: skip
TL_TASKS = {
    "text": "text", "attention": "attention", "attention+text": "attention", "card-quick": "spectrum",
    "composition": "composition", "ablate-zero": "ablate", "ablate-zero+text": "ablate", "patch": "patch",
}  # fmt: skip


def build(root: Path) -> None:
    """The model, once: a qkov checkpoint and a TransformerLens file of the same weights."""
    if (root / "tl.safetensors").exists():
        return
    import torch

    import qkov
    from qkov.io import save_tl

    print(f"building {root} (GPT-2-small shape, random weights)", flush=True)
    model = qkov.Transformer(qkov.ModelConfig(**SHAPE), seed=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.rsplit(".", 1)[-1].startswith("W_"):
                p.add_(torch.randn_like(p) * 0.05)
    qkov.save_checkpoint(model, root / "qkov")
    save_tl(model, root / "tl.safetensors")


def ids(n: int) -> list[int]:
    import torch

    g = torch.Generator().manual_seed(1)
    return [0] + torch.randint(1, SHAPE["d_vocab"], (n - 1,), generator=g).tolist()


def pair(n: int) -> tuple[list[int], list[int]]:
    """A clean/corrupted pair of ``n`` token ids differing at ``n // 8`` positions (never the first)."""
    import torch

    g = torch.Generator().manual_seed(1)
    clean = torch.randint(1, SHAPE["d_vocab"], (n,), generator=g)
    corrupted = clean.clone()
    at = torch.randperm(n - 1, generator=g)[: n // 8] + 1
    corrupted[at] = torch.randint(1, SHAPE["d_vocab"], (len(at),), generator=g)
    return clean.tolist(), corrupted.tolist()


def patch_cli(root: Path) -> tuple[float, float, object]:
    """``(0, seconds, digest)`` of ``qkov patch`` with its defaults (``--receivers 5.1``) on a 64-token pair."""
    import contextlib
    import io

    for name, seq in zip(("clean", "corrupted"), pair(64)):
        (root / f"{name}-64.txt").write_text(" ".join(map(str, seq)) + "\n")
    argv = ["patch", str(root / "qkov"), "--clean", str(root / "clean-64.txt"), "--corrupted", str(root / "corrupted-64.txt")]
    t0 = time.perf_counter()
    from qkov.apps.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main([*argv, "--receivers", "5.1", "--json"])
    if code != 0:
        raise RuntimeError(f"qkov patch exited {code}")
    return 0.0, time.perf_counter() - t0, [r["values"] for r in json.loads(out.getvalue())["results"]]


def qkov_task(task: str, root: Path) -> tuple[float, float, object]:
    """``(load_s, seconds, digest)`` of one view on the checkpoint (``+text``: after the text view)."""
    if task == "patch-cli":
        return patch_cli(root)
    t0 = time.perf_counter()
    from qkov.apps.explore.session import open_explorer
    from qkov.apps.explore.views import VIEWS

    ex = open_explorer(root / "qkov", cache_dir=None)
    ex.weights  # the folded view, built on a thread from start: ready by the time a user sends a text
    head = f"{HEAD[0]}.{HEAD[1]}"
    clean, corrupted = pair(PATCH_SEQ)
    after_text = task.endswith("+text")
    task = task.removesuffix("+text")
    name, args = {
        "model": ("model", {}),
        "text": ("text", {"text": ids(SEQ)}),
        "attention": ("attention", {"text": ids(SEQ), "head": head}),
        "heads": ("heads", {}),
        "card-quick": ("card", {"head": head, "tables": False}),
        "card": ("card", {"head": head}),
        "composition": ("composition", {}),
        "terms": ("terms", {"text": ids(TERMS_SEQ), "position": TERMS_SEQ - 2}),
        "ablate-zero": ("ablate", {"text": ids(SEQ), "heads": [f"{l}.{h}" for l, h in ABLATE], "mode": "zero"}),
        "ablate-mean": ("ablate", {"text": ids(SEQ), "heads": [f"{l}.{h}" for l, h in ABLATE], "mode": "mean"}),
        "patch": ("patch", {"clean": clean, "corrupted": corrupted, "attribution": False}),
    }[task]
    load = time.perf_counter() - t0
    if after_text:
        VIEWS["text"](ex, {"text": args["text"]}, lambda *a: None)
    t1 = time.perf_counter()
    out = VIEWS[name](ex, args, lambda *a: None)
    seconds = time.perf_counter() - t1
    digest: object = None
    if task == "text":
        digest = out["loss"][:-1]
    elif task == "attention":
        digest = out["pattern"]
    elif task == "card-quick":
        digest = sorted(abs(complex(e["re"], e["im"])) for e in out["ov_eigenvalues"] + out["qk_eigenvalues"])
    elif task == "composition":
        digest = {f"{e['kind']}:{e['src']}:{e['dst']}": e["value"] for e in out["edges"]}
    elif task == "ablate-zero":
        digest = out["loss_after"][:-1]
    elif task == "patch":
        digest = [r["values"] for r in out["results"]]
    return load, seconds, digest


def tl_task(task: str, root: Path) -> tuple[float, float, object]:
    """``(load_s, seconds, digest)`` of TransformerLens doing the same work."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    t0 = time.perf_counter()
    with safe_open(str(root / "tl.safetensors"), "pt") as f:
        config = json.loads(f.metadata()["transformer_lens_config"])
    model = HookedTransformer(HookedTransformerConfig(**config))
    model.load_state_dict(load_file(str(root / "tl.safetensors")))
    model.load_and_process_state_dict(  # value biases stay in hook_z, as qkov keeps them (module docstring)
        model.state_dict(), fold_ln=True, center_writing_weights=True, center_unembed=True, fold_value_biases=False
    )
    model.eval()
    load = time.perf_counter() - t0
    tokens = torch.tensor([ids(SEQ)])
    l, h = HEAD
    t1 = time.perf_counter()
    if task == "text":
        digest = model(tokens, return_type="loss", loss_per_token=True)[0].tolist()
    elif task == "attention":
        _, cache = model.run_with_cache(tokens)
        digest = cache["pattern", l][0, h].tolist()
    elif task == "spectrum":
        ov = (model.W_E @ model.OV[l, h] @ model.W_U).eigenvalues
        qk = (model.W_E @ model.QK[l, h] @ model.W_E.T).eigenvalues
        digest = sorted(float(abs(v)) for v in torch.cat([ov, qk]))
    elif task == "composition":
        L, H = model.cfg.n_layers, model.cfg.n_heads
        digest = {}
        for kind in "QKV":
            s = model.all_composition_scores(kind)
            for l1 in range(L):
                for h1 in range(H):
                    for l2 in range(l1 + 1, L):
                        for h2 in range(H):
                            digest[f"{kind.lower()}:{l1}.{h1}:{l2}.{h2}"] = float(s[l1, h1, l2, h2])
    elif task == "patch":
        from transformer_lens import patching

        clean, corrupted = (torch.tensor([t]) for t in pair(PATCH_SEQ))
        _, clean_cache = model.run_with_cache(clean)  # timed: qkov's view records its runs inside its time too

        def loss(logits: torch.Tensor) -> torch.Tensor:  # the loss on the clean tokens, every position
            return torch.nn.functional.cross_entropy(logits[0, :-1], clean[0, 1:])

        resid = patching.get_act_patch_resid_pre(model, corrupted, clean_cache, loss)
        heads = patching.get_act_patch_attn_head_out_all_pos(model, corrupted, clean_cache, loss)
        digest = [resid.tolist(), heads.tolist()]
    else:

        def zero(z: torch.Tensor, hook: object, heads: list[int]) -> torch.Tensor:
            z[:, :, heads] = 0.0
            return z

        by_layer: dict[int, list[int]] = {}
        for a, b in ABLATE:
            by_layer.setdefault(a, []).append(b)
        hooks = [(f"blocks.{a}.attn.hook_z", lambda z, hook, hs=hs: zero(z, hook, hs)) for a, hs in by_layer.items()]
        model(tokens, return_type="loss", loss_per_token=True)  # the view shows the loss before and after
        digest = model.run_with_hooks(tokens, return_type="loss", loss_per_token=True, fwd_hooks=hooks)[0].tolist()
    return load, time.perf_counter() - t1, digest


def worker(lib: str, task: str, root: Path) -> None:
    import torch

    torch.set_grad_enabled(False)
    load, seconds, digest = (qkov_task if lib == "qkov" else tl_task)(task, root)
    print(json.dumps({"load_s": load, "seconds": seconds, "peak_rss_mib": peak_mib(), "digest": digest}))


def measure(lib: str, task: str, root: Path) -> dict:
    res = subprocess.run([sys.executable, __file__, "--worker", lib, task, str(root)], capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"{lib} {task} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def diff(a: object, b: object) -> float:
    """The largest difference between two digests (nested lists, or dicts of floats by key): absolute, divided
    by the value where it is over 1."""
    if isinstance(a, dict) and isinstance(b, dict):
        return max(abs(a[k] - b[k]) / max(1.0, abs(b[k])) for k in a if a[k] is not None)
    flat = lambda x: [v for row in x for v in flat(row)] if isinstance(x, list) else [x]  # noqa: E731
    return max(abs(x - y) / max(1.0, abs(y)) for x, y in zip(flat(a), flat(b)) if x is not None and y is not None)


def post(url: str, path: str, body: dict) -> tuple[float, dict]:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        out = json.loads(r.read())
    return time.perf_counter() - t0, out


def http(root: Path) -> dict:
    """Start ``qkov explore`` on the checkpoint; time the first page, a head card and a 256-token attention."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "qkov", "explore", str(root / "qkov"), "--port", "0", "--no-cache"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        line = ""
        while "serving" not in line:
            line = proc.stdout.readline()  # type: ignore[union-attr]
            if not line and proc.poll() is not None:
                raise RuntimeError(f"qkov explore failed: {proc.stderr.read()[-2000:]}")  # type: ignore[union-attr]
        url = line.split(" at ", 1)[1].split()[0].rstrip("/").split("?")[0]
        with urllib.request.urlopen(url + "/", timeout=600) as r:
            r.read()
        first = time.perf_counter() - t0
        head = f"{HEAD[0]}.{HEAD[1]}"
        card_quick, _ = post(url, "/api/views/card", {"head": head, "tables": False})
        card, _ = post(url, "/api/views/card", {"head": f"{HEAD[0]}.{HEAD[1] + 1}"})
        attention, _ = post(url, "/api/views/attention", {"text": ids(SEQ), "head": head})
        with open(f"/proc/{proc.pid}/status") as fh:
            hwm = next(int(x.split()[1]) / 1024 for x in fh if x.startswith("VmHWM"))
        return {"first page": first, "card (tables=false)": card_quick, "card": card, "attention": attention, "peak_rss_mib": hwm}
    finally:
        proc.send_signal(signal.SIGINT)  # Ctrl-C: the server stops cleanly
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


# ----------------------------------------------------------------------------- a Llama-3-8B shape, streamed
def job(url: str, view: str, args: dict) -> tuple[float, list[str], dict]:
    """Run one view through the job API as the page does (``POST /api/jobs``, then ``GET`` every 0.2 s):
    ``(seconds, the distinct progress lines seen, the result)``."""
    t0 = time.perf_counter()
    _, j = post(url, "/api/jobs", {"view": view, "args": args})
    lines: list[str] = []
    while j["state"] in ("queued", "running"):
        line = f"{view}: {j['what'] or j['state']}" + (f" {j['done']}/{j['total']}" if j["total"] else "")
        if not lines or lines[-1] != line:
            lines.append(line)
        time.sleep(0.2)
        with urllib.request.urlopen(f"{url}/api/jobs/{j['id']}", timeout=600) as r:
            j = json.loads(r.read())
    if j["state"] != "done":
        raise RuntimeError(f"{view}: {j['state']}: {j.get('error')}")
    return time.perf_counter() - t0, lines, j["result"]


def drop_page_cache() -> str:
    """Empty the kernel's page cache (``/proc/sys/vm/drop_caches``; needs root), so the first view reads the
    weights from the disk rather than from the copy the build left in memory: how the cache stood, in words."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return "page cache emptied before start (weights read from disk)"
    except OSError as e:
        return f"page cache NOT emptied ({e.strerror}): the weights may be read from memory"


def llama8b(root: Path, seq: int, keep: bool, card: bool, cold: bool = False) -> int:
    """``qkov explore`` on a Llama-3-8B-shape Hugging Face directory (random bfloat16 weights of the real shape,
    ~15 GiB, written shard by shard by ``bench_modern.build_llama``; reused when ``root`` holds one): the seconds
    from starting it to the first page, the first text view of ``seq`` token ids through the job API as the page
    runs it (its progress lines counted), a pattern of the last layer from the kept run, optionally a head card
    without its vocabulary tables, and the server's peak RSS (``VmHWM``) and the peak it printed on start.
    ``cold``: the page cache emptied first (:func:`drop_page_cache`)."""
    built_here = not (root / "model.safetensors.index.json").exists()
    if built_here:
        t = time.perf_counter()
        code = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import bench_modern as b; b.build_llama(__import__('pathlib').Path({str(root)!r}))"
        subprocess.run([sys.executable, "-c", code], check=True)  # in a child: this process never holds a shard
        print(f"built {root} in {time.perf_counter() - t:.0f} s", flush=True)
    size = sum(f.stat().st_size for f in root.glob("*.safetensors")) / 2**30
    print(f"Llama-3-8B shape at {root}: {size:.1f} GiB of bfloat16 safetensors; text of {seq} token ids", flush=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    print("  " + (drop_page_cache() if cold else "page cache as the build or an earlier run left it (--cold empties it)"))
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "qkov", "explore", str(root), "--port", "0", "--no-cache"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        said = [proc.stdout.readline() for _ in range(4)]  # type: ignore[union-attr]
        if "serving" not in said[0]:
            raise RuntimeError(f"qkov explore failed: {said} {proc.stderr.read()[-2000:]}")  # type: ignore[union-attr]
        url = said[0].split(" at ", 1)[1].split()[0].rstrip("/").split("?")[0]
        with urllib.request.urlopen(url + "/", timeout=600) as r:
            r.read()
        first = time.perf_counter() - t0
        for line in said[1:3]:
            print("  " + line.strip())
        text = [128000] + [int(i) for i in torch_ids(seq - 1)]
        t_text, lines, out = job(url, "text", {"text": text})
        print(f"first page {first:.1f} s after start; first text view {t_text:.1f} s ({len(lines)} progress lines, "
              f"e.g. {lines[len(lines) // 2]!r}); mean loss {out['mean_loss']}", flush=True)  # fmt: skip
        again = [128000] + [int(i) for i in torch_ids(seq, seed=2)[1:]]
        t_again, _, _ = job(url, "text", {"text": again})
        print(f"a second text of {seq} token ids: {t_again:.1f} s (no vocabulary-mean pass)", flush=True)
        last = f"{json.loads((root / 'config.json').read_text())['num_hidden_layers'] - 1}.0"
        t_att, _, _ = job(url, "attention", {"text": text, "head": last})
        print(f"attention {last} on the same text (its layer alone, from the kept run): {t_att:.1f} s", flush=True)
        if card:
            t_card, _, _ = job(url, "card", {"head": last, "tables": False})
            print(f"head card {last} without its vocabulary tables: {t_card:.1f} s", flush=True)
        with open(f"/proc/{proc.pid}/status") as fh:
            hwm = next(int(x.split()[1]) / 2**20 for x in fh if x.startswith("VmHWM"))
        print(f"server peak RSS (VmHWM) {hwm:.2f} GiB; goals: <= 4 GiB, first text view <= 60 s")
        print("(timings on a shared CPU are noisy)")
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        if built_here and not keep:
            shutil.rmtree(root)
            print(f"removed {root} (--keep keeps it)")
    return 0


def torch_ids(n: int, seed: int = 1) -> list[int]:
    """``n`` seeded random ids below the Llama-3 vocabulary's special tokens (128000)."""
    import torch

    return torch.randint(0, 128000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, help="where the model is built (default: qkov-explore-bench, or with "
                   "--size llama3-8b qkov-llama8b, under the temporary folder)")  # fmt: skip
    p.add_argument("--size", choices=["gpt2", "llama3-8b"], default="gpt2",
                   help="llama3-8b: the explorer streaming a Llama-3-8B-shape model from disk (see llama8b)")  # fmt: skip
    p.add_argument("--seq", type=int, default=64, help="llama3-8b: token ids in the text (default 64)")
    p.add_argument("--card", action="store_true", help="llama3-8b: also time a head card without its tables")
    p.add_argument("--cold", action="store_true",
                   help="llama3-8b: empty the page cache before the explorer starts (root only), so it reads the disk")
    p.add_argument("--keep", action="store_true", help="llama3-8b: keep the model built here (~15 GiB)")
    p.add_argument("--skip", default="", help="comma-separated tasks to leave out (e.g. heads,terms,http,tl)")
    p.add_argument("--only", default="", help="comma-separated tasks to run alone (e.g. text,patch,patch-cli)")
    p.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.worker[0], args.worker[1], Path(args.worker[2]))
        return 0
    if args.size == "llama3-8b":
        return llama8b(args.dir or Path(tempfile.gettempdir()) / "qkov-llama8b", args.seq, args.keep, args.card, args.cold)
    args.dir = args.dir or Path(tempfile.gettempdir()) / "qkov-explore-bench"
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    args.dir.mkdir(parents=True, exist_ok=True)
    build_in_child(args.dir)
    print(f"{'view':16s} {'qkov s':>8s} {'peak MiB':>9s} {'TL s':>8s} {'peak MiB':>9s} {'qkov/TL':>8s} {'max diff':>9s}  (load s: qkov, TL)")
    tl_done: dict[str, dict] = {}  # a TransformerLens task measured once, read by each qkov variant
    for task in QKOV_TASKS:
        if task in skip or (only and task not in only):
            continue
        q = measure("qkov", task, args.dir)
        line = f"{task:16s} {q['seconds']:8.2f} {q['peak_rss_mib']:9.0f}"
        if task in TL_TASKS and "tl" not in skip:
            name = TL_TASKS[task]
            t = tl_done[name] = tl_done.get(name) or measure("tl", name, args.dir)
            d = diff(q["digest"], t["digest"])
            line += f" {t['seconds']:8.2f} {t['peak_rss_mib']:9.0f} {q['seconds'] / t['seconds']:8.2f} {d:9.2g}"
            line += f"  ({q['load_s']:.1f}, {t['load_s']:.1f})"
        else:
            line += f" {'-':>8s} {'-':>9s} {'-':>8s} {'-':>9s}  ({q['load_s']:.1f})"
        goal = GOALS.get(task) or GOALS.get(task.split("-")[0])
        if task.removesuffix("+text") in FASTER:
            line += "  goal qkov/TL <= 0.50"
        if task == "patch-cli":
            line += f"  goal <= {goal:.0f} s, <= 1536 MiB"
        elif goal is not None:
            line += f"  goal <= {goal:.0f} s"
        print(line, flush=True)
    if "http" not in skip and (not only or "http" in only):
        h = http(args.dir)
        print("HTTP: " + ", ".join(f"{k} {v:.2f} s" for k, v in h.items() if k != "peak_rss_mib")
              + f"; server peak {h['peak_rss_mib']:.0f} MiB")  # fmt: skip
    print("(timings on a shared CPU are noisy; compare within one run)")
    return 0


def build_in_child(root: Path) -> None:
    """:func:`build` in a subprocess, so this process never holds the model (its peak stays small)."""
    if (root / "tl.safetensors").exists():
        return
    code = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import bench_explore as b; b.build(__import__('pathlib').Path({str(root)!r}))"
    subprocess.run([sys.executable, "-c", code], check=True)


if __name__ == "__main__":
    sys.exit(main())
