"""The entry of a split, its stages and their messages on fake engines over in-memory streams:
the split gives the whole fake model's text, groups take turns, and a broken chain fails its
requests and serves again after reconnecting."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import trio
import trio.testing

from meshagent import control
from meshagent.errors import SplitUnavailable
from meshagent.serving import stage_messages as sm
from meshagent.serving.generation import Delta, GenerationRequest
from meshagent.serving.local_model import LocalModel
from meshagent.serving.pipeline import PipelineExecutor
from meshagent.serving.runner import ModelRunner
from meshagent.serving.sampling import SamplingParams
from meshagent.testing.fake_engine import FakeEngine, FakeEntry, FakeStage
from tests.serving.stages import fake_server, reply_decoder
from tests.serving.test_runner import complete

PROMPTS = ["alpha", "beta", "gamma", "delta"]


class FakeChain:
    """Entry -> middle -> last -> entry, each hop a memory stream pair."""

    def __init__(
        self,
        nursery: trio.Nursery,
        *,
        depth: int,
        delay: float = 0.0,
        batch_sensitive: bool = False,
        max_batch_tokens: int = 512,
        copy_back: int = 0,
        prefix_budget: int = 0,
        n_vocab: int = 40,
    ) -> None:
        self.nursery = nursery
        self.entry = FakeEntry(n_vocab, delay=delay)
        how = {"batch_sensitive": batch_sensitive, "copy_back": copy_back}
        last = FakeStage(n_vocab=n_vocab, last=True, delay=delay, **how)
        self.stages = [FakeStage(n_vocab=n_vocab, last=False, delay=delay), last]
        self.opens = 0
        self.pipeline = PipelineExecutor(
            self.entry,
            self._open_first,
            wire_dtype="f32",
            depth=depth,
            prefix_budget=prefix_budget,
        )
        self.servers = [
            fake_server(self.stages[0], open_next=self._open_last),
            fake_server(self.stages[1], open_reply=self._open_reply),
        ]
        runner = ModelRunner(
            self.pipeline,
            max_queue=8,
            is_end=self.entry.is_end_of_generation,
            max_batch_tokens=max_batch_tokens,
        )
        self.model = LocalModel(self.entry, runner)
        self.upstreams: list[trio.abc.Stream] = []

    def _pair(self, handler):
        a, b = trio.testing.memory_stream_pair()
        self.nursery.start_soon(handler, b)
        return a

    async def _open_first(self):
        self.opens += 1
        return self._pair(self.servers[0].handle)

    async def _open_last(self):
        return self._pair(self.servers[1].handle)

    async def _open_reply(self):
        return self._pair(self.pipeline.handle_reply)


async def all_at_once(model, prompts, n=16):
    got = {}

    async def one(i):
        got[i] = await complete(model, prompts[i], n)

    async with trio.open_nursery() as nursery:
        for i in range(len(prompts)):
            nursery.start_soon(one, i)
    return [got[i] for i in range(len(prompts))]


@pytest.fixture
async def whole(nursery):
    model = LocalModel.whole(FakeEngine(), max_queue=8)
    await nursery.start(model.run)
    return [await complete(model, p, 16) for p in PROMPTS]


async def test_a_split_gives_the_whole_models_text(nursery, whole):
    chain = FakeChain(nursery, depth=1)
    await nursery.start(chain.model.run)
    alone = [await complete(chain.model, p, 16) for p in PROMPTS]
    assert [(t, f.reason, f.completion_tokens) for t, f in alone] == [
        (t, f.reason, f.completion_tokens) for t, f in whole
    ]
    assert len(alone[0][1].stage_ms) == 3  # each stage's time, in pipeline order
    together = await all_at_once(chain.model, PROMPTS)
    assert [t for t, _ in together] == [t for t, _ in whole]


async def test_one_group_in_a_shallow_pipeline(nursery, whole):
    """Depth 1: a step takes every ready sequence. The runner starts once all four requests
    wait, so the first step holds them all whatever the machine's timing."""
    chain = FakeChain(nursery, depth=1)
    got: dict[int, str] = {}

    async def one(i):
        got[i] = (await complete(chain.model, PROMPTS[i], 16))[0]

    async with trio.open_nursery() as n:
        for i in range(len(PROMPTS)):
            n.start_soon(one, i)
        await trio.testing.wait_all_tasks_blocked()
        assert chain.model.runner.stats().active == 4
        await nursery.start(chain.model.run)
    assert [got[i] for i in range(len(PROMPTS))] == [t for t, _ in whole]
    assert chain.model.runner.largest_step == 4


