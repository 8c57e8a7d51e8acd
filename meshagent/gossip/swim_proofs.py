"""Signed proofs for membership by probes (`swim.py`), from the items gossip already signs
(`signed.py`): an agent alive at an incarnation is its own heartbeat at that beat (so only the
agent itself can say it is alive, or refute a rumour of its death); a suspicion is a
`Suspicion` and a death an `Obituary`, each signed by the member that issues it at the
subject's incarnation; a record is the owner's `SignedRecord`. A member passes on the proof
it received with a change, so every update it relays or lists in its table is checked by its
receiver against its issuer's key, whoever relays it.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import replace

from meshagent.gossip.errors import RecordRejected
from meshagent.gossip.signed import Heartbeat, Obituary, SignedRecord, Suspicion
from meshagent.gossip.swim import State, Update
from meshagent.identity.keys import NodeIdentity

_ACCUSATIONS = {State.SUSPECT: Suspicion, State.DEAD: Obituary}
_REMEMBERED = 4096  # verdicts kept, so that an update arriving again is not verified again


class SwimProofs:
    """`sign` and `verify` for a `Swim` of `identity`'s agent in the mesh `mesh`."""

    def __init__(
        self,
        identity: NodeIdentity,
        mesh: str,
        *,
        verdicts: OrderedDict[bytes, str | None] | None = None,
        remembered: int = _REMEMBERED,
    ) -> None:
        """`verdicts`: where to keep them (a simulation of many members shares one: the
        same bytes get the same verdict from every member of the mesh), `remembered` at
        most."""
        self.identity = identity
        self.mesh = mesh
        self._verdicts: OrderedDict[bytes, str | None] = (
            OrderedDict() if verdicts is None else verdicts
        )
        self._remembered = remembered
        self.last_reason: str | None = None  # why the last refused update was refused

    def sign(self, u: Update) -> Update:
        """`u`, issued by this agent, with its proof."""
        if u.issuer != self.identity.peer_id:
            raise ValueError("an agent signs only the updates it issues")
        if u.state == State.ALIVE:
            if u.subject != u.issuer:
                raise ValueError("only an agent itself says it is alive")
            proof = Heartbeat.sign(self.identity, u.incarnation, self.mesh).to_cbor()
        else:
            item = _ACCUSATIONS[u.state].sign(self.identity, u.subject, u.incarnation, self.mesh)
            proof = item.to_cbor()
        return replace(u, proof=proof)

    def verify(self, u: Update) -> bool:
        """Whether `u`'s proof holds: signed by its issuer, about its subject, at its
        incarnation, and its record (if any) the subject's own at its version."""
        key = hashlib.blake2b(repr(u.wire()).encode(), digest_size=16).digest()
        if key in self._verdicts:
            self._verdicts.move_to_end(key)
            reason = self._verdicts[key]
        else:
            reason = self._check(u)
            self._verdicts[key] = reason
            if len(self._verdicts) > self._remembered:
                self._verdicts.popitem(last=False)
        if reason is not None:
            self.last_reason = reason
        return reason is None

    def _check(self, u: Update) -> str | None:
        try:
            if u.state == State.ALIVE:
                beat = Heartbeat.decode(u.proof)
                if beat.peer_id != u.subject or u.issuer != u.subject:
                    return f"an alive of {u.subject} not signed by it"
                if beat.beat != u.incarnation:
                    return f"an alive of {u.subject} at {u.incarnation} proved at {beat.beat}"
                beat.verify(self.mesh)
            else:
                item = _ACCUSATIONS[u.state].decode(u.proof)
                if item.subject != u.subject or item.beat != u.incarnation:
                    return f"a {item.WHAT} of {u.subject} proved for another peer or time"
                if item.reporter != u.issuer:
                    return f"a {item.WHAT} of {u.subject} not signed by {u.issuer}"
                item.verify(self.mesh)
            if u.record:
                record = SignedRecord.from_cbor(u.record, self.mesh)
                if record.peer_id != u.subject or record.seq != u.record_seq:
                    return f"a record of {u.subject} that is another peer's or version"
        except RecordRejected as e:
            return str(e)
        return None
