"""Every head ablated alone (``qkov ablate --heads all``): :func:`ablation_sweep` measures each head of a model
as :func:`~qkov.analysis.causal.ablation.ablation_study` measures its heads (validation loss, the ICL score, the
repeated-token losses), several heads per forward pass: each input is tiled once per head of a group, each copy
ablating its own head. Where the intact runs' streams fit in memory (:func:`~qkov.analysis.budget.keeps_streams`),
a group holds one layer's heads and its passes start at that layer from the intact stream there: the layers before
it are the intact model's.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import Tensor

from ...device import tune_allocator_for
from ...errors import QkovError
from ...progress import Progress, tick
from ...weights.convert import SourceLike, as_source, source_bos
from ...weights.parts import WeightSource
from ..budget import fit_chunk, item, pass_bytes
from ..forward.address import Address, HeadLike, parse_heads
from ..forward.edits import per_position
from ..forward.tiled_nll import pass_nll
from ..forward.tracer import trace
from ..heads.probes import icl_windows
from ..shown import Shown
from .ablation import (
    MODES,
    PROBE_LENGTH,
    Measures,
    _ablate,
    _probe_tokens,
    ablation_budget,
    icl_examples,
    kept_streams,
    measures,
    measures_left_out,
    probe_plan,
    z_means,
)
from .positions import PositionSpec, describe_positions

__all__ = ["ablation_sweep", "AblationSweep"]


@dataclass(repr=False)
class AblationSweep(Shown):
    """Each head ablated alone (``qkov ablate --heads all``): ``intact`` and one :class:`Measures` per
    head of ``heads``, in the same order; ``probe_length`` the repeated-token probe's tokens per copy."""

    mode: str
    positions: str
    intact: Measures
    heads: list[str]
    ablated: list[Measures]
    probe_length: int | None
    mean_sample: str | None = None
    left_out: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode, "positions": self.positions, "probe_length": self.probe_length,
            "mean_sample": self.mean_sample, "intact": asdict(self.intact),
            "heads": [{"head": h, **asdict(m)} for h, m in zip(self.heads, self.ablated)],
            "left_out": dict(self.left_out),
        }  # fmt: skip


def _block_edits(group: list[Address], mode: str, positions: PositionSpec, means: Tensor | None, B: int, seed: int) -> dict:
    """Edits of a batch made of ``len(group)`` copies of ``B`` sequences: copy ``g`` has head
    ``group[g]`` ablated (``mode`` at ``positions``), the other copies leave it alone."""
    edits: dict[Any, Any] = {}
    for g, a in enumerate(group):
        one = _ablate(mode, positions, None if means is None else means[g], seed)

        def edit(z: Tensor, site: Address, lo: int = g * B, one: Callable = one) -> Tensor:
            out = z.clone()
            out[lo : lo + B] = one(z[lo : lo + B], site)
            return out

        edits[Address("z", a.layer, a.head)] = per_position(edit) if positions is None else edit
    return edits


def _groups(
    heads: list[Address], means: Tensor | None, G: int, by_layer: bool
) -> list[tuple[list[Address], Tensor | None]]:
    """``heads`` (and their ``means``) in order, in groups of at most ``G``; ``by_layer``: no group spans two
    layers' runs of heads (each pass then starts at its group's layer)."""
    spans: list[list[int]] = []
    for i, a in enumerate(heads):
        if not spans or (by_layer and heads[i - 1].layer != a.layer):
            spans.append([i, i])
        spans[-1][1] = i + 1
    return [
        (heads[i : min(i + G, hi)], None if means is None else means[i : min(i + G, hi)])
        for lo, hi in spans
        for i in range(lo, hi, G)
    ]


def _by_block(nll: Tensor, G: int) -> Tensor:
    """``[G * B, P]`` losses -> the mean of each block of ``B`` sequences ``[G]``."""
    return nll.reshape(G, -1).mean(-1)


def _sweep_group(
    w: WeightSource, group: list[Address], text: Tensor | None, icl_ex: Tensor | None, probe: Tensor | None,
    edits_of: Callable[[int], dict], starts: Mapping[str, Callable[[int], Tensor]] | None = None,
) -> list[Measures]:  # fmt: skip
    """Measures of each head of ``group`` ablated alone, every input tiled ``len(group)`` times in one pass
    (``icl_ex``: the ICL examples as the score reads them, :func:`~qkov.analysis.causal.ablation.icl_examples`);
    ``starts``: for an input (``"text"``, ``"icl"``, ``"probe"``), its intact run's stream entering a layer,
    its pass then starting at the group's first layer from that stream."""
    G, layer = len(group), min(a.layer for a in group)  # type: ignore[type-var]

    def start(name: str) -> tuple[int, Tensor] | None:
        stream = (starts or {}).get(name)
        return None if stream is None or not layer else (layer, stream(layer).repeat(G, 1, 1))

    loss = icl = first = second = [None] * G  # type: ignore[list-item]
    if text is not None:
        tiled = text.repeat(G, 1)
        loss = _by_block(pass_nll(w, tiled, edits=edits_of(text.shape[0]), start_at=start("text")), G).tolist()
    if icl_ex is not None:
        ex = icl_ex.repeat(G, 1)
        _, _, early_at, late_at = icl_windows(ex.shape[1])
        at = torch.cat([early_at, late_at]).unique()
        run = trace(w, ex, positions=at, edits=edits_of(icl_ex.shape[0]), start_at=start("icl"))
        nll = -run.logits.float().log_softmax(-1).gather(-1, ex[:, at + 1, None])[..., 0]  # [G * N, len(at)]
        late, early = torch.isin(at, late_at), torch.isin(at, early_at)
        icl = (_by_block(nll[:, late], G) - _by_block(nll[:, early], G)).tolist()
    if probe is not None:
        tiled = probe.repeat(G, 1)
        nll = pass_nll(w, tiled, edits=edits_of(probe.shape[0]), start_at=start("probe"))
        L = (probe.shape[1] - 1) // 2
        first = _by_block(nll[:, 1:L], G).tolist()
        second = _by_block(nll[:, L + 1 : 2 * L], G).tolist()
    return [Measures(*m) for m in zip(loss, icl, first, second)]


