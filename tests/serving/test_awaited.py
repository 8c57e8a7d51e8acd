"""The entry's book of the windows it awaits from the last stage: each Token answers the
window the last stage answered, voids included, and nothing else gets through."""

from __future__ import annotations

import pytest

from meshagent.serving.awaited import AwaitedWindows
from meshagent.serving.stage_messages import ForwardItem, StageProtocolError, Token


def window(seq: int, draft: tuple[int, ...] = (), follows: bool = False) -> ForwardItem:
    return ForwardItem(seq, 0, len(draft) + (not follows), True, draft, follows)


def test_a_token_answers_a_window_in_flight_and_nothing_else():
    book = AwaitedWindows()
    with pytest.raises(StageProtocolError, match="sequence 0, which awaits none"):
        book.token(Token(0, 5))
    book.sent([], [0], [window(0), ForwardItem(1, 0, 4, False)])  # (a prompt chunk: no token)
    assert book.token(Token(0, 5))
    with pytest.raises(StageProtocolError, match="sequence 0, which awaits none"):
        book.token(Token(0, 6))
    with pytest.raises(StageProtocolError, match="sequence 1, which awaits none"):
        book.token(Token(1, 6))


def test_a_token_brings_no_more_than_its_window_could_verify():
    book = AwaitedWindows()
    book.sent([], [0], [window(0, (7, 8))])
    with pytest.raises(StageProtocolError, match="brings 3 verified drafts, its window held 2"):
        book.token(Token(0, 5, more=(7, 8, 9)))
    book = AwaitedWindows()
    book.sent([], [0], [window(0, (7, 8)), window(0, (9, 4), follows=True)])
    assert book.token(Token(0, 7, more=(3,)))  # the draft 7 right, then 3 where 8 was
    # A draft wrong: the window that followed is void, and nothing more awaits.
    with pytest.raises(StageProtocolError, match="awaits none"):
        book.token(Token(0, 4))


def test_windows_that_follow_are_answered_when_their_guess_was_right_and_void_otherwise():
    book = AwaitedWindows()
    book.sent([], [0], [window(0, (7,)), window(0, (8, 3), follows=True)])
    assert book.token(Token(0, 7, more=(8,)))  # all right, ends with 8: the follower stands
    assert book.token(Token(0, 3, more=(1,)))  # its draft 3 right, then 1
    # A window sent after the token that voids it (the step was taken before the token came
    # back): the last stage meets it with no carry, and skips it too.
    book.sent([], [], [window(0, (2,)), window(0, (5, 6), follows=True)])
    assert book.token(Token(0, 9))  # the draft 2 was wrong: the follower is void
    book.sent([], [], [window(0, (5, 6), follows=True), window(0)])
    assert book.token(Token(0, 4))  # the plain window after the voided follower
    with pytest.raises(StageProtocolError, match="awaits none"):
        book.token(Token(0, 4))


def test_a_token_for_a_sequence_that_ended_in_flight_is_nobodys():
    book = AwaitedWindows()
    book.sent([], [2], [window(2)])
    book.sent([2], [2], [window(2, (4,))])  # released (cancelled), the slot given again
    assert not book.token(Token(2, 5))  # the old sequence's: dropped
    assert book.token(Token(2, 4, more=(4,)))  # the new one's own


def test_a_failure_answers_the_first_window():
    book = AwaitedWindows()
    assert not book.failure(1)  # nothing in flight: nothing to fail
    book.sent([], [1], [window(1), window(1)])
    assert book.failure(1) and book.failure(1) and not book.failure(1)


def test_a_new_chain_awaits_nothing():
    book = AwaitedWindows()
    book.sent([], [0], [window(0)])
    book.clear()
    with pytest.raises(StageProtocolError):
        book.token(Token(0, 1))
