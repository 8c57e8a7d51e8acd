"""Surviving a lost stage, on fakes: a request whose chain breaks is replayed on the chain
that serves next and gives exactly the text it would have given (greedy, and seeded at
temperature > 0); a chain that does not come back fails the request at the deadline; the
pieces (samplers that resume, Open with history, the scheduler's replayed submit) on their own.
"""

from __future__ import annotations

import numpy as np
import pytest
import structlog
import trio
import trio.testing

from meshagent.errors import SplitUnavailable
from meshagent.serving import stage_messages as sm
from meshagent.serving.chain import Outgoing
from meshagent.serving.local_model import LocalModel
from meshagent.serving.sampling import Sampler, SamplingParams
from meshagent.serving.scheduler import Scheduler
from meshagent.testing.fake_engine import FakeEngine, FakeStage
from tests.serving.stages import SameRoute, fake_server, reply_decoder
from tests.serving.test_pipeline_fake import FakeChain
from tests.serving.test_runner import complete

GREEDY = SamplingParams(temperature=0.0)
WARM = SamplingParams(temperature=0.8, top_p=0.95, seed=1234, presence_penalty=0.3)
PROMPT = "alpha"
TOKENS = 120


# ----- the pieces -----


@pytest.mark.parametrize(
    "params",
    [WARM, SamplingParams(temperature=1.0, seed=-5, frequency_penalty=0.5), GREEDY],
)
def test_a_sampler_resumed_from_history_continues_exactly(params):
    rng = np.random.default_rng(0)
    steps = [rng.normal(size=300).astype(np.float32) for _ in range(40)]
    first = Sampler(params)
    alone = [first.sample(x) for x in steps]
    for cut in (1, 17, 39):
        again = Sampler(params, history=alone[:cut])
        assert [again.sample(x) for x in steps[cut:]] == alone[cut:]


def test_unseeded_requests_get_a_seed_and_greedy_ones_need_none():
    seeded = SamplingParams(temperature=0.7).seeded()
    assert seeded.seed is not None
    assert seeded.seeded() == seeded
    assert GREEDY.seeded().seed is None


def test_open_carries_history_and_a_fresh_open_has_no_payload():
    fresh = sm.encode(sm.Open(3, WARM))
    replayed = sm.encode(sm.Open(3, WARM, (5, 0, 70000, 2**32 - 1)))
    # (a vocabulary as large as u32 ids go)
    limits = sm.StageLimits(slots=4, slot_ctx=64, n_vocab=2**32, width=4)
    assert sm.StageDecoder(limits).feed(fresh) == [sm.Open(3, WARM)]
    assert sm.StageDecoder(limits).feed(replayed) == [sm.Open(3, WARM, (5, 0, 70000, 2**32 - 1))]
    history = np.array([5, 0, 70000, 2**32 - 1], dtype="<u4").tobytes()
    assert replayed.endswith(history)  # the history is raw u32 after the header
    assert len(replayed) == len(fresh) + 4 + len(history)  # two small header entries more


def test_the_scheduler_runs_history_a_token_a_step_as_it_first_ran():
    sched = Scheduler(n_slots=2, slot_ctx=64, max_queue=4, is_end=lambda t: False)
    sched.submit(0, (1, 2, 3), 2, WARM, history=(7, 8, 4))
    steps = [sched.next_step() for _ in range(4)]
    assert [(op.slot, op.history) for op in steps[0].opened] == [(0, (7, 8, 4))]
    # The prompt in one chunk, then each token of the history in a step of its own, none
    # waiting for a token until the last: they follow each other into a pipeline.
    assert [[(it.pos, it.tokens, it.last) for it in st.items] for st in steps] == [
        [(0, (1, 2, 3), False)],
        [(3, (7,), False)],
        [(4, (8,), False)],
        [(5, (4,), True)],
    ]
    assert sched.next_step() is None  # now it waits for its token
    assert sched.token(0, 9)[0].finish is None
    step = sched.next_step()
    assert [(it.pos, it.tokens) for it in step.items] == [(6, (9,))]
    assert sched.token(0, 10)[0].finish == "length"  # two more tokens, as asked


