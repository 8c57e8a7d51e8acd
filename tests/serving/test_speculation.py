"""Speculative decoding through the runner and the local executor, on the fake engine:
drafts from the sequence's own text change no token (greedy, seeded, penalties, stop strings,
limits, batching), save steps on copy-shaped text, and show in the receipt."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import trio

from meshagent.engine.windows import check_windows
from meshagent.serving.draft_model import DraftModel
from meshagent.serving.drafting import MAX_DRAFT
from meshagent.serving.generation import Finished, GenerationRequest
from meshagent.serving.local_model import LocalModel
from meshagent.serving.sampling import SamplingParams
from meshagent.testing.fake_engine import FakeEngine, fake_logits
from tests.serving.test_runner import complete

GREEDY = SamplingParams(temperature=0.0)
SAMPLINGS = [
    GREEDY,
    SamplingParams(temperature=0.0, frequency_penalty=0.8, presence_penalty=0.2),
    SamplingParams(temperature=0.9, seed=3),
    SamplingParams(temperature=1.2, top_p=0.8, seed=8, presence_penalty=0.5),
]


async def run(model: LocalModel, prompt: str, max_tokens: int, **kw) -> tuple[str, Finished]:
    kw.setdefault("speculation", "off")  # not the model's default
    return await complete(model, prompt, max_tokens, **kw)


@pytest.fixture(params=[0, 6], ids=["novel", "copying"])
async def served(request, nursery):
    engine = FakeEngine(slots=3, slot_ctx=512, copy_back=request.param)
    model = LocalModel.whole(engine, max_queue=4)
    await nursery.start(model.run)
    return engine, model


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=str)
async def test_drafts_change_no_token(served, sampling):
    _, model = served
    for prompt in ("abcdef abcdef abc", "the cat sat on the mat, the cat"):
        plain, p_fin = await run(model, prompt, 80, sampling=sampling)
        spec, s_fin = await run(model, prompt, 80, sampling=sampling, speculation="on")
        assert spec == plain
        assert (s_fin.reason, s_fin.completion_tokens) == (p_fin.reason, p_fin.completion_tokens)
        assert p_fin.speculation is None  # (and present with "on" when a draft ran)


async def test_greedy_text_holds_where_batch_shapes_move_the_last_bits(nursery):
    # Like llama.cpp with LLAMAFILE (or a GPU), whose results change in the last bits with a
    # batch's shape, which "on" accepts where "auto" would not draft (below): a window
    # is one batch where plain decoding ran one token per step. The favourite holds (as it
    # does for llama.cpp's greedy text away from near ties); with penalties or sampling it
    # may not, which is the price of any batched verification.
    engine = FakeEngine(slots=2, slot_ctx=512, copy_back=6, batch_sensitive=True)
    model = LocalModel.whole(engine, max_queue=2)
    await nursery.start(model.run)
    plain, _ = await run(model, "abcdef abcdef", 100, sampling=GREEDY)
    spec, fin = await run(model, "abcdef abcdef", 100, sampling=GREEDY, speculation="on")
    assert spec == plain and fin.speculation.accepted > 50


async def test_copied_text_takes_fewer_steps_and_the_receipt_counts_the_drafts(nursery):
    engine = FakeEngine(slots=2, slot_ctx=512, copy_back=6)
    model = LocalModel.whole(engine, max_queue=2)
    await nursery.start(model.run)
    before = engine.forwards
    plain, _ = await run(model, "abcdef abcdef", 120, sampling=GREEDY)
    plain_steps = engine.forwards - before
    before = engine.forwards
    spec, fin = await run(model, "abcdef abcdef", 120, sampling=GREEDY, speculation="on")
    spec_steps = engine.forwards - before
    assert spec == plain
    assert spec_steps * 4 < plain_steps, (spec_steps, plain_steps)
    s = fin.speculation
    assert s.windows >= 1 and s.drafted >= s.accepted > 90
    totals = model.runner.stats()  # what `meshagent status` shows
    assert (totals.draft_windows, totals.draft_tokens, totals.draft_accepted) == (
        s.windows,
        s.drafted,
        s.accepted,
    )
    # every token came from a window or a plain step: accepted drafts save that many steps
    assert fin.completion_tokens == 120


async def test_stop_strings_and_limits_cut_inside_a_window(served):
    _, model = served
    plain, _ = await run(model, "abcdef abcdef", 150, sampling=GREEDY)
    stop = plain[40:43]
    cut, c_fin = await run(model, "abcdef abcdef", 150, sampling=GREEDY, stop=(stop,))
    spec_cut, s_fin = await run(
        model, "abcdef abcdef", 150, sampling=GREEDY, stop=(stop,), speculation="on"
    )
    assert spec_cut == cut and s_fin.reason == c_fin.reason == "stop"
    for limit in (1, 2, 7, 33):
        spec, fin = await run(model, "abcdef abcdef", limit, sampling=GREEDY, speculation="on")
        assert (spec, fin.completion_tokens) == (plain[:limit], limit)


async def test_concurrent_speculating_and_plain_requests_match_each_alone(served):
    _, model = served
    prompts = ["abcdef abcdef", "xyz xyz xyz", "hello there", "mnop mnop mn"]
    alone = [await run(model, p, 60, sampling=GREEDY) for p in prompts]
    got: dict[int, str] = {}

    async def one(i: int) -> None:
        mode = "on" if i % 2 == 0 else "off"
        got[i] = (await run(model, prompts[i], 60, sampling=GREEDY, speculation=mode))[0]

    async with trio.open_nursery() as n:
        for i in range(len(prompts)):  # more requests than slots: one waits in the queue
            n.start_soon(one, i)
    assert [got[i] for i in range(len(prompts))] == [text for text, _ in alone]


async def test_auto_backs_off_where_drafts_miss_and_the_model_default_applies(nursery):
    engine = FakeEngine(slots=2, slot_ctx=512)  # novel text: drafts from it rarely fit
    model = LocalModel.whole(engine, max_queue=2)
    await nursery.start(model.run)
    # A window of n tokens costs 1 + 0.5 (n - 1) steps, fixed: the fake's steps cost only
    # the Python around them, which a loaded machine times at random.
    cost = model.runner.scheduler.window_cost
    cost.slope, cost.weight = 0.5, 0.0
    prompt = "ab ab ab ab cd cd cd cd ef ef"
    plain, _ = await run(model, prompt, 200, sampling=GREEDY)
    on, on_fin = await run(model, prompt, 200, sampling=GREEDY, speculation="on")
    auto, auto_fin = await run(model, prompt, 200, sampling=GREEDY, speculation="auto")
    assert on == auto == plain
    auto_windows = auto_fin.speculation.windows if auto_fin.speculation else 0
    assert auto_windows < on_fin.speculation.windows / 4


async def test_the_runner_measures_what_a_window_costs(nursery):
    # On an engine whose step costs about the same whatever its tokens, windows are cheap;
    # on one where each token costs what a step costs (a compute-bound CPU), they are not.
    # (Steps of 10 ms, so that the Python around them, slower on a loaded machine, counts
    # for little.)
    def served(token_delay):
        engine = FakeEngine(slots=2, slot_ctx=512, copy_back=6, delay=0.01 - token_delay)
        engine.token_delay = token_delay
        return LocalModel.whole(engine, max_queue=2)

    cheap, dear = served(0.0), served(0.01)
    for model in (cheap, dear):
        await nursery.start(model.run)
        await run(model, "abcdef abcdef", 120, sampling=GREEDY, speculation="on")
    assert cheap.runner.scheduler.window_cost.slope < 0.2
    assert dear.runner.scheduler.window_cost.slope > 0.7


@pytest.mark.parametrize("slope", [0.05, 0.5, 1.0])
async def test_auto_drafts_as_far_as_the_window_pays_for_itself(nursery, slope):
    # Copy-shaped text, whose drafts are right: where a window costs little, or each of its
    # tokens half a step, "auto" drafts it; where each costs a whole step, no window can pay.
    engine = FakeEngine(slots=2, slot_ctx=512)
    model = LocalModel.whole(engine, max_queue=2)
    await nursery.start(model.run)
    cost = model.runner.scheduler.window_cost
    cost.slope, cost.weight = slope, 0.0  # as if measured, and fixed
    engine.copy_back = 6
    plain, _ = await run(model, "abcdef abcdef", 120, sampling=GREEDY)
    copied, fin = await run(model, "abcdef abcdef", 120, sampling=GREEDY, speculation="auto")
    assert copied == plain
    accepted = fin.speculation.accepted if fin.speculation else 0
    assert (accepted > 80) if slope < 1 else (accepted == 0), fin.speculation
    if slope < 1:  # the cheaper the window, the longer the drafts
        assert fin.speculation.windows < (20 if slope < 0.1 else 40), fin.speculation


async def test_windows_hold_at_most_16_tokens_however_cheap(nursery):
    # llama.cpp's CPU products take a batch's tokens 16 at a time (a 17th costs about two),
    # so even where windows are nearly free a long copy's windows stop at 16 tokens; the
    # runner's timings by size show which sizes ran.
    engine = FakeEngine(slots=2, slot_ctx=512, copy_back=30)  # repeats its last 30 tokens
    model = LocalModel.whole(engine, max_queue=2)
    await nursery.start(model.run)
    cost = model.runner.scheduler.window_cost
    cost.slope, cost.weight = 0.02, 0.0  # as if measured on a GPU, and fixed
    prompt = "the quick brown fox jumps over the lazy dog"
    for mode in ("auto", "on"):
        await run(model, prompt, 200, sampling=GREEDY, speculation=mode)
    sizes = {int(n) for n in cost.summary()["steps"]}
    assert max(sizes) == MAX_DRAFT + 1 == 16, sizes


async def test_auto_learns_long_drafts_pay_where_short_ones_do_not(nursery):
    # Where each drafted token costs 0.6 of a step, a one-token draft pays a little and long
    # ones pay more only if drafts come in long right runs. From its prior (runs of 70%),
    # "auto" drafts one token at a time; a one-token window says nothing about runs, so the
    # tokens it proposed and left out must tell it (else it stays at one token for good).
    engine = FakeEngine(slots=2, slot_ctx=512, copy_back=6)
    model = LocalModel.whole(engine, max_queue=2)
    await nursery.start(model.run)
    cost = model.runner.scheduler.window_cost
    cost.slope, cost.jump, cost.weight = 0.6, 0.06, 0.0  # as measured on a CPU, and fixed
    plain, _ = await run(model, "abcdef abcdef", 120, sampling=GREEDY)
    copied, fin = await run(model, "abcdef abcdef", 120, sampling=GREEDY, speculation="auto")
    assert copied == plain
    assert fin.speculation is not None and fin.speculation.accepted > 60, fin.speculation
    assert fin.speculation.accepted / fin.speculation.windows > 4  # long windows


async def test_a_request_that_does_not_choose_gets_the_models_setting(nursery):
    model = LocalModel.whole(FakeEngine(slots=2, slot_ctx=512, copy_back=6), max_queue=2)
    await nursery.start(model.run)
    assert model.speculation == "off"  # the default
    model.speculation = "on"  # --speculation: what a request that does not choose gets
    req = GenerationRequest(model.text_tokens("abcdef abcdef"), 20, GREEDY)
    send, recv = trio.open_memory_channel(30)
    async with send:
        await model.generate(req, send)
    *_, fin = [e async for e in recv]
    assert fin.speculation is not None
    model.speculation = "off"
    send, recv = trio.open_memory_channel(30)
    async with send:
        await model.generate(req, send)
    *_, fin = [e async for e in recv]
    assert fin.speculation is None


def test_a_mode_other_than_auto_on_off_is_refused():
    from meshagent.serving.scheduler import Scheduler

    sched = Scheduler(n_slots=1, slot_ctx=64, max_queue=1, is_end=lambda t: False)
    with pytest.raises(ValueError, match="auto, on or off"):
        sched.submit(0, (1, 2), 4, GREEDY, speculation="maybe")


class _Skewed(FakeEngine):
    """A fake engine whose windows of `from_rows` tokens or more round otherwise than its
    one-token steps."""

    def __init__(self, *args, from_rows: int = 2, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.from_rows = from_rows

    def forward(self, items):
        out = super().forward(items)
        return [
            r + 1e-3 if r is not None and it.want_logits and it.rows >= self.from_rows else r
            for it, r in zip(items, out, strict=True)
        ]


def test_the_window_check_finds_what_differs():
    exact = check_windows(FakeEngine(slots=1, slot_ctx=256))
    assert exact.exact and exact.max_diff == 0.0 and exact.positions == 12
    skewed = check_windows(_Skewed(slots=1, slot_ctx=256))
    assert not skewed.exact and skewed.max_diff == pytest.approx(1e-3, rel=1e-3)
    assert "differ from one-token steps by up to 0.001" in skewed.reason
    # llama.cpp's tiled K-quant kernels take batches of 8 tokens or more only: a check
    # with small windows alone would pass there.
    tiled = check_windows(_Skewed(slots=1, slot_ctx=256, from_rows=8))
    assert not tiled.exact and tiled.max_diff == pytest.approx(1e-3, rel=1e-3)
    batchy = check_windows(FakeEngine(slots=1, slot_ctx=256, batch_sensitive=True))
    assert not batchy.exact and batchy.max_diff > 0
    known = FakeEngine(slots=1, slot_ctx=256)
    known.inexact_windows = "says so itself"
    said = check_windows(known)
    assert (said.exact, said.positions, said.reason) == (False, 0, "says so itself")


async def test_auto_drafts_only_where_windows_are_exact_and_on_drafts_anyway(nursery):
    # The check runs when the model starts; "auto" (the agent's default) then drafts only
    # on an engine whose windows compute what its steps compute. "on" is the user's choice
    # to draft where they do not.
    exact = LocalModel.whole(FakeEngine(slots=2, slot_ctx=512, copy_back=6), max_queue=2)
    skewed = LocalModel.whole(_Skewed(slots=2, slot_ctx=512, copy_back=6), max_queue=2)
    for model in (exact, skewed):
        await nursery.start(model.run)
        cost = model.runner.scheduler.window_cost
        cost.slope, cost.weight = 0.05, 0.0  # cheap windows, whatever this machine measures
    assert exact.runner.executor.exact_windows and not skewed.runner.executor.exact_windows
    _, fin = await run(exact, "abcdef abcdef", 60, sampling=GREEDY, speculation="auto")
    assert fin.speculation.accepted > 20
    _, fin = await run(skewed, "abcdef abcdef", 60, sampling=GREEDY, speculation="auto")
    assert fin.speculation is None
    assert skewed.runner.stats().draft_windows == 0
    _, fin = await run(skewed, "abcdef abcdef", 60, sampling=GREEDY, speculation="on")
    assert fin.speculation.accepted > 30


def _exact_texts(held: list[int], engine: FakeEngine, steps: int, temperature: float):
    """The probability of each text of `steps` tokens (shorter where the end token comes)
    that plain sampling at `temperature` gives after `held`: the fake's known distribution."""
    out: dict[str, float] = {}

    def walk(held: list[int], text: bytes, prob: float, left: int) -> None:
        if left == 0:
            out[text.decode()] = out.get(text.decode(), 0.0) + prob
            return
        logits = fake_logits(held, engine.n_vocab, copy_back=engine.copy_back) / temperature
        p = np.exp(logits - logits.max())
        p /= p.sum()
        for token in range(len(p)):
            q = prob * float(p[token])
            if engine.is_end_of_generation(token):
                out[text.decode()] = out.get(text.decode(), 0.0) + q
            else:
                walk([*held, token], text + engine.token_bytes(token), q, left - 1)

    walk(held, b"", 1.0, steps)
    return out


