"""Tasks and files: AutoCircuit's JSON and EAP-IG's CSV read into the same task, the built-in induction and
IOI tasks built as described, ground-truth files in three spellings, MIB's submission shape, and the
one-line errors (pairs of unequal length, answers that are not one token, unknown nodes)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

from qkov import QkovError, Transformer, as_source
from qkov.analysis.discovery import (
    AnswerMetric, Circuit, edge_scores, graph_of, induction_task, ioi_task, load_task, mib_graph, read_ground_truth,
    Task, to_qkov, top_n,
)  # fmt: skip
from qkov.analysis.discovery.ioi_words import BABA, NAMES, OBJECTS, PLACES

from edge_reference import random_case
from hand_built import hand_built
from helpers import LN_MLP
from tokenizers_like import gpt2_tokenizer


@pytest.fixture(scope="module")
def worded() -> Transformer:
    """A small GPT-2-like model whose byte-level tokenizer reads every IOI name as one token."""
    g = torch.Generator().manual_seed(0)
    pick = lambda xs: xs[int(torch.randint(len(xs), (1,), generator=g))]  # noqa: E731
    fill = lambda t: t.replace("[A]", pick(NAMES)).replace("[B]", pick(NAMES))  # noqa: E731
    texts = [fill(t).replace("[PLACE]", pick(PLACES)).replace("[OBJECT]", pick(OBJECTS)) for t in BABA * 60]
    texts += [f"{n} and {n}, {n}." for n in NAMES for _ in range(20)]
    tok = gpt2_tokenizer(900, texts=texts)
    m = Transformer(LN_MLP.replace(d_vocab=tok.get_vocab_size(), n_ctx=32, positional="standard"), seed=0)
    m.tokenizer, m.bos_token_id = tok, tok.token_to_id("<|endoftext|>")
    return m


def test_autocircuit_json_and_eap_ig_csv_read_into_the_same_task(tmp_path: Path, worded: Transformer) -> None:
    prompts = [
        {"clean": "Then, Mary and John went to the store. John gave a drink to",
         "corrupt": "Then, Lisa and Paul went to the store. Mark gave a drink to",
         "answers": [" Mary"], "wrong_answers": [" John"]},
        {"clean": "When Amy and Sean got a ring", "corrupt": "When Erin and Kyle got a ring", "answers": ["Amy"],
         "wrong_answers": ["Sean"]},
    ]  # fmt: skip
    (tmp_path / "t.json").write_text(json.dumps({"prompts": prompts}))
    with (tmp_path / "t.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, ["clean", "corrupted", "correct_idx", "incorrect_idx"])
        w.writeheader()
        codec = worded.codec
        for p in prompts:
            ids = [codec.single_token(p["answers"][0]), codec.single_token(p["wrong_answers"][0])]
            w.writerow({"clean": p["clean"], "corrupted": p["corrupt"], "correct_idx": ids[0], "incorrect_idx": ids[1]})
    a, b = load_task(tmp_path / "t.json", worded), load_task(tmp_path / "t.csv", worded)
    for x in ("clean", "corrupted", "answers", "wrong", "lengths"):
        assert torch.equal(getattr(a, x), getattr(b, x)), x
    assert (
        a.lengths.tolist() == [len(codec.encode(p["clean"])) for p in prompts] and a.clean[0, 0] == worded.bos_token_id
    )
    assert a.one_length is None and len(list(a.batches(8))) == 2  # two lengths: two batches
    ids = {"prompts": [{"clean": [1, 2, 3], "corrupt": [1, 4, 3], "answers": [5], "wrong_answers": [6]}]}
    (tmp_path / "ids.json").write_text(json.dumps(ids))
    t = load_task(tmp_path / "ids.json", worded, metric="prob")
    assert t.clean.tolist() == [[1, 2, 3]] and t.answers.tolist() == [[5]] and t.metric == "prob"


def test_task_mistakes_are_one_line_errors(tmp_path: Path, worded: Transformer) -> None:
    def bad(data: object, says: str, name: str = "bad.json") -> None:
        (tmp_path / name).write_text(json.dumps(data) if not isinstance(data, str) else data)
        with pytest.raises(QkovError, match=says) as e:
            load_task(tmp_path / name, worded)
        assert "\n" not in str(e.value)

    bad(
        {"prompts": [{"clean": "Mary and John", "corrupt": "Mary and John and", "answers": [" Mary"]}]},
        "have 4 and 5 tokens; each pair must have one length",
    )
    bad(
        {"prompts": [{"clean": "Mary", "corrupt": "John", "answers": [" Maryjohnx"]}]},
        "the answer ' Maryjohnx' is not a single token",
    )
    bad({"prompts": [{"clean": "Mary"}]}, "prompt 0 has no corrupt, answers")
    bad({"items": []}, "expected AutoCircuit's")
    bad("clean,corrupted\na,b\n", "no answer column", "bad.csv")
    with pytest.raises(QkovError, match="neither a file nor a built-in task"):
        load_task("nosuch.json", worded)
    with pytest.raises(QkovError, match="the metric is one of"):
        load_task("induction", worded, metric="accuracy")
    w, task = random_case("gpt2-like")
    with pytest.raises(QkovError, match="per-position edges needs prompts of one length"):
        edge_scores(
            w,
            Task("t", task.clean, task.corrupted, task.answers, task.wrong, lengths=torch.tensor([7, 7, 6, 7])),
            per_position=True,
        )
    with pytest.raises(QkovError, match="must pair up with equal lengths"):
        Task("t", task.clean, task.corrupted[:, :-1], task.answers, task.wrong)
    with pytest.raises(QkovError, match="outside the model's vocabulary"):
        Task("t", task.clean + 100, task.corrupted, task.answers, task.wrong).check(w.cfg)


def test_the_induction_task_repeats_random_tokens_and_breaks_the_match() -> None:
    m = hand_built()
    t = induction_task(m, 6, half=5, seed=1)
    assert t.clean.shape == (6, 10) and bool((t.clean[:, 0] == m.bos_token_id).all())
    r = t.clean[:, 1:6]
    assert torch.equal(t.clean[:, 6:], r[:, :-1]) and torch.equal(t.answers[:, 0], r[:, -1])
    diff = (t.clean != t.corrupted).nonzero()[:, 1]
    assert diff.tolist() == [4] * 6 and torch.equal(t.wrong[:, 0], t.corrupted[:, 4])  # the earlier r_{k-1} replaced
    assert all(len(set(row.tolist())) == 5 for row in r) and not bool((t.wrong[:, 0][:, None] == r).any())
    assert load_task("induction", m, n=3).clean.shape[0] == 3


def test_the_ioi_task_fills_wang_et_al_templates(worded: Transformer) -> None:
    t = ioi_task(worded, 30, seed=2)
    codec = worded.codec
    assert len(t) == 30 and t.texts is not None and t.one_length is None
    abba = baba = 0
    for i in range(len(t)):
        T = int(t.lengths[i])
        text, io, s = t.texts[i], codec.token_str(int(t.answers[i, 0])), codec.token_str(int(t.wrong[i, 0]))
        assert text.endswith(" to") and text.count(io) == 1 and text.count(s) == 2  # IO once, the subject twice
        first = text.index(io) < text.index(s)
        abba, baba = abba + first, baba + (not first)
        changed = (t.clean[i, :T] != t.corrupted[i, :T]).nonzero()[:, 0].tolist()
        assert len(changed) == 3  # the three names, nothing else
        assert {codec.token_str(int(x)) for x in t.corrupted[i, changed]}.isdisjoint({io, s})
    assert abba and baba
    no_names = Transformer(LN_MLP, seed=0)
    with pytest.raises(QkovError, match="the IOI task: this model has no tokenizer"):
        ioi_task(no_names)


def test_ground_truth_files_in_every_spelling_and_mib_output(tmp_path: Path) -> None:
    w, task = random_case("gpt2-like")
    g = graph_of(w.cfg)
    edges = ["embed -> 0.1<q>", "0.0 -> mlp.1", "mlp.1 -> logits"]
    spellings = {
        "q.json": edges,
        "mib.json": {"edges": {"input->a0.h1<q>": {"in_graph": True}, "a0.h0->m1": {"in_graph": True},
                               "m1->logits": {"in_graph": True}, "m0->logits": {"in_graph": False}}},
        "ac.txt": "# AutoCircuit's names\nResid Start->A0.1.Q\nA0.0->MLP 1\nMLP 1->Resid End\n",
    }  # fmt: skip
    for name, data in spellings.items():
        (tmp_path / name).write_text(data if isinstance(data, str) else json.dumps(data))
        assert read_ground_truth(tmp_path / name) == edges, name
    assert to_qkov("a1.h0") == "1.0" and to_qkov("MLP 0") == "mlp.0" and to_qkov("A1.0.K") == "1.0<k>"
    s = edge_scores(w, task)
    circuit = top_n(s, 5)
    mib = mib_graph(s, circuit)
    assert len(mib["edges"]) == g.n_edges and sum(e["in_graph"] for e in mib["edges"].values()) == 5
    assert set(mib["nodes"]) == {"input", "a0.h0", "a0.h1", "m0", "a1.h0", "a1.h1", "m1", "logits"}
    name = mib_name_of(g, 0)
    assert mib["edges"][name]["score"] == pytest.approx(float(s.importance[0]))
    back = Circuit.of(g, [to_qkov(k) for k, v in mib["edges"].items() if v["in_graph"]])
    assert torch.equal(back.edges, circuit.edges)
    (tmp_path / "unknown.json").write_text(json.dumps(["a5.h0->logits"]))
    from qkov.analysis.discovery import circuit_roc

    with pytest.raises(QkovError, match="ground truth: the model has no head 5.0"):
        circuit_roc(s, read_ground_truth(tmp_path / "unknown.json"))


def mib_name_of(g, i):  # type: ignore[no-untyped-def]
    from qkov.analysis.discovery import mib_name

    return mib_name(g.edge(i))


def test_metrics_measure_what_they_say() -> None:
    w, task = random_case("gpt2-like", n=3, T=5)
    from qkov import trace

    run = trace(w, task.clean)
    logits = run.logits[:, -1]
    rows = torch.arange(3)
    lp = logits.log_softmax(-1)
    want = {
        "logit-diff": (logits.gather(1, task.answers).mean(1) - logits.gather(1, task.wrong).mean(1)).mean(),
        "prob": lp.gather(1, task.answers).exp().mean(1).mean(),
        "loss": -lp.gather(1, task.answers).mean(1).mean(),
    }
    for kind, v in want.items():
        assert abs(float(task.with_metric(kind).answer_metric(rows)(run)) - float(v)) < 1e-12
    kl = AnswerMetric(kind="kl", answers=task.answers, wrong=task.wrong).with_reference(run)
    assert abs(float(kl(run))) < 1e-12
    other = trace(w, task.corrupted)
    p, q = lp.exp(), other.logits[:, -1].log_softmax(-1)
    assert abs(float(kl(other)) - float((p * (lp - q)).sum(-1).mean())) < 1e-12
    assert as_source(w) is w
