"""Edge and node names in the three spellings circuit files use, read back into qkov's.

| qkov | EAP-IG / MIB | AutoCircuit |
|---|---|---|
| ``embed`` | ``input`` | ``Resid Start`` |
| ``1.2`` (a head) | ``a1.h2`` | ``A1.2`` |
| ``1.2<q>`` (its query input) | ``a1.h2<q>`` (on the edge) | ``A1.2.Q`` |
| ``mlp.1`` | ``m1`` | ``MLP 1`` |
| ``logits`` | ``logits`` | ``Resid End`` |

Edges are ``SENDER -> RECEIVER``: ``0.1 -> 1.2<q>``, ``a0.h1->a1.h2<q>``, ``A0.1->A1.2.Q``.
:func:`to_qkov` reads any of them; :func:`mib_name` writes an edge or node in MIB's spelling.
"""

from __future__ import annotations

import re

from ...errors import QkovError
from ..forward.address import HEAD, MLP, Address

__all__ = ["mib_name", "to_qkov", "to_qkov_node"]

_MIB_HEAD = re.compile(r"a(\d+)\.h(\d+)")
_MIB_MLP = re.compile(r"m(\d+)")
_AC_HEAD = re.compile(r"A(\d+)\.(\d+)(?:\.([QKV]))?")
_AC_MLP = re.compile(r"MLP (\d+)")


def to_qkov_node(text: str) -> str:
    """A node (or a head's input) in qkov's spelling, from any of the three (qkov's passes through)."""
    t = text.strip()
    if t in ("input", "Resid Start"):
        return "embed"
    if t == "Resid End":
        return "logits"
    for pattern, form in ((_MIB_HEAD, "{}.{}"), (_MIB_MLP, "mlp.{}")):
        m = pattern.fullmatch(t.split("<")[0])
        if m:
            return form.format(*m.groups()) + (t[t.index("<") :] if "<" in t else "")
    m = _AC_HEAD.fullmatch(t)
    if m:
        return f"{m.group(1)}.{m.group(2)}" + (f"<{m.group(3).lower()}>" if m.group(3) else "")
    m = _AC_MLP.fullmatch(t)
    if m:
        return f"mlp.{m.group(1)}"
    return t


def to_qkov(text: str) -> str:
    """An edge or node in qkov's written form (``0.1 -> 1.2<q>``), from any of the three spellings."""
    if not isinstance(text, str):
        raise QkovError(f"expected an edge or node name, got {text!r}")
    if "->" not in text:
        return to_qkov_node(text)
    sender, receiver = text.split("->", 1)
    return f"{to_qkov_node(sender)} -> {to_qkov_node(receiver)}"


def _mib_node(a: Address) -> str:
    if a.kind == HEAD:
        return f"a{a.layer}.h{a.head}"
    if a.kind == MLP:
        return f"m{a.layer}"
    return {"embed": "input", "logits": "logits"}[a.kind]


def mib_name(a: Address) -> str:
    """An edge (``a0.h1->a1.h2<q>``) or node (``a1.h2``) in MIB's spelling."""
    own = _mib_node(a) + ("" if a.input is None else f"<{a.input}>")
    return own if a.sender is None else f"{_mib_node(a.sender)}->{own}"
