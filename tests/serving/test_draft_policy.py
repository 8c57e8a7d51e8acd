"""The drafting policy on its own: which drafts a sequence sends, what their verdicts teach,
and when a window may follow one in flight; plain calls on a sequence's state, no scheduler."""

from __future__ import annotations

import itertools

import pytest

from meshagent.serving.draft_policy import DraftCounts, DraftPolicy
from meshagent.serving.drafting import MAX_DRAFT, best_draft
from meshagent.serving.sampling import SamplingParams
from meshagent.serving.sequence import SeqState, Window

GREEDY = SamplingParams(temperature=0.0)
END = 0
LOOP = (5, 6, 7, 8) * 3  # its text proposes 5, 6, 7, 8 next


def policy(*, max_windows: int = 1, slope: float | None = None) -> DraftPolicy:
    p = DraftPolicy(slot_ctx=64, is_end=lambda t: t == END, max_windows=max_windows)
    if slope is not None:  # a window's cost, fixed
        p.cost.slope, p.cost.jump, p.cost.weight = slope, 0.0, 0.0
    return p


def decoding(p: DraftPolicy, mode: str, prompt=LOOP, *, limit: int = 30) -> SeqState:
    """A sequence whose prompt has run: its last token is its next input."""
    s = SeqState(0, prompt, limit, GREEDY)
    s.drafts = p.start(mode, prompt, ())
    s.n_past = len(prompt) - 1
    return s


def sent(s: SeqState, draft: tuple[int, ...], *, guess: int | None = None, at=None) -> Window:
    """`s` sends a window with `draft` (a follow-up with `guess`), timed from `at`."""
    w = Window(s.n_past, draft, guess, sent_at=at)
    s.windows.append(w)
    s.n_past += len(draft) + 1 + (guess is not None)
    s.busy = True
    return w


def test_a_sequence_drafts_as_its_speculation_says():
    p = policy()
    assert p.start("off", LOOP, ()) is None
    on = p.start("on", LOOP, ())
    assert on is not None and on.length is not None and on.acceptance is None
    auto = p.start("auto", LOOP, ())
    assert auto is not None and auto.length is None and auto.acceptance is not None
    # "auto" judges a copy by how often the copy goes on, which its drafter counts
    assert auto.acceptance.follow is auto.drafter.follow
    with pytest.raises(ValueError):
        p.start("always", LOOP, ())


def test_on_drafts_its_length_within_the_budget_the_limit_and_the_slot():
    p = policy()
    s = decoding(p, "on")
    assert p.draft(s, budget=100) == (5, 6, 7, 8)  # DraftLength starts at 4
    assert p.draft(s, budget=2) == (5, 6)
    s.generated = s.limit - 3  # room for the last token and two drafts
    assert p.draft(s, budget=100) == (5, 6)
    s.generated = s.limit - 1  # the next token is its last: nothing to draft
    assert p.draft(s, budget=100) == ()
    assert p.draft(decoding(p, "off"), budget=100) == ()


def test_auto_drafts_where_a_window_pays_and_else_watches_what_it_would_have_drafted():
    cheap = policy(slope=0.05)
    s = decoding(cheap, "auto")
    assert cheap.draft(s, budget=100) == (5, 6, 7, 8)
    dear = policy(slope=1.5)
    s = decoding(dear, "auto")
    assert dear.draft(s, budget=100) == ()
    assert s.drafts.shadow == (5, 6, 7, 8)  # checked against the tokens decoded instead
    first = s.drafts.acceptance.first.value
    dear.read(s, 5)  # the model's own token: the first would have been right
    assert s.drafts.acceptance.first.value > first
    assert s.drafts.shadow == (6, 7, 8) and s.drafts.shadow_after
    dear.read(s, 9)  # and the second wrong: the watch ends
    assert s.drafts.shadow == ()


