"""GossipService: runs the membership protocol over overlay streams (label `gossip/1`).

Every `interval` it issues a heartbeat, re-checks every peer's liveness, and runs one
push-pull exchange with a random connected peer (and one with each newly connected peer,
so a joining agent learns the mesh in one round). Inbound exchanges are rate limited per
peer. The protocol itself lives in `exchange.py`/`state.py`; this module only moves bytes.

For placement and the control API:
    gossip.snapshot() -> {peer_id: PeerView}       alive and suspect peers with records
    gossip.update_local(mem_kv_bytes=..., ...)      publish new values of our own record
    gen = await gossip.wait_changed(gen)            returns once something changed
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

import structlog
import trio

from meshagent.gossip.budget import Buckets
from meshagent.gossip.config import GossipConfig
from meshagent.gossip.errors import ExchangeError, GossipError
from meshagent.gossip.exchange import Exchange
from meshagent.gossip.failure import PeerState
from meshagent.gossip.hearsay import Heard
from meshagent.gossip.peer_record import PeerRecord
from meshagent.gossip.state import Change, GossipState, PeerView
from meshagent.identity.keys import NodeIdentity
from meshagent.net.coordinates import Coordinate, CoordinateKeeper
from meshagent.net.errors import ConnectionUnavailable, StreamResetError
from meshagent.net.manager import ConnectionManager
from meshagent.net.stream import MeshStream
from meshagent.waiting import Generation

log = structlog.get_logger(__name__)

LABEL = "gossip/1"
# A record lists its RTTs to this many of its nearest peers; placement estimates the others
# from coordinates (records stay small in a big mesh, where the decoder takes 256 at most).
MAX_PUBLISHED_RTTS = 32
# Gossip streams carry small messages; a small window bounds what a peer can make us buffer.
_WINDOW_BYTES = 1 << 20
_STREAM_ERRORS = (
    ExchangeError,
    StreamResetError,
    ConnectionUnavailable,
    trio.BrokenResourceError,
    trio.ClosedResourceError,
)

LocalFields = Callable[[], dict[str, Any]]


def heard_on(overlay: ConnectionManager) -> Heard:
    """When this agent last heard each peer directly: the last PONG on its connection to it
    (its start before the first), None without one."""

    def heard(peer_id: str) -> float | None:
        conn = overlay.connection(peer_id)
        if conn is None or conn.is_closed:
            return None
        return trio.current_time() - conn.silent_for()

    return heard


class GossipService:
    def __init__(
        self,
        identity: NodeIdentity,
        mesh: str,
        overlay: ConnectionManager,
        config: GossipConfig | None = None,
        *,
        local_fields: LocalFields | None = None,
        rng: random.Random | None = None,
        wall_clock: Callable[[], float] = time.time,
        heard: Heard | None = None,
    ) -> None:
        """`heard` says when this agent last heard a peer directly (hearsay.py); by default
        the last PONG on the overlay's connection to it (`heard_on`)."""
        self.config = config or GossipConfig()
        self.state = GossipState(
            identity, mesh, self.config, now=0.0, heard=heard or heard_on(overlay)
        )
        self.overlay = overlay
        self._rng = rng or random.Random()
        self._wall = wall_clock
        self._changes = Generation()
        self._buckets = Buckets(self.config.inbound_burst, self.config.inbound_rate)
        self._known_links: set[str] = set()
        self._busy_with: set[str] = set()
        self._again: set[str] = set()  # asked for while busy: exchange again once it ends
        self._republisher = Republisher(
            local_fields, overlay, CoordinateKeeper(random.Random(self._rng.getrandbits(32)))
        )
        self._last_refresh = -float("inf")
        self._nursery: trio.Nursery | None = None
        self.bytes_sent = 0
        self.bytes_received = 0
        self.exchanges = 0
        self.failed_exchanges = 0
        self.refused_exchanges = 0

    @property
    def peer_id(self) -> str:
        return self.state.self_id

    # ----- the API placement uses -----

    def snapshot(self, *, include_dead: bool = False) -> dict[str, PeerView]:
        """Every peer with a record (ourselves included), keyed by peer id; dead peers only
        with `include_dead`. Views are immutable: hold on to one for a whole decision."""
        return self.state.views(now=trio.current_time(), include_dead=include_dead)

    def update_local(self, **fields: Any) -> None:
        """Publish new values for fields of our record (see record.PUBLISHABLE); other
        fields keep their values. Raises GossipError for unknown or oversized fields."""
        self.state.publish(wall_time=self._wall(), **fields)
        self._notify([Change(self.peer_id, "record", self.state.me.state)])

    @property
    def generation(self) -> int:
        """Increases on every change of membership, state or any record."""
        return self._changes.value

    async def wait_changed(self, after: int) -> int:
        """Wait until the generation passes `after`; returns the new generation."""
        return await self._changes.wait_past(after)

    def stats(self) -> dict[str, Any]:
        st = self.state.stats
        return {
            "members": len(self.state.entries),
            "generation": self._changes.value,
            "exchanges": self.exchanges,
            "failed_exchanges": self.failed_exchanges,
            "refused_exchanges": self.refused_exchanges,
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "accepted": dict(st.accepted),
            "stale": dict(st.stale),
            "rejected": dict(st.rejected),
            "disputed": st.disputed,
            "evicted": st.evicted,
        }

    # ----- service -----

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED):
        """Heartbeat, detect failures and exchange every `interval` until cancelled."""
        now = trio.current_time()
        self.state.me.last_progress = now
        self.state.beat(now=now, wall_time=self._wall())
        self._refresh(now)
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            while True:
                jitter = self._rng.uniform(0.9, 1.1)
                await trio.sleep(self.config.interval * jitter)
                now = trio.current_time()
                self.state.beat(now=now, wall_time=self._wall())
                self._refresh(now)
                self._notify(self.state.tick(now=now))
                for peer in self._partners():
                    self._exchange_soon(peer)

    async def handle(self, stream: MeshStream) -> None:
        """Serve an exchange another peer started (`gossip/1` streams)."""
        peer = stream.peer_id
        ex = Exchange(self.state, initiator=False, source=peer)
        try:
            with trio.move_on_after(self.config.exchange_timeout) as scope:
                if not self._buckets.take(peer, trio.current_time()):
                    self.refused_exchanges += 1
                    log.info("gossip.exchange_refused", peer=peer, reason="rate limit")
                    await stream.send_all(ex.refuse("rate limit: too many exchanges"))
                else:
                    await self._converse(stream, ex)
                await stream.send_eof()
                await _read_to_eof(stream)
            if scope.cancelled_caught:
                raise ExchangeError(f"timed out after {self.config.exchange_timeout:g} s")
        except _STREAM_ERRORS as e:
            self.failed_exchanges += 1
            log.debug("gossip.exchange_failed", peer=peer, role="responder", error=str(e))
            stream.reset(f"gossip exchange failed: {e}")
        except Exception as e:  # a bug met by one exchange ends that exchange only
            self._failed_unexpectedly(peer, "responder", e)
            stream.reset(f"gossip exchange failed: {type(e).__name__}")
        finally:
            self._account(ex)
        await stream.aclose()

    def summary(self) -> dict[str, Any]:
        """For the control API's status: the counters, members by state, the timers."""
        states: dict[str, int] = {}
        for e in self.state.entries.values():
            states[e.state.value] = states.get(e.state.value, 0) + 1
        c = self.config
        return {
            **self.stats(),
            "protocol": "heartbeat",
            "states": states,
            "interval_s": c.interval,
            "suspect_after_s": c.suspect_after,
            "dead_after_s": c.dead_after,
            "timers": f"every {c.interval:g} s, suspect after {c.suspect_after:g} s, "
            f"dead after {c.dead_after:g} s",
        }

    def record_of(self, peer_id: str) -> PeerRecord | None:
        """`peer_id`'s record as known here, if any."""
        e = self.state.entries.get(peer_id)
        return None if e is None or e.record is None else e.record.record

    def dead_since(self, peer_id: str) -> float | None:
        """When `peer_id` was declared dead here, if it is dead."""
        e = self.state.entries.get(peer_id)
        return e.state_since if e is not None and e.state is PeerState.DEAD else None

    def declare_dead(self, peer_id: str, reason: str) -> None:
        """`peer_id` is gone for certain (its process no longer listens where it did): it is
        dead here now, and every connected peer hears so at once rather than after
        `dead_after`. A peer that is alive after all refutes it with its next heartbeat."""
        changes = self.state.declare_dead(peer_id, now=trio.current_time(), reason=reason)
        if not changes:
            return
        self._notify(changes)
        self.exchange_with_all(but=peer_id)

    def beat_of(self, peer_id: str) -> int:
        """The latest heartbeat of `peer_id` known here (0: none)."""
        entry = self.state.entries.get(peer_id)
        return entry.beat if entry is not None else 0

    def exchange_with_all(self, *, but: str | None = None) -> None:
        """Exchange now with every connected peer but `but`: what they heard from it
        lately arrives here within a round trip (is it silent for everyone, or only to us?)."""
        for link in self.overlay.links():
            if link.peer_id != but:
                self._exchange_soon(link.peer_id, again=True)

    def republish(self) -> None:
        """Read the caller's dynamic fields now (not at the next refresh) and spread what
        changed: a change peers act on at once (this agent's NAT, its public address)."""
        self._last_refresh = -float("inf")
        self._refresh(trio.current_time())
        if self._nursery is not None:
            self.spread_now()

    def spread_now(self) -> None:
        """Exchange with every connected peer now: a change the others wait on (a placement
        claim: a split serves once every stage's claim says ready) reaches them within a
        round trip instead of in the next rounds, a second or more later."""
        self.exchange_with_all()

    async def leave(self, *, timeout: float = 2.0, peers: int = 3) -> None:
        """Tell a few connected peers we are leaving (they spread it), so the mesh stops
        routing to us now rather than after `dead_after`. Call before closing the overlay."""
        self.state.leave()
        links = [link.peer_id for link in self.overlay.links()]
        chosen = self._rng.sample(links, min(peers, len(links)))
        with trio.move_on_after(timeout):
            async with trio.open_nursery() as nursery:
                for peer in chosen:
                    nursery.start_soon(self._exchange_with, peer)
        log.info("gossip.left", told=len(chosen))

    # ----- internals -----

    def _exchange_soon(self, peer: str, *, again: bool = False) -> None:
        """Start an exchange with `peer` unless one is under way; with `again`, start
        another once that one ends (it may have begun before what must be sent now)."""
        if self._nursery is None:
            return
        if peer in self._busy_with:
            if again:
                self._again.add(peer)
            return
        self._busy_with.add(peer)
        self._nursery.start_soon(self._exchange_with, peer)

    def _partners(self) -> list[str]:
        """`fanout` random connected peers, plus every peer connected since the last round."""
        links = [link.peer_id for link in self.overlay.links()]
        new = [p for p in links if p not in self._known_links]
        self._known_links = set(links)
        chosen = set(new)
        idle = [p for p in links if p not in self._busy_with and p not in chosen]
        chosen.update(self._rng.sample(idle, min(self.config.fanout, len(idle))))
        return sorted(chosen)

    async def _exchange_with(self, peer: str) -> None:
        ex = Exchange(self.state, initiator=True, source=peer)
        try:
            with trio.move_on_after(self.config.exchange_timeout) as scope:
                stream = await self.overlay.open_stream(peer, LABEL, window_bytes=_WINDOW_BYTES)
                try:
                    await stream.send_all(ex.start())
                    await self._converse(stream, ex)
                    await stream.send_eof()
                    await _read_to_eof(stream)
                finally:
                    await stream.aclose()
            if scope.cancelled_caught:
                raise ExchangeError(f"timed out after {self.config.exchange_timeout:g} s")
            if ex.busy:
                log.debug("gossip.exchange_busy", peer=peer, reason=ex.busy)
        except _STREAM_ERRORS as e:
            self.failed_exchanges += 1
            log.debug("gossip.exchange_failed", peer=peer, role="initiator", error=str(e))
        except Exception as e:  # a bug met by one exchange ends that exchange only
            self._failed_unexpectedly(peer, "initiator", e)
        finally:
            self._account(ex)
            self._busy_with.discard(peer)
            if peer in self._again:
                self._again.discard(peer)
                self._exchange_soon(peer)

    async def _converse(self, stream: MeshStream, ex: Exchange) -> None:
        while not ex.done:
            data = await stream.receive_some()
            if not data:
                raise ExchangeError("the peer ended the exchange early")
            out = ex.receive_data(bytes(data), now=trio.current_time())
            if out:
                await stream.send_all(out)

    def _failed_unexpectedly(self, peer: str, role: str, error: Exception) -> None:
        self.failed_exchanges += 1
        log.error(
            "gossip.exchange_failed",
            peer=peer,
            role=role,
            error=f"{type(error).__name__}: {error}",
            exc_info=error,
        )

    def _account(self, ex: Exchange) -> None:
        self.bytes_sent += ex.bytes_sent
        self.bytes_received += ex.bytes_received
        if ex.done and not ex.busy:
            self.exchanges += 1
        self._notify(ex.changes)

    def _refresh(self, now: float) -> None:
        """Republish our RTTs and the caller's dynamic fields when they changed enough."""
        if now - self._last_refresh < self.config.rtt_refresh:
            return
        self._last_refresh = now
        current = self.state.me.record.record if self.state.me.record is not None else None
        self._republisher.republish(current, self.record_of, self.update_local)

    def _notify(self, changes: list[Change]) -> None:
        if changes:
            self._changes.bump()


