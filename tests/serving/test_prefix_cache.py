"""Kept prefixes: the index on its own (sans-IO), then through the runner and the local
executor on the fake engine, whose position checks fail any restore that puts a token where
the cache does not reach, and whose logits depend on every token a sequence holds."""

from __future__ import annotations

import random

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from meshagent.serving.generation import Delta, Finished, GenerationRequest
from meshagent.serving.local_model import LocalModel
from meshagent.serving.prefix_cache import BLOCK, MIN_REUSE, PrefixIndex, shared_length
from meshagent.serving.sampling import SamplingParams
from meshagent.testing.fake_engine import STATE_BYTES, FakeEngine
from tests.serving.test_runner import complete, expected

GREEDY = SamplingParams(temperature=0.0)


def per_token(n: int) -> int:
    return 10 * n


# ----- the index -----


def test_a_lookup_finds_the_entry_with_the_longest_shared_prefix():
    index = PrefixIndex(10_000, per_token)
    a = index.insert(list(range(100))).entry
    b = index.insert([*range(40), *range(500, 560)]).entry
    assert index.lookup([*range(70), 9, 9]) == (a, 70)
    assert index.lookup([*range(45), 500]) == (a, 45)  # a and b share 40; a shares 45
    assert index.lookup([*range(40), *range(500, 530)]) == (b, 70)
    assert index.lookup(list(range(MIN_REUSE - 1))) is None  # too short to be worth it
    assert index.lookup([7, *range(1, 60)]) is None  # differs at the first token
    assert (index.hits, index.misses) == (3, 2)


def test_an_entry_that_a_newer_one_extends_is_dropped_and_one_held_adds_nothing():
    index = PrefixIndex(10_000, per_token)
    turn1 = index.insert(list(range(50))).entry
    turn2 = index.insert(list(range(80)))  # the same conversation, one turn on
    assert turn2.dropped == (turn1,)
    assert [e.id for e in index.entries()] == [turn2.entry]
    assert index.insert(list(range(60))).entry is None  # turn 2's entry holds these
    assert index.used == per_token(80)


def test_entries_are_evicted_least_recently_used_first_within_the_budget():
    index = PrefixIndex(per_token(100), per_token)
    first = index.insert([1] * 40).entry
    second = index.insert([2] * 40).entry
    assert index.lookup([1] * 41) == (first, 40)  # the first is now the most recent
    third = index.insert([3] * 40)
    assert third.dropped == (second,)
    assert {e.id for e in index.entries()} == {first, third.entry}
    assert index.used <= index.budget
    assert index.insert([4] * 200).entry is None  # bigger than the whole budget


def test_shared_length_is_the_common_prefix():
    assert shared_length([1, 2, 3], [1, 2, 4]) == 2
    assert shared_length([], [1]) == 0
    assert shared_length([5] * 10, [5] * 7) == 7


ops = st.lists(
    st.tuples(
        st.sampled_from(["insert", "lookup"]),
        st.integers(0, 3),  # which of a few shared heads
        st.integers(0, 3 * BLOCK),  # how much of it
        st.lists(st.integers(0, 3), max_size=3 * BLOCK),  # then a tail
    ),
    max_size=40,
)


def test_with_whole_entries_a_prompt_starts_only_from_one_it_holds_all_of():
    # A recurrent state is kept as it was at the entry's end: no shorter match will do.
    index = PrefixIndex(10_000, per_token, whole=True)
    conversation = index.insert(list(range(60))).entry
    assert index.lookup([*range(50), 9, 9]) is None
    assert index.lookup([*range(60), 9, 9]) == (conversation, 60)
    # Its first turn, held inside it but not whole, is an entry of its own.
    turn1 = index.insert(list(range(30))).entry
    assert turn1 is not None
    assert index.lookup([*range(40), 9]) == (turn1, 30)
    assert index.lookup(list(range(70))) == (conversation, 60)
    assert index.insert(list(range(30))).entry is None  # held exactly: adds nothing