async def test_groups_take_turns_in_a_deep_pipeline(nursery, whole):
    chain = FakeChain(nursery, depth=3, delay=0.002)
    await nursery.start(chain.model.run)
    got = await all_at_once(chain.model, PROMPTS)
    assert [t for t, _ in got] == [t for t, _ in whole]
    assert chain.model.runner.largest_step == 1  # 4 // 3: each sequence a group of its own
    assert chain.model.runner.peak_steps_in_flight >= 3


async def test_a_broken_chain_fails_its_requests_then_serves_again(nursery, whole):
    chain = FakeChain(nursery, depth=1, delay=0.005)
    await nursery.start(chain.model.run)
    async with trio.open_nursery() as n:

        async def doomed():
            with pytest.raises(SplitUnavailable):
                await complete(chain.model, PROMPTS[0], 200)

        n.start_soon(doomed)
        await trio.sleep(0.05)
        while not chain.model.runner.busy():  # its token is on the way
            await trio.sleep(0.001)
        chain.pipeline.interrupt("a stage's peer is gone")
    assert chain.model.runner.stats().active == 0
    text, _ = await complete(chain.model, PROMPTS[1], 16)
    assert text == whole[1][0]
    assert chain.opens == 2  # reopened once


async def test_a_stage_refuses_hidden_states_meant_for_another_layer():
    """A stage of another plan (a replan moved the cut) answers with a failure naming both
    layers, never computes on the wrong input."""

    stage = FakeStage(last=True)
    stage.start = 20  # what a StageEngine says: the first layer it runs
    replies: list = []

    async def open_reply():
        a, b = trio.testing.memory_stream_pair()

        async def read():
            decoder = reply_decoder(stage)
            while data := await b.receive_some():
                replies.extend(decoder.feed(data))

        nursery.start_soon(read)
        return a

    server = fake_server(stage, open_reply=open_reply)
    up, down = trio.testing.memory_stream_pair()
    rows = np.zeros((1, 4), dtype=np.float32)
    item = sm.ForwardItem(0, 0, 1, True)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.handle, down)
        await up.send_all(
            sm.encode(sm.Open(0, SamplingParams(temperature=0.0)))
            + sm.encode(sm.Forward((item,), rows, (), layer=23))
        )
        with trio.fail_after(10):
            while not replies:
                await trio.sleep(0.01)
        await up.aclose()
    [failure] = replies
    assert isinstance(failure, sm.StageFailure) and failure.seq is None
    assert "layer 23 reached the stage starting at layer 20" in failure.message
    assert stage.forwards == 0


SAMPLINGS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.0, frequency_penalty=0.8, presence_penalty=0.2),
    SamplingParams(temperature=0.9, seed=3),
]


@pytest.mark.parametrize("copy_back", [0, 6], ids=["novel", "copying"])
@pytest.mark.parametrize("sampling", SAMPLINGS, ids=str)
async def test_a_split_verifies_drafts_at_its_last_stage_and_changes_no_token(
    nursery, copy_back, sampling
):
    # The draft rides down the chain with the step's rows; the last stage samples the
    # window's rows and keeps what plain decoding would have drawn; every stage cuts the
    # rejected tail from its cache when the next step starts before it (the fakes raise on a
    # token at the wrong position). Greedy, penalised and seeded text is that of the whole
    # model without drafts; drafts mostly miss on novel text and mostly hit on copied text.
    # Windows follow each other before their verdicts (a wrong guess voids those after it).
    engine = FakeEngine(slots=2, slot_ctx=512, copy_back=copy_back)
    whole = LocalModel.whole(engine, max_queue=4)
    chain = FakeChain(nursery, depth=1, copy_back=copy_back)
    for model in (whole, chain.model):
        await nursery.start(model.run)
    assert chain.pipeline.speculates and chain.pipeline.exact_windows
    prompt = "abcdef abcdef abc, the cat sat on the mat, the cat"
    plain, _ = await complete(whole, prompt, 100, sampling=sampling, speculation="off")
    before = chain.stages[1].forwards
    text, fin = await complete(chain.model, prompt, 100, sampling=sampling, speculation="on")
    assert text == plain
    s = fin.speculation
    assert s.windows > 0 and s.drafted >= s.accepted
    if copy_back and sampling.temperature == 0 and not sampling.frequency_penalty:
        # Plain decoding sends 100 steps down the chain; with drafts, 17-29 windows plus those
        # voided by a wrong guess went (23-41 seen, by how many were in flight at a miss).
        assert s.accepted > 60 and chain.stages[1].forwards - before < 50
        # The entry sent windows before the verdicts on those before them came back.
        assert s.peak_in_flight > 1


