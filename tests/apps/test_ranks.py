"""Analyses under torchrun (gloo, CPU): 1, 2 and 3 ranks give the same output for every split command.

One script runs every command in turn (circuits in memory and memory-mapped, trigrams, heads, paths,
report) in one process and under ``torch.distributed.run`` with 2 and 3 ranks. It records, on each
rank, which units of work every gather received from that rank (``Ranks.gather`` wrapped), so the
test sees both that the output is the same and that the work was really shared out.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import qkov
from qkov import ModelConfig
from qkov.ranks import Ranks

from helpers import torchrun

SCRIPT = """
import contextlib, io, json, os, sys
from pathlib import Path
import torch
import qkov.ranks as S
from qkov.apps.cli import main

out, commands = Path(sys.argv[1]), json.loads(sys.argv[2])
rank = int(os.environ.get("RANK", "0"))
if "RANK" in os.environ:  # one process group for every command (a group cannot be joined twice)
    import torch.distributed as dist
    dist.init_process_group("gloo")
seen, gather = [], S.Ranks.gather

def spy(self, parts, n):
    seen.append([n, sorted(parts)])
    return gather(self, parts, n)

S.Ranks.gather = spy


def blocks(path):  # composition streamed one writer layer at a time, one pair of layers per product
    import qkov.analysis.circuits.composition as C
    from qkov.apps.ranks import ranks
    from qkov.weights import LazyCheckpoint
    C.PRODUCT_BYTES = 1
    with ranks(torch.device("cpu")):
        raw = C.composition_raw(LazyCheckpoint(path), "qkv", max_bytes=1)
    if rank == 0:
        print(json.dumps({k: v.nan_to_num(-1.0).tolist() for k, v in raw.items()}))
    return 0


for i, argv in enumerate(commands):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = blocks(argv[1]) if argv[0] == "blocks" else main(argv)
    (out / f"{i}.{rank}.out").write_text(json.dumps({"rc": rc, "stdout": buf.getvalue(), "units": seen}))
    seen = []
