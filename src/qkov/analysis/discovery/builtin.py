"""Tasks that need no download: induction on repeated random tokens (any model) and an IOI-style
generator (a tokenizer that reads common first names as single tokens, as GPT-2's does).

**Induction** (Olsson et al. 2022): each clean prompt is ``k`` distinct random tokens ``r_1 .. r_k``
followed by ``r_1 .. r_{k-1}``; an induction head at the last token (``r_{k-1}``) finds its earlier
occurrence and copies the token after it, the answer ``r_k``. The corrupted prompt breaks that match:
the earlier ``r_{k-1}`` is replaced by another token ``x`` (the wrong answer), so no earlier token is
preceded by the last one. Only the previous-token information differs at the position the induction
head should attend to, so the difference travels the induction circuit: the input into a
previous-token head's values, that head into the induction head's key input, the induction head into
the logits. Metric: logit difference. The start token comes first when the model reads texts with one.

**IOI** (Wang et al. 2022): "When Mary and John went to the store, John gave a drink to" -> " Mary"
(the indirect object) against " John" (the subject), from the templates, names, places and objects of
:mod:`.ioi_words`, half with the subject introduced first (BABA), half second (ABBA). The corrupted
prompt is Wang et al.'s ABC distribution: the same sentence with three other names. Metric: logit
difference.
"""

from __future__ import annotations

from typing import Any

import torch

from ...errors import QkovError
from ...model.tokens import left_out_tokens, source_codec
from .ioi_words import BABA, NAMES, OBJECTS, PLACES
from .task import Task

__all__ = ["BUILT_IN_TASKS", "induction_task", "ioi_task"]

BUILT_IN_TASKS = ("induction", "ioi")


def _start(source: Any) -> list[int]:
    """The start token when the model reads texts with one."""
    bos = getattr(source, "bos_token_id", None)
    return [int(bos)] if bos is not None and getattr(source, "default_prepend_bos", True) else []


def induction_task(source: Any, n: int = 32, *, half: int = 8, seed: int = 0) -> Task:
    """``n`` induction prompt pairs with ``half`` random tokens before the repeat (see the module docstring)."""
    cfg = source.cfg
    start = _start(source)
    half = min(half, (cfg.n_ctx - len(start) + 1) // 2)
    if half < 2 or n < 1:
        raise QkovError(f"induction task: needs at least 2 tokens to repeat and 1 prompt (context {cfg.n_ctx})")
    left_out, _ = left_out_tokens(source, cfg.d_vocab)
    allowed = torch.ones(cfg.d_vocab, dtype=torch.bool)
    allowed[list(left_out)] = False
    pool = allowed.nonzero()[:, 0]
    if len(pool) < half + 1:
        raise QkovError(
            f"induction task: {half} repeated tokens need {half + 1} distinct token ids, the model has {len(pool)}"
        )
    g = torch.Generator().manual_seed(seed)
    clean, corrupted, answers, wrong = [], [], [], []
    for _ in range(n):
        pick = pool[torch.randperm(len(pool), generator=g)[: half + 1]].tolist()
        r, x = pick[:half], pick[half]
        clean.append(start + r + r[:-1])
        corrupted.append(start + r[:-2] + [x, r[-1]] + r[:-1])
        answers.append([r[-1]])
        wrong.append([x])
    return Task(f"induction ({half} repeated random tokens)", clean, corrupted, answers, wrong)


def ioi_task(source: Any, n: int = 32, *, seed: int = 0) -> Task:
    """``n`` IOI prompt pairs (see the module docstring); a one-line error when the model has no
    tokenizer or too few of the names are single tokens."""
    codec = source_codec(source, where="the IOI task")
    single = [name for name in NAMES if len(codec.plain(" " + name)) == 1]
    if len(single) < 5:
        raise QkovError(
            f"the IOI task needs first names the tokenizer reads as one token (GPT-2's has {len(NAMES)} of them); "
            f"this one has {len(single)}"
        )
    g = torch.Generator().manual_seed(seed)
    rand = lambda k: int(torch.randint(k, (1,), generator=g))  # noqa: E731
    rows: list[tuple[list[int], list[int], int, int, str]] = []
    for i in range(n):
        template = BABA[i % len(BABA)]
        if rand(2):  # ABBA: the subject introduced second
            template = template.replace("[B] and [A]", "[A] and [B]", 1)
        a, b, x, y, z = (single[j] for j in torch.randperm(len(single), generator=g)[:5].tolist())
        place, obj = PLACES[rand(len(PLACES))], OBJECTS[rand(len(OBJECTS))]
        text = _fill(template, a, b, b, place, obj)
        abc = _fill(template, x, y, z, place, obj)
        ids, bad = codec.encode(text), codec.encode(abc)
        if len(ids) != len(bad):  # a name that merged with its neighbour: skip the sentence
            continue
        rows.append((ids, bad, codec.plain(" " + a)[0], codec.plain(" " + b)[0], text))
    if not rows:
        raise QkovError("the IOI task: no sentence kept its length with other names; this tokenizer is not GPT-2's")
    T = max(len(r[0]) for r in rows)
    pad = lambda ids: ids + [0] * (T - len(ids))  # noqa: E731
    return Task(
        "IOI (Wang et al. templates; corrupted: three other names)",
        [pad(r[0]) for r in rows], [pad(r[1]) for r in rows], [[r[2]] for r in rows], [[r[3]] for r in rows],
        lengths=torch.tensor([len(r[0]) for r in rows]), texts=[r[4] for r in rows],
    )  # fmt: skip


def _fill(template: str, a: str, b: str, s2: str, place: str, obj: str) -> str:
    """The template with its names filled: ``a`` for ``[A]``, ``b`` for the introduced ``[B]``, ``s2`` for
    the later ``[B]`` (the subject named again)."""
    first = template.index("[B]")
    text = template[: first + 3].replace("[B]", b) + template[first + 3 :].replace("[B]", s2)
    return text.replace("[A]", a).replace("[PLACE]", place).replace("[OBJECT]", obj)
