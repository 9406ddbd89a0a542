"""Every number of a qkov report, computed from a checkpoint into one JSON-ready dict.

The report page draws only what :func:`collect` returns (it is also written as
``report.json``), so each figure is backed by a number a test or a user can read.
Sections (keys of the dict): ``card``, ``heads``, ``eigenvalues``, ``composition``,
``paths``, ``attention``, ``icl``, ``trigrams``. A section a model cannot have (heads of
a 0-layer model, composition of a 1-layer model) holds ``{"absent": "why"}``.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from ..errors import QkovError

Progress = Callable[[str], None]


def _r(x: float, digits: int = 4) -> float | None:
    """Round to ``digits`` significant digits (keeps report.json small); NaN/inf -> None."""
    if x is None or not math.isfinite(x):
        return None
    return float(f"{x:.{digits}g}")


def _rl(values: Any, digits: int = 4) -> Any:
    """Round a (nested) list of floats."""
    if isinstance(values, (list, tuple)):
        return [_rl(v, digits) for v in values]
    return _r(float(values), digits)


def _rd(d: dict[str, Any]) -> dict[str, Any]:
    """A dict with its float values rounded (see :func:`_r`)."""
    return {k: (_r(v) if isinstance(v, float) else v) for k, v in d.items()}


@contextmanager
def _stage(timings: dict[str, float], name: str, progress: Progress | None) -> Iterator[None]:
    if progress is not None:
        progress(name)
    t0 = time.perf_counter()
    yield
    timings[name] = round(time.perf_counter() - t0, 3)


def _decoder(model: Any) -> Callable[[int], str]:
    if model.tokenizer is None:
        return lambda i: f"<{i}>"
    cache: dict[int, str] = {}

    def decode(i: int) -> str:
        if i not in cache:
            cache[i] = model.tokenizer.decode([i], skip_special_tokens=False)
        return cache[i]

    return decode


def _card(ckpt: Path, model: Any, w: Any) -> dict[str, Any]:
    from ..checkpoint import read_metrics
    from ..circuits import bandwidth
    from ..cli.train_cmds import checkpoint_info
    from ..interop import source_kind

    kind = source_kind(ckpt)
    if kind == "qkov":
        info = checkpoint_info(ckpt, model)
        metrics = read_metrics(ckpt)
    else:  # an imported model: no training record
        info = {"path": str(ckpt), "model": model.cfg.to_dict(), "parameters": model.num_parameters(), "source": kind}
        metrics = []
    evals = [m for m in metrics if "val_loss" in m]
    logs = [m for m in metrics if "train_loss" in m and "val_loss" not in m]
    logs = logs[:: max(1, len(logs) // 250)]  # a readable curve, not every logged step
    curve = {
        "tokens": [m.get("tokens") for m in evals],
        "val_loss": _rl([m["val_loss"] for m in evals]),
        "induction": _rl([m.get("induction_score", float("nan")) for m in evals]),
        "train_tokens": [m.get("tokens") for m in logs],
        "train_loss": _rl([m["train_loss"] for m in logs]),
    }
    info["curve"] = curve
    info["bandwidth"] = [b.to_dict() for b in bandwidth(w)] if model.cfg.n_layers else []
    return info


def _heads(
    model: Any, w: Any, text: torch.Tensor, freqs: np.ndarray | None, icl_text: torch.Tensor, diag_k: int
) -> dict:
    from ..heads import head_report

    rep = head_report(model, text, frequencies=freqs, icl_text=icl_text, diag_k=diag_k or None)
    rows = []
    for row in rep.rows():
        rows.append(_rd(row))
    return {
        "rows": rows,
        "thresholds": rep.thresholds,
        "memory_neurons": len(rep.memory_neurons),
        "icl": None if rep.icl is None else {"score": rep.icl.score, "early": rep.icl.early, "late": rep.icl.late},
        "_icl_curve": None if rep.icl is None else rep.icl.loss_by_position,
    }


def _eigenvalues(w: Any) -> dict[str, Any]:
    from ..circuits import eigen_copying_score, ov_eigenvalues

    ev = ov_eigenvalues(w)  # [L, H, d_head] complex
    score = eigen_copying_score(ev)
    out = []
    for l in range(ev.shape[0]):
        for h in range(ev.shape[1]):
            e = ev[l, h]
            scale = float(e.abs().max()) or 1.0
            out.append(
                {
                    "head": f"{l}.{h}",
                    "scale": _r(scale),
                    "re": _rl((e.real / scale).tolist(), 3),
                    "im": _rl((e.imag / scale).tolist(), 3),
                    "score": _r(float(score[l, h])),
                }
            )
    return {"heads": out}


def _composition(w: Any) -> dict[str, Any]:
    from ..circuits import composition_scores

    if w.cfg.n_layers < 2:
        return {"absent": "composition needs at least two layers"}
    out: dict[str, Any] = {}
    for kind in ("q", "k", "v"):
        c = composition_scores(w, kind)  # type: ignore[arg-type]
        raw = c.raw  # [L, H, L, H]
        L, H = raw.shape[0], raw.shape[1]
        writers = [f"{l}.{h}" for l in range(L - 1) for h in range(H)]
        readers = [f"{l}.{h}" for l in range(1, L) for h in range(H)]
        rawm = raw[: L - 1].reshape((L - 1) * H, L, H)[:, 1:].reshape((L - 1) * H, (L - 1) * H)
        # a cell (writer, reader) only means something when the writer's layer is earlier
        wl = torch.tensor([l for l in range(L - 1) for _ in range(H)], device=rawm.device)
        rl = torch.tensor([l for l in range(1, L) for _ in range(H)], device=rawm.device)
        valid = wl[:, None] < rl[None, :]
        rawm = torch.where(valid, rawm, torch.full_like(rawm, float("nan")))
        out[kind] = {
            "writers": writers,
            "readers": readers,
            "raw": _rl(rawm.tolist()),
            "adjusted": _rl((rawm - c.baseline.mean).tolist()),
            "baseline_mean": _r(c.baseline.mean),
            "baseline_std": _r(c.baseline.std),
            "top": [_rd(p) for p in c.pairs()[:10]],
        }
    return out


def _paths(w: Any, tokens: torch.Tensor, top: int) -> dict[str, Any]:
    from ..paths import summarize

    data = summarize(w, tokens, top_virtual=top).to_dict()
    for key in ("single_head_terms", "virtual_head_terms"):
        data[key] = [_rd(e) for e in data[key]]
    return data


def _attention(model: Any, tokens: torch.Tensor, decode: Callable[[int], str]) -> dict[str, Any]:
    out = model.run(tokens[None], return_patterns=True)
    assert out.patterns is not None
    pat = out.patterns[:, 0].float().cpu()  # [L, H, T, T]
    T = tokens.shape[0]
    # lower triangle only, row by row: row q has q+1 entries
    L, H = pat.shape[0], pat.shape[1]
    rows = [[[_rl(pat[l, h, q, : q + 1].tolist(), 3) for q in range(T)] for h in range(H)] for l in range(L)]
    return {"ids": tokens.tolist(), "tokens": [decode(int(t)) for t in tokens], "patterns": rows}


def _repeat_losses(model: Any, length: int, batch: int, seed: int) -> dict[str, Any]:
    """Per-position loss on random tokens repeated twice: the first copy is unpredictable,
    the second can be copied from context (induction)."""
    from ..heads import induction_probe

    probe = induction_probe(model, length=length, repeats=2, batch=batch, seed=seed)
    n, nll = probe.length, probe.loss_by_position
    # token j of copy r sits at position 1 + r*n + j and is predicted at position r*n + j
    return {
        "length": n,
        "first": _rl(nll[0:n]),
        "second": _rl(nll[n : 2 * n]),
        "first_mean": probe.loss_by_copy[0],
        "second_mean": probe.loss_by_copy[1],
    }


def _trigrams(w: Any, decode: Callable[[int], str], bos: int, top: int) -> dict[str, Any]:
    from .. import trigrams as T

    out: dict[str, Any] = {"heads": []}
    if w.cfg.n_layers >= 1:
        for h in range(w.cfg.n_heads):
            tri = T.skip_trigrams(w, 0, h, top=top, exclude=(bos,))
            out["heads"].append(
                {
                    "head": f"0.{h}",
                    "rows": [_rd(t.to_dict(decode)) for t in tri],
                }
            )
    out["bigrams"] = [_rd(b.to_dict(decode)) for b in T.bigrams(w, top=top, exclude=(bos,))]
    return out


def collect(
    ckpt: Path | str,
    *,
    config: Path | None = None,
    batch: int = 8,
    icl_examples: int = 256,
    viewer_tokens: int = 128,
    top: int = 20,
    seed: int = 0,
    device: str = "auto",
    text: Path | None = None,
    tokens: torch.Tensor | None = None,
    diag_k: int | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Compute every number of the report of checkpoint ``ckpt``.

    Args:
        ckpt: a qkov checkpoint, or any source :func:`qkov.interop.load_any` reads (a
            Hugging Face GPT-2 directory, a TransformerLens file with ``config``, a Hub name).
        batch: validation sequences (of ``n_ctx`` tokens) for the path expansion and the
            pattern-based head scores.
        icl_examples: validation sequences for the in-context-learning curve.
        viewer_tokens: tokens of validation text shown in the attention viewer.
        top: rows of each skip-trigram / bigram / term table.
        text: a text file to analyse instead of the training corpus's validation split.
        tokens: ``[B, n_ctx]`` token ids to analyse instead (for models without a corpus or
            tokenizer); the first ``batch`` rows serve the paths and head scores, all of them
            the ICL curve.
        diag_k: k of the heads' "own logit in the top k of its OV row" rate (exact, ~V^2 d_head
            work per head); ``None`` = 5 up to a vocabulary of 8192, else skipped (0).
        progress: called with the name of each stage as it starts.
    Raises:
        QkovError: the checkpoint cannot be read, or has no corpus to take text from.
    """
    from ..inputs import analysis_text
    from ..interop import load_any
    from ..train import pick_device
    from ..weights import Weights

    ckpt = Path(ckpt)
    dev = pick_device(device)
    timings: dict[str, float] = {}
    t_start = time.perf_counter()
    with _stage(timings, "load", progress):
        model = load_any(ckpt, config=config).to(dev).eval()
        if tokens is not None:
            if tokens.ndim != 2 or tokens.shape[1] > model.cfg.n_ctx:
                raise QkovError(f"report: tokens must be [batch, <= {model.cfg.n_ctx}], got {list(tokens.shape)}")
            text, freqs = tokens.long().to(dev), None
        else:
            ids, freqs = analysis_text(ckpt, model, text, max(batch, icl_examples), want_corpus=True)
            text = ids.to(dev)
        w = Weights.from_model(model, device=dev)  # LayerNorm folded (the default view)
    decode = _decoder(model)
    L = model.cfg.n_layers
    data: dict[str, Any] = {"qkov_report": 1, "path": str(ckpt), "name": ckpt.name}
    with _stage(timings, "model card", progress):
        data["card"] = _card(ckpt, model, w)
    with torch.no_grad():
        if L >= 1:
            with _stage(timings, "heads", progress):
                k = diag_k if diag_k is not None else (5 if model.cfg.d_vocab <= 8192 else 0)
                heads = _heads(model, w, text[:batch], freqs, text[:icl_examples], k)
                icl_curve = heads.pop("_icl_curve")
                icl_info = heads["icl"]
                data["heads"] = heads
            with _stage(timings, "OV eigenvalues", progress):
                data["eigenvalues"] = _eigenvalues(w)
        else:
            from ..heads import icl_score

            data["heads"] = {"absent": "a 0-layer model has no attention heads"}
            data["eigenvalues"] = {"absent": "a 0-layer model has no attention heads"}
            icl = icl_score(model, text[:icl_examples])
            icl_curve = icl.loss_by_position
            icl_info = {"score": icl.score, "early": icl.early, "late": icl.late}
        with _stage(timings, "composition", progress):
            data["composition"] = _composition(w) if L >= 1 else {"absent": "a 0-layer model has no heads"}
        with _stage(timings, "paths", progress):
            data["paths"] = _paths(w, text[:batch], top)
        with _stage(timings, "attention", progress):
            data["attention"] = (
                _attention(model, text[0, : min(viewer_tokens, model.cfg.n_ctx)], decode)
                if L >= 1
                else {"absent": "a 0-layer model has no attention"}
            )
        with _stage(timings, "in-context learning", progress):
            length = min(100, (model.cfg.n_ctx - 1) // 2)
            data["icl"] = {
                "loss_by_position": None if icl_curve is None else _rl(icl_curve),
                **(icl_info or {}),
                "repeat": _repeat_losses(model, length, batch=16, seed=seed),
            }
        with _stage(timings, "skip-trigrams", progress):
            data["trigrams"] = _trigrams(w, decode, model.bos_token_id, top)
    timings["total"] = round(time.perf_counter() - t_start, 3)
    data["timings"] = timings
    return data
