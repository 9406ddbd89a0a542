"""TransformerLens' habits on qkov's analysis forward: :func:`run_with_cache` and :func:`run_with_hooks`,
the functions behind ``Transformer.run_with_cache`` and ``Transformer.run_with_hooks``.

Both take any source (a model, a weights view, a lazy checkpoint, a path) and a text, a list of texts
of equal token counts (each with one start token, :class:`~qkov.model.tokens.TextCodec`;
``prepend_bos`` applies to texts, as in TransformerLens) or token ids, and run
:func:`~qkov.analysis.forward.tracer.trace` once:

* ``run_with_cache(source, input, names_filter=None)`` -> ``(logits [B, T, V], cache)``: the cache is
  the :class:`~qkov.analysis.forward.cache.Trace`, indexed by TransformerLens hook names and qkov site
  names alike. ``names_filter``: ``None`` (every site but the per-head input copies, as ``"*"``), a
  name, a list of names (TransformerLens hooks, qkov sites, globs, a kind alone for every layer) or a
  function of a TransformerLens hook name returning whether to keep it.
* ``run_with_hooks(source, input, fwd_hooks=[(name, fn), ...])``: each ``fn(activation, hook)`` returns
  the activation's replacement or ``None`` (having edited it in place or only read it), as in
  TransformerLens; ``hook`` is a :class:`HookPoint` (``hook.name``, ``hook.layer()``, ``hook.ctx``).
  ``name`` is a TransformerLens hook name (or a qkov site name, glob or kind) or a function of a hook
  name. Supported: every TransformerLens hook point of a site qkov has (docs/conventions.md's table:
  ``hook_embed``, ``hook_pos_embed``, ``blocks.L.hook_resid_pre/mid/post``, ``ln1/ln2/ln_final.hook_scale``
  and ``hook_normalized``, ``hook_q/k/v_input``, ``attn.hook_q/k/v`` (``hook_rot_q/k`` in a rotary
  model), ``attn.hook_attn_scores/pattern/z/result``, ``hook_attn_out``, ``mlp.hook_pre/pre_linear/post``,
  ``hook_mlp_in`` (the MLP's input copy ``mlp_input``), ``hook_mlp_out``, ``unembed.hook_in/hook_out``);
  refused in one line: ``blocks.L.hook_attn_in`` (TransformerLens' optional per-head input copy, which
  qkov has no site for; use ``q_input``/``k_input``/``v_input``) and, in a rotary model, ``attn.hook_q/hook_k``
  (before rotation). Backward hooks are refused: ``trace(..., grad=True)`` then ``.backward()``.

``return_type`` is TransformerLens': ``"logits"``, ``"loss"`` (the mean next-token loss), ``"both"``
(``(logits, loss)``) or ``None``.

Which weights: a :class:`~qkov.Transformer` is read into the default view but with its unembedding
uncentred, so the logits are the model's own (``model(tokens)``, as ``run_with_cache`` returns in
TransformerLens); ``stream="model"`` leaves the writers uncentred too (the model's own residual stream,
:func:`~qkov.weights.as_source`). Any other source is used as :func:`~qkov.weights.as_source` reads it.

Layering: :mod:`qkov.model` sits below this package and may not import it, so the model's methods
are thin and find these functions in :mod:`qkov.model.registry`, where this module registers them
on import (``import qkov`` imports it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence, Union

import torch
from torch import Tensor

from ...errors import QkovError
from ...expect import expect_tokens
from ...model.ops import next_token_loss
from ...model.registry import register
from ...model.tokens import is_text, source_codec
from ...model.transformer import Transformer
from ...weights.convert import as_source, stream_centring
from ...weights.parts import WeightSource
from ...weights.view import Weights
from .cache import Trace
from .tracer import trace
from .sites import Address, Sites
from .edits import EditFn

__all__ = [
    "cached_sites",
    "hook_edits",
    "HookFn",
    "HookPoint",
    "NamesFilter",
    "output",
    "prepare",
    "RETURN_TYPES",
    "run_with_cache",
    "run_with_hooks",
]

RETURN_TYPES = ("logits", "loss", "both", None)
HookFn = Callable[[Tensor, "HookPoint"], Union[Tensor, None]]
NamesFilter = Union[None, str, Sequence[Any], Callable[[str], bool]]


@dataclass
class HookPoint:
    """The ``hook`` a TransformerLens hook function receives: ``name`` (the TransformerLens hook name
    of the site), ``site`` (its qkov :class:`~qkov.analysis.forward.sites.Address`) and ``ctx`` (a dict the
    function may keep things in, for the run)."""

    name: str
    site: Address
    ctx: dict[str, Any] = field(default_factory=dict)

    def layer(self) -> int:
        """The site's layer (as TransformerLens' ``HookPoint.layer()``)."""
        if self.site.layer is None:
            raise QkovError(f"hook {self.name}: this hook point is not in a block, it has no layer")
        return self.site.layer


def prepare(
    source: Any, input: Any, *, prepend_bos: bool | None, stream: str | None, where: str
) -> tuple[WeightSource, Tensor]:
    """The weights the habits run (see the module docstring) and ``input`` as token ids ``[B, T]``."""
    if isinstance(source, Transformer):
        centre = stream_centring(where, stream)
        view: WeightSource = Weights.from_model(source, center_writing=centre, center_unembed=False)
    else:
        view = as_source(source, where=where, stream=stream)
    if is_text(input):
        return view, source_codec(view, where=where).encode_texts(input, prepend_bos=prepend_bos, where=where)
    expect_tokens(where, input, "input")
    return view, torch.as_tensor(input)


def output(out: Trace, return_type: str | None, where: str) -> Any:
    """What a run returns for TransformerLens' ``return_type``."""
    if return_type not in RETURN_TYPES:
        raise QkovError(f"{where}: return_type must be one of logits, loss, both or None, got {return_type!r}")
    if return_type is None:
        return None
    if return_type == "logits":
        return out.logits
    loss = next_token_loss(out.logits, out.tokens)
    return loss if return_type == "loss" else (out.logits, loss)


