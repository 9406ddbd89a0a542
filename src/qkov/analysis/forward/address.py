"""One address for everything an analysis points at: a site, a head, a head's input, an edge.

An :class:`Address` is a small named tuple ``(kind, layer, head, input, sender)``:

* a **site**: ``Address("z", 0, 3)``, written ``z.0.3`` (head 3 of layer 0's ``z``); ``Address("logits")``
  is ``logits``. :class:`~qkov.analysis.forward.sites.Sites` resolves site names, globs and aliases
  against one model; :meth:`Address.parse` reads the written form without a model;
* a **head**: ``Address("head", 1, 0)``, written ``1.0`` (``LAYER.HEAD``); users may pass
  ``(layer, head)`` tuples wherever a head is asked for (:func:`as_head`);
* a head's **input**: ``Address("head", 1, 0, "k")``, written ``1.0<k>`` (its query, key or value input);
* an **edge**: what a sender writes into a receiver, written ``0.1 -> 1.0<k>`` (head 0.1's output into
  head 1.0's key input), ``0.1 -> logits`` (into the logits directly). It is the receiver's address
  with its ``sender`` set, so a graph's edges and nodes are one type. A model's graph
  (:mod:`qkov.analysis.discovery.graph`) has four kinds of node: the input ``embed`` (the stream
  entering block 0), each head, each MLP ``mlp.1`` (:data:`MLP`: its output as a sender, its own input
  copy ``mlp_input.1`` as a receiver) and ``logits``; :func:`node_order` orders them.

Every written form is read by :meth:`Address.parse` and every head by :func:`as_head` /
:func:`parse_heads` (the command line's ``--heads``/``--receivers``, the library, the explorer): one
parser, one error wording (:func:`not_a_head`, :func:`no_head`).
"""

from __future__ import annotations

import re
from typing import Any, Iterable, NamedTuple, Sequence, Union

from ...errors import QkovError

__all__ = ["Address", "as_head", "HEAD", "HeadLike", "INPUTS", "MLP", "no_head", "node_order", "not_a_head", "parse_heads"]

HEAD = "head"
"""The kind of a head's address (not a site: a head's output is the site ``head_out.L.H``)."""
MLP = "mlp"
"""The kind of an MLP's node in a graph, written ``mlp.1`` (not a site: its output is ``mlp_out.1``, its
input ``mlp_input.1``)."""
INPUTS = ("q", "k", "v")
"""A head's inputs an edge may enter: its query, key and value input (the sites ``{q,k,v}_input``)."""

_HEAD = re.compile(r"(-?\d+)\.(-?\d+)")
_SITE = re.compile(r"([A-Za-z_]\w*)(?:\.(-?\d+))?(?:\.(-?\d+))?")
_INPUT = re.compile(r"(.*?)\s*<\s*(\w+)\s*>")


