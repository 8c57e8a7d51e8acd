"""Drafting and verification for speculative decoding (`serving/drafting.py`): what the
drafter proposes, and that decoding with drafts, however bad, gives exactly the tokens
decoding without them gives."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshagent.serving import drafting
from meshagent.serving.drafting import (
    FOLLOW_WEIGHT,
    Acceptance,
    DraftLength,
    SuffixDrafter,
    WindowCost,
    best_draft,
    follow_up_draft,
    verify,
)
from meshagent.serving.sampling import Sampler, SamplingParams
from meshagent.testing.fake_engine import EOS, fake_logits

V = 40


def test_proposes_what_followed_the_suffix_before():
    d = SuffixDrafter([1, 2, 3, 4, 1, 2])
    assert d.propose(3) == (3, 4, 1)
    assert d.propose(10) == (3, 4, 1, 2)  # no further than the sequence goes
    assert d.propose(0) == ()


def test_the_most_recent_occurrence_and_the_longest_suffix_win():
    assert SuffixDrafter([1, 2, 3, 1, 2, 4, 1, 2]).propose(1) == (4,)
    assert SuffixDrafter([5, 1, 2, 3, 9, 1, 2, 4, 5, 1, 2]).propose(1) == (3,)


def test_no_proposal_without_an_earlier_occurrence():
    assert SuffixDrafter([1, 2, 3, 4]).propose(4) == ()
    assert SuffixDrafter([7, 7]).propose(2) == ()  # (7, 7) never occurred before its end
    assert SuffixDrafter([7, 7, 7]).propose(2) == (7,)
    assert SuffixDrafter().propose(3) == ()
    with pytest.raises(ValueError):
        SuffixDrafter(min_n=3, max_n=2)


@given(st.lists(st.integers(0, 4), max_size=60), st.integers(0, 60), st.integers(1, 8))
def test_extending_token_by_token_is_building_at_once(tokens, cut, k):
    d = SuffixDrafter(tokens[:cut])
    d.extend(tokens[cut:])
    at_once = SuffixDrafter(tokens)
    assert (d.tokens, d._after) == (at_once.tokens, at_once._after)
    if d.cursor is not None and d.cursor.trusted:
        return  # it drafts the text it follows, which one built at once does not know
    assert d.propose(k) == at_once.propose(k)
    # and what it proposes did follow that suffix somewhere before
    proposal = d.propose(k)
    if proposal:
        n = 2
        suffix = tuple(tokens[len(tokens) - n :])
        starts = [i for i in range(len(tokens) - n) if tuple(tokens[i : i + n]) == suffix]
        assert any(tuple(tokens[i + n : i + n + len(proposal)]) == proposal for i in starts)


def windows_to_write(d: SuffixDrafter, answer: list[int], k: int = 16) -> list[int]:
    """Decode `answer` with drafts from `d` checked against it: the tokens each window
    yields (its accepted drafts and the token after them)."""
    at, got = 0, []
    while at < len(answer):
        draft = d.propose(k)
        n = 0
        while n < len(draft) and at + n < len(answer) and draft[n] == answer[at + n]:
            n += 1
        window = answer[at : at + n + 1]
        d.extend(window)
        at += len(window)
        got.append(len(window))
    return got


OLD, NEW = 50, (60, 61)  # a variable's name, and the two tokens of the name it gets
CODE = [10, 11, 12, OLD, 13, 14, 15, 16, 17, 18, 19, OLD, 20, 21, 22, 23, 24, 25, 26, 27]
CODE += [OLD, 28, 29, 30, 31, 32, 33, 34, OLD, 35, 36, 37, 38]


def renamed(code: list[int]) -> list[int]:
    return [t for c in code for t in (NEW if c == OLD else (c,))]


def test_a_rename_is_learnt_where_it_is_first_made_and_drafted_where_it_comes_again():
    prompt = [1, 2, *CODE, 3, 4, OLD, 5, *NEW, 6]  # the code, then "rename OLD to NEW"
    answer = renamed(CODE)
    windows = windows_to_write(SuffixDrafter(prompt), answer)
    # After the first use, the drafts copy the code with the new name in: each later use
    # lies inside a window, and the rest takes two windows.
    assert windows[-2:] == [17, 7], windows
    # A drafter that learns no edit breaks its draft at every use of the name.
    plain = SuffixDrafter(prompt)
    plain.copier.edits = _Forgetful()
    assert len(windows_to_write(plain, answer)) >= len(windows) + 3


class _Forgetful(dict):
    def __setitem__(self, key, value):  # learns nothing
        pass


def test_an_edit_is_not_forced_where_the_text_keeps_the_original():
    # The name is renamed in code but kept where it is a word in a string: drafts propose
    # the edit, the text writes the original, and the cursor follows the original.
    prompt = [1, *CODE, 2]
    answer = renamed(CODE[:12]) + CODE[12:]
    d = SuffixDrafter(prompt)
    d.extend(answer[:16])
    assert d.copier.edits == {(OLD,): NEW}
    d.extend(answer[16:])
    assert d.cursor is not None and d.cursor.following


def test_an_edit_is_learnt_only_once_the_text_is_back_on_its_source_for_a_second_token():
    prompt = [1, *CODE, 2]
    d = SuffixDrafter(prompt)
    d.extend(CODE[:11])  # following the copy
    d.extend([70, 20])  # the name replaced by 70... and back on the source (20 after OLD)
    assert d.copier.edits == {}  # one token back is not yet an edit
    d.extend([21])
    assert d.copier.edits == {(OLD,): (70,)}
    # a detour that comes back on a token by chance is not learnt
    d2 = SuffixDrafter(prompt)
    d2.extend(CODE[:11])
    d2.extend([70, 20, 99])
    assert d2.copier.edits == {}


def test_a_cursor_drafts_only_once_it_has_followed_its_source_for_a_few_tokens():
    prompt = [5, 6, 7, 8, 9, 10, 11, 12]
    d = SuffixDrafter(prompt)
    d.extend([20, 6, 7])  # (6, 7) occurred before: a cursor, not yet trusted
    assert d.cursor is not None and not d.cursor.trusted
    assert d.propose(4) == (8, 9, 10, 11)  # the n-gram's continuation, as always
    d.extend([8, 9, 10])
    assert d.cursor.trusted and d.propose(3) == (11, 12, 20)


def test_an_edit_as_long_as_what_it_replaced_keeps_the_cursor_trusted():
    # A number changed digit for digit ("port": 9337 becomes 9400): back on the source
    # after as many tokens as it replaced, the copy goes on at once.
    doc = [20, 21, 22, 23, 30, 31, 32, 9, 3, 3, 7, 33, 34, 35, 36, 37, 38]
    d = SuffixDrafter([1, *doc, 2])
    d.extend([20, 21, 22, 23, 30, 31, 32, 9, 4, 0, 0, 33])
    assert d.cursor is not None and d.cursor.following and d.cursor.trusted
    assert d.propose(3) == (34, 35, 36)
    # One that wrote more tokens than it replaced, and more than a short edit writes, has to
    # earn it again.
    d2 = SuffixDrafter([1, *doc, 2])
    d2.extend([20, 21, 22, 23, 30, 31, 32, 9, 4, 0, 0, 0, 0, 7, 33])
    assert d2.cursor is not None and d2.cursor.following and not d2.cursor.trusted


def test_drafts_in_flight_move_the_cursor_without_teaching_it():
    prompt = [1, *CODE, 2]
    d = SuffixDrafter(prompt)
    d.extend(renamed(CODE[:13]))  # the rename learnt
    assert d.copier.edits == {(OLD,): NEW}
    ahead = CODE[13:19]  # drafts in flight, right so far
    assert d.propose(4, ahead) == (27, *NEW, 28)
    d.propose(4, [*CODE[13:19], 99, 98, 97])  # wrong drafts in flight teach nothing
    assert d.copier.edits == {(OLD,): NEW}


SPELT = 51  # the variable's name spelt by another token (after a brace, without a space)
NAMES = {OLD: "total", SPELT: "total", 60: "running", 61: "_sum", 62: "running"}
FSTRING = [40, 41, SPELT, 42, 43]  # `print(f"total={total}")`, SPELT where the name is
F_RENAMED = [40, 41, SPELT, 42, 62, 61, 43]  # the text keeps the first, renames the second


def wasted(d: SuffixDrafter, answer: list[int], k: int = 16) -> int:
    """Draft tokens proposed and rejected while decoding `answer` (see windows_to_write)."""
    at, lost = 0, 0
    while at < len(answer):
        draft = d.propose(k)
        n = 0
        while n < len(draft) and at + n < len(answer) and draft[n] == answer[at + n]:
            n += 1
        lost += len(draft) - n
        d.extend(answer[at : at + n + 1])
        at += n + 1
    return lost


def test_a_draft_stops_before_a_renamed_name_spelt_otherwise_or_also_kept():
    code = [*CODE[:20], 40, 41, SPELT, 42, SPELT, 43, *CODE[20:]]
    answer = [*renamed(CODE[:20]), *F_RENAMED, *renamed(CODE[20:])]
    prompt = [1, 2, *code, 3]
    d = SuffixDrafter(prompt, name=NAMES.get)
    d.extend(answer[:24])  # the rename learnt, up to the f-string's `f"`
    assert d.copier.edits == {(OLD,): NEW}
    # Ahead: the name spelt otherwise, which no edit covers: the draft stops before it.
    assert d.propose(8) == ()
    d.extend([SPELT, 42])  # the text keeps it here ...
    assert d.propose(8) == ()  # ... and the next is the same token: stop again
    rest = renamed(CODE[20:])
    d.extend([62, 61, 43, rest[0]])  # ... renamed there (learnt once the next token follows)
    assert d.copier.edits[(SPELT,)] == (62, 61) and SPELT in d.copier.kept
    # Both seen for that token: no edit is forced on it; the usual spelling is still drafted
    # with its edit.
    assert d.propose(16)[: len(rest) - 1] == tuple(rest[1:])
    # Over the whole answer the name-aware drafts waste fewer tokens, and no more windows.
    plain, aware = SuffixDrafter(prompt), SuffixDrafter(prompt, name=NAMES.get)
    assert wasted(aware, answer) < wasted(plain, answer)


def test_a_draft_stops_before_a_name_the_request_mentioned_until_the_text_shows_its_fate():
    prompt = [1, 2, *CODE, 3]
    d = SuffixDrafter(prompt, name=NAMES.get)
    d.copier.mentioned = {"total"}  # as "rename `total`" gives it
    d.extend(CODE[4:11])  # copying; the name comes next
    assert d.copying and d.propose(8) == ()  # the model's own token decides it
    trials = d.follow.trials
    d.extend([*NEW, CODE[12], CODE[13]])  # renamed: learnt, and no miss counted
    assert d.copier.edits == {(OLD,): NEW} and "total" not in d.copier.mentioned
    assert d.follow.value > 0.9 and d.follow.trials > trials
    assert d.propose(16)[:9] == (*CODE[14:20], *NEW, CODE[21])  # drafted with its edit now
    # A mentioned name the text copies unchanged is no longer in doubt.
    kept = SuffixDrafter(prompt, name=NAMES.get)
    kept.copier.mentioned = {"total"}
    kept.extend(CODE[4:12])
    assert not kept.copier.mentioned and kept.propose(16)[:10] == tuple(CODE[12:22])


def test_a_draft_stops_at_a_number_the_request_mentioned_until_the_text_copies_or_edits_it():
    doc = [20, 21, 22, 23, 30, 31, 32, 9, 3, 3, 7, 33, 34, 35, 36, 37, 38]
    prompt = [1, *doc, 2]
    number = {8, 9, 10, 11}  # where "9337" is spelt (the request: "9337 becomes 9400")
    d = SuffixDrafter(prompt)
    d.copier.doubtful = set(number)
    d.extend(doc[:7])
    assert d.copying and d.propose(8) == ()  # stops before its first digit
    trials = d.follow.trials
    d.extend([9])  # the same digit: copied, so that position is no longer in doubt
    assert d.copier.doubtful == number - {8} and d.follow.trials == trials
    assert d.propose(8) == ()  # the next digit is
    d.extend([4, 0, 0, 33, 34])  # edited: learnt, and no miss counted
    assert d.copier.edits == {(3, 3, 7): (4, 0, 0)} and d.follow.trials > trials
    assert d.follow.value > 0.9 and d.propose(3) == (35, 36, 37)


def test_names_are_identifiers_spelt_by_a_token():
    from meshagent.serving.copying import TokenNames

    texts = {1: b" total", 2: b"total", 3: b"={", 4: b" 0", 5: b"_sum", 6: b" x", 7: b"\xff"}
    names = TokenNames(texts.__getitem__)
    assert [names(t) for t in texts] == ["total", "total", None, None, "_sum", None, None]


def test_draft_length_grows_on_success_and_shrinks_on_failure():
    length = DraftLength(4, max_k=16)
    length.update(4, 4)
    assert length.k == 8
    length.update(8, 8)
    length.update(16, 16)
    assert length.k == 16
    length.update(16, 2)
    assert length.k == 3
    length.update(3, 0)
    assert length.k == 1
    length.update(0, 0)  # nothing proposed: nothing learned
    assert length.k == 1


def test_the_window_cost_is_learnt_from_decode_steps():
    cost = WindowCost(slope=0.3, weight=1.0)
    cost.observe(5, 0.05)  # one size of step seen: nothing to compare with
    assert cost.slope == 0.3
    cost.observe(1, 0.010)
    cost.observe(5, 0.030)  # 3x one token for 5 tokens: 0.5 per extra token
    assert cost.slope == pytest.approx(0.5) and cost.cost(3) == pytest.approx(2.0)
    cost.observe(5, 0.005)  # faster than one token (noise): never a negative slope
    assert cost.slope == 0.0


def test_the_summary_keeps_every_step_timed_while_the_line_follows_recent_ones():
    cost = WindowCost(slope=0.3, weight=0.5)
    for seconds in (0.010, 0.010, 0.040):  # the one-token step slows: its average follows
        cost.observe(1, seconds)
    cost.observe(5, 0.050)
    cost.observe(99, 1.0)  # more tokens than any window: not counted
    summary = cost.summary()
    assert summary["steps"] == {
        "1": {"count": 3, "mean_ms": 20.0},
        "5": {"count": 1, "mean_ms": 50.0},
    }
    # The line goes through the one token's moving average, 25 ms (6.25 ms a token more,
    # over 25: 0.25), not through the mean of all its steps, 20 ms (which would give 0.375).
    assert summary["slope"] == pytest.approx(0.25)
    frozen = WindowCost(slope=0.3, weight=0.0)  # a cost that does not learn still times
    frozen.observe(1, 0.02)
    assert frozen.summary()["steps"] == {"1": {"count": 1, "mean_ms": 20.0}}
    assert frozen.slope == 0.3


def test_windows_of_two_lengths_give_the_cost_without_a_one_token_step():
    # A split's entry that drafts on every trip never times a one-token step: a trip of 3
    # tokens at 84 ms and one of 9 at 96 ms put time(n) at 78 + 2n ms, so 2/80 per token.
    cost = WindowCost(slope=0.3, weight=0.5)
    for _ in range(4):
        cost.observe(3, 0.084)
        cost.observe(9, 0.096)
    assert cost.slope == pytest.approx(0.025, rel=0.01)
    assert cost.cost(17) == pytest.approx(1.4, rel=0.01)


def test_a_window_of_two_may_cost_more_than_the_line_through_longer_ones_says():
    # Measured here (SmolLM2, llama.cpp on 2 CPU threads): a step of 2 tokens costs 1.92
    # one-token steps, of 17 tokens 10.53: a jump for any window, then about 0.57 a token.
    cost = WindowCost(weight=1.0)
    for n, steps in ((1, 1.0), (2, 1.92), (3, 2.47), (5, 3.73), (9, 5.80), (17, 10.53)):
        cost.observe(n, steps * 0.01)
    assert cost.slope == pytest.approx(0.57, abs=0.03)
    assert cost.cost(2) == pytest.approx(1.92, abs=0.25) and cost.jump > 0.3
    assert cost.cost(17) == pytest.approx(10.53, rel=0.05) and cost.cost(1) == 1.0
    # Short drafts cannot pay there; only long, mostly right ones come near.
    assert best_draft(fixed(0.6), cost, 16) == 0
    assert best_draft(fixed(0.97), cost, 16) >= 8


def test_acceptance_weighs_recent_evidence():
    a = Acceptance(prior=0.7, weight=2.0, decay=0.5)
    assert a.rate == pytest.approx(0.7)
    for _ in range(10):
        a.update(0, 1)
    assert a.rate < 0.01
    a.update(4, 4)
    a.update(4, 4)
    assert a.rate > 0.7


def test_acceptance_knows_that_misses_come_in_runs():
    # Copied text around an edit: a window's first draft token is often wrong, but once one
    # is right the rest mostly are. A rate per token would say "half right" and draft short.
    a = Acceptance()
    for _ in range(20):
        a.update(0, 1)  # a miss at once
        a.update(12, 12)  # then a whole window right
    assert 0.4 < a.rate < 0.6 and a.then.value > 0.95
    assert a.reach(1) == a.rate and a.reach(12) > 0.8 * a.rate
    assert a.expected(12) > 1 + 0.8 * 12 * a.rate
    # A window that followed another's verdict-to-be starts inside a run.
    before, then = a.rate, a.then.value
    a.update(3, 4, run=True)
    assert a.rate == before and a.then.value < then


def fixed(rate: float) -> Acceptance:
    """Every draft token right with probability `rate`, whatever came before."""
    return Acceptance(prior=rate, weight=1e12)


def test_windows_that_go_on_copying_are_judged_by_how_often_the_copy_goes_on():
    # Around an edit the drafter guesses from an n-gram and misses; once back on the text it
    # copies, its drafts are right: one rate for both would draft short everywhere.
    d = SuffixDrafter([1, *CODE, 2])
    d.extend(CODE)
    acc = Acceptance(follow=d.follow)
    for _ in range(10):
        acc.update(0, 1)
        acc.update(8, 8, copying=True)  # counted by the drafter as its tokens came
    assert acc.reach(1) < 0.2 and acc.reach(8, copying=True) > 0.7
    assert acc.then.value == pytest.approx(0.7)  # no evidence from the copy's windows
    cost = WindowCost(slope=0.3)
    assert best_draft(acc, cost, 16) == 0
    assert best_draft(acc, cost, 16, copying=True) >= 8


def test_the_drafter_counts_how_often_its_copy_goes_on():
    prompt = [1, *CODE, 2]
    d = SuffixDrafter(prompt)
    prior = d.follow.value
    d.extend(CODE[:3])  # matched, not yet trusted: nothing counted
    assert d.follow.trials == pytest.approx(FOLLOW_WEIGHT)
    d.extend(CODE[3:11])
    assert d.follow.value > prior and d.follow.trials > FOLLOW_WEIGHT + 5
    high = d.follow.value
    d.extend([70])  # an edit: the copy did not go on
    assert d.follow.value < high
    # Fresh text, no cursor: nothing counted; text whose matches are chance (prose that
    # repeats a few words now and then) counts low.
    novel = SuffixDrafter([1, 2, 3, 4, 5, 6])
    novel.extend([7, 8, 9, 10])
    assert novel.follow.trials == pytest.approx(FOLLOW_WEIGHT)
    rng = random.Random(7)
    loose = SuffixDrafter([rng.randrange(4) for _ in range(50)])
    loose.extend([rng.randrange(4) for _ in range(300)])
    assert loose.follow.trials > 2 * FOLLOW_WEIGHT and loose.follow.value < 0.6


def test_a_miss_that_taught_an_edit_of_a_copy_counts_half(monkeypatch):
    prompt = [1, *CODE, 2]

    def follow_after(answer: list[int], edit_miss: float) -> float:
        monkeypatch.setattr(drafting, "EDIT_MISS", edit_miss)
        d = SuffixDrafter(prompt)
        d.extend(answer)
        return d.follow.hits

    # The name replaced by 70 after a copy of 11 tokens, back on the source for two tokens:
    # the edit is learnt, and its miss counts EDIT_MISS of one.
    renamed = [*CODE[:11], 70, 20, 21]
    assert follow_after(renamed, 0.5) == pytest.approx(follow_after(renamed, 1.0) + 0.5)
    assert follow_after(renamed, 0.5) == pytest.approx(follow_after(renamed, 0.0) - 0.5)
    # One learnt where the copy had only begun (a cursor that does not draft yet) counts whole.
    early = [*CODE[:2], 70, CODE[3], CODE[4], CODE[5], *CODE[6:11]]
    assert follow_after(early, 0.5) == pytest.approx(follow_after(early, 1.0))


def test_a_token_the_draft_stops_before_is_not_counted():
    code = [*CODE[:20], 40, 41, SPELT, 42, SPELT, 43, *CODE[20:]]
    answer = [*renamed(CODE[:20]), *F_RENAMED]
    d = SuffixDrafter([1, 2, *code, 3], name=NAMES.get)
    d.extend(answer[:24])  # up to the f-string's `f"`: the draft stops before SPELT
    assert d.copying and d.propose(8) == ()
    trials = d.follow.trials
    d.extend([SPELT])  # kept: whichever way it went, it tells nothing of the copy
    assert d.follow.trials == trials
    d.extend([42])  # the token after it is drafted again, and counts
    assert d.follow.trials > trials


def test_the_best_draft_pays_for_its_window_or_is_none():
    cheap, dear = WindowCost(slope=0.05), WindowCost(slope=0.75)
    # Cheap windows: draft long where drafts are mostly right, a little even where not.
    assert best_draft(fixed(0.9), cheap, 16) >= 8
    assert 1 <= best_draft(fixed(0.3), cheap, 16) <= 3
    # Dear windows (compute-bound): only very good drafts pay, and short ones.
    assert best_draft(fixed(0.5), dear, 16) == 0
    assert best_draft(fixed(0.95), dear, 16) >= 1
    assert best_draft(fixed(0.99), dear, 3) <= 3
    assert best_draft(fixed(0.9), cheap, 0) == 0  # no room
    # Runs: half the windows miss at once, the rest copy on: long drafts pay.
    runs = Acceptance()
    for _ in range(20):
        runs.update(0, 1)
        runs.update(12, 12)
    assert best_draft(runs, cheap, 16) == 16 > best_draft(fixed(runs.rate), cheap, 16)


def test_a_window_is_sent_before_the_verdict_while_its_tokens_are_likely_to_count():
    cheap = WindowCost(slope=0.05)
    proposal = tuple(range(10))
    # Little in flight and drafts that hold: a following window, as long as it pays.
    assert follow_up_draft(fixed(0.98), cheap, 4, proposal) == 9
    # Much in flight, each token a coin toss: its tokens would almost never count.
    assert follow_up_draft(fixed(0.5), cheap, 8, proposal) is None
    # In between: a shorter one.
    assert 0 < follow_up_draft(fixed(0.8), cheap, 4, proposal) < 9


def test_verify_wants_one_row_more_than_the_draft():
    with pytest.raises(ValueError):
        verify(Sampler(SamplingParams(temperature=0)), [np.zeros(V)], [3])


# ----- decoding with drafts against decoding without -----


def copying_logits(held: list[int]) -> np.ndarray:
    """Logits whose favourite repeats the token 7 back: copy-shaped text, where drafts
    from the sequence itself are right."""
    logits = fake_logits(held, V)
    if len(held) >= 7:
        logits[held[-7]] = 5.0
    return logits


def plain(prompt, limit, params, logits_of) -> list[int]:
    sampler, held, out = Sampler(params), list(prompt), []
    while len(out) < limit:
        token = sampler.sample(logits_of(held))
        out.append(token)
        held.append(token)
        if token == EOS:
            break
    return out


def speculative(
    prompt, limit, params, logits_of, draft_of, length: DraftLength | None = None
) -> tuple[list[int], int]:
    """Decode with a draft per step; returns the tokens and the number of windows run."""
    sampler, held, out, windows = Sampler(params), list(prompt), [], 0
    while len(out) < limit:
        draft = tuple(draft_of(held))[: limit - len(out) - 1]
        rows = [logits_of(held + list(draft[:i])) for i in range(len(draft) + 1)]
        got = verify(sampler, rows, draft, is_end=lambda t: t == EOS)
        windows += 1
        if length is not None:
            length.update(len(draft), len(got) - 1)
        out += got
        held += got
        if got[-1] == EOS:
            break
    return out, windows


SAMPLINGS = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=0, frequency_penalty=0.7, presence_penalty=0.3),
    SamplingParams(temperature=0.8, seed=5),
    SamplingParams(temperature=1.3, top_p=0.9, seed=11, frequency_penalty=0.4),
]


@settings(max_examples=60, deadline=None)
@given(
    prompt=st.lists(st.integers(2, V - 1), min_size=1, max_size=12),
    sampling=st.sampled_from(SAMPLINGS),
    copying=st.booleans(),
    seed=st.integers(0, 10**6),
)
def test_adversarial_drafts_change_nothing(prompt, sampling, copying, seed):
    logits_of = copying_logits if copying else (lambda held: fake_logits(held, V))
    rng = random.Random(seed)

    def adversarial(held):  # random tokens, sometimes the end token, of random length
        return [rng.choice([EOS, *range(2, V)]) for _ in range(rng.randrange(0, 6))]

    expected = plain(prompt, 40, sampling, logits_of)
    got, _ = speculative(prompt, 40, sampling, logits_of, adversarial)
    assert got == expected


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=str)
def test_drafts_from_the_sequence_change_nothing_and_save_windows_on_copied_text(sampling):
    prompt = [5, 9, 12, 3, 7, 20, 14, 5, 9, 12]
    length = DraftLength()
    drafter = SuffixDrafter(prompt)

    def from_sequence(held):
        drafter.extend(held[len(drafter) :])
        return drafter.propose(length.k)

    expected = plain(prompt, 120, sampling, copying_logits)
    got, windows = speculative(prompt, 120, sampling, copying_logits, from_sequence, length)
    assert got == expected
    if sampling == SamplingParams(temperature=0):
        assert windows < len(got) / 3, (windows, len(got))  # most drafts were accepted


def test_without_a_seed_the_first_token_keeps_its_distribution():
    # Whatever the draft, the token kept at a position is the sampler's draw from the row
    # plain decoding would use: its distribution is the model's.
    probs = np.array([0.05, 0.1, 0.4, 0.25, 0.2])
    row = np.log(probs)
    params = SamplingParams(temperature=1.0)
    n = 20_000
    counts = Counter(verify(Sampler(params), [row, row], [2])[0] for _ in range(n))
    expected = probs * n
    chi2 = sum((counts[i] - expected[i]) ** 2 / expected[i] for i in range(len(probs)))
    assert chi2 < 18.5  # 4 degrees of freedom, p = 0.001


def test_a_window_size_timed_often_enough_costs_what_it_took():
    # A CPU split (a LAN run's times): short windows cost more a token than long ones, so
    # the line through all sizes says too little for some. Once a size was timed 3 times,
    # its own time stands.
    cost = WindowCost(weight=1.0)
    for _ in range(3):
        for n, ms in ((1, 75.0), (2, 164.0), (3, 235.0), (5, 303.0), (16, 846.0)):
            cost.observe(n, ms / 1000)
    line = 1 + cost.jump + cost.slope * (3 - 1)
    assert cost.cost(3) == pytest.approx(235 / 75) and cost.cost(3) > line
    assert cost.cost(2) == pytest.approx(164 / 75)
    assert cost.cost(4) == pytest.approx(1 + cost.jump + cost.slope * 3)  # (never timed)
    # A size timed fewer times goes by the line.
    cost.observe(7, 0.2)
    assert cost.cost(7) == pytest.approx(1 + cost.jump + cost.slope * 6)
