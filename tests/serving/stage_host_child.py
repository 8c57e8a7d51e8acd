"""A stage host in a process of its own, for tests of what would kill one: the last stage
of a two-stage split over a StageServer, fed a few upstream streams in turn. Prints, as JSON,
what came back on each stream's reply stream.

    python -m tests.serving.stage_host_child '{"first": ..., "last": ..., "entry": ...,
        "tokens": [...], "n_vocab": ..., "bad": ["close", ...]}'
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import trio
import trio.testing

from meshagent.engine.runtime import EmbdItem
from meshagent.engine.stage import StageEngine
from meshagent.models.slicer import TokenEmbeddings
from meshagent.serving import stage_messages as sm
from meshagent.serving.sampling import SamplingParams
from meshagent.serving.stage_server import StageServer

SLOTS, CTX, CUT, LAYERS = 2, 256, 15, 30
GREEDY = SamplingParams(temperature=0.0)
FAR = 10**6  # a sequence id far past the slots


def bad_streams(width: int) -> dict[str, bytes]:
    hidden = np.zeros((1, width), np.float32)
    return {
        "close": sm.encode(sm.Close(FAR)),
        "keep": sm.encode(sm.Open(0, GREEDY)) + sm.encode(sm.Keep(FAR, 1, 1)),
        "forward": sm.encode(sm.Forward((sm.ForwardItem(FAR, 0, 1, True),), hidden)),
        "position": sm.encode(sm.Forward((sm.ForwardItem(0, 10**6, 1, True),), hidden)),
    }


async def exchange(server: StageServer, replies: list[list], data: bytes) -> list:
    before = len(replies)
    up, down = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.handle, down)
        await up.send_all(data)
        with trio.move_on_after(30):
            while len(replies) == before or not replies[-1]:
                await trio.sleep(0.01)
        await up.aclose()
    return replies[-1] if len(replies) > before else []


async def main(args: dict) -> list:
    first = StageEngine(Path(args["first"]), start=0, end=CUT, total_layers=LAYERS, slots=SLOTS,
                        slot_ctx=CTX, threads=1)  # fmt: skip
    last = StageEngine(Path(args["last"]), start=CUT, end=LAYERS, total_layers=LAYERS, slots=SLOTS,
                       slot_ctx=CTX, threads=1)  # fmt: skip
    tokens = args["tokens"]
    out = first.forward([EmbdItem(0, 0, TokenEmbeddings(Path(args["entry"]))(tokens))])
    assert out.hidden is not None
    replies: list[list] = []

    async def open_reply():
        a, b = trio.testing.memory_stream_pair()
        got: list = []
        replies.append(got)

        async def read():
            decoder = sm.StageDecoder(sm.StageLimits(SLOTS, CTX, args["n_vocab"]))
            while data := await b.receive_some():
                got.extend(decoder.feed(data))

        nursery.start_soon(read)
        return a

    async with trio.open_nursery() as nursery:
        server = StageServer(last, n_vocab=args["n_vocab"], kept_budget=1 << 24,
                             open_next=None, open_reply=open_reply)  # fmt: skip
        good = sm.encode(sm.Open(0, GREEDY)) + sm.encode(
            sm.Forward((sm.ForwardItem(0, 0, len(tokens), True),), out.hidden[0], (), CUT)
        )
        results = []
        for name in args["bad"]:
            got = await exchange(server, replies, bad_streams(last.n_embd)[name])
            results.append([_said(m) for m in got])
        results.append([_said(m) for m in await exchange(server, replies, good)])
        await server.aclose()
        nursery.cancel_scope.cancel()
    return results


def _said(msg: sm.Message) -> list:
    if isinstance(msg, sm.Token):
        return ["token", msg.seq, msg.token]
    assert isinstance(msg, sm.StageFailure)
    return ["failure", msg.seq, msg.message]


if __name__ == "__main__":
    print(json.dumps(trio.run(main, json.loads(sys.argv[1]))), flush=True)
