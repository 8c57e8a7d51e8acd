"""The updates a member of `swim.py` has yet to piggyback, sans-IO: each goes out
`retransmit` x log2(N + 1) times, those sent least first (the oldest of them first), within
`max_piggyback` bytes a message. A new record is announced by its version only: a member that
lacks it pulls it from the one that told it (`pull`), so a record crosses each link about
once. A later update about the same subject (and kind) takes the place of the earlier one.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from meshagent.gossip.swim_messages import SwimConfig, Update


class UpdateQueue:
    def __init__(self, config: SwimConfig) -> None:
        self.config = config
        # by how often each was sent (bucket i: sent i times), oldest first within one
        self._queue: list[dict[tuple[str, str], Update]] = []
        self._sent: dict[tuple[str, str], int] = {}  # (subject, kind) -> its bucket

    def __len__(self) -> int:
        return len(self._sent)

    def put(self, u: Update, *, confirmation: bool = False) -> None:
        """Spread `u` (its record as its version only). A `confirmation` (another member's
        suspicion of a member already suspected) spreads beside the suspicion, not in its
        place."""
        kind = f"confirm:{u.issuer}" if confirmation else "record" if u.record else "state"
        key = (u.subject, kind)
        if u.record:
            u = replace(u, record=b"")
        was = self._sent.pop(key, None)
        if was is not None:
            del self._queue[was][key]
        if not self._queue:
            self._queue.append({})
        self._queue[0][key] = u
        self._sent[key] = 0

    def take(self, members: int) -> tuple[Update, ...]:
        """The updates that ride on the next message, in a mesh of `members`."""
        if not self._sent:
            return ()
        limit = self.config.retransmit * max(1, math.ceil(math.log2(members + 1)))
        room, out, moved = self.config.max_piggyback, [], []
        for count, bucket in enumerate(self._queue):
            for key, u in bucket.items():
                size = u.size(self.config.signature_bytes)
                if size > room:
                    if room < 64:
                        break
                    continue
                room -= size
                out.append(u)
                moved.append((key, u, count))
            if room < 64:
                break
        for key, u, count in moved:
            del self._queue[count][key]
            if count + 1 >= limit:
                del self._sent[key]
                continue
            if len(self._queue) <= count + 1:
                self._queue.append({})
            self._queue[count + 1][key] = u
            self._sent[key] = count + 1
        return tuple(out)
