"""An independent reference for circuit discovery: the model's graph written out as a forward pass in
which every edge has its own coefficient, sharing no code with qkov's discovery package.

The forward reads a :class:`qkov.weights.Weights` view's stacked tensors, head by head with einsum (the
norms, activations and rotation of ``reference.py``). Every receiver (each head's query, key and value
input, each MLP's input, the final stream) reads the residual stream plus, for each sender before it,
``alpha[edge] * change``: the change is ``patch_s - a_s`` with ``a_s`` the sender's output *in this pass*
(``mode="current"``: AutoCircuit's patch wrappers, ACDC's and EAP-IG's circuit evaluation) or a given
constant (``mode="fixed"``). Then, by autograd on ``alpha``:

* EAP is ``d metric / d alpha`` at ``alpha = 0`` (the first-order change of ablating each edge);
* exact patching is the metric at ``alpha`` = one edge;
* a circuit is evaluated at ``alpha = 1`` outside it;
* AutoCircuit's integrated edge gradients are ``d metric / d alpha`` at ``alpha = k/m`` on every edge.

Edges are named in qkov's written form (``0.1 -> 1.0<k>``, ``embed -> mlp.0``, ``mlp.1 -> logits``),
built here from the loops, so a name that agrees with qkov's graph is a check of that graph too.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from qkov import ModelConfig, Transformer
from qkov.analysis.discovery import Task
from qkov.weights import Weights
from helpers import LN_MLP, MODERN, perturb_non_matrices
from reference import _act, _gain_bias, _norm, _rotate


def graph(w: Weights) -> tuple[list[str], list[tuple[str, int]], list[str]]:
    """``(senders, receivers, edges)``: senders and receivers as written, receivers with the order
    they read at; edges ``"S -> R"`` for every sender of a lower order than the receiver."""
    cfg = w.cfg
    K = cfg.n_kv_heads or cfg.n_heads
    group = cfg.n_heads // K
    senders, orders = ["embed"], [0]
    receivers: list[tuple[str, int]] = []
    for l in range(cfg.n_layers):
        senders += [f"{l}.{h}" for h in range(cfg.n_heads)]
        orders += [2 * l + 1] * cfg.n_heads
        receivers += [(f"{l}.{h}<q>", 2 * l + 1) for h in range(cfg.n_heads)]
        receivers += [(f"{l}.{g * group}<{x}>", 2 * l + 1) for x in "kv" for g in range(K)]
        if cfg.d_mlp:
            o = 2 * l + (1 if cfg.parallel else 2)
            senders.append(f"mlp.{l}")
            orders.append(o)
            receivers.append((f"mlp.{l}", o))
    receivers.append(("logits", 2 * cfg.n_layers + 1))
    edges = [f"{s} -> {r}" for r, ro in receivers for s, so in zip(senders, orders) if so < ro]
    return senders, receivers, edges


def edge_forward(w: Weights, tokens: Tensor, alpha: dict[str, Tensor], patch: dict[str, Tensor], *,
                 mode: str = "current", embed: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:  # fmt: skip
    """Logits ``[B, T, V]`` and every sender's output ``{name: [B, T, D]}``. ``alpha``: a coefficient
    (a scalar tensor, or ``[T, 1]`` per position) per edge name (missing: 0); ``patch``: per sender,
    its replacement (``mode="current"``) or the change itself (``mode="fixed"``). ``embed``: replaces
    the input stream."""
    cfg = w.cfg
    T = tokens.shape[1]
    K = cfg.n_kv_heads or cfg.n_heads
    group = cfg.n_heads // K
    pos = w.W_pos[:T] if w.W_pos is not None else None
    x = w.W_E[tokens] + (pos if cfg.positional == "standard" else 0) if embed is None else embed
    out: dict[str, Tensor] = {"embed": x}

    def receive(stream: Tensor, name: str) -> Tensor:
        for s, a_s in out.items():
            coeff = alpha.get(f"{s} -> {name}")
            if coeff is not None:
                change = patch[s] - a_s if mode == "current" else patch[s]
                stream = stream + coeff * change
        return stream

    later = torch.arange(T)[None, :] > torch.arange(T)[:, None]
    for l in range(cfg.n_layers):
        ln1 = _gain_bias(w, "ln1", l)
        qk = lambda v: _norm(v + pos if cfg.positional == "shortformer" else v, w.norm, cfg.ln_eps, *ln1)  # noqa: E731
        q = torch.stack([qk(receive(x, f"{l}.{h}<q>")) @ w.W_Q[l, h] + w.b_Q[l, h] for h in range(cfg.n_heads)], 1)
        k = torch.stack([qk(receive(x, f"{l}.{g * group}<k>")) @ w.W_K[l, g] + w.b_K[l, g] for g in range(K)], 1)
        v = torch.stack(
            [
                _norm(receive(x, f"{l}.{g * group}<v>"), w.norm, cfg.ln_eps, *ln1) @ w.W_V[l, g] + w.b_V[l, g]
                for g in range(K)
            ],
            1,
        )
        if cfg.positional == "rotary":
            q, k = _rotate(q, cfg), _rotate(k, cfg)
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        p = torch.softmax((q @ k.transpose(-1, -2) / math.sqrt(cfg.d_head)).masked_fill(later, float("-inf")), -1)
        heads = torch.einsum("bhqk,bhke,hed->hbqd", p, v, w.W_O[l])
        block_in = x
        for h in range(cfg.n_heads):
            out[f"{l}.{h}"] = heads[h]
        x = x + heads.sum(0) + w.b_O[l]
        if cfg.d_mlp:
            m_in = _norm(
                receive(block_in if cfg.parallel else x, f"mlp.{l}"), w.norm, cfg.ln_eps, *_gain_bias(w, "ln2", l)
            )
            pre = m_in @ w.W_in[l] + w.b_in[l]
            hidden = (
                _act(cfg.act_fn, m_in @ w.W_gate[l] + w.b_gate[l]) * pre if cfg.gated_mlp else _act(cfg.act_fn, pre)
            )
            out[f"mlp.{l}"] = hidden @ w.W_out[l] + w.b_out[l]
            x = x + out[f"mlp.{l}"]
    logits = _norm(receive(x, "logits"), w.norm, cfg.ln_eps, *_gain_bias(w, "lnf", None)) @ w.W_U + w.b_U
    return logits, out


def logit_diff(logits: Tensor, answers: Tensor, wrong: Tensor) -> Tensor:
    """Mean over prompts of (mean answer logit - mean wrong-answer logit) at the last position."""
    last = logits[:, -1]
    return (last.gather(-1, answers).mean(-1) - last.gather(-1, wrong).mean(-1)).mean()


def senders_of(w: Weights, tokens: Tensor) -> dict[str, Tensor]:
    """Every sender's output on ``tokens`` (nothing patched)."""
    with torch.no_grad():
        return edge_forward(w, tokens, {}, {})[1]