class Republisher:
    """What either membership service republishes of its own record, and when: the caller's
    dynamic fields that changed, its nearest RTTs and its coordinate (`fields_to_publish`)."""

    def __init__(
        self,
        local_fields: LocalFields | None,
        overlay: ConnectionManager,
        coordinate: CoordinateKeeper,
        rtt_peers: Callable[[], set[str]] | None = None,
    ) -> None:
        """`rtt_peers`: the peers whose RTTs to publish, of those connected (None: any); a
        bounded connection set publishes its lasting connections', not the probes' brief
        ones, so that its record does not change with every probe."""
        self.local_fields = local_fields
        self.overlay = overlay
        self.coordinate = coordinate
        self.rtt_peers = rtt_peers
        self.published_rtts: dict[str, float] = {}

    def republish(
        self,
        current: PeerRecord | None,
        record_of: Callable[[str], PeerRecord | None],
        publish: Callable[..., None],
    ) -> None:
        """Publish what changed since `current` (everything, with no record yet)."""
        changed, self.published_rtts = fields_to_publish(
            current,
            self.local_fields,
            self.overlay,
            self.published_rtts,
            self.coordinate,
            record_of,
            None if self.rtt_peers is None else self.rtt_peers(),
        )
        if changed or current is None:
            try:
                publish(**changed)
            except GossipError as e:
                log.warning("gossip.publish_failed", error=str(e))


