"""Merge rules as tables."""

from __future__ import annotations

import pytest

from meshagent.gossip import merge
from meshagent.gossip.merge import Verdict
from meshagent.gossip.messages import DigestEntry as E


@pytest.mark.parametrize(
    "known, incoming, verdict",
    [(None, 1, Verdict.NEW), (1, 2, Verdict.NEWER), (2, 2, Verdict.STALE), (3, 2, Verdict.STALE)],
)
def test_record_and_beat_verdicts(known, incoming, verdict):
    assert merge.record_verdict(known, incoming) is verdict
    assert merge.beat_verdict(known, incoming) is verdict


@pytest.mark.parametrize(
    "known_beat, known_obit, incoming, verdict",
    [
        (None, None, 5, Verdict.NEW),
        (5, None, 5, Verdict.NEW),  # the beat that timed out: the obituary holds
        (6, None, 5, Verdict.STALE),  # a newer beat is known: the peer is alive
        (5, 5, 5, Verdict.STALE),
        (5, 5, 7, Verdict.NEWER),
        (5, 7, 6, Verdict.STALE),
    ],
)
def test_obituary_verdicts(known_beat, known_obit, incoming, verdict):
    assert merge.obituary_verdict(known_beat, known_obit, incoming) is verdict


@pytest.mark.parametrize(
    "mine, beat, theirs, expected",
    [
        (E("p", 3, 10), 10, None, (True, True, False)),
        (E("p", 0, 10), 10, None, (False, True, False)),
        (E("p", 3, 10, True), 8, None, (True, True, True)),
        (E("p", 3, 10), 10, E("p", 3, 10), (False, False, False)),
        (E("p", 4, 10), 10, E("p", 3, 10), (True, False, False)),
        (E("p", 3, 11), 11, E("p", 3, 10), (False, True, False)),
        (E("p", 3, 10, True), 10, E("p", 3, 10), (False, False, True)),
        # our obituary is at beat 10 but we hold only beat 8: they have 9, send the obituary
        (E("p", 3, 10, True), 8, E("p", 3, 9), (False, False, True)),
        (E("p", 3, 10, True), 10, E("p", 3, 11), (False, False, False)),  # they know newer
        (E("p", 3, 10), 10, E("p", 3, 10, True), (False, False, False)),
    ],
)
def test_what_to_send(mine, beat, theirs, expected):
    assert merge.to_send(mine, beat, theirs) == expected


@pytest.mark.parametrize(
    "mine, theirs, want",
    [
        (None, E("p", 1, 1), True),
        (E("p", 1, 1), E("p", 1, 1), False),
        (E("p", 1, 1), E("p", 2, 1), True),
        (E("p", 1, 1), E("p", 1, 2), True),
        (E("p", 1, 2), E("p", 1, 2, True), True),
        (E("p", 1, 2, True), E("p", 1, 2), False),
        (E("p", 1, 3), E("p", 1, 2, True), False),
    ],
)
def test_wants(mine, theirs, want):
    assert merge.wants(mine, theirs) is want
