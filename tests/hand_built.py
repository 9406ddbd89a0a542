"""Models built by hand whose answers are known by construction, shared by the tests of several packages."""

from __future__ import annotations

import torch

from qkov import ModelConfig, Transformer
from qkov.weights import Weights

V, CTX = 40, 64  # vocabulary, context


D = V + CTX + V  # stream: [token one-hot | position one-hot | previous-token one-hot]


C = 40.0  # attention sharpness


def hand_built() -> Transformer:
    """2 layers x 2 heads, shortformer, attention only.

    0.0 previous-token head (positional QK: query i matches key i-1), OV copies the token into
        the "previous token" subspace;
    0.1 sink head: every query attends to position 0; zero OV;
    1.0 induction head: query = current token, key = previous-token subspace (K-composition
        with 0.0), OV copies the attended token to the output;
    1.1 copying head with uniform attention (zero QK), OV copies.
    """
    cfg = ModelConfig(n_layers=2, n_heads=2, d_model=D, d_head=CTX, d_vocab=V, n_ctx=CTX)
    m = Transformer(cfg, seed=0)
    tok, pos, prev = slice(0, V), slice(V, V + CTX), slice(V + CTX, D)
    with torch.no_grad():
        for p in m.parameters():
            p.zero_()
        m.W_E[:, tok] = torch.eye(V)
        m.W_pos[:, pos] = torch.eye(CTX)
        m.W_U[tok, :] = torch.eye(V)
        a0, a1 = m.blocks[0].attn, m.blocks[1].attn
        scale = C * CTX**0.5  # scores are divided by sqrt(d_head)
        # 0.0: q_i = e_i, k_j = e_{j+1}: score(i, j) = C [i == j + 1]
        a0.W_Q[0, pos, :] = torch.eye(CTX) * scale
        a0.W_K[0, pos, :] = torch.diag(torch.ones(CTX - 1), 1)  # position j -> e_{j+1}
        a0.W_V[0, tok, :V] = torch.eye(V)
        a0.W_O[0, :V, prev] = torch.eye(V)
        # 0.1: every query -> e_0, only key position 0 -> e_0
        a0.W_Q[1, pos, 0] = scale
        a0.W_K[1, V, 0] = 1.0
        # 1.0: q = current token, k = previous token
        a1.W_Q[0, tok, :V] = torch.eye(V) * scale
        a1.W_K[0, prev, :V] = torch.eye(V)
        a1.W_V[0, tok, :V] = torch.eye(V)
        a1.W_O[0, :V, tok] = torch.eye(V) * 10  # a strong vote for the attended token
        # 1.1: uniform attention, copying OV
        a1.W_V[1, tok, :V] = torch.eye(V)
        a1.W_O[1, :V, tok] = torch.eye(V)
    return m.eval()


def identity_model(d: int, d_head: int, sign: float) -> Weights:
    """W_E = W_U = I and every head's W_OV = sign * 3 * (projection onto the first d_head dims)."""
    cfg = ModelConfig(n_layers=1, n_heads=2, d_model=d, d_head=d_head, d_vocab=d, n_ctx=4)
    m = Transformer(cfg, seed=0).double()
    with torch.no_grad():
        m.W_E.copy_(torch.eye(d))
        m.W_U.copy_(torch.eye(d))
        P = torch.eye(d)[:, :d_head]
        m.blocks[0].attn.W_V.copy_(torch.stack([P * sign * 3, P * sign * 3]))
        m.blocks[0].attn.W_O.copy_(torch.stack([P.T, P.T]))
    return Weights.from_model(m, dtype=torch.float64)


def natural_text(n: int = 4, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(1, V, (n, CTX), generator=g)
    t[:, 0] = 0
    return t


RELAY_V, RELAY_CTX, RELAY_NOISE = 12, 8, 8


def relay_model(seed: int = 0) -> Transformer:
    """2 layers x 2 heads, standard positions, attention only, no normalisation: one named path carries
    the token at position 1 to the logits at every later position, and the rest is noise.

    0.0 every query attends to position 1; its OV copies the token into subspace B;
    1.0 every query attends to itself; its OV moves subspace B into subspace C, which the unembedding reads;
    0.1, 1.1 random heads that read the tokens, positions and the noise subspace and write only into the
        noise subspace, which nothing on the path reads.

    So the answer's path is ``embed -> 0.0<v>``, ``0.0 -> 1.0<v>``, ``1.0 -> logits``; every other edge changes
    no logit, and the model is linear in every edge (the patterns read positions only)."""
    V, P, N = RELAY_V, RELAY_CTX, RELAY_NOISE
    A, Ps, B = slice(0, V), slice(V, V + P), slice(V + P, 2 * V + P)
    C, Ns = slice(2 * V + P, 3 * V + P), slice(3 * V + P, 3 * V + P + N)
    D = 3 * V + P + N
    cfg = ModelConfig(
        n_layers=2, n_heads=2, d_model=D, d_head=V, d_vocab=V, n_ctx=P, positional="standard", normalization="none"
    )
    m = Transformer(cfg, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.zero_()
        m.W_E[:, A] = torch.eye(V)
        m.W_pos[:, Ps] = torch.eye(P)
        m.W_U[C, :] = torch.eye(V)
        a0, a1 = m.blocks[0].attn, m.blocks[1].attn
        scale = C_SHARP * V**0.5
        a0.W_Q[0, Ps, 0] = scale  # every position queries the same direction
        a0.W_K[0, V + 1, 0] = 1.0  # only position 1 answers
        a0.W_V[0, A, :] = torch.eye(V)
        a0.W_O[0, :, B] = torch.eye(V)
        a1.W_Q[0, Ps, :P] = torch.eye(P) * scale  # each position attends to itself
        a1.W_K[0, Ps, :P] = torch.eye(P)
        a1.W_V[0, B, :] = torch.eye(V)
        a1.W_O[0, :, C] = torch.eye(V)
        for a in (a0, a1):  # the noise heads: read anything but B and C, write the noise subspace only
            reads = torch.cat([torch.arange(0, V + P), torch.arange(3 * V + P, D)])
            for W in (a.W_Q, a.W_K, a.W_V):
                W[1, reads] = torch.randn(len(reads), V, generator=g)
            a.W_O[1, :, Ns] = torch.randn(V, N, generator=g)
    return m.eval()


C_SHARP = 20.0
