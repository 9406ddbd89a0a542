"""``qkov architectures``: the paper's 2-layer attention-only model trained in each variant of the
residual stream and attention qkov implements (docs/architectures.md), on the same corpus and token
budget, and read with the same tools.

Each variant lives in ``OUT/<variant>`` (a finished run is reused, an interrupted one resumed, a
missing one trained) with its snapshots and its dynamics (``OUT/<variant>/dynamics``, the tour's
``qkov dynamics``). Beside the training record and the dynamics' reading, each final model gets:

* the **attention-sink mass** of every head (mean attention on the first token, the "memory
  management" heads [F] predicted; gated attention is reported to remove them) and, for gated
  variants, each head's mean gate and gate sparsity (:func:`~qkov.analysis.heads.gates.gate_stats`);
* **paths by order**: the validation loss of the logits made of the paths through at most ``k``
  heads (the exact path expansion, with patterns, routing and gates frozen), ``k = 0 .. depth``;
* the bus's width (streams x d_model) and each stream's write overlap
  (:func:`~qkov.analysis.circuits.bus_bandwidth.bus_bandwidth`); for a routed model the K-composition
  the dynamics report is weighted by how much of the writer reaches the reader;
* the **induction circuit's path-patching share**: the share of the induction head's effect on the loss of
  repeated random tokens carried by the path from the previous-token head into its keys
  (:func:`~qkov.analysis.causal.composition.k_path_share`; the heads: :func:`induction_circuit`).

The comparison page ``OUT/index.html`` and every number in ``OUT/architectures.json`` are written
as one pair (:func:`~qkov.apps.outputs.replace_pair`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ..analysis.causal.composition import k_path_share
from ..analysis.circuits.bus_bandwidth import bus_bandwidth
from ..analysis.heads.gates import gate_stats
from ..analysis.paths.expansion import expand
from ..device import pick_device
from ..errors import QkovError
from ..finite import to_json
from ..io.checkpoint import load, read_config, read_metrics, training_record
from ..model.config import ModelConfig
from ..training.config import TrainConfig
from ..training.loop import Diverged, saved_configs, train
from ..weights.view import Weights
from .inputs import sample_for
from .outputs import output_folder, replace_pair
from .progress import TrainProgress
from .report.render import render_template
from .tour import earlier_dynamics, run_state
from .dynamics.study import write_dynamics

__all__ = [
    "ARCHITECTURE_FILES",
    "DEFAULT_VARIANTS",
    "induction_circuit",
    "paths_by_order",
    "run_architectures",
    "SCHEMA_VERSION",
    "STUDY_STEPS",
    "VARIANTS",
    "variant_config",
]

VARIANTS: dict[str, dict[str, Any]] = {
    "standard": {},
    "attnres": {"residual": "attnres"},
    "attnres-block": {"residual": "attnres-block", "attnres_block": 2},
    "hyper": {"residual": "hyper", "n_streams": 4},
    "hyper-dynamic": {"residual": "hyper", "n_streams": 4, "hyper_dynamic": True},
    "mhc": {"residual": "mhc", "n_streams": 4},
    "gate": {"gate": "elementwise"},
    "gate-headwise": {"gate": "headwise"},
    "loop": {"loop": 2},
}
"""Each variant's changes to the default 2-layer attention-only :class:`~qkov.ModelConfig`."""

DEFAULT_VARIANTS: tuple[str, ...] = ("standard", "attnres", "hyper", "mhc", "gate", "loop")
"""The variants trained by default: one of each scheme (the others, ``--variants``, cost the same again)."""
STUDY_STEPS = 3000
"""Training steps of every variant by default (16 x 256 tokens each: 12.3M tokens; the default model's
induction-head phase change comes at 8-12M tokens), so that the default variants train in about twice
the tour's time."""
ARCHITECTURE_FILES = ("index.html", "architectures.json")
SCHEMA_VERSION = 1
SINK_SEQUENCES = 8  # validation sequences the sink mass and the paths by order are measured on


def variant_config(name: str, base: ModelConfig | None = None) -> ModelConfig:
    """The model of variant ``name`` (:data:`VARIANTS`): ``base`` (default: the 2-layer attention-only
    model) with the variant's changes."""
    if name not in VARIANTS:
        raise QkovError(f"architectures: unknown variant {name!r} (known: {', '.join(VARIANTS)})")
    return (base or ModelConfig(n_layers=2)).replace(**VARIANTS[name])


