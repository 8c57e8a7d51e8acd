"""A stage server fed bad messages from upstream: each ends that stream with a protocol error
that names the value, before the engine is touched; the stage serves the next stream."""

from __future__ import annotations

import cbor2
import numpy as np
import pytest
import trio
import trio.testing

from meshagent.serving import stage_messages as sm
from meshagent.serving.sampling import SamplingParams
from meshagent.testing.fake_engine import STATE_BYTES, FakeStage
from tests.serving.stages import fake_server, reply_decoder

GREEDY = SamplingParams(temperature=0.0)


def rows(pos: int, tokens: list[int]) -> np.ndarray:
    """A fake stage's hidden rows: token id, position, padding."""
    out = np.zeros((len(tokens), 4), np.float32)
    out[:, 0], out[:, 1] = tokens, np.arange(pos, pos + len(tokens))
    return out


def forward(seq: int, pos: int, tokens: list[int], sample: bool = True) -> bytes:
    item = sm.ForwardItem(seq, pos, len(tokens), sample)
    return sm.encode(sm.Forward((item,), rows(pos, tokens)))


def raw(header: dict, payload: bytes = b"") -> bytes:
    return sm.FRAMING.encode(cbor2.dumps({sm.K_VERSION: sm.VERSION} | header)) + payload


class LastStage:
    """A fake last stage behind a StageServer; `exchange` sends bytes on a new upstream
    stream and returns what came back on its reply stream."""

    def __init__(self, nursery: trio.Nursery, **server) -> None:
        self.stage = FakeStage(last=True)
        self.nursery = nursery
        self.replies: list[list[sm.Message]] = []
        self.server = fake_server(self.stage, open_reply=self._open_reply, **server)

    async def _open_reply(self):
        a, b = trio.testing.memory_stream_pair()
        got: list[sm.Message] = []
        self.replies.append(got)

        async def read():
            decoder = reply_decoder(self.stage)
            while data := await b.receive_some():
                got.extend(decoder.feed(data))

        self.nursery.start_soon(read)
        return a

    async def exchange(self, data: bytes, expect: int = 1) -> list[sm.Message]:
        up, down = trio.testing.memory_stream_pair()
        before = len(self.replies)
        self.nursery.start_soon(self.server.handle, down)
        await up.send_all(data)
        with trio.fail_after(5):  # (the stream's reply stream opens once the one before ends)
            while len(self.replies) == before or len(self.replies[-1]) < expect:
                await trio.sleep(0.001)
        return self.replies[-1]

    async def serves_on(self) -> None:
        """A well-formed stream after the bad one is answered (the stage is not wedged)."""
        got = await self.exchange(sm.encode(sm.Open(1, GREEDY)) + forward(1, 0, [5, 6, 7]))
        assert [type(m) for m in got] == [sm.Token] and got[0].seq == 1


BAD_UPSTREAM = [
    # A sequence past the slots (llama.cpp asserts seq_id < n_seq and aborts the process).
    ("close", sm.encode(sm.Close(10**6)), "sequence 1000000 is not one of the 4 slots"),
    ("open", sm.encode(sm.Open(4, GREEDY)), "sequence 4 is not one of the 4 slots"),
    ("keep", sm.encode(sm.Keep(7, 1, 16)), "sequence 7 is not one of the 4 slots"),
    ("forward seq", forward(9, 0, [5]), "sequence 9 is not one of the 4 slots"),
    # Positions past a slot's 256.
    ("forward pos", forward(0, 255, [5, 6]), "positions 255-256 of sequence 0 are past"),
    ("keep length", sm.encode(sm.Keep(0, 1, 257)), "a keep's length must be 1-256"),
    (
        "restore length",
        sm.encode(sm.Open(0, GREEDY, restore=(3, 300))),
        "restore length must be 1-256",
    ),
    # Ids past the vocabulary of 40.
    ("history", sm.encode(sm.Open(0, GREEDY, (5, 40))), "holds token 40, not of the vocabulary"),
    (
        "draft",
        sm.encode(sm.Forward((sm.ForwardItem(0, 0, 2, True, (99,)),), rows(0, [5, 6]))),
        "draft must be at most 256 token ids below 40",
    ),
    # Rows of another width than the stage's 4.
    (
        "width",
        sm.encode(sm.Forward((sm.ForwardItem(0, 0, 1, True),), np.zeros((1, 576), np.float32))),
        "576 wide reached a stage 4 wide",
    ),
    # Messages the entry never sends upstream.
    ("token", sm.encode(sm.Token(0, 5)), "type 4 does not come from upstream"),
]