def test_each_token_of_a_window_is_judged_against_its_draft_and_counted():
    p = policy()
    s = decoding(p, "on")
    w = sent(s, (5, 6, 7))
    verdicts = [p.judge(w, t) for t in (5, 6, 9)]
    assert [(v.at, v.right) for v in verdicts] == [(0, True), (1, True), (2, False)]
    assert (verdicts[-1].drafted, verdicts[-1].accepted) == (3, 2)
    assert p.counts == DraftCounts(windows=1, tokens=3, accepted=2)
    plain = sent(decoding(p, "off"), ())
    assert not p.judge(plain, 4).right
    assert p.counts == DraftCounts(windows=1, tokens=3, accepted=2)  # no draft, no count


def test_on_doubles_after_a_draft_accepted_whole_and_cuts_after_a_miss():
    p = policy()
    s = decoding(p, "on")
    w = sent(s, (5, 6, 7, 8))
    for t in (5, 6, 7, 8):
        p.judge(w, t)
    s.windows.popleft()
    p.closed(s, w, p.judge(w, 5), 5, void=0, now=None)
    assert s.drafts.length.k == 8
    w = sent(s, (6, 7, 8, 5, 6, 7, 8, 5))
    p.judge(w, 6)
    v = p.judge(w, 9)
    s.windows.popleft()
    p.closed(s, w, v, 9, void=0, now=None)
    assert s.drafts.length.k == 2  # one more than it got right


def test_a_windows_trip_is_what_a_window_of_its_length_costs_and_void_tokens_count():
    p = policy()
    s = decoding(p, "off")
    w = sent(s, (), at=1.0)
    v = p.judge(w, 4)
    s.windows.popleft()
    p.closed(s, w, v, 4, void=3, now=1.25)
    assert p.cost.summary()["steps"] == {"1": {"count": 1, "mean_ms": 250.0}}
    assert p.counts.tokens == 3  # the void windows' drafts were sent too


def test_auto_learns_from_the_token_after_a_short_draft_that_was_right():
    p = policy()
    s = decoding(p, "auto")
    draft = p.draft(s, budget=100)
    assert draft == (5, 6) and s.drafts.beyond == 7  # proposed, not sent
    w = sent(s, draft)
    p.judge(w, 5)
    p.judge(w, 6)
    then = s.drafts.acceptance.then.value
    v = p.judge(w, 7)  # the model's own token after the draft: the left-out one was right
    s.windows.popleft()
    p.closed(s, w, v, 7, void=0, now=None)
    assert s.drafts.beyond is None
    assert s.drafts.acceptance.then.value > then


def test_a_window_follows_one_in_flight_only_where_the_executor_holds_more():
    one = policy()
    s = decoding(one, "on")
    sent(s, (5, 6))
    assert one.follow_up(s, budget=100) == ()
    two = policy(max_windows=2)
    s = decoding(two, "on")
    sent(s, (5, 6))
    # it guesses the window ends with 7 (after 5, 6 right), then drafts on from there
    assert two.follow_up(s, budget=100) == (7, 8, 5, 6)
    sent(s, (8, 5, 6, 7), guess=7)
    assert two.follow_up(s, budget=100) == ()  # two in flight: as many as it holds


def test_no_window_follows_a_drafted_end_or_runs_past_the_limit():
    p = policy(max_windows=3)
    ends = decoding(p, "on", (5, 6, END, 8) * 3)
    sent(ends, (5, 6, END))
    assert p.follow_up(ends, budget=100) == ()
    full = decoding(p, "on", limit=3)
    sent(full, (5, 6))  # three tokens promised: the last
    assert p.follow_up(full, budget=100) == ()
    room = decoding(p, "on", limit=4)
    sent(room, (5, 6))
    assert p.follow_up(room, budget=100) == (7,)  # the guess alone: one token more


def test_auto_sends_a_follow_up_only_where_its_tokens_are_likely_enough_right():
    cheap = policy(max_windows=2, slope=0.05)
    s = decoding(cheap, "auto")
    sent(s, (5, 6))
    assert cheap.follow_up(s, budget=100)[:1] == (7,)
    dear = policy(max_windows=2, slope=1.5)
    s = decoding(dear, "auto")
    sent(s, (5, 6))
    assert dear.follow_up(s, budget=100) == ()