@settings(max_examples=150, deadline=None)
@given(ops, st.integers(0, 300), st.booleans())
def test_the_index_matches_a_search_of_every_entry(script, budget, whole):
    heads = [[h * 10 + i % 7 for i in range(3 * BLOCK)] for h in range(4)]
    index = PrefixIndex(budget * 10, per_token, whole=whole)

    def usable(tokens, entry) -> int:
        n = shared_length(tokens, entry.tokens)
        return n if not whole or n == len(entry.tokens) else 0

    for op, head, cut, tail in script:
        tokens = heads[head][:cut] + tail
        if op == "insert":
            index.insert(tokens)
        else:
            best = max((usable(tokens, e) for e in index.entries()), default=0)
            found = index.lookup(tokens)
            if best >= MIN_REUSE:
                assert found is not None and found[1] == best
                assert list(index.entries()[-1].tokens[:best]) == tokens[:best]
            else:
                assert found is None
        assert index.used == sum(e.size for e in index.entries()) <= index.budget
        held = index.entries()
        for e in held:  # no entry is a prefix of one stored after it (or of any, unless whole)
            assert not any(
                o.tokens != e.tokens
                and o.tokens[: len(e.tokens)] == e.tokens
                and (o.id > e.id or not whole)
                for o in held
            )
            assert sum(o.tokens == e.tokens for o in held) == 1


# ----- through the runner, on the fake engine -----


@pytest.fixture
async def cached(nursery):
    engine = FakeEngine(slots=3, slot_ctx=512)
    model = LocalModel.whole(engine, max_queue=8, prefix_budget=STATE_BYTES * 2000)
    await nursery.start(model.run)
    return engine, model


@pytest.fixture
async def plain(nursery):
    engine = FakeEngine(slots=3, slot_ctx=512)
    model = LocalModel.whole(engine, max_queue=8)
    await nursery.start(model.run)
    return engine, model


SYSTEM = "you are a careful assistant who answers in short plain sentences "


async def test_a_repeated_prompt_prefills_only_its_last_token_and_says_so(cached):
    engine, model = cached
    prompt = SYSTEM + "what is a river"
    first, f1 = await complete(model, prompt, 20)
    before = model.runner.stats().tokens_processed
    second, f2 = await complete(model, prompt, 20)
    assert first == second == expected(engine, prompt, 20)
    assert f1.cached_tokens == 0
    n_prompt = len(model.text_tokens(prompt))
    assert f2.cached_tokens == n_prompt - 1
    # the last prompt token and 19 generated ones ran: nothing of the prefix again
    assert model.runner.stats().tokens_processed - before == 1 + 19
    stats = model.runner.stats()
    assert (stats.prefix_hits, stats.prefix_tokens) == (1, n_prompt - 1)


async def test_a_conversations_next_turn_starts_from_the_last_turns_cache(cached):
    engine, model = cached
    turn1 = SYSTEM + "name a colour"
    reply, _ = await complete(model, turn1, 30)
    turn2 = turn1 + reply + " and another one"
    text, fin = await complete(model, turn2, 30)
    assert text == expected(engine, turn2, 30)
    # the first turn's prompt and its reply are kept (the reply as far as its text gives
    # back the same tokens)
    assert fin.cached_tokens >= len(model.text_tokens(turn1))


@pytest.mark.parametrize(
    "sampling",
    [GREEDY, SamplingParams(temperature=0.9, seed=5, frequency_penalty=0.3)],
    ids=["greedy", "seeded"],
)
async def test_a_mixed_workload_gives_the_same_text_with_and_without_the_cache(
    cached, plain, sampling
):
    rng = random.Random(7)
    heads = [SYSTEM, "tell me a story about a dog ", "the weather today is "]
    prompts = [
        rng.choice(heads) + " ".join(rng.choice(["sun", "rain", "cat", "map"]) for _ in range(3))
        for _ in range(24)
    ]
    lengths = [rng.randint(5, 40) for _ in prompts]

    async def texts(model: LocalModel) -> list[str]:
        out: list[str] = [""] * len(prompts)

        async def one(i: int) -> None:
            out[i], _ = await complete(model, prompts[i], lengths[i], sampling=sampling)

        for start in range(0, len(prompts), 4):  # four at a time: slots and the queue
            async with trio.open_nursery() as n:
                for i in range(start, start + 4):
                    n.start_soon(one, i)
        return out

    with_cache = await texts(cached[1])
    without = await texts(plain[1])
    assert with_cache == without
    assert cached[1].runner.stats().prefix_hits >= 12


