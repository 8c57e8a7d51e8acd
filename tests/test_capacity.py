"""The memory an agent offers: one total, carried as two record fields, read back as one."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from meshagent.capacity import RESERVE_BYTES, MemoryOffer, memory_offer, offered_memory
from meshagent.gossip.peer_record import PeerRecord
from meshagent.identity.keys import NodeIdentity

GIB = 1 << 30


@given(st.integers(0, 1 << 50))
def test_a_total_split_for_the_wire_adds_back_up(total):
    offer = MemoryOffer.split(total)
    assert offer.total == total
    assert offer.weights >= 3 * offer.kv - 3


def test_measured_memory_is_what_is_available_less_the_reserve():
    assert memory_offer(9 * GIB).total == 9 * GIB - 10**9  # 1 GB kept back
    assert memory_offer(RESERVE_BYTES // 2).total == 0


def test_a_limit_caps_the_total_and_is_split_3_to_1():
    assert memory_offer(9 * GIB, limit=80_000_000) == MemoryOffer(60_000_000, 20_000_000)
    assert memory_offer(2 * GIB, limit=4 * GIB).total == 2 * GIB - 10**9  # a cap above it


def test_configured_parts_replace_the_measured_ones_under_the_cap():
    kv = MemoryOffer.split(9 * GIB - 10**9).kv  # the measured part, 3:1 of what is left
    assert memory_offer(9 * GIB, weights=GIB) == MemoryOffer(GIB, kv)
    assert memory_offer(9 * GIB, weights=GIB, kv=GIB, limit=GIB).total == GIB


def test_the_total_is_read_back_from_a_record_as_any_agent_sent_it():
    ident = NodeIdentity.generate()
    sent = memory_offer(9 * GIB, limit=300_000_000)
    record = PeerRecord(
        ident.peer_id, ident.public_key, 1, mem_weights_bytes=sent.weights, mem_kv_bytes=sent.kv
    )
    assert offered_memory(PeerRecord.from_body(record.to_body())) == 300_000_000
    # An agent that split its offer some other way is read the same: only the sum counts.
    other = PeerRecord(ident.peer_id, ident.public_key, 2, mem_weights_bytes=5, mem_kv_bytes=7)
    assert offered_memory(other) == 12
