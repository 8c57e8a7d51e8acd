"""Gossip framing on the wire: bytes captured from the framer before it moved onto
`meshagent.wire.framing` (old and new agents must understand each other)."""

from __future__ import annotations

import pytest

from meshagent.gossip.errors import ExchangeError
from meshagent.gossip.messages import (
    Busy,
    Delta,
    Digest,
    DigestEntry,
    Items,
    decode,
    encode,
    framing,
)
from meshagent.wire.framing import LengthPrefixDecoder

# Produced by the old code from the messages in MESSAGES, in that order.
GOSSIP_DIGEST = bytes.fromhex("0000001da30001010102828466706565722d610307f48466706565722d620002f5")
GOSSIP_DELTA = bytes.fromhex(
    "00000029a600010102038144726563310482456265617431456265617432058006818466706565722d630101f4"
)
GOSSIP_DELTA_FINAL = bytes.fromhex("0000000da6000101020380048005800680")
GOSSIP_BUSY = bytes.fromhex("00000013a300010103076c72617465206c696d69746564")

MESSAGES = [
    (
        Digest((DigestEntry("peer-a", 3, 7, False), DigestEntry("peer-b", 0, 2, True))),
        GOSSIP_DIGEST,
    ),
    (
        Delta(Items((b"rec1",), (b"beat1", b"beat2"), ()), (DigestEntry("peer-c", 1, 1, False),)),
        GOSSIP_DELTA,
    ),
    (Delta(Items()), GOSSIP_DELTA_FINAL),
    (Busy("rate limited"), GOSSIP_BUSY),
]


@pytest.mark.parametrize(("msg", "old"), MESSAGES)
def test_messages_are_framed_as_before(msg, old):
    assert encode(msg) == old


def test_old_messages_decode_in_any_chunking():
    data = b"".join(old for _, old in MESSAGES)
    for step in (1, 3, 17, len(data)):
        frames = LengthPrefixDecoder(framing(2 << 20))
        got = []
        for i in range(0, len(data), step):
            frames.feed(data[i : i + step])
            while (body := frames.next_frame()) is not None:
                got.append(decode(body))
        assert got == [msg for msg, _ in MESSAGES]


def test_a_message_over_the_receivers_limit_is_an_exchange_error():
    frames = LengthPrefixDecoder(framing(40), GOSSIP_DELTA)
    with pytest.raises(ExchangeError, match="gossip message of 41 bytes is over the 40-byte limit"):
        frames.next_frame()
