"""Training dynamics: ``qkov dynamics`` over a run's snapshots, the same core work beside
TransformerLens, and the cost of keeping snapshots during training.

RUN (default ``runs/tour/qkov-2l``, the tour's 2-layer run; ~40 snapshots) must hold snapshots.

1. ``qkov dynamics RUN`` in its own process: wall time and peak RSS (goal: <= 60 s, 40 snapshots).
2. The core per-snapshot work both libraries can do, on the same snapshots and tokens: load the
   weights, run the validation text and the repeated random tokens, and compute the loss, every
   head's previous-token and induction attention scores. qkov: what ``qkov dynamics`` runs (one text
   pass for the losses and the previous-token entries, one pass over the repeated tokens for the
   induction entries, both read from the attention kernel's log-sum-exp, no pattern formed);
   TransformerLens: ``HookedTransformer`` (built once, weights loaded per snapshot) +
   ``run_with_cache`` (its patterns). Ratio, and the largest difference of their numbers.
3. Snapshot overhead: the time to write the run's snapshots (measured here, same model and
   count) as a share of the run's recorded training time (goal <= 3%).

    python benchmarks/bench_dynamics.py [RUN]
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from peak import peak_mib  # this process's own peak (ru_maxrss counts a forked parent's)


def core_worker(lib: str, run: str) -> dict[str, float]:
    import torch

    torch.set_grad_enabled(False)
    import qkov
    from qkov.analysis.series.measures import PER_TOKEN_SEQUENCES, text_pass
    from qkov.analysis.heads.entries import EntryWatch
    from qkov.analysis.heads.probes import induction_attention, induction_entries, induction_probe_tokens
    from qkov.apps.inputs import analysis_inputs
    from qkov.model.ops import next_token_loss
    from qkov.training import snapshots as snaps

    final = qkov.load(run)
    text = analysis_inputs(Path(run), final, batch=16).tokens
    length = min(50, (final.cfg.n_ctx - 1) // 2)
    rep = induction_probe_tokens(final, length=length, batch=8, seed=0)
    found = snaps.listing(Path(run))
    none = torch.zeros(0, dtype=torch.long)
    out = []
    if lib == "tl":
        from qkov.io import to_hooked

        hooked = to_hooked(final, dtype=torch.float32)
    t0 = time.perf_counter()
    for _, path in found:
        tensors, _ = snaps.read(path)
        model = qkov.Transformer(final.cfg, init=False)  # both: no random init, every parameter is loaded
        model.load_state_dict(tensors, assign=lib == "qkov")  # qkov: the snapshot's tensors, not copies
        if lib == "qkov":
            w = qkov.Weights.from_model(model)
            nll, prev = text_pass(w, text)  # the losses and every head's A[i, i-1], one pass, no pattern
            loss = float(nll.mean())
            ind = torch.zeros(final.cfg.n_layers, final.cfg.n_heads)
            take = lambda layer, entries: ind.__setitem__(layer, entries.mean(dim=(0, 2)))  # noqa: E731
            watch = EntryWatch(final.cfg.n_layers, *induction_entries(rep.shape[1], length), take)
            qkov.trace(w, rep, edits=watch.edits(), positions=none)  # no logits read: nothing unembedded
        else:
            hooked.load_state_dict(to_hooked(model, dtype=torch.float32).state_dict())
            logits, cache = hooked.run_with_cache(text)
            loss = float(next_token_loss(logits, text))
            pats = torch.stack([cache["pattern", l] for l in range(final.cfg.n_layers)])
            prev = pats.diagonal(offset=-1, dim1=-2, dim2=-1).mean(dim=(1, 3))
            _, cache = hooked.run_with_cache(rep)
            pats = torch.stack([cache["pattern", l] for l in range(final.cfg.n_layers)])
            ind = induction_attention(pats, length)
        out.append([loss, prev.flatten().tolist(), ind.flatten().tolist()])
    dt = time.perf_counter() - t0
    rss = peak_mib() / 1024
    return {"seconds": dt, "peak_gib": rss, "snapshots": len(found), "values": out, "seqs": PER_TOKEN_SEQUENCES}


def _child(args: list[str]) -> dict:
    res = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(res.stderr[-3000:])
    return json.loads(res.stdout.strip().splitlines()[-1])


def dynamics_cli(run: str) -> dict[str, float]:
    out = tempfile.mkdtemp(prefix="qkov-dyn-")
    t0 = time.perf_counter()
    res = subprocess.run(
        [sys.executable, "-m", "qkov", "dynamics", run, "-o", out, "--device", "cpu", "--json"],
        capture_output=True,
        text=True,
    )
    dt = time.perf_counter() - t0
    if res.returncode != 0:
        raise SystemExit(res.stderr[-3000:])
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
    data = json.loads(res.stdout)
    return {"seconds": dt, "peak_gib": peak, "snapshots": len(data["snapshots"]), "reading": data["reading"]}


def snapshot_overhead(run: str) -> dict[str, float]:
    import qkov
    from qkov.io.checkpoint import read_config
    from qkov.training import snapshots as snaps

    model = qkov.load(run)
    n = len(snaps.listing(Path(run)))
    folder = Path(tempfile.mkdtemp(prefix="qkov-snap-"))
    t0 = time.perf_counter()
    for i in range(n):
        snaps.write(folder, model, i, 0)
    write_s = time.perf_counter() - t0
    wall = float(read_config(run)["training"]["wall_s"])
    return {"snapshots": n, "write_s": write_s, "train_s": wall, "share": write_s / wall}


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--core":
        print(json.dumps(core_worker(sys.argv[2], sys.argv[3])))
        return
    run = sys.argv[1] if len(sys.argv) > 1 else "runs/tour/qkov-2l"
    if not (Path(run) / "snapshots").is_dir():
        raise SystemExit(f"{run} holds no snapshots: run `qkov tour` (or qkov train) first")
    cli = dynamics_cli(run)
    w = cli["reading"]["windows"]["induction"]
    print(f"qkov dynamics: {cli['snapshots']} snapshots in {cli['seconds']:.1f} s, peak {cli['peak_gib']:.2f} GiB")
    print(f"  induction window: {w and (round(w['start']), round(w['end']))}")
    q, t = _child(["--core", "qkov", run]), _child(["--core", "tl", run])
    diff = max(
        abs(a - b)
        for sq, st in zip(q["values"], t["values"])
        for xa, xb in zip(sq, st)
        for a, b in zip(xa if isinstance(xa, list) else [xa], xb if isinstance(xb, list) else [xb])
    )
    print(
        f"core work per series ({q['snapshots']} snapshots: load, loss, previous-token and induction scores): "
        f"qkov {q['seconds']:.2f} s / {q['peak_gib']:.2f} GiB, TransformerLens {t['seconds']:.2f} s / "
        f"{t['peak_gib']:.2f} GiB -> {t['seconds'] / q['seconds']:.1f}x; largest difference {diff:.1e}"
    )
    o = snapshot_overhead(run)
    print(
        f"snapshot overhead: {o['snapshots']} writes {o['write_s']:.2f} s over a {o['train_s']:.0f} s run "
        f"= {100 * o['share']:.2f}%"
    )


if __name__ == "__main__":
    main()