def test_a_long_prompt_is_chunked_up_to_its_end_and_history_still_goes_alone():
    sched = Scheduler(
        n_slots=1, slot_ctx=64, max_queue=1, is_end=lambda t: False, max_batch_tokens=4
    )
    sched.submit(0, tuple(range(10, 16)), 1, GREEDY, history=(7, 8))
    shapes = []
    while (step := sched.next_step()) is not None:
        shapes += [(it.pos, len(it.tokens), it.last) for it in step.items]
    assert shapes == [(0, 4, False), (4, 2, False), (6, 1, False), (7, 1, True)]


def test_history_counts_against_the_slot():
    sched = Scheduler(n_slots=1, slot_ctx=8, max_queue=1, is_end=lambda t: False)
    with pytest.raises(Exception, match="context"):
        sched.submit(0, (1, 2, 3), 2, GREEDY, history=(4, 5, 6, 7))


def _forward(*items: tuple[int, int, int, bool]) -> sm.Forward:
    """A Forward of fake hidden rows (token id, position) for (seq, pos, n, sample) items."""
    rows = [
        np.array([[10 + seq, p, 0, 0] for p in range(pos, pos + n)]) for seq, pos, n, _ in items
    ]
    fitems = tuple(sm.ForwardItem(*it) for it in items)
    return sm.Forward(fitems, np.concatenate(rows).astype(np.float32))


async def _never():
    raise AssertionError("not opened here")


def test_a_stage_runs_one_sequences_batches_apart_and_other_sequences_together():
    stage = FakeStage(last=True, batch_sensitive=True)
    server = fake_server(stage, open_reply=_never)
    out = server._run(
        [
            sm.Open(0, GREEDY),
            sm.Open(1, GREEDY),
            _forward((0, 0, 3, False)),
            _forward((0, 3, 2, True)),  # the same sequence: not in the batch before it
            _forward((1, 0, 2, True)),  # another: joins the batch before it
        ]
    )
    assert stage.caches.batches(0) == (3, 2)
    assert stage.caches.batches(1) == (2,)
    assert stage.forwards == 2
    assert [m.seq for m in reply_decoder(stage).feed(out)] == [0, 1]


# ----- a request through a chain that breaks -----


async def whole_text(nursery, params):
    model = LocalModel.whole(FakeEngine(), max_queue=8)
    await nursery.start(model.run)
    return await complete(model, PROMPT, TOKENS, sampling=params)


async def break_mid_stream(chain: FakeChain, params, *, after: int = 30, then=None):
    """Run one request and break the chain once `after` tokens have come back (calling
    `then` first). Returns its result or raises its error."""
    got = {}

    async def run():
        try:
            got["result"] = await complete(chain.model, PROMPT, TOKENS, sampling=params)
        except SplitUnavailable as e:
            got["error"] = e

    async with trio.open_nursery() as n:
        n.start_soon(run)
        while chain.model.runner.stats().tokens_processed < after:
            await trio.sleep(0.001)
        while not chain.model.runner.busy():  # a token on the way is lost with the chain
            await trio.sleep(0)
        if then is not None:
            then()
        chain.pipeline.interrupt("a stage's peer is gone")
    if "error" in got:
        raise got["error"]
    return got["result"]


@pytest.mark.parametrize("params", [GREEDY, WARM], ids=["greedy", "seeded"])
async def test_a_request_survives_a_broken_chain_with_the_same_text(nursery, params):
    text, finished = await whole_text(nursery, params)
    chain = FakeChain(nursery, depth=1, delay=0.001)
    chain.model.routes = SameRoute(chain.model)
    await nursery.start(chain.model.run)
    got, done = await break_mid_stream(chain, params)
    assert got == text
    assert (done.reason, done.completion_tokens) == (finished.reason, finished.completion_tokens)
    assert chain.opens == 2  # the chain was opened again once
    [replay] = done.replays
    assert "peer is gone" in replay.reason
    assert 0 <= replay.wait_ms <= replay.ms  # waiting for a chain, then the replay itself
    assert replay.tokens > len(chain.model.text_tokens(PROMPT))  # prompt and tokens so far


