"""The records an agent knows: its cache first, then what peers gossip, verified and kept."""

from __future__ import annotations

from dataclasses import dataclass

from meshagent.identity.keys import NodeIdentity
from meshagent.models.capability import CapabilityStore
from meshagent.serving.capabilities import Capabilities
from tests.models.test_capability import claim_f16_exact, record


@dataclass
class Record:
    capabilities: tuple[bytes, ...] = ()


@dataclass
class View:
    record: Record


def test_a_record_heard_from_a_peer_is_verified_kept_and_gossiped_on(tmp_path):
    certifier = NodeIdentity.generate()
    blob = record(certifier.peer_id).sign(certifier).to_bytes()
    views = {"p": View(Record((blob,)))}
    caps = Capabilities(CapabilityStore(tmp_path / "caps"), lambda: views)
    assert caps.published() == ()
    found = caps.for_model("ab" * 32)
    assert found is not None and found.record.certifier == certifier.peer_id
    views.clear()  # the peer is gone: the record stays
    assert caps.for_model("ab" * 32) is not None
    assert caps.published() == (blob,)
    assert caps.for_model("cd" * 32) is None


def test_a_tampered_record_from_a_peer_is_refused_and_not_kept(tmp_path):
    certifier = NodeIdentity.generate()
    forged = claim_f16_exact(record(certifier.peer_id).sign(certifier))
    views = {"p": View(Record((forged, b"garbage")))}
    caps = Capabilities(CapabilityStore(tmp_path / "caps"), lambda: views)
    assert caps.for_model("ab" * 32) is None
    assert caps.published() == ()