async def test_concurrent_split_requests_with_and_without_drafts_match_each_alone(nursery):
    whole = LocalModel.whole(FakeEngine(slots=4, slot_ctx=256, copy_back=5), max_queue=8)
    chain = FakeChain(nursery, depth=2, copy_back=5, delay=0.001)
    for model in (whole, chain.model):
        await nursery.start(model.run)
    prompts = ["abcab abcab", "xyzzy xyzzy xy", "hello there hello", "qwerty"]
    alone = {p: (await complete(whole, p, 40, speculation="off"))[0] for p in prompts}
    got = {}

    async def one(i, p):
        got[p] = (await complete(chain.model, p, 40, speculation=("on", "off")[i % 2]))[0]

    async with trio.open_nursery() as n:
        for i, p in enumerate(prompts):
            n.start_soon(one, i, p)
    assert got == alone


async def test_the_entry_learns_what_a_window_costs_from_its_trips(nursery):
    # No step of a split's entry ends with its tokens: each window's trip around the chain is
    # timed instead. Where a trip costs about the same whatever the window holds (latency, a
    # step's fixed cost), windows are cheap; where each token costs a step, they are not.
    # (Steps of 8 ms, so that the Python around them, slower on a loaded machine, counts
    # for little.)
    def chain(token_delay: float) -> FakeChain:
        c = FakeChain(nursery, depth=1, copy_back=6, delay=0.008 - token_delay)
        for part in (c.entry, *c.stages):
            part.token_delay = token_delay
        return c

    cheap, dear = chain(0.0), chain(0.008)
    for c in (cheap, dear):
        await nursery.start(c.model.run)
        assert c.model.runner.scheduler.window_cost.slope == 0.3  # the prior, until timed
        # One window in flight: a window that follows another waits behind it, so only a
        # chain's first is timed, and the fake's text, drafted right throughout, would make
        # one long chain.
        c.model.runner.scheduler.max_windows = 1
        await complete(c.model, "abcdef abcdef", 100, speculation="on")
    assert cheap.model.runner.scheduler.window_cost.slope < 0.2
    assert dear.model.runner.scheduler.window_cost.slope > 0.6


SYSTEM = "you are a careful assistant who answers in short plain sentences "


async def stages_hold_what_the_entry_keeps(chain: FakeChain) -> None:
    """Wait until every stage holds the entry's kept prefixes (a Keep follows the last
    token of its request down the chain)."""
    with trio.fail_after(5):
        while not all(set(s.book._kept) == set(chain.pipeline.book._kept) for s in chain.servers):
            await trio.sleep(0.001)