async def test_after_a_reroute_tokens_become_text_by_the_new_models_vocabulary(nursery):
    # A new plan brings a new engine, and the old one (whose vocabulary the request began
    # with) may be freed by then: text after the break must come from the new route's.
    text, _ = await whole_text(nursery, GREEDY)
    chain = FakeChain(nursery, depth=1, delay=0.001)
    old = chain.model.engine.token_bytes

    chain.model.routes = SameRoute(chain.model, lambda t: old(t).upper())
    await nursery.start(chain.model.run)
    got, done = await break_mid_stream(chain, GREEDY)
    assert len(done.replays) == 1
    assert got.lower() == text.lower() and got != text
    assert got.endswith(text[-8:].upper()) and got.startswith(text[:4])


async def test_a_sampled_request_survives_where_batching_moves_the_logits(nursery):
    """Here the fakes' logits move with how the tokens were batched, as llama.cpp's do in
    their last bits: a replay that prefilled the history in one batch would draw other
    tokens; one that runs each token as it first ran gives the same text."""
    hot = SamplingParams(temperature=1.5, seed=99)
    whole = LocalModel.whole(FakeEngine(batch_sensitive=True), max_queue=8)
    await nursery.start(whole.run)
    text, finished = await complete(whole, PROMPT, TOKENS, sampling=hot)
    greedy, _ = await complete(whole, PROMPT, TOKENS)
    assert text != greedy  # the draws do wander from the favourites
    chain = FakeChain(nursery, depth=1, delay=0.001, batch_sensitive=True)
    chain.model.routes = SameRoute(chain.model)
    await nursery.start(chain.model.run)
    got, done = await break_mid_stream(chain, hot)
    assert len(done.replays) == 1
    assert got == text
    assert done.completion_tokens == finished.completion_tokens


async def test_a_chain_that_loses_a_step_silently_is_broken_and_the_request_replayed(nursery):
    # A message lost on the way (a stage reloaded under it) leaves the request waiting for a
    # token that never comes: after `stall_after` without one the chain counts as broken and
    # the request is replayed, instead of hanging.
    text, finished = await whole_text(nursery, GREEDY)
    chain = FakeChain(nursery, depth=1, delay=0.001)
    chain.pipeline.chain.stall_after = 0.5
    chain.model.routes = SameRoute(chain.model)
    await nursery.start(chain.model.run)
    links, lost = chain.pipeline.chain, []

    def lose_one():  # the next step's messages go, and are lost on the way
        outbox = links._outbox
        put = outbox.put

        def lost_on_the_way(data):
            lost.append(data)
            outbox.put = put

        outbox.put = lost_on_the_way

    got = {}

    async def run():
        got["result"] = await complete(chain.model, PROMPT, TOKENS, sampling=GREEDY)

    with trio.fail_after(20):  # without the watchdog: waits for ever
        async with trio.open_nursery() as n:
            n.start_soon(run)
            while chain.model.runner.stats().tokens_processed < 30:
                await trio.sleep(0.001)
            lose_one()
    out, done = got["result"]
    assert lost and out == text and done.completion_tokens == finished.completion_tokens
    [replay] = done.replays
    assert "no token from the split" in replay.reason


async def test_a_step_made_for_a_broken_chain_never_reaches_the_next_one(nursery):
    # The worker computes a step while the chain breaks and is opened again: its messages
    # (a Forward for a sequence the new chain was never told to open) are dropped, not sent.
    chain = FakeChain(nursery, depth=1, delay=0.001)
    chain.model.routes = SameRoute(chain.model)
    await nursery.start(chain.model.run)
    sent = []
    links = chain.pipeline.chain
    outbox = {"put": lambda self, data: sent.append(data), "close": lambda self: None}
    links._outbox = type("Outbox", (), outbox)()  # no real chain: watch what would go out
    old = links.generation
    links.break_("a stage's peer is gone")
    links.failed = None  # reopened, as opening the stream again leaves it
    links.send(Outgoing(old, b"a Forward of the old chain"))
    links.send(Outgoing(links.generation, b"a Forward of the new chain"))
    assert sent == [b"a Forward of the new chain"]


