"""Where a circuit's nodes and edges sit when it is drawn: one layout for every drawing of a circuit
(the notebook's SVG, the report, the tour and the explorer draw from it).

Nodes sit by where they are in the forward pass: the input at the bottom, each layer's heads in a row
above the previous layer, its MLP in a row of its own, the logits at the top; the members of a row
spread evenly across it. An edge's width grows with ``|score|`` (0.5 to 5 units, the largest of the
drawn edges widest); its colour says which input it enters: a query (blue), a key (green), a value
(orange), an MLP or the logits (grey).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..forward.address import HEAD, MLP, node_order
from .circuit import Circuit
from .graph import Graph
from .scores import EdgeScores

__all__ = ["circuit_layout", "CircuitLayout", "COLOURS", "drawn_edges", "INPUT_NAMES", "node_half"]

COLOURS: dict[str | None, str] = {"q": "#1f77b4", "k": "#2ca02c", "v": "#ff7f0e", None: "#7f7f7f"}
INPUT_NAMES: dict[str | None, str] = {"q": "query", "k": "key", "v": "value", None: "MLP / logits"}
_W, _ROW, _PAD = 640, 44, 24



def node_half(label: str) -> float:
    """Half the width of a node's pill: a circle (radius 9) for a head's ``L.H``, wide enough for the label at
    8 px otherwise."""
    return round(max(9.0, 2.6 * len(label) + 4), 1)

@dataclass
class CircuitLayout:
    """A drawing's ``width`` and ``height``, its ``nodes`` (``node``, ``label``, ``x``, ``y``, ``half``: half the width
    of the node's pill, 9 = a circle, wider for ``embed``, ``logits``), its ``edges``
    (``edge``: the edge number, ``name``, ``input``: ``q``/``k``/``v``/``None``, ``score``, ``x1 y1 x2 y2``
    from sender to receiver, ``width``, ``colour``) and the ``legend`` (``[name, colour]`` per input kind)."""

    width: int
    height: int
    nodes: list[dict[str, Any]] = field(default_factory=list)
    edges: list[dict[str, Any]] = field(default_factory=list)
    legend: list[list[str]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CircuitLayout":
        return cls(d["width"], d["height"], list(d["nodes"]), list(d["edges"]), list(d["legend"]))


def _positions(g: Graph) -> dict[int, tuple[float, float]]:
    """Node index -> (x, y): rows by forward order (the input at the bottom), members spread across a row."""
    rows: dict[int, list[int]] = {}
    for i, a in enumerate(g.nodes):
        rows.setdefault(node_order(a, g.cfg) or 0, []).append(i)  # type: ignore[arg-type]
    top = max(rows)
    out = {}
    for order, members in rows.items():
        y = _PAD + (top - order) * _ROW
        for j, i in enumerate(members):
            out[i] = (_PAD + (j + 0.5) * (_W - 2 * _PAD) / len(members), y)
    return out


def circuit_layout(g: Graph, on: list[int], score: list[float]) -> CircuitLayout:
    """The layout of the edges ``on`` of ``g`` (edge numbers), each with its ``score``; only the nodes they
    touch are placed."""
    pos = _positions(g)
    top = max((abs(s) for s in score), default=1.0) or 1.0
    s_node, r_node = g.edge_nodes
    used = {int(s_node[e]) for e in on} | {int(r_node[e]) for e in on}
    edges = []
    for e, sc in zip(on, score):
        (x1, y1), (x2, y2) = pos[int(s_node[e])], pos[int(r_node[e])]
        inp = g.receivers[int(g.dst[e])].input
        edges.append({
            "edge": int(e), "name": g.names[e], "input": inp, "score": float(sc),
            "x1": round(x1, 1), "y1": round(y1, 1), "x2": round(x2, 1), "y2": round(y2, 1),
            "width": round(0.5 + 4.5 * abs(sc) / top, 2), "colour": COLOURS[inp],
        })  # fmt: skip
    nodes = []
    for i in sorted(used):
        a, (x, y) = g.nodes[i], pos[i]
        label = a.name if a.kind in (HEAD, MLP) else a.kind
        nodes.append({"node": a.name, "label": label, "x": round(x, 1), "y": round(y, 1), "half": node_half(label)})
    height = 2 * _PAD + (2 * g.cfg.n_layers + 1) * _ROW + 16  # the legend in a line of its own, under the input
    legend = [[INPUT_NAMES[k], COLOURS[k]] for k in ("q", "k", "v", None)]
    return CircuitLayout(_W, height, nodes, edges, legend)


def drawn_edges(scores: EdgeScores, circuit: Circuit) -> tuple[list[int], list[float]]:
    """The circuit's edges (numbers, at any position), by ``|score|`` (largest first; per position the
    largest over positions), and each one's score (summed over positions)."""
    rank = scores.scores.abs()
    rank = rank.amax(0) if scores.per_position else rank
    on = sorted(circuit.union.nonzero()[:, 0].tolist(), key=lambda i: -float(rank[i].nan_to_num(0)))
    return on, [float(scores.scores[..., i].sum()) for i in on]
