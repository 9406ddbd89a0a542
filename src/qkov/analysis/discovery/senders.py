"""Every sender's output on a run, and what replaces it, kept compactly for circuit evaluation.

A head's output is ``z_h W_O^h`` (``[B, T, D]`` for ``E`` numbers a token): a run's heads are kept as their
``z`` (``[L, H, B, T, E]``, a layer's ``H E`` numbers a token), the input and the MLPs' outputs as they are
(``[1 + L, B, T, D]``). A replacement (:mod:`.ablations`) has the same form: the corrupted run's ``z`` and
outputs; zero (no ``z``); a mean, whose head outputs are a ``shift`` added in ``d_model`` space. A sender's
change from a run to its replacement, ``a~_s - a_s``, is then formed when it is needed: for the heads of a
layer, ``(z~_h - z_h) W_O^h + shift_h``, one batched product (:func:`head_changes`), never the ``[S, B, T,
D]`` tensor of every sender's output.

From the two, :func:`ablated_streams` gives what each receiver group reads with every edge into it
ablated, ``x_r + sum_{s -> r} (a~_s - a_s)`` (the input of a layer's heads, of its MLP, the logits), a
running sum over the senders in forward order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ...weights.parts import WeightSource
from ..forward.cache import Trace
from .ablations import Ablation
from .graph import Graph
from .head_inputs import project_heads_of

__all__ = [
    "ablated_heads", "ablated_streams", "change_of", "from_position", "head_changes", "io_index", "replacement_of",
    "run_senders", "SenderSet",
]  # fmt: skip


@dataclass
class SenderSet:
    """Every sender's output on one run, or what replaces it: ``io [1 + L m, B|1, T|1, D]`` the input
    (row 0) and each MLP's output (row ``1 + l``; ``m`` = 1 with MLPs), ``z [L, H, B, T, E]`` each head's
    ``z`` (its output is ``z_h W_O^h``; ``None``: zero), ``shift [L, H, B|1, T|1, D]`` added to each head's
    output (``None``: nothing)."""

    io: Tensor
    z: Tensor | None = None
    shift: Tensor | None = None


def from_position(senders: SenderSet, f: int) -> SenderSet:
    """``senders`` at positions ``f ..`` only (tensors without a position axis, of length 1, as they are)."""
    cut = lambda x, dim: x if x is None or x.shape[dim] == 1 else x.narrow(dim, f, x.shape[dim] - f).contiguous()  # noqa: E731
    return SenderSet(cut(senders.io, 2), cut(senders.z, 3), cut(senders.shift, 3))


def change_of(w: WeightSource, graph: Graph, sender: int, before: SenderSet, rep: SenderSet) -> Tensor:
    """``[B, T, D]``: sender ``sender``'s change ``a~_s - a_s`` from the run ``before`` to ``rep``."""
    if sender == 0 or (graph.mlp and (sender - 1) % graph.per_layer == graph.cfg.n_heads):
        i = io_index(graph, sender)
        return (rep.io[i] - before.io[i]).expand_as(before.io[i])
    l, h = divmod(sender - 1, graph.per_layer)
    assert before.z is not None
    heads = torch.tensor([h], device=before.z.device)
    return head_changes(w, l, heads, before.z[l].index_select(0, heads), rep)[0]


def io_index(graph: Graph, sender: int) -> int:
    """The row of :attr:`SenderSet.io` that holds sender ``sender`` (the input or an MLP)."""
    return 0 if sender == 0 else 1 + (sender - 1) // graph.per_layer


def run_senders(recording: Trace, graph: Graph) -> SenderSet:
    """A run's senders from a recording that cached :func:`~.ablations.sender_sites`."""
    L = graph.cfg.n_layers
    io = [recording["resid_pre", 0].detach()]
    io += [recording["mlp_out", l].detach() for l in range(L)] if graph.mlp else []
    z = torch.stack([recording["z", l].detach().permute(2, 0, 1, 3) for l in range(L)])  # [L, H, B, T, E]
    return SenderSet(torch.stack(io), z.contiguous())