"""

# GPT-2-like (LayerNorm, MLP, biases) and Llama-like (rotary, RMSNorm, grouped-query attention)
LN = ModelConfig(n_layers=3, n_heads=3, d_model=24, d_head=8, d_vocab=40, n_ctx=64, normalization="layernorm",
                 d_mlp=32, bias=True)  # fmt: skip
ROT = ModelConfig(n_layers=3, n_heads=4, d_model=16, d_head=4, d_vocab=30, n_ctx=12, positional="rotary",
                  rotary_base=100.0, normalization="rmsnorm", d_mlp=24, act_fn="silu", gated_mlp=True, n_kv_heads=2)  # fmt: skip


def _commands(tmp: Path, report: Path) -> list[list[str]]:
    ln, rot, toks = str(tmp / "ln"), str(tmp / "rot"), str(tmp / "tokens.txt")
    text = ["--tokens", toks, "--batch", "6"]
    return [
        ["circuits", ln, "--json"],
        ["circuits", rot, "--json", "--lazy"],  # memory-mapped: writer layers in blocks, readers streamed
        ["blocks", str(tmp / "deep")],  # memory-mapped, one writer layer per block: each rank reads what it needs
        ["trigrams", ln, "--head", "0.1", "--json"],
        ["heads", ln, *text, "--max-memory", "300K", "--json"],  # small memory: one sequence per text chunk
        ["paths", ln, *text, "--json"],
        ["report", ln, "-o", str(report), "--quiet", *text],
    ]


def threads_of_a_rank(ranks: int) -> int:
    """The threads qkov gives each of ``ranks`` local ranks (the cores shared out)."""
    return Ranks(world=ranks, local_world=ranks).threads


def _run(tmp: Path, ranks: int, env: dict[str, str], threads: int | None = None) -> tuple[Path, list[list[str]]]:
    """The commands on ``ranks`` ranks; one process (``ranks == 1``) on ``threads`` threads."""
    out = tmp / (f"ranks{ranks}" if threads is None else f"ranks1-threads{threads}")
    out.mkdir()
    if threads is not None:
        env = {**env, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    commands = _commands(tmp, out / "report")
    args = [str(tmp / "script.py"), str(out), json.dumps(commands)]
    if ranks == 1:
        res = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=600)
    else:
        res = torchrun(args, env, nproc=ranks, script=True)
    assert res.returncode == 0, res.stderr[-3000:]
    return out, commands


def _result(out: Path, i: int, rank: int = 0) -> dict:  # type: ignore[type-arg]
    return json.loads((out / f"{i}.{rank}.out").read_text())


def _output(out: Path, i: int, command: str) -> object:
    """What command ``i`` gave on rank 0, less its timings: its JSON, or the report it wrote."""
    if command == "report":
        data = json.loads((out / "report" / "report.json").read_text())
        data.pop("timings")
        assert sorted(p.name for p in (out / "report").iterdir()) == ["index.html", "report.json"]
        return data
    data = json.loads(_result(out, i)["stdout"])
    data.pop("seconds", None)  # paths: wall time
    return data


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[object, tuple[Path, list[list[str]]]]:
    tmp = tmp_path_factory.mktemp("split")
    torch.manual_seed(0)
    qkov.save_checkpoint(qkov.Transformer(LN), tmp / "ln")
    qkov.save_checkpoint(qkov.Transformer(ROT), tmp / "rot")
    qkov.save_checkpoint(qkov.Transformer(replace(ROT, n_layers=6)), tmp / "deep")
    g = torch.Generator().manual_seed(0)
    (tmp / "tokens.txt").write_text(" ".join(map(str, torch.randint(0, 40, (64 * 6,), generator=g).tolist())))
    (tmp / "script.py").write_text(SCRIPT)
    env = {**os.environ, "QKOV_CACHE": str(tmp / "cache")}
    # the one-process reference runs on as many threads as a rank gets: a product whose long inner dimension is
    # split over threads (the circuit section's score contractions) sums in another order on another thread
    # count, and the point here is the split over ranks, not over threads
    runs = {n: _run(tmp, n, env) for n in (2, 3)}
    for t in sorted({threads_of_a_rank(n) for n in (2, 3)}):
        runs[("one", t)] = _run(tmp, 1, env, threads=t)
    return runs


@pytest.mark.parametrize("ranks", [2, 3])
def test_any_rank_count_gives_one_process_output(runs: dict, ranks: int) -> None:  # type: ignore[type-arg]
    one, commands = runs[("one", threads_of_a_rank(ranks))]
    many, _ = runs[ranks]
    for i, argv in enumerate(commands):
        assert _result(many, i)["rc"] == 0
        assert _output(many, i, argv[0]) == _output(one, i, argv[0]), argv  # equal, not close
        for rank in range(1, ranks):  # the other ranks print nothing
            other = _result(many, i, rank)
            assert other["rc"] == 0 and other["stdout"] == "", (argv, rank, other["stdout"][:200])


@pytest.mark.parametrize("ranks", [2, 3])
def test_every_unit_is_computed_once_by_its_rank(runs: dict, ranks: int) -> None:  # type: ignore[type-arg]
    one, commands = runs[("one", threads_of_a_rank(ranks))]
    many, _ = runs[ranks]
    shared = set()
    for i, argv in enumerate(commands):
        alone = _result(one, i)["units"]
        assert all(units == list(range(n)) for n, units in alone), argv  # one process: every unit itself
        per_rank = [_result(many, i, r)["units"] for r in range(ranks)]
        assert all(len(p) == len(alone) for p in per_rank), argv  # every rank meets every gather
        for k, (n, _) in enumerate(alone):
            got = [per_rank[r][k] for r in range(ranks)]
            assert all(g[0] == n for g in got)
            for r, (_, units) in enumerate(got):
                assert units == list(range(r * n // ranks, (r + 1) * n // ranks)), (argv, k, r)  # runs: all, once
            if n >= ranks:
                shared.add(argv[0])
    # every command but trigrams (one head: one unit, rank 0's) shared work out over all the ranks
    assert shared == {"circuits", "blocks", "heads", "paths", "report"}