# ------------------------------------------------------------------ measures of one final model
@torch.no_grad()
def paths_by_order(source: Any, tokens: torch.Tensor) -> list[float]:
    """The next-token loss of ``tokens [B, T]`` from the logits of the paths through at most ``k`` heads
    (``k = 0 .. depth``; biases and frozen MLP outputs always in), the exact path expansion with
    every pattern, normalisation, routing weight and gate frozen at the run's values. The last entry
    is the model's own loss (the expansion is exact)."""
    e = expand(source, tokens, per_head=False)
    target = e.recording.tokens[:, 1:]
    stream, b_U = e.bias + e.mlp, e.source.unembed().b_U
    out = []
    for term in e.orders:
        stream = stream + term
        logits = e.logits_of(stream) + b_U
        lp = torch.log_softmax(logits[:, :-1].double(), dim=-1)
        out.append(round(float(-lp.gather(-1, target[..., None]).mean()), 5))
    return out


def induction_circuit(heads: dict[str, Any] | None) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """``(writer, reader)`` of a model's induction circuit from its head scores (the dynamics' ``heads`` of a
    snapshot: ``[layer][head]`` grids): the reader the head above layer 0 with the highest induction score,
    the writer the head of an earlier layer with the highest previous-token score; ``None`` without them."""
    if not heads or heads.get("previous_token") is None or len(heads.get("induction") or []) < 2:
        return None
    ind, prev = heads["induction"], heads["previous_token"]
    reader = max(((l, h) for l in range(1, len(ind)) for h in range(len(ind[l]))), key=lambda p: ind[p[0]][p[1]])
    writer = max(((l, h) for l in range(reader[0]) for h in range(len(prev[l]))), key=lambda p: prev[p[0]][p[1]])
    return writer, reader


def _final_measures(ckpt: Path, dev: torch.device, heads: dict[str, Any] | None) -> dict[str, Any]:
    model = load(ckpt, device=dev)
    sample = sample_for(ckpt, model, text=None, tokens=None, seed=0)
    if sample.text is None:
        raise QkovError(f"architectures: no validation text for {ckpt} (the corpus it recorded cannot be read)")
    text = sample.text[:SINK_SEQUENCES].to(dev)
    w = Weights.from_model(model)
    stats = gate_stats(w, text)
    circuit = induction_circuit(heads)

    def grid(t: torch.Tensor | None) -> list[list[float]] | None:
        return None if t is None else [[round(float(v), 4) for v in row] for row in t]

    return {
        "parameters": model.num_parameters(),
        "sink_mass": grid(stats.sink),
        "max_sink": round(float(stats.sink.max()), 4),
        "gate_mean": grid(stats.mean),
        "gate_sparsity": grid(stats.sparsity),
        "paths_by_order": paths_by_order(w, text),
        "bandwidth": bus_bandwidth(w, text).to_dict(),
        "k_path_share": None if circuit is None else k_path_share(w, *circuit, seed=0).to_dict(),
    }


