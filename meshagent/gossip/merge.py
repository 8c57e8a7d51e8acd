"""Pure merge rules: which of two versions of a peer's items wins, and what to send.

Records are ordered by `seq`; heartbeats by `beat`; an obituary holds while no heartbeat
newer than its `beat` is known. Per peer, a side's *liveness* is (newest beat heard of,
holds an obituary): an obituary at beat b outranks a heartbeat at b (that heartbeat is the
one that timed out), and any later heartbeat outranks the obituary.
"""

from __future__ import annotations

from enum import StrEnum

from meshagent.gossip.messages import DigestEntry


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