def _streams(w: WeightSource, tokens: Tensor) -> Callable[[int], Tensor]:
    """The stream entering each layer of an intact run over ``tokens``, by layer (no logits made; the probe's:
    :func:`~qkov.analysis.heads.probes.induction_probe` keeps none)."""
    streams = trace(w, tokens, cache=["resid_pre.*"], logits=False).stack("resid_pre")
    return lambda layer: streams[layer]


def ablation_sweep(
    source: SourceLike,
    text: Tensor | None = None,
    *,
    heads: Sequence[HeadLike] | str | None = None,
    icl_text: Tensor | None = None,
    mode: str = "mean",
    bos: int | None = None,
    seed: int = 0,
    positions: PositionSpec = None,
    progress: Progress | None = None,
) -> AblationSweep:
    """Ablate each head of ``heads`` (default every head) alone and measure it as
    :func:`ablation_study` does (loss on ``text``, ICL score on ``icl_text``, repeated-token losses):
    batched, several heads per forward pass (each input tiled once per head, the copies ablating
    different heads), as many as fit the memory budget. Equal to one :func:`ablation_study` per head
    (tested)."""
    w = as_source(source, where="qkov.ablation_sweep")
    bos = source_bos("qkov.ablation_sweep", w, bos)
    if mode not in MODES:
        raise QkovError(f"ablate: mode must be one of {', '.join(MODES)}, got {mode!r}")
    c = w.cfg
    if heads is None:
        heads = [(l, h) for l in range(c.n_layers) for h in range(c.n_heads)]
        if not heads:
            raise QkovError("ablate: the model has no heads to sweep")
    heads = parse_heads(heads, c, "ablate")
    length, why = probe_plan(c.n_ctx, positions)
    chunks = ablation_budget(w, text, icl_text, mode, bos=bos, seed=seed, probe_length=length)
    tune_allocator_for(w)
    probe = None if length is None else _probe_tokens(w, bos, seed, length).to(w.device)
    mean_on = text if text is not None else _probe_tokens(w, bos, seed, length or PROBE_LENGTH).to(w.device)
    means = z_means(w, mean_on, heads, chunk=chunks.mean) if mode == "mean" else None
    inputs = [t for t in (text, icl_text, probe) if t is not None]
    B, T = max(t.shape[0] for t in inputs), max(t.shape[1] for t in inputs)  # the largest pass, per head
    icl_ex = icl_examples(icl_text, c.n_ctx)
    keep = kept_streams(w, text=text, icl=icl_ex, probe=probe)  # to start each group's passes from
    one = pass_bytes(w, 1, T, tiled=True) + (T * c.d_model * item(w) if keep else 0)  # + its start stream
    sequences = fit_chunk(w, len(heads) * B, one, 0, "ablate: one head's pass", "ablate fewer heads")
    G = max(1, sequences // B)  # heads per forward pass
    groups = _groups(heads, means, G, by_layer=bool(keep))
    kept: dict[str, list[Tensor]] = {name: [] for name in ("text", "icl") if name in keep}  # chunk by chunk
    intact = measures(w, text, icl_text, bos=bos, seed=seed, chunks=chunks, probe_length=length, keep=kept)
    starts: dict[str, Callable[[int], Tensor]] = {
        name: lambda layer, parts=parts: torch.cat([k[layer] for k in parts]) for name, parts in kept.items()
    }
    if "probe" in keep and sum(min(a.layer for a in g) * len(g) for g, _ in groups) > c.n_layers:
        starts["probe"] = _streams(w, probe)  # type: ignore[arg-type]  # its layers skipped > one more pass
    out: list[Measures] = []
    for group, m in groups:
        edits_of = lambda B, group=group, m=m: _block_edits(group, mode, positions, m, B, seed)  # noqa: E731
        out += _sweep_group(w, group, text, icl_ex, probe, edits_of, starts)
        tick(progress, "ablate: each head in turn", len(out), len(heads))
    sample = None if mode != "mean" else f"every position of {mean_on.shape[0]} sequences of {mean_on.shape[1]} tokens"
    left = measures_left_out(c.n_ctx, text, icl_text) | ({} if why is None else {"repeated": why})
    names = [a.name for a in heads]
    return AblationSweep(mode, describe_positions(positions), intact, names, out, length, sample, left)