async def test_memory_stays_within_the_budget_and_evicted_prefixes_still_answer_right(nursery):
    engine = FakeEngine(slots=2, slot_ctx=512)
    budget = STATE_BYTES * 300  # a few entries at most
    model = LocalModel.whole(engine, max_queue=4, prefix_budget=budget)
    await nursery.start(model.run)
    rng = random.Random(3)
    executor = model.runner.executor
    for i in range(40):
        prompt = f"conversation {rng.randint(0, 6)} " * 5 + "abc" * rng.randint(0, 20)
        text, _ = await complete(model, prompt, 15)
        assert text == expected(engine, prompt, 15), i
        # The ended sequence's KV is saved by the worker's next step, which may run after
        # the reply reached us: wait for the index and the executor to agree.
        with trio.fail_after(10):
            while executor.kept_bytes() != model.runner.stats().prefix_bytes:
                await trio.sleep(0.001)
        assert executor.kept_bytes() <= budget
    stats = model.runner.stats()
    assert stats.prefix_hits > 0 and stats.prefix_misses > 0


async def test_a_stop_string_mid_generation_leaves_a_prefix_that_still_answers_right(cached):
    engine, model = cached
    prompt = SYSTEM + "count"
    full = expected(engine, prompt, 30)
    stop = full[10:12]
    cut, _ = await complete(model, prompt, 30, stop=(stop,))
    assert cut == full[: full.index(stop)]
    # Asked at once: the cut sequence's prefix is in the index before its reply ends, even
    # with its next window in flight (the KV itself is saved at the next step, before any
    # restore of it).
    again, fin = await complete(model, prompt, 30)
    assert again == full and fin.cached_tokens > 0


async def test_a_failed_step_leaves_no_prefix(cached):
    engine, model = cached
    prompt = SYSTEM + "fail once"
    engine.fail_next = "the engine broke"
    with pytest.raises(Exception, match="broke"):
        await complete(model, prompt, 10)
    assert model.runner.stats().prefix_entries == 0
    text, fin = await complete(model, prompt, 10)
    assert text == expected(engine, prompt, 10) and fin.cached_tokens == 0


async def test_no_prefix_is_reused_where_a_batch_changes_the_last_bits(nursery):
    # Such an engine's cache of a prefix depends on the batches it ran in: reusing one could
    # change a sampled token, so the cache stays off and says why.
    engine = FakeEngine(slots=2, slot_ctx=512, batch_sensitive=True)
    model = LocalModel.whole(engine, max_queue=2, prefix_budget=STATE_BYTES * 1000)
    await nursery.start(model.run)
    for _ in range(2):
        _, fin = await complete(model, SYSTEM + "hello", 5)
        assert fin.cached_tokens == 0
    assert model.runner.executor.prefix_reason.startswith("off: ")


async def test_requests_with_the_same_prefix_at_once_each_answer_right(cached):
    engine, model = cached
    await complete(model, SYSTEM + "warm", 5)
    results: dict[str, tuple[str, Finished]] = {}

    async def one(q: str) -> None:
        results[q] = await complete(model, SYSTEM + q, 25)

    async with trio.open_nursery() as n:
        for q in ("one", "two", "three", "four", "five"):
            n.start_soon(one, q)
    for q, (text, fin) in results.items():
        assert text == expected(engine, SYSTEM + q, 25)
        assert fin.cached_tokens >= len(model.text_tokens(SYSTEM))