@pytest.mark.parametrize("drafter", ["text", "draft model"])
async def test_sampled_text_keeps_the_models_distribution_with_drafts(nursery, drafter):
    # Sampling with drafts must draw texts with the model's own distribution: many samples of
    # three tokens, with drafts (most of them accepted: copy-shaped text), against the
    # distribution computed from the fake's logits, by a chi-squared test. A request without
    # a seed gets a random one (`SamplingParams.seeded`); here the seeds are 0..n-1, so the
    # test gives the same verdict on every run. The drafts come from the text, or from a
    # draft model (the same arithmetic: its greedy tokens, verified through the scheduler).
    engine = FakeEngine(slots=8, slot_ctx=512, copy_back=3)
    draft = None
    if drafter == "draft model":
        draft = DraftModel(FakeEngine(slots=8, slot_ctx=512, copy_back=3), engine, same_vocab=True)
    model = LocalModel.whole(engine, max_queue=64, draft=draft)
    await nursery.start(model.run)
    prompt, steps, temperature, n = "abcabcabcabc", 3, 2.5, 2400
    exact = _exact_texts(engine.tokenize(prompt, add_bos=True), engine, steps, temperature)
    counts: Counter[str] = Counter()
    accepted = 0

    async def sample(seeds: range) -> None:
        nonlocal accepted
        for seed in seeds:
            sampling = SamplingParams(temperature=temperature, seed=seed)
            text, fin = await run(model, prompt, steps, sampling=sampling, speculation="on")
            counts[text] += 1
            accepted += fin.speculation.accepted if fin.speculation else 0

    async with trio.open_nursery() as n_:
        for i in range(8):
            n_.start_soon(sample, range(i, n, 8))
    assert sum(counts.values()) == n and set(counts) <= set(exact), set(counts) - set(exact)
    assert accepted > n / 5  # drafts were taken (one fits in three tokens), not merely offered
    # Cells with too few expected draws are pooled into one.
    cells = sorted(t for t, p in exact.items() if p * n >= 5)
    rest = 1 - sum(exact[t] for t in cells)
    observed = [counts[t] for t in cells] + [n - sum(counts[t] for t in cells)]
    expected = [exact[t] * n for t in cells] + [rest * n]
    chi2 = sum((o - e) ** 2 / e for o, e in zip(observed, expected, strict=True) if e > 0)
    dof = len(cells)  # cells + the pool - 1
    # The chi-squared value with p = 0.001 for dof degrees of freedom (Wilson-Hilferty).
    z = 3.09
    limit = dof * (1 - 2 / (9 * dof) + z * (2 / (9 * dof)) ** 0.5) ** 3
    assert len(cells) > 10 and chi2 < limit, (chi2, limit, len(cells))
    if draft is not None:  # the model's drafts were the ones verified, and a seed repeats
        assert model.runner.stats().model_accepted > n / 5
        again = SamplingParams(temperature=temperature, seed=7)
        first, _ = await run(model, prompt, 40, sampling=again, speculation="on")
        assert (await run(model, prompt, 40, sampling=again, speculation="on"))[0] == first


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=str)
async def test_a_draft_model_drafts_novel_text_and_changes_no_token(nursery, sampling):
    # Novel text, where the text's own drafts rarely fit: a draft model (here the same fake
    # arithmetic, so it knows the greedy text) drafts it, computed outside the scheduler's
    # lock, and the text is what plain decoding gives.
    engine = FakeEngine(slots=2, slot_ctx=512)
    draft = DraftModel(FakeEngine(slots=2, slot_ctx=512), engine, same_vocab=True)
    model = LocalModel.whole(engine, max_queue=2, draft=draft)
    await nursery.start(model.run)
    prompt = "ab ab ab ab cd cd cd cd ef ef"
    before = engine.forwards
    plain, p_fin = await run(model, prompt, 120, sampling=sampling)
    plain_steps = engine.forwards - before
    before = engine.forwards
    spec, s_fin = await run(model, prompt, 120, sampling=sampling, speculation="on")
    spec_steps = engine.forwards - before
    assert spec == plain and s_fin.completion_tokens == p_fin.completion_tokens
    s = s_fin.speculation
    assert s is not None and s.windows >= 1 and s.accepted > 0
    assert s.draft_model == "fake" and 1 <= s.model_windows <= s.windows
    assert 0 < s.model_accepted <= s.model_drafted <= s.drafted
    if sampling.greedy:  # it drafts the very greedy text: most windows are taken whole
        assert s.accepted > 0.9 * s.drafted and spec_steps * 4 < plain_steps
    assert draft.holds(0) is False and draft.holds(1) is False  # slots freed at the end


