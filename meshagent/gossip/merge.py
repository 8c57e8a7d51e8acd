"""Pure merge rules: which of two versions of a peer's items wins, and what to send.

Records are ordered by `seq`; heartbeats by `beat`; an obituary holds while no heartbeat
newer than its `beat` is known. Per peer, a side's *liveness* is (newest beat heard of,
holds an obituary): an obituary at beat b outranks a heartbeat at b (that heartbeat is the
one that timed out), and any later heartbeat outranks the obituary.

How far ahead a beat may run. Beats are their signer's wall clock in milliseconds, and any
member may sign an obituary: one dated far ahead would hold its subject dead until the
subject's beats passed it (near 2**64, for ever: it cannot beat past it). So an obituary
about another peer is taken only up to `BEAT_LEAD_MS` past the earlier of our own clock and
the subject's beat clock (its newest heartbeat here, advanced one per millisecond since it
arrived): what the subject could have sent by now. A subject outgrows an obituary about
itself up to `BEAT_LEAD_MS + CLOCK_SKEW_MS` past its own clock, so whatever another agent
takes, the subject refutes, while their clocks agree within `CLOCK_SKEW_MS`. Its own clock,
not its latest beat: a refutation never raises what the next one may reach, so forged
obituaries cannot ratchet its beats ahead. Heartbeats are bounded only by `signed.MAX_BEAT`:
their subject signs them, and one far ahead harms nobody but its signer.
"""

from __future__ import annotations

from enum import StrEnum

from meshagent.gossip.messages import DigestEntry

# An honest obituary leads the subject's last beat by at most `suspect_after` plus how long
# it had been silent (`GossipState.declare_dead`): seconds. Ten minutes is far past that.
BEAT_LEAD_MS = 10 * 60 * 1000
# How far apart agents' wall clocks may be while every obituary another agent takes is one
# its subject refutes.
CLOCK_SKEW_MS = 30 * 60 * 1000


class Verdict(StrEnum):
    NEW = "new"  # nothing was known: take it
    NEWER = "newer"  # replaces what was known
    STALE = "stale"  # older than or equal to what is known: ignore
    REJECTED = "rejected"  # malformed, forged or unverifiable: ignore and count


def record_verdict(known_seq: int | None, incoming_seq: int) -> Verdict:
    if known_seq is None:
        return Verdict.NEW
    return Verdict.NEWER if incoming_seq > known_seq else Verdict.STALE


def beat_verdict(known_beat: int | None, incoming_beat: int) -> Verdict:
    if known_beat is None:
        return Verdict.NEW
    return Verdict.NEWER if incoming_beat > known_beat else Verdict.STALE


def obituary_verdict(
    known_beat: int | None, known_obituary_beat: int | None, incoming_beat: int
) -> Verdict:
    """An obituary applies if no newer heartbeat is known and it is newer than the one held."""
    if known_beat is not None and incoming_beat < known_beat:
        return Verdict.STALE
    if known_obituary_beat is None:
        return Verdict.NEW
    return Verdict.NEWER if incoming_beat > known_obituary_beat else Verdict.STALE


def obituary_survives(obituary_beat: int, beat: int) -> bool:
    """Whether an obituary still holds once heartbeat `beat` is known."""
    return beat <= obituary_beat


def to_send(mine: DigestEntry, beat: int, theirs: DigestEntry | None) -> tuple[bool, bool, bool]:
    """Which of (record, heartbeat, obituary) we hold that the other side lacks, given our
    entry for a peer (`beat`: our heartbeat's beat, 0 if none) and theirs (None: unknown)."""
    if theirs is None:
        return mine.seq > 0, beat > 0, mine.dead
    record = mine.seq > theirs.seq
    if mine.liveness <= theirs.liveness:
        return record, False, False
    return record, beat > theirs.beat, mine.dead


def wants(mine: DigestEntry | None, theirs: DigestEntry) -> bool:
    """Whether the other side knows something newer about this peer than we do."""
    if mine is None:
        return True
    return theirs.seq > mine.seq or theirs.liveness > mine.liveness


def beat_clock(beat: int, since_s: float) -> int:
    """Where a peer's beats can have got to: `beat` (its newest heartbeat here) advanced one
    per millisecond of the `since_s` seconds since it arrived."""
    return beat + int(max(0.0, since_s) * 1000)


def obituary_ceiling(wall_ms: int, subject_clock_ms: int | None) -> int:
    """The latest beat an obituary about another peer may carry here: `BEAT_LEAD_MS` past
    the earlier of our clock and the subject's beat clock (None: no heartbeat of it here)."""
    base = wall_ms if subject_clock_ms is None else min(wall_ms, subject_clock_ms)
    return base + BEAT_LEAD_MS


def refute_ceiling(wall_ms: int) -> int:
    """The latest obituary about itself a peer whose clock reads `wall_ms` outgrows: one
    past it was forged (no honest agent takes it while clocks agree) and is refused."""
    return wall_ms + BEAT_LEAD_MS + CLOCK_SKEW_MS