def test_a_request_that_continues_a_replay_reuses_only_what_its_prompt_shares():
    # `history` tokens follow the prompt; a kept prefix may reach into them, and the
    # scheduler then feeds the rest one per step, as a replay does.
    from meshagent.serving.scheduler import Scheduler

    sched = Scheduler(n_slots=1, slot_ctx=256, max_queue=1, is_end=lambda t: t == 0)
    sched.prefix = PrefixIndex(10_000, per_token)
    prompt = tuple(range(2, 22))
    sched.submit(1, prompt, 3, GREEDY, cache=True)
    step = sched.next_step()
    assert step.items[0].tokens == prompt and step.opened[0].restore is None
    for t in (30, 31, 32):
        sched.token(0, t)
        step = sched.next_step()
    assert step.saves and step.saves[0].tokens == len(prompt) + 2  # the last was not fed
    saved = step.saves[0]
    sched.submit(2, prompt, 5, GREEDY, (30, 31, 32, 33), cache=True)
    step = sched.next_step()
    assert step.opened[0].restore == (saved.entry, len(prompt) + 2)
    assert [it.tokens for it in step.items] == [(32,)]  # history, one per step


def test_a_sequence_cut_with_its_step_in_flight_leaves_its_prefix_for_the_next_request():
    # A stop string is found in the text while the sequence's next window is in flight: the
    # conversation's next turn, sent at once, finds the prefix, not only once the token of
    # the window in flight comes back.
    from meshagent.serving.scheduler import Scheduler

    sched = Scheduler(n_slots=2, slot_ctx=256, max_queue=1, is_end=lambda t: t == 0)
    sched.prefix = PrefixIndex(10_000, per_token)
    prompt = tuple(range(2, 42))
    sched.submit(1, prompt, 10, GREEDY, cache=True)
    sched.next_step()
    sched.token(0, 50)
    sched.next_step()
    sched.token(0, 51)
    assert sched.next_step().items[0].tokens == (51,)  # in flight
    sched.cancel(1)
    sched.submit(2, (*prompt, 50, 51, 60, 61), 5, GREEDY, cache=True)
    step = sched.next_step()
    # Positions up to 51's hold whatever the window's verdict: kept, and restored.
    assert [s.tokens for s in step.saves] == [len(prompt) + 2]
    assert step.opened[0].restore == (step.saves[0].entry, len(prompt) + 2)
    assert [it.tokens for it in step.items] == [(60, 61)]
    assert sched.token(0, 52) == []  # the cut sequence's token: nothing, and nothing kept
    assert not sched.next_step().saves


async def test_a_soak_of_500_requests_keeps_within_the_budget_and_starves_no_one(nursery):
    # Random shared prefixes, eight at a time on three slots: every request finishes with
    # the model's text, and the kept bytes never pass the budget.
    engine = FakeEngine(slots=3, slot_ctx=256)
    budget = STATE_BYTES * 600
    model = LocalModel.whole(engine, max_queue=16, prefix_budget=budget)
    await nursery.start(model.run)
    executor = model.runner.executor
    rng = random.Random(11)
    heads = ["".join(rng.choice("abcdefgh ") for _ in range(rng.randint(20, 90))) for _ in range(8)]
    jobs = [
        (rng.choice(heads) + "".join(rng.choice("xyz ") for _ in range(rng.randint(0, 30))), n)
        for n in (rng.randint(1, 12) for _ in range(500))
    ]
    peak = 0
    done = 0

    async def worker(mine: list[tuple[str, int]]) -> None:
        nonlocal peak, done
        for prompt, n in mine:
            text, _ = await complete(model, prompt, n)
            assert text == expected(engine, prompt, n)
            peak = max(peak, executor.kept_bytes())
            done += 1

    async with trio.open_nursery() as n:
        for w in range(8):
            n.start_soon(worker, jobs[w::8])
    assert done == 500
    assert 0 < peak <= budget
    stats = model.runner.stats()
    assert stats.prefix_hits > 250 and stats.active == stats.queued == 0


