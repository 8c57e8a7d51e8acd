"""The capability records an agent knows: those in its own cache, and those its peers gossip.

A record heard from a peer is verified before use and then kept in the cache, so that it
survives a restart and this agent gossips it on in turn.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import structlog

from meshagent.errors import ModelError
from meshagent.gossip.peer_record import MAX_CAPABILITIES
from meshagent.models.capability import CapabilityStore, SignedRecord

log = structlog.get_logger(__name__)


class Capabilities:
    def __init__(self, store: CapabilityStore, views: Callable[[], Mapping[str, Any]]) -> None:
        self.store = store
        self._views = views  # gossip's snapshot: peer id -> view with a `record`
        self._checked: dict[bytes, SignedRecord | None] = {}  # gossiped bytes, verified once

    def for_model(self, model_sha256: str) -> SignedRecord | None:
        """The record for a model file: the cached one, else one a peer gossips."""
        try:
            cached = self.store.get(model_sha256)
        except ModelError as e:
            log.warning("capability.refused", source="cache", error=str(e))
            cached = None
        if cached is not None:
            return cached
        for peer, view in self._views().items():
            for blob in getattr(view.record, "capabilities", ()):
                signed = self._verified(peer, blob)
                if signed is not None and signed.record.model_sha256 == model_sha256:
                    self.store.put(signed)
                    log.info(
                        "capability.learned",
                        model=signed.record.model_name,
                        certifier=signed.record.certifier,
                        exact=list(signed.record.exact_dtypes()),
                        via=peer,
                    )
                    return signed
        return None

    def _verified(self, peer: str, blob: bytes) -> SignedRecord | None:
        if blob not in self._checked:
            if len(self._checked) > 256:  # records replaced over a long run
                self._checked.clear()
            try:
                self._checked[blob] = SignedRecord.from_bytes(blob)
            except ModelError as e:
                log.warning("capability.refused", source=peer, error=str(e))
                self._checked[blob] = None
        return self._checked[blob]

    def published(self) -> tuple[bytes, ...]:
        """What this agent gossips: the records in its cache."""
        return tuple(r.to_bytes() for r in self.store.all()[:MAX_CAPABILITIES])