async def test_a_split_keeps_prefixes_in_every_stage_and_changes_no_token(nursery):
    from meshagent.testing.fake_engine import STATE_BYTES

    whole = LocalModel.whole(FakeEngine(), max_queue=8)
    await nursery.start(whole.run)
    chain = FakeChain(nursery, depth=3, delay=0.001, prefix_budget=STATE_BYTES * 2000)
    await nursery.start(chain.model.run)
    prompts = [SYSTEM + q for q in ("what is a river", "what is a lake", "what is a river")]
    got = [await complete(chain.model, p, 20) for p in prompts]
    want = [await complete(whole, p, 20) for p in prompts]
    assert [t for t, _ in got] == [t for t, _ in want]
    cached = [f.cached_tokens for _, f in got]
    n_system = len(chain.model.text_tokens(SYSTEM))
    assert cached[0] == 0 and cached[1] >= n_system
    assert cached[2] == len(chain.model.text_tokens(prompts[2])) - 1
    # every stage holds its own KV of each kept prefix, and the same entries
    await stages_hold_what_the_entry_keeps(chain)
    assert chain.pipeline.book._kept
    concurrent = await all_at_once(chain.model, [SYSTEM + q for q in PROMPTS], 12)
    alone = [await complete(whole, SYSTEM + q, 12) for q in PROMPTS]
    assert [t for t, _ in concurrent] == [t for t, _ in alone]


class PeakBytes(dict):
    """A kept-prefix store that remembers the most bytes it ever held at once."""

    peak = 0

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        self.peak = max(self.peak, sum(len(v) for v in self.values()))


async def test_an_evicted_prefix_is_freed_before_the_new_one_is_kept_at_every_stage(nursery):
    from meshagent.testing.fake_engine import STATE_BYTES

    budget = STATE_BYTES * 120  # room for two of these conversations, not three
    chain = FakeChain(nursery, depth=2, prefix_budget=budget)
    held = [PeakBytes() for _ in range(3)]
    chain.pipeline.book._kept, chain.servers[0].book._kept, chain.servers[1].book._kept = held
    await nursery.start(chain.model.run)
    for i in range(6):  # (the fake tokenizer reads letters only)
        await complete(chain.model, "".join(chr(97 + (i + 3 * j) % 26) for j in range(80)), 8)
    await stages_hold_what_the_entry_keeps(chain)
    assert chain.pipeline.kept_bytes() > 0
    # Each new conversation evicts the oldest: its Drop reaches every stage before the Keep.
    assert [h.peak <= budget for h in held] == [True, True, True], [h.peak for h in held]


async def test_a_broken_chain_forgets_its_prefixes_and_still_gives_the_same_text(nursery):
    # The stages of a new chain start with no kept prefix (a stage restarted, or its host
    # was replaced): the entry forgets them all, and prompts prefill in full again.
    from meshagent.testing.fake_engine import STATE_BYTES

    whole = LocalModel.whole(FakeEngine(), max_queue=8)
    await nursery.start(whole.run)
    chain = FakeChain(nursery, depth=1, delay=0.002, prefix_budget=STATE_BYTES * 2000)
    await nursery.start(chain.model.run)
    prompt = SYSTEM + "what is a river"
    await complete(chain.model, prompt, 10)
    assert chain.model.runner.stats().prefix_entries == 1
    async with trio.open_nursery() as n:

        async def doomed():
            with pytest.raises(SplitUnavailable):
                await complete(chain.model, SYSTEM + "and a sea", 150)

        n.start_soon(doomed)
        while not chain.model.runner.busy():
            await trio.sleep(0.001)
        chain.pipeline.interrupt("a stage's peer is gone")
    assert chain.model.runner.stats().prefix_entries == 0
    text, fin = await complete(chain.model, prompt, 10)
    assert text == (await complete(whole, prompt, 10))[0]
    assert fin.cached_tokens == 0 and chain.opens == 2
    again, fin = await complete(chain.model, prompt, 10)  # kept again on the new chain
    assert again == text and fin.cached_tokens > 0
    await stages_hold_what_the_entry_keeps(chain)


async def test_a_stage_that_lacks_a_prefix_breaks_the_chain_and_the_request_is_not_wrong(
    nursery,
):
    from meshagent.testing.fake_engine import STATE_BYTES

    chain = FakeChain(nursery, depth=1, prefix_budget=STATE_BYTES * 2000)
    await nursery.start(chain.model.run)
    prompt = SYSTEM + "what is a river"
    first, _ = await complete(chain.model, prompt, 10)
    with trio.fail_after(5):
        while not chain.servers[1].book._kept:  # (the Keep follows the request's last token)
            await trio.sleep(0.001)
    chain.servers[1].book._kept.clear()  # as if the last stage had lost it
    with pytest.raises(SplitUnavailable, match="not held by this stage"):
        await complete(chain.model, prompt, 10)
    assert chain.model.runner.stats().prefix_entries == 0
    assert (await complete(chain.model, prompt, 10))[0] == first