async def test_a_draft_model_with_auto_and_requests_at_once(nursery):
    engine = FakeEngine(slots=2, slot_ctx=512)
    draft = DraftModel(FakeEngine(slots=2, slot_ctx=512), engine, same_vocab=True)
    model = LocalModel.whole(engine, max_queue=4, draft=draft)
    await nursery.start(model.run)
    prompts = ["ab ab ab ab cd cd", "the cat sat", "xyz xyz", "hello there"]
    alone = [(await run(model, p, 60, sampling=GREEDY))[0] for p in prompts]
    got: dict[int, str] = {}

    async def one(i: int) -> None:
        mode = ("auto", "on", "off", "auto")[i]
        got[i] = (await run(model, prompts[i], 60, sampling=GREEDY, speculation=mode))[0]

    async with trio.open_nursery() as n:
        for i in range(len(prompts)):  # more requests than slots: some wait in the queue
            n.start_soon(one, i)
    assert [got[i] for i in range(len(prompts))] == alone


async def test_auto_counts_the_draft_models_compute_and_a_dear_one_proposes_rarely(nursery):
    # The draft model knows the greedy text (the same fake arithmetic) but each of its
    # forward passes costs ten of the target's steps: no window of its drafts pays for that,
    # so "auto" asks it only for a short proposal every PROBE_EVERY steps (what keeps the
    # acceptance known), and the text is plain decoding's.
    from meshagent.serving.draft_policy import PROBE_EVERY, PROBE_TOKENS

    engine = FakeEngine(slots=2, slot_ctx=512)
    engine.delay = 0.002
    draft_engine = FakeEngine(slots=2, slot_ctx=512)
    draft_engine.delay = 0.02
    draft = DraftModel(draft_engine, engine, same_vocab=True)
    model = LocalModel.whole(engine, max_queue=2, draft=draft)
    await nursery.start(model.run)
    prompt = "ab ab ab ab cd cd cd cd ef ef"
    plain, _ = await run(model, prompt, 160, sampling=GREEDY)
    before = draft.forwards
    spec, fin = await run(model, prompt, 160, sampling=GREEDY, speculation="auto")
    assert spec == plain
    policy = model.runner.scheduler.drafting
    assert policy.model_forward is not None and policy.model_extra() > 3
    # Before its cost is known it proposes in full; then a probe's tokens every PROBE_EVERY.
    probes = fin.completion_tokens / PROBE_EVERY * (PROBE_TOKENS + 1)
    assert draft.forwards - before < 2 * (MAX_DRAFT + 1) + probes, draft.forwards - before


async def test_auto_judges_the_draft_models_drafts_apart_from_the_texts(nursery):
    # Copy-shaped text (the token five back comes again), where the text's own drafts are
    # right, and a draft model that knows none of it (the plain fake arithmetic): "auto"
    # learns the model's drafts miss, and its doubt does not stop the text's, which go.
    # A step's time is mostly fixed (a window of 16 costs 1.4 steps): windows pay.
    engine = FakeEngine(slots=2, slot_ctx=512, copy_back=5)
    engine.delay, engine.token_delay = 0.002, 0.00005
    draft = DraftModel(FakeEngine(slots=2, slot_ctx=512), engine, same_vocab=True)
    model = LocalModel.whole(engine, max_queue=2, draft=draft)
    await nursery.start(model.run)
    prompt = "ab cd ef gh ij kl"
    plain, _ = await run(model, prompt, 200, sampling=GREEDY)
    spec, fin = await run(model, prompt, 200, sampling=GREEDY, speculation="auto")
    assert spec == plain
    s = fin.speculation
    assert s is not None and s.model_accepted <= 0.5 * max(1, s.model_drafted)
    text_accepted = s.accepted - s.model_accepted
    assert text_accepted > 0.6 * fin.completion_tokens, s