class Address(NamedTuple):
    """A site (``kind`` a site kind), a head (``kind == "head"``), a head's ``input`` or, with a
    ``sender``, an edge into it. ``layer`` is ``None`` for the global kinds, ``head`` ``None`` for a
    whole site."""

    kind: str
    layer: int | None = None
    head: int | None = None
    input: str | None = None
    sender: Address | None = None

    # ------------------------------------------------------------------ making one
    @classmethod
    def of_head(cls, layer: int, head: int) -> Address:
        """Head ``layer.head``."""
        return cls(HEAD, int(layer), int(head))

    @classmethod
    def of_mlp(cls, layer: int) -> Address:
        """The MLP of layer ``layer`` as a node of a graph: ``mlp.1``."""
        return cls(MLP, int(layer))

    @classmethod
    def edge(cls, sender: Address, receiver: Address, input: str | None = None) -> Address:
        """The edge ``sender -> receiver<input>`` (``input``: ``q``, ``k`` or ``v`` of a receiving head)."""
        return receiver._replace(input=input if input is not None else receiver.input, sender=sender)

    @classmethod
    def parse(cls, text: str, what: str = "address") -> Address:
        """The address written ``text``: ``1.0`` (a head), ``1.0<k>`` (its key input), ``z.0.3`` or
        ``logits`` (a site), ``0.1 -> 1.0<k>`` (an edge). Syntax only: :meth:`check` checks it
        against a model. ``what`` begins the error message."""
        if not isinstance(text, str):
            raise QkovError(f"{what}: expected a written address such as 1.0 or 0.1 -> 1.0<k>, got {text!r}")
        sender_text, arrow, receiver_text = text.partition("->")
        if arrow:
            sender, receiver = _node(sender_text, what, text), _node(receiver_text, what, text)
            if sender.input is not None or sender.sender is not None:
                raise QkovError(f"{what}: {text.strip()!r}: an edge's sender is a head or a site, not an input")
            return receiver._replace(sender=sender)
        return _node(text, what, text)

    # ------------------------------------------------------------------ reading one
    @property
    def name(self) -> str:
        """The written form: ``z.0.3``, ``1.0``, ``1.0<k>``, ``0.1 -> 1.0<k>``."""
        if self.kind == HEAD:
            own = f"{self.layer}.{self.head}"
        else:
            own = ".".join(str(p) for p in (self.kind, self.layer, self.head) if p is not None)
        own += "" if self.input is None else f"<{self.input}>"
        return own if self.sender is None else f"{self.sender.name} -> {own}"

    def __str__(self) -> str:
        return self.name

    @property
    def site(self) -> tuple[str, int | None]:
        """The stored site (kind, layer): a head's address reads a slice of it."""
        return self.kind, self.layer

    @property
    def is_head(self) -> bool:
        """A head itself (no input, no sender)."""
        return self.kind == HEAD and self.input is None and self.sender is None

    @property
    def is_edge(self) -> bool:
        return self.sender is not None

    @property
    def receiver(self) -> Address:
        """An edge's receiving end (the address without its sender)."""
        return self._replace(sender=None)

    def input_site(self, cfg: Any) -> Address:
        """The site a head's ``input`` is read from: ``Address("k_input", layer, slot)``, the slot
        of a key or value input the head's key/value group (grouped-query attention)."""
        if self.kind == MLP:
            return Address("mlp_input", self.layer)
        if self.kind != HEAD or self.input not in INPUTS:
            raise QkovError(f"{self.name} is not a head's query, key or value input")
        group = cfg.n_heads // cfg.kv_heads if self.input in ("k", "v") else 1
        return Address(f"{self.input}_input", self.layer, self.head // group)  # type: ignore[operator]

    def check(self, cfg: Any, what: str = "address") -> Address:
        """``self`` if the model of ``cfg`` has it (its heads in range; an edge's sender head before its
        receiving head), else a one-line :class:`QkovError` beginning with ``what``. Site kinds are
        checked by :class:`~qkov.analysis.forward.sites.Sites`."""
        for a in (self.sender, self.receiver):
            if a is not None and a.kind == HEAD and not (0 <= a.layer < cfg.n_layers and 0 <= a.head < cfg.n_heads):  # type: ignore[operator]
                raise QkovError(no_head(what, a, cfg))
            if a is not None and a.kind == MLP and (cfg.d_mlp is None or not 0 <= a.layer < cfg.n_layers):  # type: ignore[operator]
                has = "no MLPs" if cfg.d_mlp is None else f"MLPs in layers 0..{cfg.n_layers - 1}"
                raise QkovError(f"{what}: the model has no {a.name} ({has})")
        s = self.sender
        if s is not None and s.kind == HEAD and self.kind == HEAD and not s.layer < self.layer:  # type: ignore[operator]
            raise QkovError(
                f"{what}: in {self.name} the sender {s.name} must come before the receiver's layer {self.layer}"
            )
        ends = (node_order(s, cfg), node_order(self.receiver, cfg)) if s is not None else (0, 1)
        if None not in ends and not ends[0] < ends[1]:  # type: ignore[operator]
            raise QkovError(f"{what}: in {self.name} the sender {s.name} must come before the receiver")
        return self


def node_order(a: Address, cfg: Any) -> int | None:
    """Where a graph node sits in the forward pass: ``embed`` 0, layer ``l``'s heads ``2l + 1``, its MLP
    ``2l + 2`` (``2l + 1`` in a parallel block, which reads the block's input), ``logits`` ``2L + 1``;
    ``None`` for any other site. An edge of a graph runs from a lower order to a higher one."""
    if a.kind == HEAD:
        return 2 * a.layer + 1  # type: ignore[operator]
    if a.kind == MLP:
        return 2 * a.layer + (1 if getattr(cfg, "parallel", False) else 2)  # type: ignore[operator]
    if a.kind == "logits":
        return 2 * cfg.n_layers + 1
    return 0 if a.kind == "embed" else None


def not_a_head(what: str, given: Any) -> str:
    """The one wording of a head that cannot be read."""
    return f"{what}: {given!r} is not a head; write LAYER.HEAD, e.g. 1.0"


def no_head(what: str, head: Address, cfg: Any) -> str:
    """The one wording of a head the model lacks."""
    return f"{what}: the model has no head {head.name} ({cfg.n_layers} layers of {cfg.n_heads} heads)"


def _node(text: str, what: str, whole: str) -> Address:
    """One end of an edge, or a whole address without one: a head (with an input), or a site."""
    text = text.strip()
    inp = None
    m = _INPUT.fullmatch(text)
    if m:
        text, inp = m.group(1), m.group(2)
        if inp not in INPUTS:
            raise QkovError(f"{what}: {whole.strip()!r}: a head's input is q, k or v, got <{inp}>")
    m = _HEAD.fullmatch(text)
    if m:  # LAYER.HEAD
        return Address(HEAD, int(m.group(1)), int(m.group(2)), inp)
    m = _SITE.fullmatch(text)
    if m is None or inp is not None:
        raise QkovError(
            f"{what}: {whole.strip()!r} is not an address; write a head LAYER.HEAD (1.0), its input (1.0<k>), "
            "a site (z.0.3, logits) or an edge SENDER -> RECEIVER (0.1 -> 1.0<k>)"
        )
    return Address(m.group(1), *(None if g is None else int(g) for g in m.groups()[1:]))


HeadLike = Union[Address, Sequence[int], str]
"""What a head may be given as: an :class:`Address` of a head, a ``(layer, head)`` pair, or ``"L.H"``."""


def as_head(value: HeadLike, cfg: Any = None, what: str = "heads") -> Address:
    """The head ``value`` names (``Address``, ``(layer, head)`` or ``"L.H"``), checked against ``cfg``
    when given; a one-line :class:`QkovError` beginning with ``what`` otherwise."""
    if isinstance(value, Address):
        head = value
    elif isinstance(value, str):
        head = _node(value, what, value) if _HEAD.fullmatch(value.strip()) else None
    elif _is_pair(value):
        head = Address.of_head(*value)  # type: ignore[misc]
    else:
        head = None
    if head is None or not head.is_head:
        raise QkovError(not_a_head(what, value if not isinstance(value, Address) else value.name))
    return head if cfg is None else head.check(cfg, what)


def parse_heads(value: str | Iterable[HeadLike], cfg: Any = None, what: str = "heads") -> list[Address]:
    """Heads from ``"1.0,1.3"`` (comma-separated), one head, or a collection of heads (:data:`HeadLike`),
    each read by :func:`as_head` and checked against ``cfg`` when given; in order, once each, at least one."""
    if isinstance(value, str):
        items: list[Any] = [p for p in value.split(",") if p.strip()]
    elif isinstance(value, Address) or _is_pair(value):
        items = [value]  # one head
    elif isinstance(value, Iterable):
        items = list(value)
    else:
        raise QkovError(not_a_head(what, value))
    heads: list[Address] = []
    for item in items:
        head = as_head(item, cfg, what)
        if head not in heads:
            heads.append(head)
    if not heads:
        raise QkovError(f"{what}: no heads given")
    return heads


def _is_pair(value: Any) -> bool:
    """``(layer, head)``: a sequence of two integers (not a string)."""
    return isinstance(value, Sequence) and not isinstance(value, str) and len(value) == 2 and all(map(_is_int, value))


def _is_int(v: Any) -> bool:
    try:
        return not isinstance(v, bool) and int(v) == v
    except (TypeError, ValueError):
        return False