def test_drafts_stop_at_max_draft():
    p = policy()
    s = decoding(p, "on", tuple(range(2, 20)) * 2, limit=25)
    s.drafts.length.k = s.drafts.length.max_k
    assert len(p.draft(s, budget=100)) == MAX_DRAFT


def test_auto_weighs_the_draft_models_proposal_against_the_texts_by_each_ones_acceptance():
    from meshagent.serving.draft_model import DraftModel
    from meshagent.testing.fake_engine import FakeEngine

    p = policy(slope=0.1)  # (across tokenizers: a model's prior is below the text's)
    p.model = DraftModel(FakeEngine(slots=2, slot_ctx=64), FakeEngine(), same_vocab=False)
    s = SeqState(0, LOOP, 30, GREEDY)
    s.drafts = p.start("auto", LOOP, (), seq=0)
    s.n_past = len(LOOP) - 1
    d = s.drafts.drafter
    model_acc, text_acc = d.accepts, s.drafts.acceptance
    assert model_acc is not None and text_acc is not None and model_acc is not text_acc
    d.offer = (d.key(), (9, 9, 9, 9))  # the model's proposal; the text's is 5, 6, 7, 8
    # Before evidence the text's goes (a model's prior is lower); once the model's drafts
    # were right, the model's.
    assert p.draft(s, budget=100) == (5, 6, 7, 8)
    for _ in range(6):
        model_acc.update(4, 4)
    assert p.draft(s, budget=100) == (9, 9, 9, 9) and d.from_model
    # The model's windows miss: its own acceptance learns it, the text's does not move.
    before = text_acc.rate
    for _ in range(6):
        w = sent(s, (9, 9, 9, 9))
        w.model = True
        verdict = p.judge(w, 5)
        s.windows.popleft()
        p.closed(s, w, verdict, 5, void=0, now=None)
        s.busy = False
    assert model_acc.rate < 0.4 and text_acc.rate == before
    assert p.draft(s, budget=100) == (5, 6, 7, 8)  # now the text's goes
    assert not d.from_model


def _with_draft_model(
    p: DraftPolicy, prompt: tuple[int, ...], limit: int, *, same_vocab: bool = True
) -> SeqState:
    """A sequence of `p` (which drafts with a draft model) past its prompt, decoding."""
    from meshagent.serving.draft_model import DraftModel
    from meshagent.testing.fake_engine import FakeEngine

    p.model = DraftModel(FakeEngine(slots=2, slot_ctx=512), FakeEngine(), same_vocab=same_vocab)
    s = SeqState(0, prompt, limit, GREEDY)
    s.drafts = p.start("auto", prompt, (), seq=0)
    s.n_past = len(prompt)
    s.pending = [prompt[-1]]
    return s


def _decoded(s: SeqState, tokens: int) -> None:
    """`s` decoded `tokens` more, none of which its text repeats."""
    s.drafts.drafter.extend(range(10_000 + s.generated, 10_000 + s.generated + tokens))
    s.generated += tokens


def _right_for_8(s: SeqState) -> None:
    """The draft model's windows of 4 were right 8 times over, then `s` decoded 8 tokens."""
    for _ in range(8):
        s.drafts.drafter.accepts.update(4, 4)
    _decoded(s, 8)


def _timed(p: DraftPolicy) -> None:
    """A one-token step takes 0.1 s, a window of two 0.11 s."""
    p.cost.observe(1, 0.1)
    p.cost.observe(2, 0.11)


