"""Circuit discovery, qkov vs AutoCircuit 1.0.1, on the same model and prompts in one run: parity and cost.

A GPT-2-like model (LayerNorm, MLPs, biases and gains perturbed, learned positions; random weights,
seeded) is written as a TransformerLens state-dict file, and prompt pairs as AutoCircuit's JSON of token
ids (the answer: the clean run's top token at the last position; the wrong answer: the corrupted run's).
AutoCircuit runs in its own virtual environment (``benchmarks/requirements-autocircuit.txt``; created
when missing, or ``--venv PATH``) on an **unprocessed** ``HookedTransformer`` (TransformerLens'
``process_weights_`` always folds value biases into ``b_O``, which changes zero ablation; qkov never
folds them), ``separate_qkv=True``, output at the last position. Both do the same work:

* EAP under the corrupted (resample), zero and per-position mean (over the corrupted prompts) ablations;
* integrated edge gradients (AutoCircuit's "integrated_grad_samples", qkov's ``ieg``) at ``--steps``;
* exact edge patching (every edge at ``--size small``; AutoCircuit's ``patch_mode`` one edge at a time);
* the circuits of AutoCircuit's top-n edge sets at a few counts, run with the complement ablated on
  the clean prompts (``TREE_PATCH``; qkov ``ablate-complement``) and patched into the corrupted ones
  (``EDGE_PATCH``; qkov ``patch-in``) under the three ablations: the logit difference and faithfulness;
* ROC AUC of the EAP scores against the 12 edges exact patching ranks first (AutoCircuit's grid).

Parity is printed edge for edge: AutoCircuit's score is ``-batches`` times qkov's (``-batches (m + 1)`` for
the integrated gradients; the batch sums of the gradient of ``-metric``), so the check is
``max |c qkov - AutoCircuit| / max |AutoCircuit|`` (goal 1e-4). Each library's work runs in its own
process, its time and its peak memory above the loaded model printed side by side.

``--size gpt2`` (12 x 12, d_model 768, vocab 50257; 32,491 edges) also measures qkov's goals: EAP on
``--goal-prompts`` pairs, EAP-IG (m = 5), a 10-point faithfulness curve and exact patching of 1,000 edges,
each against its FLOP floor (the matrix products the work cannot avoid: two forward passes and one backward
for EAP; one pass per distinct circuit for the curve; each edge's pass from its receiver's layer on for
exact patching) and its memory. ``--size pythia`` (Pythia-160M's shape: parallel blocks, rotary) measures
the same goals with qkov alone.

    python benchmarks/bench_circuit.py                      # the small case: parity, seconds
    python benchmarks/bench_circuit.py --size gpt2          # GPT-2-small shape: minutes to hours on a CPU
    python benchmarks/bench_circuit.py --size pythia        # Pythia-160M shape: qkov's goals
    python benchmarks/bench_circuit.py --venv /path/to/venv --skip-autocircuit
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from matmul_rate import matmul_rate
from peak import peak_mib

HERE = Path(__file__).resolve().parent
SIZES = {
    "small": dict(shape=dict(n_layers=2, n_heads=4, d_model=32, d_head=8, d_mlp=128, d_vocab=50, n_ctx=16),
                  prompts=8, tokens=6, batch=4, exact=True, counts=[0, 1, 5, 10, 20, 55, 110]),
    "gpt2": dict(shape=dict(n_layers=12, n_heads=12, d_model=768, d_head=64, d_mlp=3072, d_vocab=50257, n_ctx=64),
                 prompts=16, tokens=24, batch=16, exact=False, counts=[0, 10, 100, 1000, 10000, 32491]),
    # Pythia-160M's shape (GPT-NeoX: parallel attention and MLP, rotary on a quarter of each head): qkov's goals
    # only (AutoCircuit's side is written for the GPT-2-like case)
    "pythia": dict(shape=dict(n_layers=12, n_heads=12, d_model=768, d_head=64, d_mlp=3072, d_vocab=50304, n_ctx=64,
                              positional="rotary", rotary_dim=16, parallel=True, act_fn="gelu"),
                   prompts=16, tokens=24, batch=16, exact=False, counts=[]),
}  # fmt: skip
GPT2_LIKE = dict(normalization="layernorm", positional="standard", act_fn="gelu_new", bias=True)
VARIANTS = {"TREE_PATCH": "ablate-complement", "EDGE_PATCH": "patch-in"}
ABLATIONS = {"RESAMPLE": "corrupted", "ZERO": "zero", "TOKENWISE_MEAN_CORRUPT": "mean-position"}


def vm_rss_mib() -> float:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:")) / 1024


# ------------------------------------------------------------------ the case (qkov's environment)
def build(root: Path, size: str, seed: int) -> None:
    """The model as a TransformerLens file, the prompts as AutoCircuit's JSON, and the plan of the work."""
    import torch

    import qkov
    from qkov.io import save_tl

    s = SIZES[size]
    cfg = qkov.ModelConfig(**{**GPT2_LIKE, **s["shape"]})
    model = qkov.Transformer(cfg, seed=seed)
    torch.manual_seed(seed)  # the perturbations below draw from the global generator
    with torch.no_grad():  # biases and gains matter; a larger stream so attention is not uniform
        for name, p in model.named_parameters():
            if not name.rsplit(".", 1)[-1].startswith("W_"):
                p.add_(torch.randn_like(p) * 0.1)
        model.W_E.mul_(4.0)
        if model.W_pos is not None:
            model.W_pos.mul_(4.0)
    if size == "pythia":  # outside the family a TransformerLens file holds: a qkov checkpoint
        from qkov.io import save_checkpoint

        save_checkpoint(model, root / "model")
    else:
        save_tl(model, root / "model.pt")
    g = torch.Generator().manual_seed(seed + 1)
    N, T = 2 * s["prompts"], s["tokens"]
    clean = torch.randint(0, cfg.d_vocab, (N, T), generator=g)
    corrupted = clean.clone()
    corrupted[:, T // 3] = torch.randint(0, cfg.d_vocab, (N,), generator=g)
    corrupted[:, -1] = torch.randint(0, cfg.d_vocab, (N,), generator=g)
    with torch.no_grad():
        lc, lk = model(clean)[:, -1], model(corrupted)[:, -1]
    answer = lc.argmax(-1, keepdim=True)
    top2 = lk.topk(2, dim=-1).indices
    wrong = torch.where(top2[:, :1] == answer, top2[:, 1:], top2[:, :1])
    prompts = [{"clean": clean[i].tolist(), "corrupt": corrupted[i].tolist(), "answers": answer[i].tolist(),
                "wrong_answers": wrong[i].tolist()} for i in range(N)]  # fmt: skip
    (root / "prompts.json").write_text(json.dumps({"prompts": prompts}))
    plan = {"size": size, "prompts": s["prompts"], "batch": s["batch"], "exact": s["exact"], "counts": s["counts"]}
    (root / "plan.json").write_text(json.dumps(plan))


# ------------------------------------------------------------------ AutoCircuit's side (its environment)
def autocircuit(root: Path, steps: int) -> dict:
    """AutoCircuit's numbers on the case, through its public API only; its edge names."""
    from importlib.metadata import version

    import torch as t
    from auto_circuit.data import load_datasets_from_json
    from auto_circuit.metrics.official_circuits.measure_roc import measure_task_roc
    from auto_circuit.metrics.prune_metrics.answer_diff import measure_answer_diff
    from auto_circuit.prune import run_circuits
    from auto_circuit.prune_algos.mask_gradient import mask_gradient_prune_scores
    from auto_circuit.types import AblationType, PatchType
    from auto_circuit.utils.ablation_activations import src_ablations
    from auto_circuit.utils.graph_utils import patch_mode, patchable_model, set_all_masks
    from auto_circuit.utils.tensor_ops import batch_avg_answer_diff, prune_scores_threshold
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    t.set_grad_enabled(True)
    plan = json.loads((root / "plan.json").read_text())
    saved = t.load(root / "model.pt", weights_only=True)
    tl = HookedTransformer(HookedTransformerConfig(**saved["config"]))
    params = {n for n, _ in tl.named_parameters()}  # the file's buffers are another TransformerLens version's
    missing, _ = tl.load_state_dict({k: v for k, v in saved["state_dict"].items() if k in params}, strict=False)
    assert not params & set(missing), f"parameters missing from the file: {params & set(missing)}"
    tl.cfg.use_attn_result, tl.cfg.use_split_qkv_input, tl.cfg.use_hook_mlp_in = True, True, True
    tl.eval()
    for p in tl.parameters():
        p.requires_grad = False
    cpu, n = t.device("cpu"), plan["prompts"]
    train, test = load_datasets_from_json(None, root / "prompts.json", cpu, prepend_bos=False, batch_size=plan["batch"],
                                          train_test_size=(n, n), shuffle=False, pad=False)  # fmt: skip
    model = patchable_model(tl, factorized=True, slice_output="last_seq", separate_qkv=True, seq_len=None, device=cpu)
    flat = lambda ps: {e.name: float(e.prune_score(ps)) for e in model.edges}  # noqa: E731
    kw = dict(grad_function="logit", answer_function="avg_diff", mask_val=0.0)
    t0, base = time.perf_counter(), vm_rss_mib()
    eap_ps = mask_gradient_prune_scores(model, train, None, **kw)
    out: dict = {"edges": model.n_edges, "seconds": {"eap": time.perf_counter() - t0}, "peak_mib": {}}
    out["peak_mib"]["eap"] = peak_mib() - base
    out["eap"] = flat(eap_ps)
    out["eap_zero"] = flat(
        mask_gradient_prune_scores(model, train, None, **kw, ablation_type=AblationType.ZERO, clean_corrupt=None)
    )
    mean = AblationType.TOKENWISE_MEAN_CORRUPT
    out["eap_mean"] = flat(mask_gradient_prune_scores(model, train, None, **kw, ablation_type=mean, clean_corrupt=None))
    t0 = time.perf_counter()
    out["ieg"] = flat(mask_gradient_prune_scores(model, train, None, grad_function="logit", answer_function="avg_diff",
                                                 integrated_grad_samples=steps))  # fmt: skip
    out["seconds"]["ieg"] = time.perf_counter() - t0
    if plan["exact"]:
        t0 = time.perf_counter()
        set_all_masks(model, 0.0)
        with t.no_grad():
            base_ld = t.stack([batch_avg_answer_diff(model(b.clean)[:, -1], b) for b in train]).mean().item()
        exact = {}
        for e in sorted(model.edges, key=lambda e: e.name):
            vals = []
            for b in train:
                with patch_mode(model, src_ablations(model, b.corrupt, AblationType.RESAMPLE), edges=[e]), t.no_grad():
                    vals.append(batch_avg_answer_diff(model(b.clean)[model.out_slice], b))
            exact[e.name] = t.stack(vals).mean().item() - base_ld
        out["exact"], out["seconds"]["exact"] = exact, time.perf_counter() - t0
        official = sorted(exact, key=lambda k: -abs(exact[k]))[:12]
    else:
        g = t.Generator().manual_seed(0)
        names = sorted(e.name for e in model.edges)
        official = [names[i] for i in t.randperm(len(names), generator=g)[:50].tolist()]
    pts = measure_task_roc(model, {e for e in model.edges if e.name in official}, eap_ps)
    out["roc"] = {
        "official": official,
        "auc": sum((x2 - x1) * (y1 + y2) / 2 for (x1, y1), (x2, y2) in zip(pts, pts[1:])),
    }
    out["circuits"], out["circuit_edges"] = {}, {}
    for n_e in plan["counts"]:
        thr = prune_scores_threshold(eap_ps, n_e)
        out["circuit_edges"][str(n_e)] = sorted(e.name for e in model.edges if abs(float(e.prune_score(eap_ps))) >= thr)
    t0 = time.perf_counter()
    for pt in ("TREE_PATCH", "EDGE_PATCH"):
        for ab in ABLATIONS:
            if pt == "EDGE_PATCH" and ab != "RESAMPLE":
                continue  # AutoCircuit's EDGE_PATCH with zero or mean puts them on the circuit's edges: not compared
            res = run_circuits(
                model, test, plan["counts"], eap_ps, patch_type=PatchType[pt], ablation_type=AblationType[ab]
            )
            out["circuits"][f"{pt}/{ab}"] = measure_answer_diff(model, test, res)
    out["seconds"]["circuits"] = time.perf_counter() - t0
    out["versions"] = {k: version(k) for k in ("auto-circuit", "transformer-lens", "torch")}
    return out


# ------------------------------------------------------------------ qkov's side
def ac_name(g, i: int) -> str:  # type: ignore[no-untyped-def]
    """qkov's edge ``i`` in AutoCircuit's spelling."""
    e = g.edge(i)

    def node(a, recv: bool) -> str:  # type: ignore[no-untyped-def]
        if a.kind == "embed":
            return "Resid Start"
        if a.kind == "logits":
            return "Resid End"
        if a.kind == "mlp":
            return f"MLP {a.layer}"
        return f"A{a.layer}.{a.head}" + (f".{a.input.upper()}" if recv else "")

    return f"{node(e.sender, False)}->{node(e.receiver, True)}"


def qkov_side(root: Path, steps: int, ac: dict | None) -> dict:
    """qkov's numbers on the case, in AutoCircuit's names and scale."""
    import qkov
    from qkov.analysis.discovery import Circuit, Evaluator, circuit_roc, edge_scores, graph_of, load_task, make_ablation
    from qkov.analysis.discovery.faithfulness import evaluate

    plan = json.loads((root / "plan.json").read_text())
    w = qkov.as_source(qkov.load_any(root / "model.pt"))
    g = graph_of(w.cfg)
    n, B = plan["prompts"], plan["batch"]
    both = load_task(root / "prompts.json", w)
    train, test = both.take(n), _rows(both, n, 2 * n)
    nb = n // B
    names = [ac_name(g, i) for i in range(g.n_edges)]
    scaled = lambda r, c: dict(zip(names, (c * r.scores).tolist()))  # noqa: E731
    t0, base = time.perf_counter(), vm_rss_mib()
    eap = edge_scores(w, train, batch=B)
    out: dict = {
        "edges": g.n_edges,
        "seconds": {"eap": time.perf_counter() - t0},
        "peak_mib": {"eap": peak_mib() - base},
    }
    out["eap"] = scaled(eap, -nb)
    out["eap_zero"] = scaled(edge_scores(w, train, ablation="zero", batch=B), -nb)
    out["eap_mean"] = scaled(edge_scores(w, train, ablation="mean-position", batch=B), -nb)
    t0 = time.perf_counter()
    out["ieg"] = scaled(edge_scores(w, train, method="ieg", steps=steps, batch=B), -nb * (steps + 1))
    out["seconds"]["ieg"] = time.perf_counter() - t0
    if plan["exact"]:
        t0 = time.perf_counter()
        out["exact"] = scaled(edge_scores(w, train, method="exact", batch=B), 1)
        out["seconds"]["exact"] = time.perf_counter() - t0
    if ac is not None:
        by_ac = {a: i for i, a in enumerate(names)}
        truth = [g.names[by_ac[a]] for a in ac["roc"]["official"]]
        grid = "exact" if g.n_edges <= 200 else "log"
        out["roc"] = {"auc": circuit_roc(eap, truth, grid=grid).edge_auc}
        out["circuits"] = {}
        t0 = time.perf_counter()
        for key in ac["circuits"]:
            pt, ab = key.split("/")
            ev = Evaluator(w, g, test, make_ablation(w, g, test, ABLATIONS[ab]), variant=VARIANTS[pt], batch=B)
            cs = [
                Circuit.of(g, [g.names[by_ac[a]] for a in ac["circuit_edges"][str(c)]]) for c, _ in ac["circuits"][key]
            ]
            r = evaluate(ev, cs)
            out["circuits"][key] = [[c.n_edges, v, f] for c, v, f in zip(cs, r.values, r.faithfulness)]
        out["seconds"]["circuits"] = time.perf_counter() - t0
    return out


def _rows(task, lo: int, hi: int):  # type: ignore[no-untyped-def]
    from dataclasses import replace

    return replace(task, clean=task.clean[lo:hi], corrupted=task.corrupted[lo:hi], answers=task.answers[lo:hi],
                   wrong=task.wrong[lo:hi], lengths=task.lengths[lo:hi], texts=None)  # fmt: skip


def goal(root: Path, what: str, prompts: int, tokens: int) -> dict:
    """One of qkov's GPT-2-shape goals, measured in this process: seconds and peak MiB above the model."""
    import torch

    import qkov
    from qkov.analysis.discovery import Evaluator, Task, edge_scores, graph_of, make_ablation
    from qkov.analysis.discovery.faithfulness import faithfulness_curve

    w = qkov.as_source(qkov.load_any(root / "model" if (root / "model").exists() else root / "model.pt"))
    V = w.cfg.d_vocab
    g = torch.Generator().manual_seed(5)
    clean = torch.randint(0, V, (prompts, tokens), generator=g)
    corrupted = clean.clone()
    corrupted[:, tokens // 3] = torch.randint(0, V, (prompts,), generator=g)
    task = Task(
        "goal",
        clean,
        corrupted,
        torch.randint(0, V, (prompts, 1), generator=g),
        torch.randint(0, V, (prompts, 1), generator=g),
    )
    edge_scores(w, task.take(2))  # warm up
    gr = graph_of(w.cfg)
    base = vm_rss_mib()
    t0 = time.perf_counter()
    if what == "eap":
        edge_scores(w, task)
    elif what == "eap-ig":
        edge_scores(w, task, method="eap-ig", steps=5)
    elif what == "curve":
        ev = Evaluator(w, gr, task, make_ablation(w, gr, task, "corrupted"))
        curve = faithfulness_curve(ev, edge_scores(w, task))
    elif what == "exact-1000":
        edges = torch.randperm(gr.n_edges, generator=g)[:1000]
        edge_scores(w, task, method="exact", edges=edges, batch=prompts)
    dt = time.perf_counter() - t0
    cfg = w.cfg
    per_token = (
        2 * cfg.n_layers * (4 * cfg.d_model**2 + 2 * cfg.d_model * cfg.d_mlp) + 2 * cfg.n_layers * tokens * cfg.d_model
    )
    forward = per_token * prompts * tokens  # one forward pass's matrix products, no unembedding
    if what == "eap":  # two forward passes and one backward (twice a forward)
        floor = 4 * forward
    elif what == "eap-ig":  # the two runs, then a forward and a backward per step
        floor = (2 + 3 * 5) * forward
    elif what == "curve":  # EAP's scores, the two runs, one pass per distinct circuit
        floor = (4 + 2 + len(set(curve.signed.edges)) + len(set(curve.absolute.edges))) * forward
    else:  # the two runs, then each edge's pass from its receiver's layer on
        layers = [cfg.n_layers if r.kind == "logits" else r.layer for r in (gr.receivers[int(gr.dst[e])] for e in edges)]
        floor = 2 * forward + sum((cfg.n_layers - l) / cfg.n_layers for l in layers) * forward
    rate = matmul_rate([(1, prompts * tokens, cfg.d_model, cfg.d_mlp), (1, prompts * tokens, cfg.d_mlp, cfg.d_model)])
    return {"what": what, "seconds": dt, "peak_gib": (peak_mib() - base) / 1024, "floor_gflop": floor / 1e9,
            "floor_seconds": floor / rate, "model_gib": base / 1024}  # fmt: skip


# ------------------------------------------------------------------ the driver
def _worker(python: str, mode: str, root: Path, *extra: str) -> dict:
    """Run this file in ``mode`` under ``python`` (its own process: its own peak memory); its JSON result."""
    out = root / f"{mode}-{len(list(root.glob(mode + '-*.json')))}.json"
    cmd = [python, str(Path(__file__).resolve()), f"--{mode}", str(root), "--result", str(out), *extra]
    env = dict(os.environ)
    if mode != "autocircuit":  # this checkout's qkov, whatever is installed
        env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent / "src"), *filter(None, [env.get("PYTHONPATH")])])
    done = subprocess.run(cmd, cwd=HERE.parent, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        sys.exit(f"{mode} failed:\n{done.stderr[-4000:]}")
    return json.loads(out.read_text()) if out.exists() else {}


def venv_python(venv: Path) -> str:
    """The venv's python, the venv made from requirements-autocircuit.txt when missing."""
    py = venv / "bin" / "python"
    if not py.exists():
        print(f"creating {venv} from requirements-autocircuit.txt (once; a few GB)", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run(
            [str(py), "-m", "pip", "install", "-q", "-r", str(HERE / "requirements-autocircuit.txt")], check=True
        )
    return str(py)


def rel(ours: dict, theirs: dict) -> float:
    """``max |ours - theirs| / max |theirs|`` over the edges of ``theirs``."""
    scale = max(abs(v) for v in theirs.values()) or 1.0
    return max(abs(ours[k] - v) for k, v in theirs.items()) / scale


def report(q: dict, ac: dict, steps: int) -> bool:
    print(f"edges: qkov {q['edges']:,}, AutoCircuit {ac['edges']:,}")
    ok = q["edges"] == ac["edges"]
    rows = [("EAP (corrupted)", "eap"), ("EAP (zero)", "eap_zero"), ("EAP (mean per position)", "eap_mean"),
            (f"integrated edge gradients (m = {steps})", "ieg"), ("exact edge patching", "exact")]  # fmt: skip
    print("\nscores, edge for edge: max |c qkov - AutoCircuit| / max |AutoCircuit| (goal 1e-4)")
    for label, key in rows:
        if key in ac and key in q:
            r = rel(q[key], ac[key])
            ok &= r < 1e-4
            print(f"  {label:40s} {r:.2e}")
    if "roc" in q:
        d = abs(q["roc"]["auc"] - ac["roc"]["auc"])
        ok &= d < 1e-6
        print(f"\nROC AUC of the EAP scores against {len(ac['roc']['official'])} edges: qkov {q['roc']['auc']:.6f}, "
              f"AutoCircuit {ac['roc']['auc']:.6f}")  # fmt: skip
    print("\ncircuits (AutoCircuit's top-n edge sets): logit difference, qkov vs AutoCircuit; qkov's faithfulness")
    for key, theirs in ac.get("circuits", {}).items():
        ours = q["circuits"][key]
        worst = max(abs(o[1] - t[1]) for o, t in zip(ours, theirs))
        ok &= worst < 1e-4
        cells = ", ".join(f"{t[0]}: {o[1]:.4f}/{t[1]:.4f} f={o[2]:.3f}" for o, t in zip(ours, theirs))
        print(f"  {key:32s} max diff {worst:.1e}  [{cells}]")
    print("\ncost (seconds; peak MiB above the loaded model)")
    for what in ("eap", "ieg", "exact", "circuits"):
        if what in q["seconds"] and what in ac["seconds"]:
            ratio = ac["seconds"][what] / max(q["seconds"][what], 1e-9)
            print(
                f"  {what:10s} qkov {q['seconds'][what]:8.3f} s, AutoCircuit {ac['seconds'][what]:8.3f} s: "
                f"{ratio:6.1f}x"
            )
    print(f"  EAP peak: qkov {q['peak_mib']['eap']:.0f} MiB, AutoCircuit {ac['peak_mib']['eap']:.0f} MiB")
    print(f"  AutoCircuit's environment: {ac.get('versions')}")
    return ok


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=SIZES, default="small")
    p.add_argument("--steps", type=int, default=5, help="integration steps (default 5)")
    p.add_argument("--venv", type=Path, default=HERE / ".autocircuit-venv", help="AutoCircuit's virtual environment")
    p.add_argument("--skip-autocircuit", action="store_true", help="qkov's side and goals only")
    p.add_argument("--goal-prompts", type=int, default=64, help="prompt pairs of the GPT-2-shape goals (default 64)")
    p.add_argument("--goals", action="store_true", help="measure qkov's goals at this size too (always at gpt2)")
    p.add_argument("--keep", type=Path, help="keep the case and the results in this folder")
    for mode in ("build", "autocircuit", "qkov", "goal"):
        p.add_argument(f"--{mode}", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--what", help=argparse.SUPPRESS)
    p.add_argument("--ac", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.build:
        build(args.build, args.size, seed=0)
        return 0
    ac_json = lambda: json.loads(args.ac.read_text()) if args.ac else None  # noqa: E731
    for mode, fn in (
        ("autocircuit", lambda r: autocircuit(r, args.steps)),
        ("qkov", lambda r: qkov_side(r, args.steps, ac_json())),
        ("goal", lambda r: goal(r, args.what, args.goal_prompts, SIZES[args.size]["tokens"])),
    ):
        root = getattr(args, mode)
        if root:
            args.result.write_text(json.dumps(fn(root)))
            return 0
    root = args.keep or Path(tempfile.mkdtemp(prefix="bench-circuit-"))
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    _worker(sys.executable, "build", root, "--size", args.size)
    print(f"case ({args.size}): {root} ({time.perf_counter() - t0:.1f} s)", flush=True)
    ok = True
    if args.size == "pythia" and not args.skip_autocircuit:
        print("AutoCircuit's side runs on the GPT-2-like cases (small, gpt2); at pythia shape qkov's goals only")
    if not args.skip_autocircuit and args.size != "pythia":
        ac = _worker(venv_python(args.venv), "autocircuit", root, "--steps", str(args.steps))
        (root / "autocircuit.json").write_text(json.dumps(ac))
        q = _worker(sys.executable, "qkov", root, "--steps", str(args.steps), "--ac", str(root / "autocircuit.json"))
        ok = report(q, ac, args.steps)
    if args.size in ("gpt2", "pythia") or args.goals:
        print(f"\nqkov's goals ({args.size}), {args.goal_prompts} prompt pairs of {SIZES[args.size]['tokens']} tokens:")
        flags = ("--goal-prompts", str(args.goal_prompts), "--size", args.size)
        got = {
            w: _worker(sys.executable, "goal", root, "--what", w, *flags)
            for w in ("eap", "eap-ig", "curve", "exact-1000")
        }
        e = got["eap"]
        print(f"  (the process holds {e['model_gib']:.2f} GiB with the model loaded; peaks below are above that)")
        for w in ("eap", "eap-ig", "curve", "exact-1000"):
            r = got[w]
            print(
                f"  {w}: {r['seconds']:.1f} s ({r['seconds'] / e['seconds']:.1f}x EAP), {r['peak_gib']:.2f} GiB; "
                f"FLOP floor {r['floor_gflop']:.0f} GFLOP, {r['floor_seconds']:.1f} s at this machine's matmul rate: "
                f"{r['seconds'] / r['floor_seconds']:.2f}x the floor"
            )
    print("\nparity:", "ok" if ok else "NOT within 1e-4")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