async def deltas_of(model, prompt, n, sampling, speculation):
    req = GenerationRequest(model.text_tokens(prompt), n, sampling, speculation=speculation)
    send, recv = trio.open_memory_channel(n + 4)
    async with send:
        await model.generate(req, send)
    return [e async for e in recv]


@pytest.mark.parametrize("speculation", ["off", "on"])
@pytest.mark.parametrize(
    "sampling",
    [SamplingParams(temperature=0.0), SamplingParams(temperature=1.2, seed=4)],
    ids=["greedy", "seeded"],
)
async def test_a_split_enforces_a_grammar_and_reports_logprobs_as_the_whole_model_does(
    nursery, speculation, sampling
):
    # The grammar and the logprobs live where sampling runs: the whole model's executor, or
    # a split's last stage (its Open carries them, its Tokens bring the logprobs back).
    words = ["the cat sat on the mat the cat sat", "a dog", "the cat ran"]
    sampling = replace(sampling, grammar="fake:" + "|".join(words), logprobs=2)
    whole = LocalModel.whole(FakeEngine(copy_back=4), max_queue=4)
    chain = FakeChain(nursery, depth=1, copy_back=4)
    for model in (whole, chain.model):
        await nursery.start(model.run)
    got = []
    for model in (whole, chain.model):
        events = await deltas_of(model, "the cat sat on", 60, sampling, speculation)
        deltas = [e for e in events if isinstance(e, Delta)]
        text = "".join(d.text for d in deltas)
        assert text in words and events[-1].reason == "stop"
        lps = [lp for d in deltas for lp in d.logprobs]
        assert len(lps) == sum(len(d.tokens) for d in deltas) == len(text)
        assert all(len(lp.top) == 2 and lp.top[0][1] >= lp.logprob for lp in lps)
        got.append((text, lps))
    assert got[0] == got[1]


@pytest.mark.parametrize(
    ("forged", "why"),
    [
        (sm.Token(3, 5), "a token for sequence 3, which awaits none"),
        (sm.Token(0, 10**6), "token 1000000 is not of the vocabulary of 40"),
        (sm.Token(0, 5, more=(5,) * 30), "verified drafts|awaits none"),
    ],
    ids=["idle slot", "past the vocabulary", "more than the draft"],
)
async def test_a_forged_token_breaks_the_chain_and_never_reaches_a_completion(
    nursery, whole, forged, why
):
    # What comes back on a reply stream is checked against what the entry awaits: a token
    # for a slot with nothing in flight, of no vocabulary, or past its window's draft is a
    # protocol error of that stream; the requests fail (and replay elsewhere), none takes it.
    chain = FakeChain(nursery, depth=1, delay=0.005)
    await nursery.start(chain.model.run)
    async with trio.open_nursery() as n:

        async def doomed():
            with pytest.raises(SplitUnavailable, match=why):
                await complete(chain.model, PROMPTS[0], 200)

        n.start_soon(doomed)
        while not chain.model.runner.busy():
            await trio.sleep(0.001)
        forger, reply = trio.testing.memory_stream_pair()
        n.start_soon(chain.pipeline.handle_reply, reply)
        await forger.send_all(sm.encode(forged))
        await forger.aclose()
    text, _ = await complete(chain.model, PROMPTS[1], 16)
    assert text == whole[1][0]