def test_a_dear_draft_models_probes_stay_within_a_share_of_the_sequences_time():
    # Each of its forward passes costs 4 of the target's steps (0.1 s), a token it catches up
    # on 0.0005 s: no window of its drafts pays. Its first probe, which catches up on the
    # 200-token prompt, waits until the sequence's share of 1% covers it; later ones catch up
    # on the tokens since, and all of them together stay within that share.
    from meshagent.serving.draft_policy import PROBE_EVERY, PROBE_SHARE, PROBE_TOKENS

    p = policy()
    _timed(p)
    s = _with_draft_model(p, tuple(range(1, 201)), limit=100_000)
    p.model_timed(1, 1, 0.4)
    p.model_timed(5, 100, 100 * 0.0005 + 4 * 0.4)  # (a feed of 100 tokens, then 4 passes)
    assert p.model_forward == pytest.approx(0.4) and p.model_feed == pytest.approx(0.0005)
    asked_at = []
    for _ in range(12_000):
        _decoded(s, 1)
        if (want := p.wanted(s)) is not None:
            assert want[0] == PROBE_TOKENS
            spent = p.catch_up(s) + PROBE_TOKENS * 0.4
            assert s.drafts.model_spent + spent <= PROBE_SHARE * s.generated * 0.1 + 1e-9
            asked_at.append(s.generated)
            p.offer(s, want[2], (9,) * PROBE_TOKENS, spent)
    assert asked_at[0] >= ((200 + asked_at[0]) * 0.0005 + PROBE_TOKENS * 0.4) / (PROBE_SHARE * 0.1)
    gaps = [b - a for a, b in itertools.pairwise(asked_at)]
    assert len(asked_at) >= 3 and min(gaps) >= PROBE_EVERY
    # A draft model that catches up dearer than the share grows never probes at all.
    p.model_feed = 0.12
    fresh = _with_draft_model(p, tuple(range(1, 201)), limit=100_000)
    for _ in range(2_000):
        _decoded(fresh, 1)
        assert p.wanted(fresh) is None


def test_drafts_that_pay_wait_while_catching_up_would_cost_more_than_they_save():
    # A cheap draft model, always right: its drafts pay. Catching up on a short prompt costs
    # little against what they save over a long answer, so it is asked at once; a prompt of
    # 400 tokens with a short answer left is not worth its catching up.
    p = policy()
    _timed(p)
    p.model_timed(1, 1, 0.01)
    p.model_timed(1, 100, 100 * 0.005)
    short = _with_draft_model(p, tuple(range(1, 21)), limit=200)
    _right_for_8(short)
    assert p.wanted(short) is not None
    long = _with_draft_model(p, tuple(range(1, 401)), limit=12)
    _right_for_8(long)
    assert p.catch_up(long) == pytest.approx(408 * 0.005)
    assert p.wanted(long) is None


def test_while_windows_travel_the_draft_model_catches_up_where_its_drafts_would_pay():
    # A trip takes 0.1 s and a token the draft model reads 0.004 s: it reads 25 of the 428
    # it lacks while a window travels, none once the trip is due, and none for drafts that
    # do not pay.
    p = policy(max_windows=4)
    _timed(p)
    p.model_timed(1, 1, 0.01)
    p.model_timed(1, 100, 100 * 0.004)
    s = _with_draft_model(p, tuple(range(1, 421)), limit=40)
    _right_for_8(s)
    assert p.wanted(s) is None  # catching up on 428 tokens costs more than 32 would save
    s.pending = []
    sent(s, (), at=10.0)
    assert p.catch_up_wanted(s, now=10.0) == 25
    # Read a few at a time it took twice as long a token as a proposal's reading: what it
    # reads in a trip follows the one, what a proposal would wait on the other.
    p.caught_up(s, 25, 0.2)
    assert p.catch_up(s) == pytest.approx((428 - 25) * 0.004)
    assert p.catch_up_wanted(s, now=10.0) == 12
    assert p.catch_up_wanted(s, now=10.2) == 0
    for _ in range(20):
        s.drafts.drafter.accepts.update(0, 4)
    assert p.catch_up_wanted(s, now=10.0) == 0


