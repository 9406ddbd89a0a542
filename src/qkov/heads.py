"""Head detectors measured on behaviour (token ids in, scores out).

So far: the repeated-random-tokens induction score that training tracks to see
induction heads form (Olsson et al., 2022). Scores come back as ``[n_layers,
n_heads]`` tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .model import Transformer


def repeated_random_tokens(
    d_vocab: int,
    *,
    length: int = 50,
    repeats: int = 2,
    batch: int = 8,
    seed: int = 0,
    bos: int = 0,
    low: int = 1,
) -> Tensor:
    """``[batch, 1 + length * repeats]``: the start token, then ``length`` random ids repeated.

    Ids are drawn uniformly from ``[low, d_vocab)`` (so the start token, id 0 in
    qkov's tokenizers, is never drawn) with a seeded generator.
    """
    gen = torch.Generator().manual_seed(seed)
    block = torch.randint(low, d_vocab, (batch, length), generator=gen)
    body = block.repeat(1, repeats)
    return torch.cat([torch.full((batch, 1), bos, dtype=torch.long), body], dim=1)


def induction_attention(patterns: Tensor, period: int, *, first: int = 1) -> Tensor:
    """Mean attention from each repeated token to the token after its previous occurrence.

    Args:
        patterns: ``[n_layers, batch, n_heads, seq, seq]`` with the repeated block
            starting at position ``first`` and repeating every ``period`` positions.
    Returns:
        ``[n_layers, n_heads]``: for every query ``q >= first + period``, the attention
        paid to key ``q - period + 1``, averaged over queries and batch.
    """
    seq = patterns.shape[-1]
    q = torch.arange(first + period, seq, device=patterns.device)
    k = q - period + 1
    picked = patterns[..., q, k]  # [layers, batch, heads, n_queries]
    return picked.mean(dim=(1, 3))


@dataclass
class InductionProbe:
    """Induction score per head and the loss on each copy of repeated random tokens."""

    scores: Tensor  # [n_layers, n_heads]
    loss_by_copy: list[float]  # mean next-token loss on copy 1, copy 2, ...

    @property
    def best(self) -> float:
        """Largest score among heads in layers >= 1 (0.0 for models with fewer than 2 layers)."""
        if self.scores.shape[0] < 2:
            return 0.0
        return float(self.scores[1:].max())

    @property
    def best_head(self) -> tuple[int, int] | None:
        if self.scores.shape[0] < 2:
            return None
        flat = int(self.scores[1:].argmax())
        return 1 + flat // self.scores.shape[1], flat % self.scores.shape[1]


@torch.no_grad()
def induction_probe(
    model: Transformer,
    *,
    length: int = 50,
    repeats: int = 2,
    batch: int = 8,
    seed: int = 0,
) -> InductionProbe:
    """Run ``model`` on repeated random tokens; score every head's induction attention."""
    length = min(length, (model.cfg.n_ctx - 1) // repeats)
    tokens = repeated_random_tokens(
        model.cfg.d_vocab, length=length, repeats=repeats, batch=batch, seed=seed, bos=model.bos_token_id
    )
    out = model.run(tokens, return_patterns=True)
    assert out.patterns is not None
    scores = induction_attention(out.patterns, length)
    logp = torch.log_softmax(out.logits[:, :-1].float(), dim=-1)
    target = tokens[:, 1:].to(logp.device)
    nll = -logp.gather(-1, target[..., None])[..., 0]  # [batch, seq-1]; position i predicts token i+1
    losses = []
    for r in range(repeats):
        # predictions of the tokens of copy r (positions 1 + r*length .. ), skipping the first of each copy
        lo = r * length + 1
        losses.append(float(nll[:, lo : lo + length - 1].mean()))
    return InductionProbe(scores=scores.float().cpu(), loss_by_copy=losses)
