"""A model's computational graph, as circuit discovery scores and cuts it.

**Nodes.** Senders: the input ``embed`` (the stream entering block 0: the token embedding, plus the
learned positions for standard positions), every head (its output ``z_h W_O^h``, without ``b_O``) and
every MLP ``mlp.l`` (its output, ``b_out`` included). Receivers: every head's query, key and value
inputs as three separate receivers (``l.h<q>``, ``l.h<k>``, ``l.h<v>``; under grouped-query attention
a layer has ``K`` key and ``K`` value receivers, one per key/value head, written with the group's first
query head), every MLP's own input copy (``mlp.l``) and the ``logits`` (the stream entering the final
norm). Each receiver's input is the sum of what the senders before it wrote, plus the attention output
biases ``b_O`` of the layers before it, which no edge carries.

**Edges.** Every sender into every later receiver: an edge ``s -> r`` exists when ``s`` comes before
``r`` in the forward pass (:func:`~qkov.analysis.forward.address.node_order`: ``embed`` 0, layer
``l``'s heads ``2l + 1``, its MLP ``2l + 2``, or ``2l + 1`` in a parallel block, ``logits``
``2L + 1``). A head feeds its own layer's MLP, not its own layer's heads. The count follows from the
shape alone (:func:`edge_count`); GPT-2 small (12 layers of 12 heads, MLPs) has 32,491 edges, the
count of EAP-IG's graph, AutoCircuit's ``separate_qkv`` graph and MIB.

Edges are numbered receiver by receiver in forward order (layer by layer: the query, key and value
receivers, then the MLP; the logits last), each receiver's senders in forward order, so reversing the
numbering visits receivers from the logits back to the input (ACDC's order).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Iterable

import torch
from torch import Tensor

from ...model.bus import require_sum_residual
from ...errors import QkovError
from ..forward.address import HEAD, INPUTS, MLP, Address, node_order

__all__ = ["edge_count", "EDGE_COUNT_RULE", "Graph", "graph_of"]

EDGE_COUNT_RULE = (
    "every sender (the input, each head, each MLP) into every later receiver (each head's query, key and "
    "value input, each MLP's input, the logits)"
)


@dataclass(frozen=True, eq=False)
class Graph:
    """The graph of one model shape (see the module docstring). ``senders`` and ``receivers`` are
    :class:`~qkov.analysis.forward.address.Address` es in forward order; ``src [E]`` and ``dst [E]`` the
    sender and receiver index of each edge."""

    cfg: Any
    senders: tuple[Address, ...]
    receivers: tuple[Address, ...]
    src: Tensor
    dst: Tensor
    _by_name: dict[str, int] = field(default_factory=dict, repr=False)

    # ------------------------------------------------------------------ sizes
    @property
    def n_edges(self) -> int:
        return int(self.src.numel())

    def __len__(self) -> int:
        return self.n_edges

    @property
    def mlp(self) -> bool:
        return self.cfg.d_mlp is not None

    @property
    def per_layer(self) -> int:
        """Senders per layer: its heads, and its MLP when it has one."""
        return self.cfg.n_heads + int(self.mlp)

    def head_sender(self, layer: int, head: int = 0) -> int:
        """The sender index of head ``layer.head``."""
        return 1 + layer * self.per_layer + head

    def mlp_sender(self, layer: int) -> int:
        return 1 + layer * self.per_layer + self.cfg.n_heads

    def attention_receivers(self, layer: int) -> range:
        """The receiver indices of layer ``layer``'s query, key and value inputs (``H + 2K``)."""
        c = self.cfg
        start = layer * self.receivers_per_layer
        return range(start, start + c.n_heads + 2 * c.kv_heads)

    @property
    def receivers_per_layer(self) -> int:
        return self.cfg.n_heads + 2 * self.cfg.kv_heads + int(self.mlp)

    def mlp_receiver(self, layer: int) -> int:
        return layer * self.receivers_per_layer + self.cfg.n_heads + 2 * self.cfg.kv_heads

    @property
    def logits_receiver(self) -> int:
        return len(self.receivers) - 1

    def before(self, receiver: int) -> int:
        """How many senders feed receiver ``receiver``: the senders before it are a prefix of
        :attr:`senders`."""
        return int(self.fan_in[receiver])

    @cached_property
    def fan_in(self) -> Tensor:
        """``[R]`` the number of senders into each receiver."""
        return torch.bincount(self.dst, minlength=len(self.receivers))

    @cached_property
    def first_edge(self) -> Tensor:
        """``[R + 1]`` the first edge index of each receiver (edges are numbered receiver by receiver)."""
        return torch.cat([torch.zeros(1, dtype=torch.long), self.fan_in.cumsum(0)])

    def edge_index(self, sender: int, receiver: int) -> int:
        """The number of the edge from sender index ``sender`` into receiver index ``receiver``."""
        if not 0 <= sender < self.before(receiver):
            raise QkovError(f"{self.senders[sender].name} does not send to {self.receivers[receiver].name}")
        return int(self.first_edge[receiver]) + sender

    # ------------------------------------------------------------------ edges as addresses
    def edge(self, i: int) -> Address:
        """Edge ``i`` as an :class:`~qkov.analysis.forward.address.Address` (``0.1 -> 1.0<k>``)."""
        r, s = self.receivers[int(self.dst[i])], self.senders[int(self.src[i])]
        return r._replace(sender=s)

    @cached_property
    def names(self) -> list[str]:
        """Every edge's written form, in edge order."""
        return [self.edge(i).name for i in range(self.n_edges)]

    def index(self, edge: Address | str, what: str = "edge") -> int:
        """The number of ``edge`` (an :class:`Address` or its written form; a key or value input may be
        written with any query head of its group); a one-line error if the graph has no such edge."""
        a = Address.parse(edge, what) if isinstance(edge, str) else edge
        if not a.is_edge:
            raise QkovError(f"{what}: {a.name} is not an edge (write SENDER -> RECEIVER, e.g. 0.1 -> 1.0<k>)")
        a.check(self.cfg, what)
        if a.kind == HEAD and a.input is None:
            raise QkovError(
                f"{what}: {a.name}: a head receives through its query, key or value input "
                f"(write {a.receiver.name}<q>, <k> or <v>)"
            )
        key = self._canonical(a).name
        if key not in self._by_name:
            raise QkovError(f"{what}: the graph has no edge {a.name} ({EDGE_COUNT_RULE})")
        return self._by_name[key]

    def indices(self, edges: Iterable[Address | str], what: str = "edges") -> Tensor:
        """``[n]`` the numbers of ``edges``, each read by :meth:`index`."""
        return torch.tensor([self.index(e, what) for e in edges], dtype=torch.long)

    def _canonical(self, a: Address) -> Address:
        """``a`` with a key or value input written with its group's first query head."""
        group = self.cfg.n_heads // self.cfg.kv_heads
        if a.kind == HEAD and a.input in ("k", "v") and group > 1:
            a = a._replace(head=a.head // group * group)  # type: ignore[operator]
        return a

    # ------------------------------------------------------------------ nodes
    @cached_property
    def nodes(self) -> list[Address]:
        """Every node: ``embed``, each head and MLP in forward order, ``logits``."""
        return [*self.senders, Address("logits")]

    def node_of_receiver(self, r: int) -> int:
        """The node index of receiver ``r`` (a head's q/k/v inputs are the head)."""
        a = self.receivers[r]
        if a.kind == "logits":
            return len(self.nodes) - 1
        if a.kind == MLP:
            return self.mlp_sender(a.layer)  # type: ignore[arg-type]
        return self.head_sender(a.layer, a.head)  # type: ignore[arg-type]

    @cached_property
    def receiver_node(self) -> Tensor:
        """``[R]`` the node index of each receiver."""
        return torch.tensor([self.node_of_receiver(r) for r in range(len(self.receivers))], dtype=torch.long)

    @cached_property
    def edge_nodes(self) -> tuple[Tensor, Tensor]:
        """``([E], [E])`` the sender node and the receiver node of every edge (node indices)."""
        return self.src.clone(), self.receiver_node[self.dst]

    def node_index(self, node: Address | str, what: str = "node") -> int:
        """The index of a node: ``embed``, a head ``1.0``, an MLP ``mlp.1``, ``logits``."""
        a = Address.parse(node, what) if isinstance(node, str) else node
        a = a._replace(input=None)
        if a.is_edge:
            raise QkovError(f"{what}: {a.name} is an edge, not a node")
        a.check(self.cfg, what)
        try:
            return self.nodes.index(a)
        except ValueError:
            raise QkovError(
                f"{what}: the graph has no node {a.name} (nodes: embed, heads L.H, mlp.L, logits)"
            ) from None

    def summary(self) -> str:
        """One line: the edge count and its rule."""
        c = self.cfg
        kv = "" if c.kv_heads == c.n_heads else f", {c.kv_heads} key/value heads"
        mlp = "" if self.mlp else ", no MLPs"
        return (
            f"{self.n_edges:,} edges: {EDGE_COUNT_RULE} ({c.n_layers} layers of {c.n_heads} heads{kv}{mlp}; "
            f"{len(self.senders)} senders, {len(self.receivers)} receivers)"
        )


def edge_count(cfg: Any) -> int:
    """The number of edges of a model's graph from its shape alone:
    ``sum_l (H + 2K) S_l + sum_l (S_l + H·[sequential]) + S_L`` with ``S_l = 1 + l (H + m)`` senders
    before layer ``l`` (``m`` = 1 with MLPs), MLP terms only with MLPs. GPT-2 small: 32,491."""
    L, H, K = cfg.n_layers, cfg.n_heads, cfg.kv_heads
    m = int(cfg.d_mlp is not None)
    before = [1 + l * (H + m) for l in range(L + 1)]
    attn = sum((H + 2 * K) * before[l] for l in range(L))
    mlp = sum(before[l] + (0 if cfg.parallel else H) for l in range(L)) if m else 0
    return attn + mlp + before[L]


_GRAPHS: dict[Any, Graph] = {}


def graph_of(cfg: Any) -> Graph:
    """The graph of a model with config ``cfg`` (made once per config)."""
    require_sum_residual(cfg, "circuit discovery's graph")
    if cfg not in _GRAPHS:
        if len(_GRAPHS) > 16:
            _GRAPHS.clear()
        _GRAPHS[cfg] = _build(cfg)
    return _GRAPHS[cfg]


def _build(cfg: Any) -> Graph:
    L, H, K = cfg.n_layers, cfg.n_heads, cfg.kv_heads
    mlp, group = cfg.d_mlp is not None, H // K
    senders: list[Address] = [Address("embed")]
    receivers: list[Address] = []
    for l in range(L):
        senders += [Address.of_head(l, h) for h in range(H)] + ([Address.of_mlp(l)] if mlp else [])
        receivers += [Address(HEAD, l, h, "q") for h in range(H)]
        receivers += [Address(HEAD, l, g * group, inp) for inp in INPUTS[1:] for g in range(K)]
        receivers += [Address.of_mlp(l)] if mlp else []
    receivers.append(Address("logits"))
    s_order = [node_order(s, cfg) for s in senders]
    src, dst = [], []
    for r, a in enumerate(receivers):
        order = node_order(a, cfg)
        n = sum(1 for o in s_order if o < order)  # type: ignore[operator]
        assert all(o < order for o in s_order[:n]), "senders are not in forward order"  # type: ignore[operator]
        src += range(n)
        dst += [r] * n
    g = Graph(cfg, tuple(senders), tuple(receivers), torch.tensor(src), torch.tensor(dst))
    g._by_name.update({name: i for i, name in enumerate(g.names)})
    assert g.n_edges == edge_count(cfg)
    return g
