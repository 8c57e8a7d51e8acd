"""SwimService: membership by probes (`swim.py`) over overlay streams (label `swim/1`), behind
the API of `GossipService`, so that placement, the dialer and the control API use either.

Every message goes on a stream of its own to the member it is for (one message per stream,
read to its end, at most `swim_wire.MAX_MESSAGE` bytes); a member without a connection here
does not get it, which the protocol takes as it takes a lost datagram. A received message is
decoded with its bounds (`swim_wire`), its updates checked against their issuers' signatures
(`swim_proofs`), and a bad one ends its stream only. Every connection that comes up is a join:
this agent asks that peer for its table (so two meshes that meet merge), and what it learns it
spreads as SWIM does, piggybacked on its probes.

The agent chooses it with `membership = "swim"` (config) or `--membership swim`; the default
is still the heartbeat protocol (`service.py`) until the overlay keeps connections to a
bounded set of peers (docs/gossip.md).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

import structlog
import trio

from meshagent.gossip.errors import GossipError
from meshagent.gossip.failure import PeerState
from meshagent.gossip.peer_record import PUBLISHABLE, PeerRecord
from meshagent.gossip.service import LocalFields, fields_to_publish
from meshagent.gossip.signed import SignedRecord
from meshagent.gossip.state import PeerView
from meshagent.gossip.swim import Message, State, Swim, SwimConfig
from meshagent.gossip.swim_proofs import SwimProofs
from meshagent.gossip.swim_wire import MAX_MESSAGE, SwimWireError, decode, encode
from meshagent.identity.keys import NodeIdentity
from meshagent.net.errors import ConnectionUnavailable, StreamResetError
from meshagent.net.manager import ConnectionManager
from meshagent.net.stream import MeshStream

log = structlog.get_logger(__name__)

LABEL = "swim/1"
_SEND_TIMEOUT = 2.0
_RTT_REFRESH = 10.0  # our record's RTT figures are republished at most this often
_STATES = {
    State.ALIVE: PeerState.ALIVE,
    State.SUSPECT: PeerState.SUSPECT,
    State.DEAD: PeerState.DEAD,
}
_STREAM_ERRORS = (
    StreamResetError,
    ConnectionUnavailable,
    trio.BrokenResourceError,
    trio.ClosedResourceError,
)


class SwimService:
    def __init__(
        self,
        identity: NodeIdentity,
        mesh: str,
        overlay: ConnectionManager,
        config: SwimConfig | None = None,
        *,
        local_fields: LocalFields | None = None,
        rng: random.Random | None = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config or SwimConfig()
        self.identity = identity
        self.mesh = mesh
        self.overlay = overlay
        self.proofs = SwimProofs(identity, mesh)
        self._local_fields = local_fields
        self._rng = rng or random.Random()
        self._wall = wall_clock
        self.swim = Swim(
            identity.peer_id,
            config=self.config,
            seed=self._rng.getrandbits(32),
            now=0.0,
            incarnation=int(wall_clock() * 1000),  # a restart outranks what the mesh recalls
            sign=self.proofs.sign,
            verify=self.proofs.verify,
        )
        self._fields: dict[str, Any] = {}
        self._record: SignedRecord | None = None
        self._parsed: dict[tuple[str, int], PeerRecord] = {}
        self._since: dict[str, float] = {}  # when each member's state last changed here
        self._rows: dict[str, tuple[int, State, int]] = {}
        self._seen_digest = b""
        self._generation = 0
        self._changed = trio.Event()
        self._wake = trio.Event()
        self._known_links: set[str] = set()
        self._published_rtts: dict[str, float] = {}
        self._last_refresh = -float("inf")
        self._nursery: trio.Nursery | None = None
        self.bytes_sent = 0
        self.bytes_received = 0
        self.messages_sent = 0
        self.messages_received = 0
        self.failed = 0

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id

    # ----- the API placement uses (as GossipService's) -----

    def snapshot(self, *, include_dead: bool = False) -> dict[str, PeerView]:
        now = trio.current_time()
        out: dict[str, PeerView] = {}
        if self._record is not None:
            me = self.peer_id
            out[me] = PeerView(me, self._record.record, PeerState.ALIVE, 0.0, self.swim.incarnation)
        for m, x in self.swim.members.items():
            if not x.record or (x.state == State.DEAD and not include_dead):
                continue
            record = self._record_of(m, x.record_seq, x.record)
            since = self._since.get(m, now)
            out[m] = PeerView(m, record, _STATES[x.state], max(0.0, now - since), x.incarnation)
        return out

    def record_of(self, peer_id: str) -> PeerRecord | None:
        x = self.swim.members.get(peer_id)
        if x is None or not x.record:
            return None
        return self._record_of(peer_id, x.record_seq, x.record)

    def dead_since(self, peer_id: str) -> float | None:
        """When `peer_id` was last declared dead here, if it is dead."""
        if self.swim.state_of(peer_id) != State.DEAD:
            return None
        return self._since.get(peer_id)

    def update_local(self, **fields: Any) -> None:
        unknown = set(fields) - PUBLISHABLE
        if unknown:
            raise GossipError(
                f"unknown record fields: {', '.join(sorted(unknown))} "
                f"(publishable: {', '.join(sorted(PUBLISHABLE))})"
            )
        candidate = {**self._fields, **fields}
        wall = self._wall()
        seq = max(int(wall * 1_000_000), (self._record.seq + 1) if self._record else 1)
        record = PeerRecord(
            peer_id=self.peer_id,
            public_key=self.identity.public_key,
            seq=seq,
            issued_at=round(wall, 3),
            **candidate,
        )
        signed = SignedRecord.sign(record, self.identity, self.mesh)  # raises if too large
        self._fields, self._record = candidate, signed
        self.swim.publish(signed.raw, _now(), seq)
        self._generation_up()
        self._wake.set()

    @property
    def generation(self) -> int:
        return self._generation

    async def wait_changed(self, after: int) -> int:
        while self._generation <= after:
            await self._changed.wait()
        return self._generation

    def stats(self) -> dict[str, Any]:
        return {
            "protocol": "swim",
            "members": len(self.swim.members),
            "generation": self._generation,
            "messages_sent": self.messages_sent,
            "messages_received": self.messages_received,
            "failed": self.failed,
            "exchanges": self.messages_sent,
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "rejected": self.swim.rejected,
            "last_rejection": self.proofs.last_reason,
        }

    def summary(self) -> dict[str, Any]:
        """For the control API's status: the counters, members by state, the timers."""
        states: dict[str, int] = {PeerState.ALIVE.value: 1}  # this agent, as heartbeat's says
        for x in self.swim.members.values():
            name = _STATES[x.state].value
            states[name] = states.get(name, 0) + 1
        c = self.config
        return {
            **self.stats(),
            "states": states,
            "timers": f"probes every {c.probe_interval:g} s, dead "
            f"{c.suspicion_min:g}-{c.suspicion_max:g} s after a suspicion",
        }

    def declare_dead(self, peer_id: str, reason: str) -> None:
        """`peer_id` is gone for certain: dead here now, and the others hear so with this
        agent's next messages. One alive after all refutes it."""
        if self.swim.declare_dead(peer_id, _now()):
            log.info("gossip.declared_dead", peer=peer_id, reason=reason)
            self._after_change()

    def beat_of(self, peer_id: str) -> int:
        """`peer_id`'s incarnation as known here (0: unknown)."""
        x = self.swim.members.get(peer_id)
        return 0 if x is None else x.incarnation

    def exchange_with_all(self, *, but: str | None = None) -> None:
        self._wake.set()

    def spread_now(self) -> None:
        """Send what waits to be spread now rather than at the next gossip tick."""
        self._wake.set()

    def republish(self) -> None:
        self._last_refresh = -float("inf")
        self._refresh(_now())

    async def leave(self, *, timeout: float = 2.0, peers: int = 3) -> None:
        """Tell a few members this agent is leaving: a death of its own, signed by it."""
        out = self.swim.leave(_now(), peers)
        with trio.move_on_after(timeout):
            async with trio.open_nursery() as nursery:
                for dest, msg in out:
                    nursery.start_soon(self._send, dest, msg)
        log.info("gossip.left", told=len(out))

    # ----- service -----

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED):
        self._refresh(_now())
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            while True:
                now = _now()
                self._refresh(now)
                out = self._joins(now) + self.swim.tick(now)
                self._dispatch(out)
                self._after_change()
                wait = max(0.0, min(self.swim.next_timer(), now + 0.5) - _now())
                with trio.move_on_after(wait):
                    await self._wake.wait()
                if self._wake.is_set():
                    self._wake = trio.Event()
                    self._dispatch(self.swim.flush(_now()))

    async def handle(self, stream: MeshStream) -> None:
        """One message from a member (`swim/1` streams); the replies go on streams of ours."""
        peer = stream.peer_id
        try:
            data = bytearray()
            with trio.fail_after(_SEND_TIMEOUT):
                while chunk := await stream.receive_some():
                    data += chunk
                    if len(data) > MAX_MESSAGE:
                        raise SwimWireError(f"a membership message over {MAX_MESSAGE} bytes")
            msg = decode(bytes(data))
            self.bytes_received += len(data)
            self.messages_received += 1
            self._dispatch(self.swim.receive(_now(), peer, msg))
            self._after_change()
            await stream.send_eof()
        except (SwimWireError, trio.TooSlowError, *_STREAM_ERRORS) as e:
            self.failed += 1
            log.info("gossip.message_refused", peer=peer, error=str(e))
            stream.reset(f"membership message refused: {e}")
        except Exception as e:  # a bug met by one message ends that message only
            self.failed += 1
            log.error("gossip.message_failed", peer=peer, error=repr(e), exc_info=e)
            stream.reset(f"membership message failed: {type(e).__name__}")
        await stream.aclose()

    # ----- internals -----

    def _record_of(self, peer_id: str, seq: int, raw: bytes) -> PeerRecord:
        key = (peer_id, seq)
        got = self._parsed.get(key)
        if got is None:
            got = self._parsed[key] = SignedRecord.from_cbor(raw, self.mesh).record
            if len(self._parsed) > 4 * max(64, len(self.swim.members)):
                self._parsed.clear()
                self._parsed[key] = got
        return got

    def _joins(self, now: float) -> list[tuple[str, Message]]:
        """Ask every peer newly connected for its table: a join, or two meshes merging."""
        links = {link.peer_id for link in self.overlay.links()}
        new = sorted(links - self._known_links)
        self._known_links = links
        out: list[tuple[str, Message]] = []
        for peer in new:
            out += self.swim.join(peer, now)
        return out

    def _dispatch(self, out: list[tuple[str, Message]]) -> None:
        if self._nursery is None:
            return
        for dest, msg in out:
            self._nursery.start_soon(self._send, dest, msg)

    async def _send(self, dest: str, msg: Message) -> None:
        if self.overlay.connection(dest) is None:
            return  # no path to it now: as a lost datagram
        data = encode(msg)
        try:
            with trio.move_on_after(_SEND_TIMEOUT):
                stream = await self.overlay.open_stream(dest, LABEL, window_bytes=MAX_MESSAGE)
                try:
                    await stream.send_all(data)
                    await stream.send_eof()
                    while await stream.receive_some():  # the receiver's end: it has it all
                        raise SwimWireError("a reply on a membership message's stream")
                finally:
                    await stream.aclose()
                self.bytes_sent += len(data)
                self.messages_sent += 1
        except (SwimWireError, *_STREAM_ERRORS) as e:
            self.failed += 1
            log.debug("gossip.send_failed", peer=dest, error=str(e))

    def _after_change(self) -> None:
        """Bump the generation if any member's row changed (placement waits on it)."""
        digest = self.swim.digest()
        if digest == self._seen_digest:
            return
        self._seen_digest = digest
        now = _now()
        changed = False
        for m, x in self.swim.members.items():
            row = (x.incarnation, x.state, x.record_seq)
            old = self._rows.get(m)
            if old != row:
                if old is None or old[1] != x.state:
                    self._since[m] = now
                self._rows[m] = row
                changed = True
        if changed:
            self._generation_up()

    def _generation_up(self) -> None:
        self._generation += 1
        self._changed.set()
        self._changed = trio.Event()

    def _refresh(self, now: float) -> None:
        """Republish our RTTs and the caller's dynamic fields when they changed enough."""
        if now - self._last_refresh < _RTT_REFRESH and self._record is not None:
            return
        self._last_refresh = now
        current = self._record.record if self._record is not None else None
        changed, self._published_rtts = fields_to_publish(
            current, self._local_fields, self.overlay, self._published_rtts
        )
        if changed or current is None:
            try:
                self.update_local(**changed)
            except GossipError as e:
                log.warning("gossip.publish_failed", error=str(e))


def _now() -> float:
    return trio.current_time()