def test_while_the_texts_copy_goes_the_draft_model_reads_on_and_drafts_where_it_ends():
    # An answer that retells its prompt word for word, then goes its own way: while the copy
    # goes, the text's drafts go and the model proposes nothing, but it reads the text while
    # the windows travel; where the copy ends it holds the text, so its drafts go at once
    # instead of waiting on a catching up that would cost more than they save.
    p = policy(max_windows=4)
    _timed(p)
    p.model_timed(1, 1, 0.01)
    p.model_timed(1, 100, 100 * 0.004)
    prompt = tuple(range(100, 400))
    s = _with_draft_model(p, prompt, limit=80)
    s.drafts.drafter.extend(prompt[:8])  # the answer retells the prompt
    s.generated = 8
    p.caught_up(s, len(prompt) + 8, 1.2)  # (it read the prompt while the prompt travelled)
    s.pending = []
    for at in range(8, 48, 4):  # four tokens a trip
        sent(s, (), at=10.0)
        s.drafts.drafter.extend(prompt[at : at + 4])
        s.generated += 4
        assert s.drafts.drafter.copying
        assert p.wanted(s) is None  # (the copy's draft goes)
        n = p.catch_up_wanted(s, now=10.0)
        assert n == 4  # all it lacks, well within a trip of 0.1 s
        p.caught_up(s, n, n * 0.004)
        s.windows.popleft()
    s.busy, s.pending = False, [7]
    _decoded(s, 2)  # the answer goes its own way
    assert not s.drafts.drafter.copying and p.catch_up(s) == pytest.approx(2 * p.model_feed)
    assert p.wanted(s) is not None


def test_a_new_sequence_starts_from_what_the_draft_models_tokens_did_before():
    # A draft model of the target's vocabulary starts from 0.8; once its windows were right
    # over 40 tokens, a new sequence starts from that instead, and its first draft is as long
    # as a window goes.
    from meshagent.serving.draft_policy import MODEL_PRIOR_SAME_VOCAB

    p = policy(slope=0.05)
    s = _with_draft_model(p, tuple(range(1, 41)), limit=200)
    assert s.drafts.drafter.accepts.rate == pytest.approx(MODEL_PRIOR_SAME_VOCAB)
    s.pending = []
    for _ in range(10):  # windows of the model's 4 tokens and its own, all right
        w = sent(s, (5, 6, 7, 8))
        w.model = True
        for token in (5, 6, 7, 8, 9):
            verdict = p.judge(w, token)
        s.windows.popleft()
        p.closed(s, w, verdict, 9, void=0, now=None)
    fresh = _with_draft_model(p, tuple(range(1, 41)), limit=200)
    assert fresh.drafts.drafter.accepts.rate > 0.99
    assert best_draft(fresh.drafts.drafter.accepts, p.cost, MAX_DRAFT) == MAX_DRAFT
    # A poor record never starts one below the prior.
    p.model_right.update(0, 400)
    poor = _with_draft_model(p, tuple(range(1, 41)), limit=200)
    assert poor.drafts.drafter.accepts.rate == pytest.approx(MODEL_PRIOR_SAME_VOCAB)


def test_a_copy_whose_drafts_no_longer_pay_gives_way_to_the_draft_model():
    # The answer follows its prompt, but keeps going off it: where a window of the copy no
    # longer pays, the model is asked while the text still copies, and its window goes,
    # judged as the model's (not as the copy's).
    p = policy(max_windows=1, slope=0.5)
    _timed(p)
    p.cost.slope, p.cost.jump = 0.5, 0.0
    p.model_timed(1, 1, 0.005)
    p.model_timed(1, 100, 100 * 0.001)
    prompt = tuple(range(100, 160))
    s = _with_draft_model(p, prompt, limit=200)
    s.drafts.drafter.extend(prompt[:12])  # it retells the prompt
    s.generated = 12
    p.caught_up(s, len(prompt) + 12, 0.07)
    d = s.drafts
    assert d.drafter.copying and p.wanted(s) is None  # the copy goes
    for _ in range(40):
        d.drafter.follow.update(0, 1)  # and then keeps going off its source
    assert d.drafter.copying
    asked = p.wanted(s)
    assert asked is not None
    k, _, key = asked
    p.offer(s, key, (900, 901, 902, 903)[:k], 0.02)
    draft = p.draft(s, budget=64)
    assert draft and draft == (900, 901, 902, 903)[: len(draft)]
    assert p.from_model(s) and not d.copying


