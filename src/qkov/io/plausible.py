"""A config checked against the weights' shapes before anything is allocated.

A ``config.json`` can claim anything: 100,000 layers of ``d_model`` 4096 next to a 20 KiB weights
file. Building the model first allocates what the config claims (gigabytes, or an allocator error)
before the weights are compared with it. Every loader calls :func:`check_shapes` first, with the
shapes its weights have (a safetensors header gives them without reading the data:
:func:`file_shapes`), so a config that does not describe its weights is a one-line
:class:`~qkov.QkovError` that costs nothing.

The check starts with the layer count (read off the names, before any per-layer work), then
compares every tensor with the shape :class:`~qkov.Transformer` gives it under the config,
computed from a one-layer model on the ``meta`` device (no memory; every block has the same shapes).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Mapping, Sequence

import torch
from safetensors import SafetensorError, safe_open

from ..errors import QkovError
from ..model.config import ModelConfig
from ..model.bus import bus_shapes
from ..model.transformer import Transformer

__all__ = ["check_shapes", "file_shapes", "model_shapes"]

_LAYER = re.compile(r"^blocks\.(\d+)\.(.+)$")


def model_shapes(cfg: ModelConfig) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    """The shapes of ``Transformer(cfg)``'s tensors with nothing allocated: ``(outside the blocks,
    inside one block)``, the second keyed by the name after ``blocks.N.`` (the same in every block)."""
    one = cfg if cfg.n_layers <= 1 else cfg.replace(n_layers=1)
    with torch.device("meta"):
        state = Transformer(one, init=False).state_dict()
    outside: dict[str, tuple[int, ...]] = {}
    block: dict[str, tuple[int, ...]] = {}
    for name, t in state.items():
        m = _LAYER.match(name)
        (outside if m is None else block)[name if m is None else m.group(2)] = tuple(t.shape)
    outside |= {f"bus.{k}": v for k, v in bus_shapes(cfg).items()}  # per sublayer of the whole model
    return outside, block


def _names(names: list[str]) -> str:
    return f"{', '.join(names[:4])}{' ...' if len(names) > 4 else ''}"


def check_shapes(cfg: ModelConfig, shapes: Mapping[str, Sequence[int]], where: str, *, complete: bool = True) -> None:
    """Refuse (one line) weights ``shapes`` (qkov's names) that ``cfg`` does not describe.

    First the layers: the ``blocks.N.`` the weights hold must be exactly ``0 .. n_layers - 1``;
    then every tensor's shape. ``complete=False`` checks only the tensors present (a format whose
    loader fills some in, such as a TransformerLens file's absent biases, or a converter checking
    its first tensors before it builds the rest): the layers only when some are given, and
    unknown names pass (the converter names them). The work grows with the tensors given, never
    with the layers the config claims.
    """
    layers = {int(m.group(1)) for m in map(_LAYER.match, shapes) if m is not None}
    if layers != set(range(cfg.n_layers)) and (complete or layers):
        held = (
            "none"
            if not layers
            else f"{len(layers)} (block {min(layers)})"
            if len(layers) == 1
            else (f"{len(layers)} (blocks {min(layers)} to {max(layers)})")
        )
        raise QkovError(
            f"{where}: the config says {cfg.n_layers} layer(s), but the weights hold {held}: "
            "the config does not belong to these weights"
        )
    outside, block = model_shapes(cfg)

    def expected(name: str) -> tuple[int, ...] | None:
        m = _LAYER.match(name)
        return outside.get(name) if m is None else block.get(m.group(2))

    if complete:  # the layers are the config's now, and as many as the weights hold
        want = set(outside) | {f"blocks.{l}.{rest}" for l in layers for rest in block}
        for what, names in (("missing", sorted(want - set(shapes))), ("unexpected", sorted(set(shapes) - want))):
            if names:
                raise QkovError(f"{where}: {what} weight(s) {_names(names)}")
    for name in sorted(shapes, key=lambda n: (_LAYER.match(n) is not None, n)):  # the embedding first: it names d_model
        need = expected(name)
        if need is not None and tuple(shapes[name]) != need:
            raise QkovError(f"{where}: {name} has shape {tuple(shapes[name])} but the config implies {need}")


def file_shapes(path: Path, where: str) -> dict[str, tuple[int, ...]]:
    """The tensors' shapes in a safetensors file's header (no data is read)."""
    try:
        with safe_open(str(path), framework="pt") as fh:
            return {k: tuple(fh.get_slice(k).get_shape()) for k in fh.keys()}
    except (SafetensorError, OSError, ValueError) as exc:
        raise QkovError(f"{where}: {path.name} is corrupt ({exc})") from None