@pytest.mark.parametrize("same_vocab", [True, False], ids=["same-vocab", "cross-vocab"])
@pytest.mark.parametrize("sampling", [SAMPLINGS[0], SAMPLINGS[-1]], ids=str)
async def test_a_split_entry_drafts_with_a_draft_model_and_changes_no_token(
    nursery, sampling, same_vocab
):
    # Novel text, where the text's own drafts rarely fit: the entry's draft model (the same
    # fake arithmetic, so it knows the greedy text) proposes windows, beyond those in flight
    # too, and the chain verifies them. The text is the whole model's without drafts.
    # Across vocabularies the draft reads the target's text re-tokenized its own way; the
    # fake vocabulary of 29 spells every text one way only (at 40, eleven tokens spell a
    # space, and the fake model is then another model on the re-tokenized text).
    from meshagent.serving.draft_model import DraftModel

    n_vocab = 40 if same_vocab else 29
    engine = FakeEngine(n_vocab, slots=2, slot_ctx=512)
    whole = LocalModel.whole(engine, max_queue=4)
    chain = FakeChain(nursery, depth=1, delay=0.002, n_vocab=n_vocab)
    drafter = FakeEngine(n_vocab, slots=8, slot_ctx=512)
    draft = DraftModel(drafter, chain.entry, same_vocab=same_vocab)
    chain.model.runner.scheduler.drafting.model = draft
    for model in (whole, chain.model):
        await nursery.start(model.run)
    prompt = "the lighthouse keeper found a map"
    plain, _ = await complete(whole, prompt, 100, sampling=sampling, speculation="off")
    for mode in ("on", "auto"):
        before = chain.stages[1].forwards
        text, fin = await complete(chain.model, prompt, 100, sampling=sampling, speculation=mode)
        assert text == plain
        s = fin.speculation
        assert s is not None and s.draft_model == "fake" and s.model_windows > 0
        if sampling.temperature == 0:  # the draft is the greedy text: windows travel full
            assert s.model_accepted > 0.9 * s.model_drafted and s.model_accepted > 60
            assert chain.stages[1].forwards - before < 40  # not 100 one-token trips
            assert s.peak_in_flight > 1  # windows followed each other before their verdicts
    if sampling.temperature == 0:  # the status's record of it: "auto" judged its tokens
        right = control._draft_model(chain.model)["right"]
        assert right["p"] > 0.9 and right["judged"] > 60


async def test_a_split_entrys_draft_model_reads_a_long_prompt_beside_the_steps(nursery):
    # A draft model that reads slowly (2.5 ms a token) and a prompt of 120 tokens: its
    # reading takes many trips. The entry's reader reads it whole while the sequence's
    # plain tokens go through the chain, and the model drafts once it holds the text; no
    # proposal reads the prompt. The text is the whole model's without drafts.
    import time

    from meshagent.serving.draft_model import DraftModel

    class SlowReader(FakeEngine):
        def __init__(self, **kw):
            super().__init__(**kw)
            self.reads: list[tuple[float, float]] = []

        def forward(self, items):
            fed = sum(len(it.tokens) for it in items)
            started = time.perf_counter()
            time.sleep(0.0025 * fed)
            if fed >= 100:
                self.reads.append((started, time.perf_counter()))
            return super().forward(items)

    engine = FakeEngine(slots=2, slot_ctx=512)
    whole = LocalModel.whole(engine, max_queue=4)
    chain = FakeChain(nursery, depth=1, delay=0.005)
    slow = SlowReader(slots=8, slot_ctx=512)
    draft = DraftModel(slow, chain.entry, same_vocab=True)
    chain.model.runner.scheduler.drafting.model = draft
    for model in (whole, chain.model):
        await nursery.start(model.run)
    prompt = "the lighthouse keeper found a map under the floor of the old boathouse "
    prompt += "and read it by the lamp until the tide came in"
    plain, _ = await complete(whole, prompt, 100, speculation="off")
    greedy = SamplingParams(temperature=0.0)
    req = GenerationRequest(chain.model.text_tokens(prompt), 100, greedy, speculation="on")
    send, recv = trio.open_memory_channel(100)
    arrived: list[float] = []
    texts: list[str] = []

    async def generate():
        async with send:
            await chain.model.generate(req, send)

    async with trio.open_nursery() as inner:
        inner.start_soon(generate)
        async for ev in recv:
            if isinstance(ev, Delta):
                arrived.append(time.perf_counter())
                texts.append(ev.text)
    assert "".join(texts) == plain
    [(started, ended)] = slow.reads  # the prompt, read once, whole
    assert sum(started < t < ended for t in arrived) >= 5  # plain tokens went meanwhile
    assert draft.read_ahead.tokens >= len(req.prompt_tokens) - 8
    assert draft.read_when_asked.tokens < 40
    stats = chain.model.runner.stats()
    assert stats.model_windows > 0