def test_while_its_prompt_travels_the_draft_model_reads_it_and_drafts_from_the_first_token():
    # At a split's entry a prompt's trip through the stages leaves the proposing thread idle:
    # the draft model reads the prompt meanwhile (32 tokens at a time before its reading was
    # timed, then what it reads in a trip), and a sequence whose prompt it holds is asked
    # for drafts from its first token, where one whose prompt it lacks waits MODEL_AFTER.
    from meshagent.serving.draft_policy import MODEL_AFTER

    p = policy(max_windows=4)
    s = _with_draft_model(p, tuple(range(1, 81)), limit=200)
    s.pending = []
    sent(s, ())  # the prompt's last chunk: its token comes a trip later
    read = 0
    while n := p.catch_up_wanted(s):
        assert n == min(32, 80 - read)
        p.caught_up(s, n, n * 0.004)
        read += n
    assert read == 80 and p.catch_up(s) == 0
    s.windows.popleft()
    s.busy, s.pending = False, [7]
    _decoded(s, 1)
    assert p.wanted(s) is not None
    lacking = _with_draft_model(p, tuple(range(1, 81)), limit=200)
    _decoded(lacking, 1)
    assert p.wanted(lacking) is None
    _decoded(lacking, MODEL_AFTER - 1)
    assert p.wanted(lacking) is not None
    # Timed: a trip of 0.1 s, a token read in 0.004 s, so 25 at a time; none for a prompt of
    # a sequence whose drafts do not pay.
    _timed(p)
    p.model_timed(1, 1, 0.01)
    p.model_timed(1, 100, 100 * 0.004)
    timed = _with_draft_model(p, tuple(range(1, 81)), limit=200)
    timed.pending = []
    sent(timed, ())
    assert p.catch_up_wanted(timed) == 25
    for _ in range(20):
        timed.drafts.drafter.accepts.update(0, 4)
    assert p.catch_up_wanted(timed) == 0


def test_a_draft_models_window_counts_the_forward_passes_beyond_its_draft():
    # A window of k of the model's tokens costs it k + 1 forward passes (it is asked for one
    # more, to learn whether a longer draft would have been right), and across tokenizers
    # k + 2 (one more to cut at a boundary both agree on). At a forward pass of 0.3 steps and
    # the model's prior, one drafted token would pay counted alone; counted in full, none.
    from meshagent.serving.drafting import best_draft, draft_gain

    p = policy()
    _timed(p)  # a window of two tokens costs 1.1 steps
    s = _with_draft_model(p, tuple(range(1, 21)), limit=200, same_vocab=False)
    p.model_timed(1, 1, 0.03)
    assert p.model_extra() == pytest.approx(0.3) and p.model_overhead() == pytest.approx(0.6)
    accepts = s.drafts.drafter.accepts
    assert draft_gain(accepts, p.cost, 1, 0.3) > 1.05
    assert best_draft(accepts, p.cost, MAX_DRAFT, extra=0.3, overhead=p.model_overhead()) == 0
    _decoded(s, 8)
    assert p.wanted(s) is None  # (no probe due yet either)
    p.model.same_vocab = True
    assert p.model_overhead() == pytest.approx(0.3)
    # At a split's entry the model proposes while windows travel: those passes are hidden.
    p.max_windows = 4
    assert p.model_overhead() == 0.0


def test_a_draft_model_of_the_targets_own_vocabulary_starts_from_a_higher_prior():
    # Mostly the target's family (or the target itself): right far more often than a model
    # across tokenizers, so its drafts are weighed from 0.8 before evidence, not 0.5.
    from meshagent.serving.draft_policy import MODEL_PRIOR, MODEL_PRIOR_SAME_VOCAB

    p = policy()
    same = _with_draft_model(p, tuple(range(1, 21)), limit=200)
    assert same.drafts.drafter.accepts.expected(1) == pytest.approx(1 + MODEL_PRIOR_SAME_VOCAB)
    across = _with_draft_model(p, tuple(range(1, 21)), limit=200, same_vocab=False)
    assert across.drafts.drafter.accepts.expected(1) == pytest.approx(1 + MODEL_PRIOR)