def fields_to_publish(
    current: PeerRecord | None,
    local_fields: LocalFields | None,
    overlay: ConnectionManager,
    published_rtts: dict[str, float],
    coordinate: CoordinateKeeper,
    record_of: Callable[[str], PeerRecord | None],
    rtt_peers: set[str] | None = None,
) -> tuple[dict[str, Any], dict[str, float]]:
    """What of our record to republish (the caller's dynamic fields that changed, our RTTs to
    the `MAX_PUBLISHED_RTTS` nearest peers where they moved enough, our coordinate where it
    moved: each measured RTT to a peer with a coordinate moves ours), and the RTTs published
    from now on."""
    fields = dict(local_fields()) if local_fields is not None else {}
    measured = {
        link.peer_id: round(link.rtt.smoothed * 1000, 2)
        for link in overlay.links()
        if link.rtt.smoothed is not None and (rtt_peers is None or link.peer_id in rtt_peers)
    }
    for peer, ms in sorted(measured.items()):
        record = record_of(peer)
        theirs = Coordinate.from_wire(list(record.coord)) if record and record.coord else None
        if theirs is not None:
            coordinate.observe(theirs, ms)
    coord = coordinate.to_publish()
    if coord is not None:
        fields["coord"] = coord
    nearest = sorted(measured.items(), key=lambda kv: (kv[1], kv[0]))[:MAX_PUBLISHED_RTTS]
    rtts = dict(nearest)
    if _rtts_moved(published_rtts, rtts):
        fields["rtts_ms"] = tuple(sorted(rtts.items()))
        published_rtts = rtts
    changed = {k: v for k, v in fields.items() if current is None or getattr(current, k) != v}
    return changed, published_rtts


def _rtts_moved(old: dict[str, float], new: dict[str, float]) -> bool:
    """A peer came or went, or an RTT moved by over 20% and 0.5 ms."""
    if old.keys() != new.keys():
        return True
    return any(abs(new[p] - old[p]) > max(0.5, 0.2 * old[p]) for p in new)


async def _read_to_eof(stream: MeshStream) -> None:
    while await stream.receive_some():
        raise ExchangeError("data after the end of the exchange")