def reference_eap(w: Weights, clean: Tensor, patch: dict[str, Tensor], answers: Tensor, wrong: Tensor,
                  alphas: list[float] = [0.0], *, mode: str = "current",
                  embeds: list[Tensor] | None = None) -> dict[str, float]:  # fmt: skip
    """``sum_k d metric / d alpha`` at ``alpha = alphas[k]`` on every edge (``[0]``: EAP), divided by the
    number of points, with ``patch`` the senders' replacements (``mode="fixed"``: their changes); with
    ``embeds``, at ``alpha = 0`` with the input stream replaced by each of them in turn."""
    _, _, edges = graph(w)
    total = {e: 0.0 for e in edges}
    points = [(a, None) for a in alphas] if embeds is None else [(0.0, e) for e in embeds]
    for a, embed in points:
        alpha = {e: torch.tensor(a, dtype=w.W_E.dtype, requires_grad=True) for e in edges}
        logits, _ = edge_forward(w, clean, alpha, patch, mode=mode, embed=embed)
        g = torch.autograd.grad(logit_diff(logits, answers, wrong), list(alpha.values()), allow_unused=True)
        for e, gi in zip(edges, g):
            total[e] += 0.0 if gi is None else float(gi) / len(points)
    return total


def reference_circuit(w: Weights, clean: Tensor, patch: dict[str, Tensor], answers: Tensor, wrong: Tensor,
                      ablated: set[str]) -> float:  # fmt: skip
    """The metric with the edges ``ablated`` carrying ``patch`` (the current-pass change)."""
    one = torch.tensor(1.0, dtype=w.W_E.dtype)
    with torch.no_grad():
        logits, _ = edge_forward(w, clean, {e: one for e in ablated}, patch)
    return float(logit_diff(logits, answers, wrong))


CONFIGS = {
    "gpt2-like": LN_MLP.replace(positional="standard", act_fn="gelu_new"),
    "ln-mlp-shortformer": LN_MLP,
    "llama-like": MODERN,
    "neox-parallel": MODERN.replace(
        normalization="layernorm", gated_mlp=False, act_fn="gelu", parallel=True, n_kv_heads=None
    ),
    "attention-only": ModelConfig(
        n_layers=2, n_heads=3, d_model=24, d_head=8, d_vocab=30, n_ctx=12, positional="standard", normalization="none"
    ),
}


def random_case(name: str, n: int = 4, T: int = 7, seed: int = 0) -> tuple[Weights, Task]:
    """A random model of kind ``name`` (biases and gains perturbed; float64) and ``n`` prompt pairs of ``T``
    tokens whose corrupted twins differ at two positions, the last one included."""
    cfg = CONFIGS[name]
    m = perturb_non_matrices(Transformer(cfg, seed=seed + 1).double().eval(), 0.2)
    w = Weights.from_model(m, dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    clean = torch.randint(0, cfg.d_vocab, (n, T), generator=g)
    corrupted = clean.clone()
    corrupted[:, 2] = torch.randint(0, cfg.d_vocab, (n,), generator=g)
    corrupted[:, -1] = torch.randint(0, cfg.d_vocab, (n,), generator=g)
    answers = torch.randint(0, cfg.d_vocab, (n, 2), generator=g)
    wrong = torch.randint(0, cfg.d_vocab, (n, 1), generator=g)
    return w, Task(name, clean, corrupted, answers, wrong)