def cached_sites(sites: Sites, names_filter: NamesFilter) -> Any:
    """``names_filter`` as :func:`trace`'s ``cache=``."""
    if names_filter is None:
        return "*"
    if isinstance(names_filter, str):
        return [names_filter]
    if callable(names_filter):
        return [a for a in sites.resolve("*") if names_filter(sites.tl_name(a))]
    if isinstance(names_filter, (list, tuple)):
        return list(names_filter)
    raise QkovError(
        "run_with_cache: names_filter must be None, a name, a list of names or a function of a hook name, "
        f"got {names_filter!r}"
    )


def run_with_cache(
    source: Any,
    input: str | Sequence[str] | Tensor,
    names_filter: NamesFilter = None,
    *,
    prepend_bos: bool | None = None,
    stream: str | None = None,
    return_type: str | None = "logits",
) -> tuple[Any, Trace]:
    """Run ``source`` on ``input`` and keep the sites ``names_filter`` names: ``(logits [B, T, V],
    cache)`` (the first part as ``return_type`` asks); see the module docstring."""
    where = "run_with_cache"
    view, tokens = prepare(source, input, prepend_bos=prepend_bos, stream=stream, where=where)
    sites = Sites(view.cfg, view.norm)
    out = trace(view, tokens, cache=cached_sites(sites, names_filter))
    return output(out, return_type, where), out


def _hook_sites(sites: Sites, name: Any) -> list[Address]:
    """The sites one ``fwd_hooks`` entry's name (or name filter) picks."""
    if callable(name):
        return [a for a in sites.resolve("*") if name(sites.tl_name(a))]
    try:
        return sites.resolve(name)
    except QkovError as exc:
        raise QkovError(f"run_with_hooks: {exc}") from None


def hook_edits(sites: Sites, fwd_hooks: Iterable[tuple[Any, HookFn]]) -> dict[Address, EditFn]:
    """``fwd_hooks`` as :func:`trace`'s ``edits=``: one edit per site, running that site's hook
    functions in the order given, each with the site's :class:`HookPoint`."""
    by_site: dict[Address, list[HookFn]] = {}
    for entry in fwd_hooks:
        if not (isinstance(entry, (tuple, list)) and len(entry) == 2 and callable(entry[1])):
            raise QkovError(f"run_with_hooks: each of fwd_hooks is (name, fn(activation, hook)), got {entry!r}")
        for address in _hook_sites(sites, entry[0]):
            by_site.setdefault(address, []).append(entry[1])

    def edit_of(address: Address, fns: list[HookFn]) -> EditFn:
        point = HookPoint(sites.tl_name(address), address)

        def edit(value: Tensor, site: Address) -> Tensor:
            for fn in fns:
                new = fn(value, point)
                value = value if new is None else new
            return value

        return edit

    return {address: edit_of(address, fns) for address, fns in by_site.items()}


def run_with_hooks(
    source: Any,
    input: str | Sequence[str] | Tensor,
    fwd_hooks: Iterable[tuple[Any, HookFn]] = (),
    *,
    bwd_hooks: Iterable[Any] = (),
    prepend_bos: bool | None = None,
    stream: str | None = None,
    return_type: str | None = "logits",
) -> Any:
    """Run ``source`` on ``input`` with TransformerLens hook functions at named sites; returns what
    ``return_type`` asks (the logits ``[B, T, V]`` by default). See the module docstring."""
    where = "run_with_hooks"
    if list(bwd_hooks):
        raise QkovError(
            f"{where}: backward hooks are not supported: trace(..., cache=[...], grad=True), then .backward() "
            "and out[site].grad"
        )
    view, tokens = prepare(source, input, prepend_bos=prepend_bos, stream=stream, where=where)
    out = trace(view, tokens, edits=hook_edits(Sites(view.cfg, view.norm), fwd_hooks))
    return output(out, return_type, where)


register("run_with_cache")(run_with_cache)
register("run_with_hooks")(run_with_hooks)