async def test_drafts_rolled_back_leave_a_prefix_that_answers_as_plain_decoding(nursery):
    # Speculation's rejected drafts are cut from the slot before its KV is kept, so the next
    # turn, started from that prefix with drafts again, gives plain decoding's text.
    models = []
    for budget in (STATE_BYTES * 4000, 0):
        engine = FakeEngine(slots=2, slot_ctx=1024, copy_back=6)
        model = LocalModel.whole(engine, max_queue=4, prefix_budget=budget)
        await nursery.start(model.run)
        models.append(model)
    kept, plain = models
    turn = "abcdef abcdef abc, the cat sat on the mat, the cat"
    rejected = 0
    for i in range(3):
        text, fin = await complete(kept, turn, 60, speculation="on")
        want, _ = await complete(plain, turn, 60, speculation="off")
        assert text == want, i
        assert fin.speculation is not None and fin.speculation.windows > 0
        rejected += fin.speculation.drafted - fin.speculation.accepted
        assert fin.cached_tokens > 0 or i == 0
        turn = turn + text + f" and then {i}"
    assert rejected > 0  # some drafts were rolled back
    assert kept.runner.stats().prefix_hits == 2


# ----- n completions of one prompt: one prefill -----


async def completions(model, prompt, samplings, n_tokens=16, share="req-1"):
    got = {}

    async def one(i, sampling):
        req = GenerationRequest(model.text_tokens(prompt), n_tokens, sampling, share=share)
        send, recv = trio.open_memory_channel(n_tokens + 4)
        async with send:
            await model.generate(req, send)
        events = [e async for e in recv]
        got[i] = ("".join(e.text for e in events if isinstance(e, Delta)), events[-1])

    async with trio.open_nursery() as n:
        for i, s in enumerate(samplings):
            n.start_soon(one, i, s)
    return [got[i] for i in range(len(samplings))]


@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
async def test_n_completions_prefill_their_prompt_once_and_each_is_what_it_is_alone(nursery, split):
    from tests.serving.test_pipeline_fake import FakeChain

    budget = STATE_BYTES * 4000
    if split:
        chain = FakeChain(nursery, depth=2, prefix_budget=budget)
        model = chain.model
    else:
        model = LocalModel.whole(
            FakeEngine(slots=4, slot_ctx=512), max_queue=8, prefix_budget=budget
        )
    await nursery.start(model.run)
    prompt = SYSTEM + "tell me about rivers and the sea"
    samplings = [SamplingParams(temperature=2.0, seed=s) for s in (1, 2, 3, 4)]
    alone = [await complete(model, prompt, 16, sampling=s) for s in samplings]
    model.runner.forget_prefixes()  # the prompt is not kept from those runs
    before = model.runner.stats().tokens_processed
    together = await completions(model, prompt, samplings)
    assert [t for t, _ in together] == [t for t, _ in alone]
    assert len({t for t, _ in together}) > 1  # the seeds differ, and so do the texts
    n_prompt = len(model.text_tokens(prompt))
    # One prefill of the prompt; each other completion runs the prompt's last token itself.
    fed = sum(f.completion_tokens - (f.reason == "length") for _, f in together)
    assert model.runner.stats().tokens_processed - before == n_prompt + 3 + fed
    assert sorted(f.cached_tokens for _, f in together) == [0, *[n_prompt - 1] * 3]


async def test_without_kept_prefixes_n_completions_prefill_each(plain):
    engine, model = plain
    prompt = SYSTEM + "what is a lake"
    samplings = [SamplingParams(temperature=0.0)] * 3
    before = model.runner.stats().tokens_processed
    together = await completions(model, prompt, samplings, 8)
    assert {t for t, _ in together} == {expected(engine, prompt, 8)}
    assert model.runner.stats().tokens_processed - before == 3 * (
        len(model.text_tokens(prompt)) + 7
    )
