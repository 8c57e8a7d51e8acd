"""The catalogue's book: the winning operation per name, whatever order entries arrive in;
tombstones hold a removal against older adds for 7 days; the book and what is gossiped are
bounded."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshagent.catalog.book import (
    MAX_GOSSIPED,
    MAX_KEPT,
    TOMBSTONE_TTL,
    CatalogBook,
)
from meshagent.catalog.entry import CatalogEntry, SignedEntry
from meshagent.errors import CatalogError
from meshagent.identity.keys import NodeIdentity
from tests.catalog.support import T0, signed_add, signed_remove

A, B, C = (NodeIdentity.generate() for _ in range(3))
NOW = T0 + 60.0


def test_the_highest_version_wins():
    book = CatalogBook([signed_add(A, version=1), signed_add(B, version=2, size=99)], now=NOW)
    assert book.live()["tiny-llama"].author == B.peer_id
    assert book.live()["tiny-llama"].entry.size == 99


def test_on_the_same_version_the_higher_author_wins():
    a, b = signed_add(A, version=3, size=1), signed_add(B, version=3, size=2)
    winner = max(a, b, key=lambda s: s.author)
    assert CatalogBook([a, b], now=NOW).winner("tiny-llama") == winner
    assert CatalogBook([b, a], now=NOW).winner("tiny-llama") == winner


def test_a_tombstone_beats_an_older_add_heard_after_it():
    book = CatalogBook([signed_remove(B, version=2)], now=NOW)
    assert not book.merge([signed_add(A, version=1)], now=NOW)
    assert book.live() == {}
    assert book.winner("tiny-llama").entry.op == "remove"


def test_an_add_after_a_removal_brings_the_model_back():
    book = CatalogBook([signed_add(A, version=1), signed_remove(B, version=2)], now=NOW)
    assert book.live() == {}
    assert book.next_version("tiny-llama") == 3
    assert book.merge([signed_add(C, version=3)], now=NOW)
    assert book.live()["tiny-llama"].author == C.peer_id


def test_names_are_compared_without_case():
    book = CatalogBook([signed_add(A, name="Tiny-Llama", version=1)], now=NOW)
    book.merge([signed_remove(B, name="tiny-llama", version=2)], now=NOW)
    assert book.live() == {}
    assert book.next_version("TINY-LLAMA") == 3


def test_merging_again_changes_nothing():
    entries = [signed_add(A, version=1), signed_remove(B, version=2)]
    book = CatalogBook(entries, now=NOW)
    assert not book.merge(entries, now=NOW)
    assert not book.merge([], now=NOW)


def test_a_tombstone_is_dropped_after_seven_days_and_an_older_add_may_then_return():
    book = CatalogBook([signed_remove(B, version=2, time=T0)], now=NOW)
    assert not book.expire(now=T0 + TOMBSTONE_TTL)
    assert book.expire(now=T0 + TOMBSTONE_TTL + 1)
    assert len(book) == 0
    later = T0 + TOMBSTONE_TTL + 2
    # An expired tombstone heard from a peer is not taken either.
    assert not book.merge([signed_remove(B, version=2, time=T0)], now=later)
    assert book.merge([signed_add(A, version=1)], now=later)
    assert "tiny-llama" in book.live()


def test_an_add_does_not_expire():
    book = CatalogBook([signed_add(A, time=T0)], now=NOW)
    assert not book.expire(now=T0 + 100 * TOMBSTONE_TTL)
    assert "tiny-llama" in book.live()


def test_the_version_past_the_last_is_refused_naming_who_set_it():
    book = CatalogBook([signed_add(A, version=2**32 - 1)], now=NOW)
    with pytest.raises(CatalogError, match=A.peer_id):
        book.next_version("tiny-llama")


def test_what_is_gossiped_is_bounded_adds_first_then_the_newest_tombstones():
    adds = [signed_add(A, name=f"model-{i}", time=T0 + i) for i in range(40)]
    removals = [signed_remove(B, name=f"gone-{i}", time=T0 + i) for i in range(10)]
    book = CatalogBook(adds + removals, now=NOW)
    gossiped = book.gossiped()
    assert len(gossiped) == MAX_GOSSIPED
    assert all(s.entry.op == "add" for s in gossiped)
    assert {s.entry.name for s in gossiped} == {f"model-{i}" for i in range(8, 40)}
    book = CatalogBook(adds[:30] + removals, now=NOW)
    names = [s.entry.name for s in book.gossiped()]
    assert names[30:] == ["gone-9", "gone-8"]


def test_the_book_keeps_at_most_its_bound_of_names():
    removals = [signed_remove(B, name=f"gone-{i}", time=T0 + i) for i in range(MAX_KEPT + 20)]
    book = CatalogBook(removals, now=NOW)
    assert len(book) == MAX_KEPT
    assert book.winner("gone-0") is None and book.winner(f"gone-{MAX_KEPT + 19}") is not None


# Operations on a few names, by a few authors: what every agent may hear, in any order.
_ops = st.tuples(
    st.sampled_from(["m-a", "m-b", "M-A"]),
    st.sampled_from(["add", "remove"]),
    st.integers(1, 4),
    st.sampled_from([A, B, C]),
    st.integers(0, 3),
)


def _signed(op: tuple) -> SignedEntry:
    name, kind, version, who, size = op
    if kind == "add":
        return signed_add(who, name=name, version=version, size=1 + size)
    return CatalogEntry.remove(name, version=version, time=T0).sign(who)


@settings(max_examples=150, deadline=None)
@given(st.lists(_ops, min_size=1, max_size=12), st.randoms(use_true_random=False))
def test_every_order_and_grouping_gives_the_same_book(ops, rng):
    entries = [_signed(op) for op in ops]
    whole = CatalogBook(entries, now=NOW)
    shuffled = entries[:]
    rng.shuffle(shuffled)
    one_by_one = CatalogBook([], now=NOW)
    for s in shuffled:
        one_by_one.merge([s, s], now=NOW)  # twice: idempotent
    # Two agents each hear a part, then hear each other's book.
    cut = rng.randrange(len(entries) + 1)
    left, right = CatalogBook(shuffled[:cut], now=NOW), CatalogBook(shuffled[cut:], now=NOW)
    left.merge(right.gossiped(), now=NOW)
    assert whole.entries() == one_by_one.entries() == left.entries()
    for name in ("m-a", "m-b"):
        held = [s for s in entries if s.entry.name.casefold() == name]
        if held:
            assert whole.winner(name) == max(held, key=lambda s: s.rank)
