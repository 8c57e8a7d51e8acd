"""The book of an engine's slots and kept prefixes, on the fake engine: what it keeps it
restores as it was, it cuts a rejected draft's tail, and it holds a peer's asks to limits."""

from __future__ import annotations

import pytest

from meshagent.engine.base import ForwardItem
from meshagent.serving.kv_book import KeptPrefixError, KvBook, measure_kept_size
from meshagent.serving.sampling import SamplingParams
from meshagent.serving.steps import Opened, Save, Step
from meshagent.testing.fake_engine import STATE_BYTES, FakeEngine

TOKENS = [2, 3, 4, 5, 6, 7]


def logits_after(engine: FakeEngine, slot: int, pos: int, token: int):
    [out] = engine.forward([ForwardItem(slot, pos, [token], True)])
    return out


def test_a_kept_prefix_restores_the_slot_as_it_was_up_to_its_length():
    engine = FakeEngine()
    book = KvBook(engine)
    engine.forward([ForwardItem(0, 0, TOKENS, False)])
    book.keep(7, 0, 4)
    assert book.kept == 1 and book.kept_bytes() == 4 * STATE_BYTES
    book.release(0)
    book.restore(1, 7, 3)  # the first 3 of the 4 kept positions
    fresh = FakeEngine()
    fresh.forward([ForwardItem(1, 0, TOKENS[:3], False)])
    assert (logits_after(engine, 1, 3, 9) == logits_after(fresh, 1, 3, 9)).all()
    with pytest.raises(KeptPrefixError, match="kept prefix 8 is not held by this engine"):
        book.restore(2, 8, 1)


def test_a_forward_that_starts_before_a_slots_end_cuts_the_rejected_tail_first():
    engine = FakeEngine()
    book = KvBook(engine)
    book.take(0, 0, 6)
    engine.forward([ForwardItem(0, 0, TOKENS, False)])
    book.take(0, 4, 1)  # positions 4 and 5 were a rejected draft's
    engine.forward([ForwardItem(0, 4, [9], False)])  # the fake raises if they were still in
    book.take(0, 5, 1)
    engine.forward([ForwardItem(0, 5, [9], False)])


def test_limits_refuse_what_a_peer_asks_past_them_and_keep_the_rest():
    engine = FakeEngine()
    book = KvBook(engine, budget=4 * STATE_BYTES, max_kept=2, holder="this stage")
    engine.forward([ForwardItem(0, 0, TOKENS, False)])
    book.keep(1, 0, 3)
    with pytest.raises(KeptPrefixError, match="this stage's kept prefixes to 320 bytes"):
        book.keep(2, 0, 2)
    book.keep(2, 0, 1)
    with pytest.raises(KeptPrefixError, match="more than the 2 this stage holds"):
        book.keep(3, 0, 1)
    assert book.kept == 2 and book.kept_bytes() == 4 * STATE_BYTES
    book.keep(1, 0, 1)  # replacing an entry counts its new size only
    assert book.kept_bytes() == 2 * STATE_BYTES


def test_a_step_frees_evicted_entries_before_it_keeps_and_restores():
    engine = FakeEngine()
    book = KvBook(engine, budget=6 * STATE_BYTES)  # room for one of these at a time
    engine.forward([ForwardItem(0, 0, TOKENS, False)])
    book.keep(1, 0, 6)
    greedy = SamplingParams(temperature=0.0)
    step = Step(
        items=(),
        saves=(Save(0, 2, 6),),
        released=(0,),
        opened=(Opened(5, 1, greedy, restore=(2, 4)),),
        dropped=(1,),
    )
    book.apply(step)  # 1 goes before 2 comes: never two at once
    assert book.kept == 1 and book.kept_bytes() == 6 * STATE_BYTES
    book.take(1, 4, 1)
    engine.forward([ForwardItem(1, 4, [9], False)])  # slot 1 holds the first 4 positions


def test_the_size_of_a_kept_prefix_is_measured_linear_in_its_tokens():
    engine = FakeEngine()

    def prefill(slot, tokens):
        engine.forward([ForwardItem(slot, 0, tokens, False)])

    size = measure_kept_size(engine, prefill, TOKENS)
    assert [size(n) for n in (1, 6, 100)] == [STATE_BYTES, 6 * STATE_BYTES, 100 * STATE_BYTES]
    double = measure_kept_size(engine, prefill, TOKENS, scale=2.0)
    assert double(10) == 20 * STATE_BYTES