# ------------------------------------------------------------------ the study
def _row(name: str, cfg: ModelConfig, ckpt: Path, dyn: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    rec = training_record(ckpt)
    last = dyn["snapshots"][-1] if dyn.get("snapshots") else {}
    win = (dyn.get("reading") or {}).get("windows", {}).get("induction")
    tps = rec["tokens"] / rec["wall_s"] if rec.get("tokens") and rec.get("wall_s") else None
    return {
        "variant": name,
        "model": cfg.describe(),
        "config": dict(VARIANTS[name]),
        "tokens": rec.get("tokens"),
        "wall_s": rec.get("wall_s"),
        "tokens_per_s": None if tps is None else round(tps),
        "val_loss": rec.get("val_loss"),
        "icl": last.get("icl"),
        "induction": last.get("induction"),
        "previous_token": last.get("previous_token"),
        "k_composition": last.get("k_composition"),
        "phase_change": None if win is None else {"start": win["start"], "peak": win["peak"], "end": win["end"]},
        "curves": {
            "tokens": [s.get("tokens") for s in dyn.get("snapshots", [])],
            **{k: [s.get(k) for s in dyn.get("snapshots", [])] for k in ("induction", "previous_token", "icl_improvement", "val_loss")},
        },
        "loss_curve": _loss_curve(ckpt),
        "dynamics": f"{name}/dynamics/index.html",
        "diverged": None,
        **extra,
    }


def _check_same_model(ckpt: Path, cfg: ModelConfig) -> None:
    """Refuse to reuse or resume a run in ``ckpt`` of another model than ``cfg`` (another base, or a
    variant's older definition)."""
    state = run_state(ckpt, "architectures")
    if state == "new":
        return
    saved = saved_configs(ckpt)[0] if state == "partial" else read_config(ckpt).get("model", {})
    if ModelConfig.from_dict(saved) != cfg:  # a key the saved config predates takes its default
        raise QkovError(
            f"architectures: {str(ckpt)!r} holds a run of another model than {cfg.describe()!r}; "
            "choose another output folder", hint="out",
        )  # fmt: skip


def _corpus_of(runs: list[Path]) -> str | None:
    """The corpus the first run that wrote its config records (a run that diverged before its first
    checkpoint has none)."""
    for ckpt in runs:
        if (ckpt / "config.json").is_file():
            return training_record(ckpt).get("corpus")
    return None


def _diverged_row(name: str, cfg: ModelConfig, ckpt: Path, exc: Diverged) -> dict[str, Any]:
    """A variant whose training diverged: what it was and where it stopped; no measures."""
    return {
        "variant": name, "model": cfg.describe(), "config": dict(VARIANTS[name]), "diverged": exc.step,
        "parameters": cfg.parameter_count(), "tokens": None, "wall_s": None, "tokens_per_s": None,
        "val_loss": None, "icl": None, "induction": None, "previous_token": None, "k_composition": None,
        "phase_change": None, "curves": {"tokens": []}, "loss_curve": _loss_curve(ckpt), "dynamics": None,
        "sink_mass": [], "max_sink": None, "gate_mean": None, "gate_sparsity": None, "paths_by_order": [],
        "bandwidth": None, "k_path_share": None,
    }  # fmt: skip


def run_architectures(
    out: Path | str,
    *,
    variants: Sequence[str] = DEFAULT_VARIANTS,
    steps: int = STUDY_STEPS,
    device: str = "auto",
    corpus: str | None = None,
    base: ModelConfig | None = None,
    train_options: dict[str, Any] | None = None,
    quiet: bool = False,
    say: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """Train (or reuse) the 2-layer attention-only model in each of ``variants`` in ``out``, measure each
    (see the module docstring), write the comparison page; return one summary row per variant. A variant
    whose training diverges (:class:`~qkov.training.loop.Diverged`) gets a row saying at which step, and
    the study goes on (run again, it resumes from that run's last checkpoint and diverges again).

    ``base``: the model the variants change (default: the 2-layer attention-only model);
    ``train_options``: further :class:`~qkov.training.config.TrainConfig` fields (batch, lr, snapshots...)."""
    out = Path(out)
    if not variants:
        raise QkovError("architectures: no variant to train")
    configs = {name: variant_config(name, base) for name in variants}  # every name checked before any training
    with output_folder(out, ARCHITECTURE_FILES, overwrite=False, what="architectures"):
        pass  # refused now, not after an hour of training
    for name, cfg in configs.items():  # a run in OUT must be the model asked for: refused now, not after hours
        _check_same_model(out / name, cfg)
    dev = pick_device(device)
    t0 = time.perf_counter()
    over: dict[str, Any] = {**(train_options or {}), "steps": steps, **({"corpus": corpus} if corpus is not None else {})}
    TrainConfig(**over)  # a bad option refused before the first run
    rows = []
    for i, (name, cfg) in enumerate(configs.items()):
        ckpt = out / name
        state = run_state(ckpt, "architectures")
        tag = f"[{i + 1}/{len(configs)} {name}]"
        if state == "done":
            say(f"{tag} reusing the finished run in {ckpt}")
        else:
            say(f"{tag} {'resuming' if state == 'partial' else 'training'} {cfg.describe()} in {ckpt}")
            try:
                with TrainProgress(quiet=quiet) as progress:
                    if state == "partial":
                        train(ckpt, device=str(dev), resume=True, callback=progress.event, progress=progress)
                    else:
                        train(ckpt, cfg, TrainConfig(**over), device=str(dev), callback=progress.event, progress=progress)
            except Diverged as exc:  # a result of the study, not the end of it: the other variants go on
                say(f"{tag} diverged at step {exc.step} ({exc.value} loss); left out of the measures")
                rows.append(_diverged_row(name, cfg, ckpt, exc))
                continue
        dyn = earlier_dynamics(ckpt)
        if dyn is None:
            t1 = time.perf_counter()
            dyn = write_dynamics(ckpt / "dynamics", [ckpt], device=str(dev), overwrite=True).to_dict()
            say(f"{tag} dynamics -> {ckpt / 'dynamics' / 'index.html'} in {time.perf_counter() - t1:.0f} s")
        last = dyn["snapshots"][-1] if dyn.get("snapshots") else {}
        rows.append(_row(name, cfg, ckpt, dyn, _final_measures(ckpt, dev, last.get("heads"))))
    meta = {"device": str(dev), "steps": steps, "seconds": round(time.perf_counter() - t0, 1),
            "corpus": _corpus_of([out / name for name in configs])}  # fmt: skip
    body = {"schema_version": SCHEMA_VERSION, "variants": rows, **meta}
    page = render_template("architectures.html", body, ("report.js", "architectures.js"), "qkov architectures: the bus generalised")
    replace_pair(out, {"index.html": page, "architectures.json": to_json(body, indent=1)}, overwrite=False, what="architectures")
    return rows


def _loss_curve(ckpt: Path) -> dict[str, list[Any]]:
    """The validation-loss curve a run logged (tokens, loss)."""
    evals = [m for m in read_metrics(ckpt) if "val_loss" in m]
    return {"tokens": [m.get("tokens") for m in evals], "val_loss": [m["val_loss"] for m in evals]}