async def test_a_chain_that_stays_down_fails_the_request_at_the_deadline(nursery):
    chain = FakeChain(nursery, depth=1, delay=0.001)
    chain.model.routes = SameRoute(chain.model)
    chain.model.replay_deadline = 1.0
    await nursery.start(chain.model.run)
    real_open = chain.pipeline.chain.open_downstream

    async def refused():
        chain.opens += 1
        raise OSError("connection refused")

    def stay_down():
        chain.pipeline.chain.open_downstream = refused
        times.append(trio.current_time())

    times = []
    with pytest.raises(SplitUnavailable, match="within 1 s"):
        await break_mid_stream(chain, GREEDY, then=stay_down)
    assert 1.0 <= trio.current_time() - times[0] < 5
    assert chain.opens >= 3  # it kept trying, backing off
    chain.pipeline.chain.open_downstream = real_open  # back: the next request is served
    text, _ = await complete(chain.model, PROMPT, 8)
    assert len(text) > 0


async def test_without_reroute_a_broken_chain_fails_as_before(nursery):
    chain = FakeChain(nursery, depth=1, delay=0.001)
    await nursery.start(chain.model.run)
    with pytest.raises(SplitUnavailable):
        await break_mid_stream(chain, GREEDY)


async def test_a_closed_stage_server_waits_for_its_running_forward_and_serves_no_more(nursery):
    # The engine is freed after aclose: a forward still running on the worker thread then
    # would crash the agent.
    stage = FakeStage(last=True, delay=0.3)
    replies = []

    async def open_reply():
        send, recv = trio.testing.memory_stream_pair()
        replies.append(recv)
        return send

    server = fake_server(stage, open_reply=open_reply)
    up_send, up_recv = trio.testing.memory_stream_pair()
    nursery.start_soon(server.handle, up_recv)
    await up_send.send_all(sm.encode(sm.Open(0, GREEDY)) + sm.encode(_forward((0, 0, 2, True))))
    while not replies:
        await trio.sleep(0.01)
    await trio.sleep(0.05)  # the forward runs on the worker thread now
    assert stage.forwards == 0
    await server.aclose()
    assert stage.forwards == 1  # it finished before aclose returned
    _, again = trio.testing.memory_stream_pair()
    with trio.fail_after(1):
        await server.handle(again)  # refused at once
    assert stage.forwards == 1


async def test_a_long_history_that_answers_nothing_for_a_while_is_not_a_stall(nursery):
    # A continuation's history runs a token a step, and no step of it is answered: the entry
    # sends them as fast as its own stage computes, and the slower stages behind it are still
    # working through them long after the last one went. The chain waits for the work it
    # was sent (scaled from the entry's own time) instead of breaking, over and over, on a
    # request that is only long.
    whole = LocalModel.whole(FakeEngine(), max_queue=8)
    await nursery.start(whole.run)
    first, _ = await complete(whole, PROMPT, 60, sampling=GREEDY)
    history = tuple(whole.text_tokens(first)[1:41])  # (no BOS)
    chain = FakeChain(nursery, depth=3, delay=0.004)
    for stage in chain.stages:
        stage.delay = 0.025
    chain.pipeline.chain.stall_after = 0.3
    await nursery.start(chain.model.run)
    with structlog.testing.capture_logs() as logs:
        text, done = await complete(chain.model, PROMPT, 60, sampling=GREEDY, history=history)
    assert not [e for e in logs if e["event"] == "pipeline.broken"]
    assert not done.replays
    expected, _ = await complete(whole, PROMPT, 60, sampling=GREEDY, history=history)
    assert text == expected and done.completion_tokens == 60