def replacement_of(ablation: Ablation, source: Trace | None, w: WeightSource, graph: Graph) -> SenderSet:
    """What an ablated edge carries, as a :class:`SenderSet`: the source run's senders (``corrupted``;
    ``source`` cached :func:`~.ablations.sender_sites`), zeros, or the means."""
    if ablation.kind == "corrupted":
        assert source is not None
        return run_senders(source, graph)
    L, H, D = graph.cfg.n_layers, graph.cfg.n_heads, graph.cfg.d_model
    io_rows = [0, *(graph.mlp_sender(l) for l in range(L) if graph.mlp)]
    if ablation.kind == "zero":
        return SenderSet(torch.zeros(len(io_rows), 1, 1, D, dtype=w.dtype, device=w.device))
    m = ablation.means.to(device=w.device, dtype=w.dtype)  # type: ignore[union-attr]  # [S, D] or [S, T, D]
    m = m[:, None, None] if m.ndim == 2 else m[:, None]  # [S, 1, 1|T, D]
    heads = torch.stack([m[graph.head_sender(l) : graph.head_sender(l) + H] for l in range(L)])
    return SenderSet(m[io_rows].contiguous(), None, heads)


def head_changes(
    w: WeightSource, layer: int, heads: Tensor, z: Tensor, rep: SenderSet, pos: Tensor | None = None,
    out: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """``[n, B, P, D]``: the change ``a~_h - a_h = (z~_h - z_h) W_O^h + shift_h`` of each of ``heads [n]`` of
    ``layer`` whose ``z`` in a run is ``z [n, B, P, E]`` (at positions ``pos [P]``, or every position),
    written into ``out`` when given (contiguous, ``[n, B, P, D]``)."""
    n, B, P, E = z.shape
    if rep.z is None:
        dz = z.neg()
    else:
        zr = rep.z[layer].index_select(0, heads)
        dz = (zr if pos is None else zr.index_select(2, pos)) - z
    W_O = w.attention(layer, expand_kv=False).W_O.index_select(0, heads)  # [n, E, D]
    flat = None if out is None else out.view(n, B * P, -1)
    got = torch.bmm(dz.reshape(n, B * P, E), W_O, out=flat).view(n, B, P, -1)
    if rep.shift is not None:
        s = rep.shift[layer].index_select(0, heads)  # [n, B|1, T|1, D]
        got += s if pos is None or s.shape[2] == 1 else s.index_select(2, pos)
    return got


def ablated_streams(base: Trace, before: SenderSet, rep: SenderSet, w: WeightSource, graph: Graph) -> dict[str, Tensor]:
    """Each receiver group's input with every edge into it ablated, ``x_r + sum_{s -> r} (a~_s - a_s)``
    (``{"attn.l", "mlp.l", "logits"}: [B, T, D]``): ``x_r`` from ``base`` (a recording that cached
    :func:`~.ablations.stream_sites`), the changes from the run's senders ``before`` to ``rep``."""
    L, H = graph.cfg.n_layers, graph.cfg.n_heads
    x0 = base["resid_pre", 0]
    total = (rep.io[0] - before.io[0]).expand_as(x0).clone()  # the changes summed so far
    every = torch.arange(H, device=x0.device)
    out: dict[str, Tensor] = {}
    assert before.z is not None
    for l in range(L):
        out[f"attn.{l}"] = base["resid_pre", l] + total
        if graph.mlp and graph.cfg.parallel:  # the MLP reads the block's input: the same senders
            out[f"mlp.{l}"] = out[f"attn.{l}"]
        total += head_changes(w, l, every, before.z[l], rep).sum(0)
        if graph.mlp:
            if not graph.cfg.parallel:
                out[f"mlp.{l}"] = base["resid_mid", l] + total
            total += rep.io[1 + l] - before.io[1 + l]
    out["logits"] = base["resid_post", L - 1] + total
    return out


def ablated_heads(w: WeightSource, graph: Graph, streams: dict[str, Tensor]) -> dict[tuple[int, str], Tensor]:
    """Every head's query, key and value with every edge into it ablated, ``{(layer, kind): [B, T, n, E]}``,
    from :func:`ablated_streams`."""
    heads: dict[tuple[int, str], Tensor] = {}
    for l in range(graph.cfg.n_layers):
        for kind in "qkv":
            n = graph.cfg.n_heads if kind == "q" else graph.cfg.kv_heads
            x = streams[f"attn.{l}"]
            heads[l, kind] = project_heads_of(w, l, kind, range(n), x).permute(1, 2, 0, 3).contiguous()
    return heads
