"""SwimService: membership by probes (`swim.py`) over overlay streams (label `swim/1`), behind
the API of `GossipService`, so that placement, the dialer and the control API use either.

Messages to a member go on one long-lived stream to it (`u32 length || message`, at most
`swim_wire.MAX_MESSAGE` bytes), opened when the first is sent and reopened after a break; the
replies come on the member's own stream back. The agent keeps connections to a bounded set of
members (`kept`: a few at random, a few near, those under a probe; the dialer closes the
others it opened once quiet, `discovery/keep.py`), and probes, gossip, PING-REQs and syncs go
to its neighbours (`_neighbour`). A message to a member without a connection dials it (at most
`_DIALS` at once); one whose stream is backed up by `_OUTBOX` messages, or that cannot be
sent, is dropped: the protocol takes that as it takes a lost datagram. A received message
is decoded with its bounds (`swim_wire`), its updates checked against their issuers'
signatures (`swim_proofs`), and a bad one ends its stream only. Every connection that comes
up is a join: this agent asks that peer for its table (so two meshes that meet merge), and
what it learns it spreads as SWIM does, piggybacked on its probes.

It is the agent's default (`membership = "swim"`, `--membership swim`); `--membership
heartbeat` runs the heartbeat protocol (`service.py`) instead, which keeps a connection to
every member (docs/gossip.md).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

import structlog
import trio

from meshagent.discovery.keep import KeepConfig, KeepSet
from meshagent.gossip.failure import PeerState
from meshagent.gossip.peer_record import PeerRecord
from meshagent.gossip.service import LocalFields, Republisher
from meshagent.gossip.signed import SignedRecord, sign_new_record
from meshagent.gossip.state import PeerView
from meshagent.gossip.swim import Message, State, Swim, SwimConfig
from meshagent.gossip.swim_proofs import SwimProofs
from meshagent.gossip.swim_wire import MAX_MESSAGE, SwimWireError, decode, encode
from meshagent.identity.keys import NodeIdentity
from meshagent.net.coordinates import Coordinate, CoordinateKeeper, estimate_ms
from meshagent.net.errors import ConnectionUnavailable, StreamResetError
from meshagent.net.manager import ConnectionManager
from meshagent.net.stream import MeshStream
from meshagent.waiting import Generation
from meshagent.wire.errors import ErrorCode
from meshagent.wire.framing import Framing, LengthPrefixDecoder

log = structlog.get_logger(__name__)

LABEL = "swim/1"
_SEND_TIMEOUT = 2.0
_OUTBOX = 32  # messages waiting for one member's stream; more are dropped
_LINK_SYNC = 2.0  # seconds between digest syncs with members newly connected
_DIALS = 8  # streams waiting for a connection to be dialled; a message past them is dropped
_IDLE = 60.0  # seconds a stream to a member stays open with nothing to send
FRAMING = Framing("membership message", 4, MAX_MESSAGE, error=SwimWireError)
_RTT_REFRESH = 10.0  # our record's RTT figures are republished at most this often
_LOST_PROBED = 30.0  # seconds a member whose connection broke is still probed without one
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
        keep: KeepConfig | None = None,
    ) -> None:
        self.config = config or SwimConfig()
        self.identity = identity
        self.mesh = mesh
        self.overlay = overlay
        self.proofs = SwimProofs(identity, mesh)
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
        self.swim.reachable = self._neighbour
        self.on_tick: Callable[[], None] | None = None  # after each tick (the dialer's wake)
        self._dialing = 0  # streams waiting for a connection to be dialled
        self._fields: dict[str, Any] = {}
        self._record: SignedRecord | None = None
        self._parsed: dict[tuple[str, int], PeerRecord] = {}
        self._since: dict[str, float] = {}  # when each member's state last changed here
        self._rows: dict[str, tuple[int, State, int]] = {}
        self._seen_digest = b""
        self._changes = Generation()
        self._wake = trio.Event()
        self._known_links: set[str] = set()
        # Members whose connection to this agent broke (not closed in order): when, so
        # that they are probed until found dead or connected again (`link_lost`).
        self._lost: dict[str, float] = {}
        self._last_link_sync = -float("inf")
        self._joined: dict[str, float] = {}  # linked peers not yet members: when last asked
        self._disputed: dict[str, float] = {}  # linked members known dead: when last synced
        self.keep_config = keep or KeepConfig()
        self._keep = KeepSet(self.keep_config, random.Random(self._rng.getrandbits(32)))
        self._republisher = Republisher(
            local_fields,
            overlay,
            CoordinateKeeper(random.Random(self._rng.getrandbits(32))),
            rtt_peers=self._keep.lasting,
        )
        self._exchanged: dict[str, float] = {}  # member -> when a message last went either way
        self._last_refresh = -float("inf")
        self._nursery: trio.Nursery | None = None
        self._outboxes: dict[str, trio.MemorySendChannel[bytes]] = {}
        self.dropped = 0  # messages not sent: no connection, or the member's stream backed up
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
        candidate = {**self._fields, **fields}
        wall = self._wall()
        seq = max(int(wall * 1_000_000), (self._record.seq + 1) if self._record else 1)
        signed = sign_new_record(self.identity, self.mesh, candidate, seq=seq, wall_time=wall)
        self._fields, self._record = candidate, signed
        self.swim.publish(signed.raw, _now(), seq)
        self._changes.bump()
        self._wake.set()

    @property
    def generation(self) -> int:
        return self._changes.value

    async def wait_changed(self, after: int) -> int:
        return await self._changes.wait_past(after)

    def stats(self) -> dict[str, Any]:
        return {
            "protocol": "swim",
            "members": len(self.swim.members),
            "generation": self._changes.value,
            "messages_sent": self.messages_sent,
            "messages_received": self.messages_received,
            "failed": self.failed,
            "dropped": self.dropped,
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
            # a crash is declared within about this after the first probe it fails
            "dead_after_s": c.probe_timeout + c.indirect_timeout + c.suspicion_max,
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
        if self._nursery is None:
            return
        self._dispatch(out)
        # Waited for: those connected now (one that is gone takes nothing, and a dial to it
        # would only hold this agent's exit up).
        told = {dest for dest, _ in out if self.overlay.connection(dest) is not None}
        with trio.move_on_after(timeout):  # until those members' streams have taken it
            while any(
                (box := self._outboxes.get(d)) is not None and box.statistics().current_buffer_used
                for d in told
            ):
                await trio.sleep(0.01)
            await trio.sleep(0.05)
        log.info("gossip.left", told=len(out))

    def kept(self) -> set[str]:
        """The members to keep connections to: a few at random, a few nearest by
        coordinates, and those under a probe (`keep.py`)."""
        pinned = self.swim.probing()
        mine = self._coordinate(self.peer_id)

        def estimate(m: str) -> float | None:
            theirs = self._coordinate(m)
            return None if mine is None or theirs is None else estimate_ms(mine, theirs)

        return self._keep.choose(self.swim.alive_others(), estimate, pinned)

    def _neighbour(self, peer_id: str) -> bool:
        """Whether membership talks to `peer_id` on its own account (probes it, gossips
        to it): a member this agent keeps and is connected to, one that opened a connection
        to it, or one whose connection broke lately (`link_lost`: a crash, probed until the
        probes find it dead). A connection this agent opened and does not keep (a join, one
        dialled for a stream) carries no probe of its own, so it falls quiet and closes."""
        conn = self.overlay.connection(peer_id)
        if conn is None:
            lost = self._lost.get(peer_id)
            return lost is not None and _now() - lost < _LOST_PROBED
        return not conn.initiator or peer_id in self._keep.lasting()

    def link_lost(self, peer_id: str) -> None:
        """The connection to `peer_id` broke without a close (the overlay's `on_lost`, by
        way of the dialer): it stays a neighbour a while, so that this agent's probes (each
        dialling it) find out whether it crashed. Without that a crash would go unprobed by
        everyone connected to it, since each probes only its connections."""
        x = self.swim.members.get(peer_id)
        if x is not None and x.state != State.DEAD:
            self._lost[peer_id] = _now()

    def quiet_for(self, peer_id: str) -> float:
        """Seconds since a membership message last went to or came from `peer_id`."""
        return _now() - self._exchanged.get(peer_id, -float("inf"))

    def _coordinate(self, peer_id: str) -> Coordinate | None:
        if peer_id == self.peer_id:
            record = self._record.record if self._record is not None else None
        else:
            record = self.record_of(peer_id)
        if record is None or not record.coord:
            return None
        return Coordinate.from_wire(list(record.coord))

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
                self._forget_lost(now)
                if self.on_tick is not None:
                    self.on_tick()
                wait = max(0.0, min(self.swim.next_timer(), now + 0.5) - _now())
                with trio.move_on_after(wait):
                    await self._wake.wait()
                if self._wake.is_set():
                    self._wake = trio.Event()
                    self._dispatch(self.swim.flush(_now()))

    async def handle(self, stream: MeshStream) -> None:
        """A member's stream of messages to this agent (`swim/1`), read until it ends."""
        peer = stream.peer_id
        frames = LengthPrefixDecoder(FRAMING)
        try:
            while chunk := await stream.receive_some():
                frames.feed(chunk)
                while (data := frames.next_frame()) is not None:
                    msg = decode(data)
                    self._exchanged[peer] = _now()
                    self.bytes_received += FRAMING.width + len(data)
                    self.messages_received += 1
                    self._dispatch(self.swim.receive(_now(), peer, msg))
                    self._after_change()
            if frames.pending:
                raise SwimWireError("a membership stream ended inside a message")
            await stream.send_eof()
        except (SwimWireError, *_STREAM_ERRORS) as e:
            if not _closed(e):  # (else its connection closed, an idle one, say)
                self.failed += 1
                log.info("gossip.message_refused", peer=peer, error=str(e))
                stream.reset(f"membership message refused: {e}")
        except Exception as e:  # a bug met by one stream ends that stream only
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
        """Compare tables with peers newly connected: one it does not know of gets a join
        (its whole table with records comes back, and two meshes that meet merge), again
        every `_LINK_SYNC` seconds while it stays unknown (a join lost with a connection
        that closed under it would otherwise leave a connected peer out of the view for
        good); of those it knows, one at most every `_LINK_SYNC` seconds gets a digest (and
        answers with its table only where they differ, records pulled as needed), so that
        connections that come back after a partition merge the two sides soon, while the
        short ones dialled for a stream or a PING-REQ cost little more. A member known dead
        whose connection is up gets a digest every `_LINK_SYNC` seconds: its answer tells it
        of its death, which it refutes, and its own digest brings the refutation here. (Two
        agents alone that buried each other while their direct path died, and meet again
        through a relay, would otherwise each wait for the other to speak first.)"""
        links = {link.peer_id for link in self.overlay.links()}
        new = sorted(links - self._known_links)
        self._known_links = links
        out: list[tuple[str, Message]] = []
        for peer in sorted(links):
            if peer in self.swim.members:
                self._joined.pop(peer, None)
            elif now - self._joined.get(peer, -float("inf")) >= _LINK_SYNC:
                self._joined[peer] = now
                out += self.swim.join(peer, now)
        for peer in self._joined.keys() - links:
            del self._joined[peer]
        for peer in sorted(links):
            conn = self.overlay.connection(peer)
            if self.swim.state_of(peer) != State.DEAD or not (conn and conn.accepting_streams):
                self._disputed.pop(peer, None)  # (one draining is its leaving, or replaced)
            elif now - self._disputed.get(peer, -float("inf")) >= _LINK_SYNC:
                self._disputed[peer] = now
                out += self.swim.sync_with(peer)
        for peer in self._disputed.keys() - links:
            del self._disputed[peer]
        for peer in new:
            if peer in self.swim.members and now - self._last_link_sync >= _LINK_SYNC:
                self._last_link_sync = now
                out += self.swim.sync_with(peer)
        return out

    def _dispatch(self, out: list[tuple[str, Message]]) -> None:
        if self._nursery is None:
            return
        now = _now()
        for dest, msg in out:
            self._exchanged[dest] = now
            self._post(dest, FRAMING.encode(encode(msg)))
        if len(self._exchanged) > 4 * max(64, len(self.swim.members)):
            self._exchanged = {p: t for p, t in self._exchanged.items() if now - t < 60.0}

    def _post(self, dest: str, frame: bytes) -> None:
        """Queue `frame` on `dest`'s stream (opened now if there is none)."""
        assert self._nursery is not None
        connected = self.overlay.connection(dest) is not None
        box = self._outboxes.get(dest)
        if (
            box is None
            and not connected
            and (self.overlay.reach is None or self._dialing >= _DIALS)
        ):
            self.dropped += 1  # no path to it now, nor one to be dialled: a lost datagram
            return
        if box is None:
            box, inbox = trio.open_memory_channel[bytes](_OUTBOX)
            self._outboxes[dest] = box
            self._nursery.start_soon(self._stream_to, dest, box, inbox)
        try:
            box.send_nowait(frame)
        except trio.WouldBlock:
            self.dropped += 1

    async def _stream_to(
        self,
        dest: str,
        box: trio.MemorySendChannel[bytes],
        inbox: trio.MemoryReceiveChannel[bytes],
    ) -> None:
        """Send what is queued for `dest` on one stream, until the stream breaks or the
        member has nothing for `_IDLE` seconds; a later message opens another."""
        try:
            stream = await self._open(dest)
            if stream is None:
                raise ConnectionUnavailable(f"no stream to {dest} within {_SEND_TIMEOUT:g} s")
            try:
                idle_since = _now()
                while True:
                    frame: bytes | None = None
                    # A connection that drains (this agent stops, or it is replaced) or
                    # whose peer sent GOAWAY (it stops) ends the stream now, not after the
                    # drain's grace (looked at every half second, and before each frame:
                    # messages keep coming; those queued go on the next stream).
                    if not stream.connection.accepting_streams:
                        break
                    with trio.move_on_after(0.5):
                        frame = await inbox.receive()
                    if frame is None:
                        if _now() - idle_since >= _IDLE:
                            break
                        continue
                    idle_since = _now()
                    with trio.fail_after(_SEND_TIMEOUT):
                        await stream.send_all(frame)
                    self.bytes_sent += len(frame)
                    self.messages_sent += 1
            finally:
                with trio.move_on_after(_SEND_TIMEOUT):
                    await stream.send_eof()
                    while await stream.receive_some():
                        pass
                await stream.aclose()
        except (SwimWireError, trio.TooSlowError, *_STREAM_ERRORS) as e:
            self.failed += not _closed(e)
            log.debug("gossip.send_failed", peer=dest, error=str(e))
        finally:
            if self._outboxes.get(dest) is box:
                del self._outboxes[dest]
            self.dropped += _drain(inbox)

    async def _open(self, dest: str) -> MeshStream | None:
        """A stream to `dest` (its connection dialled first where there is none, counted
        in `_dialing` meanwhile), or None after `_SEND_TIMEOUT`."""
        dialling = self.overlay.connection(dest) is None
        self._dialing += dialling
        try:
            with trio.move_on_after(_SEND_TIMEOUT):
                return await self.overlay.open_stream(dest, LABEL, window_bytes=MAX_MESSAGE)
            return None
        finally:
            self._dialing -= dialling

    def _forget_lost(self, now: float) -> None:
        """Drop the broken links that are settled: the member is dead, connected again,
        or was probed without one for `_LOST_PROBED` seconds."""
        for m, when in list(self._lost.items()):
            x = self.swim.members.get(m)
            if (
                x is None
                or x.state == State.DEAD
                or self.overlay.connection(m) is not None
                or now - when >= _LOST_PROBED
            ):
                del self._lost[m]

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
                    _log_state(m, x.state, old)
                self._rows[m] = row
                changed = True
        if changed:
            self._changes.bump()

    def _refresh(self, now: float) -> None:
        """Republish our RTTs and the caller's dynamic fields when they changed enough."""
        if now - self._last_refresh < _RTT_REFRESH and self._record is not None:
            return
        self._last_refresh = now
        current = self._record.record if self._record is not None else None
        self._republisher.republish(current, self.record_of, self.update_local)


def _now() -> float:
    return trio.current_time()


def _log_state(member: str, state: State, old: tuple[int, State, int] | None) -> None:
    """Log a member that joined, died or came back, as the heartbeat protocol does."""
    if old is None and state != State.DEAD:
        log.info("gossip.peer_joined", peer=member)
    elif state == State.DEAD:
        log.info("gossip.peer_dead", peer=member)
    elif old is not None and old[1] == State.DEAD:
        log.info("gossip.peer_back", peer=member)


def _closed(e: BaseException) -> bool:
    """Whether `e` is a stream's end with its connection's orderly close."""
    return isinstance(e, StreamResetError) and e.code is ErrorCode.NO_ERROR


def _drain(inbox: trio.MemoryReceiveChannel[bytes]) -> int:
    """Messages left in a closed outbox: dropped."""
    n = 0
    while True:
        try:
            inbox.receive_nowait()
        except (trio.WouldBlock, trio.EndOfChannel):
            return n
        n += 1
