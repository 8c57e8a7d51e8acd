"""Remembers recently seen first handshake messages so a captured one is refused on replay."""

from __future__ import annotations

import hashlib
from collections import OrderedDict


class ReplayGuard:
    """A bounded set of digests. A replay older than the bound still fails later in the
    handshake (it cannot produce message 3 without the original ephemeral key); this guard
    only makes the refusal immediate and the logged reason precise."""

    def __init__(self, capacity: int = 65536) -> None:
        self._capacity = capacity
        self._seen: OrderedDict[bytes, None] = OrderedDict()

    def check_and_remember(self, message: bytes) -> bool:
        """True if `message` is new (and now remembered), False if it was seen before."""
        digest = hashlib.sha256(message).digest()
        if digest in self._seen:
            return False
        self._seen[digest] = None
        if len(self._seen) > self._capacity:
            self._seen.popitem(last=False)
        return True
