"""Skip-trigram and bigram tables against brute force over the materialised circuits."""

from __future__ import annotations

import itertools

import pytest
import torch

from qkov import ModelConfig, QkovError, Transformer
from qkov.analysis.circuits import trigrams as T
from qkov.analysis.circuits.factored import LowRank
from qkov.weights import Weights


def weights(seed: int = 0) -> Weights:
    m = Transformer(ModelConfig(n_layers=1, n_heads=2, d_model=16, d_head=4, d_vocab=24, n_ctx=8), seed=seed)
    return Weights.from_model(m, dtype=torch.float64)


def brute(w: Weights, head: int) -> list[tuple[float, int, int, int]]:
    E, U = w.W_E, w.W_U
    qk = E @ w.W_Q[0, head] @ w.W_K[0, head].T @ E.T  # [dest, src]
    qk = qk - qk.mean(dim=1, keepdim=True)
    ov = E @ w.W_V[0, head] @ w.W_O[0, head] @ U  # [src, out]
    ov = ov - ov.mean(dim=1, keepdim=True)
    out = []
    V = E.shape[0]
    for s, d, o in itertools.product(range(1, V), repeat=3):
        if qk[d, s] > 0 and ov[s, o] > 0:
            out.append((float(qk[d, s] * ov[s, o]), s, d, o))
    return sorted(out, reverse=True)


@pytest.mark.parametrize("head", [0, 1])
def test_top_trigrams_match_brute_force(head: int) -> None:
    w = weights()
    ours = T.skip_trigrams(w, 0, head, top=15)
    ref = brute(w, head)[:15]
    assert [round(t.score, 9) for t in ours] == [round(r[0], 9) for r in ref]
    assert [(t.source, t.destination, t.output) for t in ours] == [r[1:] for r in ref]
    # small batches of sources: the bound stops the search early and the table is still exact
    few = T.skip_trigrams(w, 0, head, top=3, batch=2)
    assert [(t.source, t.destination, t.output) for t in few] == [r[1:] for r in ref[:3]]
    assert all(0 not in (t.source, t.destination, t.output) for t in ours)


def test_source_view_and_crossed_trigrams() -> None:
    w = weights()
    table = T.TrigramTable(w, 0, 0)
    view = table.source_view(5, top=4)
    E = w.W_E
    ov = (E @ w.W_V[0, 0] @ w.W_O[0, 0] @ w.W_U)[5]
    ov = ov - ov.mean()
    ov[0] = float("-inf")
    assert [i for i, _ in view.outputs] == torch.topk(ov, 4).indices.tolist()
    tr = T.skip_trigrams(w, 0, 0, top=40)
    pair = T.first_bug(tr)
    assert pair is not None
    a, b = pair
    crossed = table.crossed(a, b)
    assert (crossed[0].destination, crossed[0].output) == (a.destination, b.output)
    assert crossed[0].qk == pytest.approx(a.qk) and crossed[0].ov == pytest.approx(b.ov)
    with pytest.raises(QkovError, match="same source"):
        first = tr.trigrams[0]
        table.crossed(first, next(t for t in tr.trigrams if t.source != first.source))


def test_bigrams_match_brute_force() -> None:
    w = weights()
    full = w.W_E @ (w.W_U - w.W_U.mean(dim=1, keepdim=True))
    full[0] = float("-inf")
    full[:, 0] = float("-inf")
    v, i = torch.topk(full.flatten(), 5)
    got = T.bigrams(w, top=5)
    assert [(b.token, b.next) for b in got] == [divmod(int(x), 24) for x in i]
    assert [b.logit for b in got] == pytest.approx(v.tolist())


def test_bigrams_fill_the_table_when_the_start_token_dominates() -> None:
    """The start token's column holds the largest entries: the table still has ``top`` rows."""
    w = weights()
    W_U = w.W_U.clone()
    W_U[:, 0] = 50.0 * w.W_E.sum(0) / w.W_E.sum(0).norm()  # column 0 lights up for most rows
    w = w.replace(W_U=W_U)
    got = T.bigrams(w, top=10)
    assert len(got) == 10 and all(0 not in (b.token, b.next) for b in got)
    full = w.W_E @ (W_U - W_U.mean(dim=1, keepdim=True))
    full[0] = float("-inf")
    full[:, 0] = float("-inf")
    assert [b.logit for b in got] == pytest.approx(torch.topk(full.flatten(), 10).values.tolist())


def test_tied_trigrams_come_by_source_destination_output_whatever_the_visit() -> None:
    """Integer-valued circuits (scores tie everywhere): the table is the brute-force top under the order
    (-score, source, destination, output), the same for every batch size (every order of the visit)."""
    g = torch.Generator().manual_seed(0)
    V = 13
    table = T.TrigramTable(weights(), 0, 0)
    table.d_vocab = V
    qk = torch.randint(-2, 3, (V, 2), generator=g).double(), torch.randint(-2, 3, (2, V), generator=g).double()
    ov = torch.randint(-2, 3, (V, 2), generator=g).double(), torch.randint(-2, 3, (2, V), generator=g).double()
    table.qk, table.ov = LowRank(*qk), LowRank(*ov)
    q, o = qk[0] @ qk[1], ov[0] @ ov[1]  # [source, destination], [source, output]
    for exclude in ((), (0, 4)):
        keep = [t for t in range(V) if t not in exclude]
        ref = sorted(
            (-float(q[s, d] * o[s, x]), s, d, x)
            for s in keep
            for d in keep
            for x in keep
            if q[s, d] > 0 and o[s, x] > 0
        )
        for top in (1, 6, 25):
            for batch in (1, 2, 5, 256):
                got = table.top(top, exclude=exclude, batch=batch)
                assert [(-t.score, t.source, t.destination, t.output) for t in got] == ref[:top], (exclude, top, batch)
