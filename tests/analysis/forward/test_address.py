"""Address: one type for a site, a head, a head's input and an edge; one parser and one error wording,
shared by the library, the command line and the explorer."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from qkov import QkovError
from qkov.analysis.forward.address import HEAD, Address, as_head, parse_heads
from qkov.apps.cli.common import parse_head
from qkov.apps.explore.context import BadRequest, Explorer

GQA = SimpleNamespace(n_layers=2, n_heads=4, kv_heads=2)  # two query heads per key/value head


@pytest.mark.parametrize(
    "text, want",
    [
        ("1.0", Address(HEAD, 1, 0)),
        ("1.3<k>", Address(HEAD, 1, 3, "k")),
        ("z.0.3", Address("z", 0, 3)),
        ("pattern.1", Address("pattern", 1)),
        ("logits", Address("logits")),
        ("0.1 -> 1.0<k>", Address(HEAD, 1, 0, "k", Address(HEAD, 0, 1))),
        ("0.1 -> logits", Address("logits", sender=Address(HEAD, 0, 1))),
        ("embed -> 1.2<q>", Address(HEAD, 1, 2, "q", Address("embed"))),
    ],
)
def test_every_written_form_reads_back_as_written(text: str, want: Address) -> None:
    got = Address.parse(text)
    assert got == want and got.name == text and str(got) == text
    assert Address.parse(got.name) == got  # the written form is the parser's input
    assert got.is_edge == ("->" in text) and got.is_head == (text in ("1.0",))
    assert Address.parse(" 0.1->1.0 < k > ") == Address.parse("0.1 -> 1.0<k>")  # spacing is free


def test_an_edge_is_its_receiver_with_a_sender() -> None:
    s, r = Address.of_head(0, 1), Address.of_head(1, 0)
    e = Address.edge(s, r, "k")
    assert e == Address.parse("0.1 -> 1.0<k>") and e.receiver == Address.parse("1.0<k>") and e.sender == s
    assert e.check(GQA) is e
    # the site an input is read from: a key or value input is its key/value head's slot (grouped-query)
    assert Address.parse("0.1 -> 1.3<k>").input_site(GQA) == Address("k_input", 1, 1)
    assert Address.parse("0.1 -> 1.3<v>").input_site(GQA) == Address("v_input", 1, 1)
    assert Address.parse("0.1 -> 1.3<q>").input_site(GQA) == Address("q_input", 1, 3)
    with pytest.raises(QkovError, match="not a head's query, key or value input"):
        Address.parse("1.3").input_site(GQA)


@pytest.mark.parametrize(
    "text, says",
    [
        ("1", "'1' is not an address"),
        ("0.1 -> 1.0<o>", "a head's input is q, k or v, got <o>"),
        ("0.1<k> -> 1.0", "an edge's sender is a head or a site, not an input"),
        ("z.0<k>", "is not an address"),
    ],
)
def test_unreadable_addresses_are_one_line_errors(text: str, says: str) -> None:
    with pytest.raises(QkovError, match=says) as err:
        Address.parse(text, "edges")
    assert str(err.value).startswith("edges: ") and "\n" not in str(err.value)


def test_checks_against_a_model() -> None:
    for text, says in [
        ("2.0", r"edges: the model has no head 2\.0 \(2 layers of 4 heads\)"),
        ("0.1 -> 1.4<k>", "no head 1.4"),
        ("1.0 -> 0.1<k>", r"in 1\.0 -> 0\.1<k> the sender 1\.0 must come before the receiver's layer 0"),
        ("1.0 -> 1.1<k>", "must come before"),
    ]:
        with pytest.raises(QkovError, match=says):
            Address.parse(text).check(GQA, "edges")


def test_a_head_given_any_way_is_one_address() -> None:
    want = Address.of_head(1, 3)
    for given in ["1.3", " 1.3 ", (1, 3), [1, 3], want]:
        assert as_head(given, GQA) == want
    assert parse_heads("1.0, 0.1,1.0", GQA) == [Address.of_head(1, 0), Address.of_head(0, 1)]  # in order, once
    assert parse_heads([(1, 0), "0.2", Address.of_head(1, 0)]) == [Address.of_head(1, 0), Address.of_head(0, 2)]
    assert parse_heads((1, 0)) == parse_heads(want._replace(head=0)) == parse_heads("1.0") == [Address.of_head(1, 0)]
    for bad in ["x", "1", "1.0<k>", "0.1 -> 1.0", (1.5, 0), (True, 0), (1, 2, 3), None]:
        with pytest.raises(QkovError, match="is not a head; write LAYER.HEAD, e.g. 1.0"):
            as_head(bad, GQA, "heads")  # type: ignore[arg-type]
    with pytest.raises(QkovError, match="heads: no heads given"):
        parse_heads(" , ", GQA)
    with pytest.raises(QkovError, match="heads: 5 is not a head"):
        parse_heads(5, GQA)  # type: ignore[arg-type]


def test_the_library_the_command_line_and_the_explorer_say_it_alike() -> None:
    """One parser: the same mistake reads the same everywhere, only the prefix names the caller (a
    command-line flag, an explorer argument, an analysis); the explorer answers 400 for a malformed
    head and 404 for one the model lacks."""
    explorer = SimpleNamespace(model=SimpleNamespace(cfg=GQA), cfg=GQA)
    for text, says, status in [("1x", "'1x' is not a head; write LAYER.HEAD, e.g. 1.0", 400),
                               ("3.0", "the model has no head 3.0 (2 layers of 4 heads)", 404)]:  # fmt: skip
        with pytest.raises(QkovError) as lib:
            parse_heads(text, GQA, "ablate")
        with pytest.raises(QkovError) as cli:
            parse_head(text, GQA)  # type: ignore[arg-type]
        with pytest.raises(BadRequest) as web:
            Explorer.head(explorer, {"head": text})  # type: ignore[arg-type]
        assert str(lib.value) == f"ablate: {says}" and str(cli.value) == f"--head: {says}"
        assert str(web.value) == f"'head': {says}" and web.value.status == status