@pytest.mark.parametrize(("what", "data", "why"), BAD_UPSTREAM, ids=[c[0] for c in BAD_UPSTREAM])
async def test_a_value_out_of_range_ends_the_stream_with_a_protocol_error(nursery, what, data, why):
    last = LastStage(nursery)
    got = await last.exchange(sm.encode(sm.Open(0, GREEDY)) + data)
    [failure] = got
    assert isinstance(failure, sm.StageFailure) and failure.seq is None
    assert failure.message.startswith("protocol error: ") and why in failure.message
    assert last.stage.forwards == 0
    await last.serves_on()


async def test_a_payload_over_what_its_type_holds_is_refused_on_its_header(nursery):
    # A Close that says 200 MiB follow: refused at once, nothing of them waited for.
    last = LastStage(nursery)
    got = await last.exchange(raw({sm.K_TYPE: sm.T_CLOSE, sm.K_SEQ: 0, sm.K_SIZE: 200 << 20}))
    assert "carries at most 0 payload bytes" in got[0].message
    # A history longer than a slot: over 4 bytes a position.
    header = {sm.K_TYPE: sm.T_OPEN, sm.K_SEQ: 0, sm.K_HISTORY: True, sm.K_SIZE: 4 * 257}
    got = await last.exchange(raw(header | {sm.K_SAMPLING: {0: 0.0, 1: 1.0, 2: None, 3: 0, 4: 0}}))
    assert "an open carries at most 1024 payload bytes" in got[0].message
    await last.serves_on()


async def test_kept_prefixes_stay_within_the_stages_budget(nursery):
    # Each Keep of 20 positions costs 20 * STATE_BYTES here; the budget holds two of them.
    last = LastStage(nursery, kept_budget=STATE_BYTES * 45)
    prompt = sm.encode(sm.Open(0, GREEDY)) + forward(0, 0, list(range(2, 22)), sample=False)
    keeps = [sm.encode(sm.Keep(0, entry, 20)) for entry in range(3)]
    got = await last.exchange(prompt + b"".join(keeps))
    assert "bring this stage's kept prefixes to 3840 bytes, over its budget of 2880" in (
        got[0].message
    )
    assert last.server.kept_bytes() <= last.server.kept_budget
    # Dropped first, a third fits: the entry's order (Drop before Keep) stays within it.
    again = prompt + b"".join(keeps[:2]) + sm.encode(sm.Drop((0,))) + keeps[2]
    await last.exchange(again + sm.encode(sm.Close(0)) + forward(1, 0, [5]))
    assert set(last.server.book._kept) == {1, 2}


async def test_kept_prefixes_are_counted_too(nursery):
    last = LastStage(nursery, max_kept=2)
    prompt = sm.encode(sm.Open(0, GREEDY)) + forward(0, 0, [5, 6, 7], sample=False)
    keeps = b"".join(sm.encode(sm.Keep(0, entry, 3)) for entry in range(3))
    got = await last.exchange(prompt + keeps)
    assert "kept prefix 2 would be more than the 2 this stage holds" in got[0].message
    assert len(last.server.book._kept) == 2


async def test_an_earlier_stages_failure_reaches_the_entry_with_its_reason(nursery):
    # A middle stage that stopped on a bad message says why downstream; the last stage
    # passes that on to the entry instead of a failure of its own.
    last = LastStage(nursery)
    reason = "protocol error: sequence 9 is not one of the 4 slots"
    got = await last.exchange(sm.encode(sm.StageFailure(None, reason)))
    assert got[0].message == f"protocol error: an earlier stage stopped: {reason}"


async def test_forwards_that_arrive_together_run_in_batches_the_engine_takes(nursery):
    """Prompt chunks of several sequences that arrive at once are batched together only up to
    the rows one forward of the engine takes; each is answered."""
    last = LastStage(nursery)
    last.stage.max_batch_tokens = 8
    opened = sm.encode(sm.Open(0, GREEDY)) + sm.encode(sm.Open(1, GREEDY))
    got = await last.exchange(opened + forward(0, 0, [5] * 6) + forward(1, 0, [6] * 6), expect=2)
    assert [(type(m), m.seq) for m in got] == [(sm.Token, 0), (sm.Token, 1)]
