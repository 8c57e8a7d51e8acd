"""PeerDialer: keeps this node connected to every live member it has heard of or, with
membership by probes, to the bounded set of members that membership keeps (`keep.py`); others
are dialled when a stream must go to them (`reach`), and a connection it opened to one of them
is closed once it has carried nothing but membership for a while.

Candidates come from mDNS, relay rendezvous, bootstrap addresses and gossip records. For a
peer without a connection it tries the peer's direct addresses, then the relays it shares
with it; for a peer reached only through a relay it keeps trying the direct addresses
(every `upgrade_interval`), and a direct connection that comes up replaces the relayed one
(the overlay drains and closes the old one). Peers that gossip declares dead are not dialled
until a newer sighting of them arrives; only their direct addresses are looked at now and
then (a bare connect, no handshake: every `dead_probe_max` at most), and a peer restarted
there is dialled. A restarted agent whose only way into the mesh was a peer that declared it
dead (it was the inviter, say) is found again this way.

A connection the transport ended (a reset, EOF without BYE) is how a crashed peer shows
first: the dialer then looks at once whether anything still listens at the peer's direct
addresses, and if every one refuses (the host is up, the process is gone), gossip declares
the peer dead now rather than after `dead_after`, so placement can replan in seconds.

A connection whose peer stopped answering PINGs (the overlay's `on_silent`: a power cut, a
partition, a broken path) has no reset to go by. The dialer waits `silence_confirm`, then
asks every other connected peer whether it still hears the peer (`hearing.ask`). If one
does (or the peer's heartbeat reached us meanwhile), only our path is bad: the connection is
dropped and a new one (direct, else through a relay) replaces it. If none does and one of
them finds it silent too (or there is no one else to ask), the peer is declared dead. With
no answer to go by, nothing is declared: gossip's `dead_after` decides.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import structlog
import trio

from meshagent.discovery import hearing, nat
from meshagent.discovery.keep import IdleConnections
from meshagent.discovery.punch import Outcome, punches, schedule, why_relayed
from meshagent.gossip import swim_service
from meshagent.gossip.membership import Membership
from meshagent.gossip.swim_service import SwimService
from meshagent.net.address import Address
from meshagent.net.connection import DIRECT, RELAYED, Connection
from meshagent.net.errors import DialError
from meshagent.net.manager import ConnectionManager
from meshagent.relay.errors import RelayError
from meshagent.wire.errors import ErrorCode, HandshakeError

log = structlog.get_logger(__name__)

# (relay address, peer id) -> a connection to the peer through that relay
RelayDial = Callable[[str, str], Awaitable[Connection]]
Punch = Callable[[str], Awaitable[Outcome]]
_KINDS_WAIT = 10.0  # seconds a punch waits for both NATs' kinds to be known
_REACH_POLL = 0.05  # seconds between looks at an attempt already under way
_DIAL_ERRORS = (DialError, RelayError, HandshakeError, OSError, trio.BrokenResourceError)


@dataclass(frozen=True)
class DialerConfig:
    check_interval: float = 1.0  # how often connections are reviewed
    connect_timeout: float = 4.0  # per address tried
    retry_initial: float = 1.0  # backoff after a failed attempt to reach an unconnected peer
    retry_max: float = 30.0
    upgrade_interval: float = 5.0  # how often a relayed peer's direct addresses are retried
    first_upgrade: float = 1.0  # seconds after a relayed connection before the first try
    upgrade_timeout: float = 2.0  # per direct attempt of an upgrade (the addresses at once)
    yield_delay: float = 1.5  # the higher peer id waits this long, so both don't dial at once
    gone_timeout: float = 1.0  # per address, when checking whether a lost peer is gone
    silence_confirm: float = 0.5  # waited before asking the others about a silent peer
    hears_within: float = 1.25  # a peer that had a PONG this recently still hears it
    dead_probe_max: float = 10.0  # the longest gap between looks at a dead peer's addresses


@dataclass
class Candidate:
    """How a peer might be reached, merged from every source that mentioned it."""

    peer_id: str
    addresses: tuple[str, ...] = ()
    relays: tuple[str, ...] = ()
    sources: set[str] = field(default_factory=set)
    offered_at: float = 0.0
    next_attempt: float = 0.0
    next_upgrade: float = 0.0
    failures: int = 0
    attempting: bool = False
    direct_bad_until: float = 0.0  # its direct path just went silent: relays first till then
    next_probe: float = 0.0  # dead: when its direct addresses are looked at next
    # Hole punching (`punch.py`), tried once direct dials fail, by the side `punches` picks
    punches: int = 0  # attempts
    punch_failures: int = 0  # failed in a row
    punched: bool = False  # its direct path came from a punch: a plain dial will not do
    punch_error: str | None = None  # why the last attempt failed
    next_punch: float = 0.0


class PeerDialer:
    def __init__(
        self,
        overlay: ConnectionManager,
        *,
        gossip: Membership | None = None,
        relay_dial: RelayDial | None = None,
        local_relays: Callable[[], tuple[str, ...]] = tuple,
        punch: Punch | None = None,
        my_nat: Callable[[], str] = str,
        relay_members: Callable[[], set[str]] = set,
        config: DialerConfig | None = None,
        rng: random.Random | None = None,
    ) -> None:
        """With membership by probes (`gossip` a SwimService) the dialer keeps connections to
        the members that `gossip.kept()` names and to peers not yet members; a connection it
        opened to another, carrying no stream but membership's, is closed once it has been
        so for `keep_config.idle_close` seconds; a stream to a peer without a connection
        dials it (the overlay's `reach`)."""
        self.overlay = overlay
        self.gossip = gossip
        self.config = config or DialerConfig()
        self._relay_dial = relay_dial
        self._local_relays = local_relays
        self._punch = punch
        self._my_nat = my_nat  # this agent's NAT kind as its relays see it (`nat.py`)
        self._relay_members = relay_members  # peers registered now at one of our relays
        self._keep: Callable[[], set[str]] | None = None
        self._idle = IdleConnections(0.0)
        self._idle_labels: frozenset[str] = frozenset()
        self._quiet_for: Callable[[str], float] = lambda peer: float("inf")
        self._link_lost: Callable[[str], None] = lambda peer: None
        if isinstance(gossip, SwimService):
            self._keep = gossip.kept
            self._quiet_for = gossip.quiet_for
            self._link_lost = gossip.link_lost
            self._idle = IdleConnections(gossip.keep_config.idle_close)
            self._idle_labels = frozenset({swim_service.LABEL})
            overlay.reach = self.reach
            gossip.on_tick = self.wake
        self._rng = rng or random.Random()
        self._candidates: dict[str, Candidate] = {}
        self._judging: set[str] = set()  # peers whose silence is being looked into
        self._wake = trio.Event()
        self._nursery: trio.Nursery | None = None
        self._running = trio.CancelScope()

    @property
    def self_id(self) -> str:
        return self.overlay.peer_id

    def offer(
        self,
        peer_id: str,
        *,
        addresses: tuple[str, ...] = (),
        relays: tuple[str, ...] = (),
        source: str,
        renew: bool = False,
    ) -> None:
        """Tell the dialer a peer exists and how it might be reached. `renew`: this is a
        fresh sighting (an mDNS announcement), worth a try even if gossip says it died."""
        if peer_id == self.self_id:
            return
        now = trio.current_time()
        c = self._candidates.get(peer_id)
        if c is None:
            c = self._candidates[peer_id] = Candidate(peer_id)
            if self.self_id > peer_id:
                c.next_attempt = now + self.config.yield_delay
        new_ways = set(addresses) - set(c.addresses) or set(relays) - set(c.relays)
        if new_ways:
            c.next_punch = 0.0  # an address changed: punch again at once
        c.addresses = tuple(dict.fromkeys((*addresses, *c.addresses)))[:16]
        c.relays = tuple(dict.fromkeys((*relays, *c.relays)))[:8]
        if source not in c.sources or new_ways or renew:
            c.offered_at = now
            c.next_attempt = min(c.next_attempt, now) if c.failures else c.next_attempt
            self._wake.set()
        c.sources.add(source)

    def lost(self, conn: Connection) -> None:
        """The transport ended `conn` (the overlay's `on_lost`): find out now whether its
        peer is gone (and membership probes it meanwhile, `SwimService.link_lost`)."""
        self._link_lost(conn.peer_id)
        if self._nursery is not None and conn.path == DIRECT:
            self._nursery.start_soon(self._check_gone, conn.peer_id)

    def silent(self, conn: Connection) -> None:
        """`conn`'s peer stopped answering (the overlay's `on_silent`): find out whether the
        peer is gone or only this path to it."""
        if self._nursery is not None and conn.peer_id not in self._judging:
            self._judging.add(conn.peer_id)
            self._nursery.start_soon(self._judge_silence, conn)

    def candidates(self) -> dict[str, Candidate]:
        return dict(self._candidates)

    async def reach(self, peer_id: str) -> None:
        """Try to connect to `peer_id` now, whatever its backoff says (a stream must go to it:
        a peer that came back after a crash is needed at once). Returns when connected or
        when the attempt failed; the caller's open then says which."""
        c = self._candidates.get(peer_id)
        if c is None or self.overlay.connection(peer_id) is not None:
            return
        while c.attempting:  # the dialer is trying already: wait for that attempt
            await trio.sleep(_REACH_POLL)
        if self.overlay.connection(peer_id) is None:
            c.attempting = True
            await self._connect(c)

    def stop(self) -> None:
        """This agent is leaving: dial no one from now on."""
        self._running.cancel()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED):
        with self._running:
            await self._run(task_status)

    async def _run(self, task_status: trio.TaskStatus[None]) -> None:
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                while True:
                    self._from_gossip()
                    self._review(nursery, trio.current_time())
                    with trio.move_on_after(self.config.check_interval):
                        await self._wake.wait()
                    self._wake = trio.Event()
        finally:
            self._nursery = None  # `lost` starts nothing once stopped

    def wake(self) -> None:
        """Review the connections now (the kept set changed)."""
        self._wake.set()

    # ----- internals -----

    def _from_gossip(self) -> None:
        if self.gossip is None:
            return
        for pid, view in self.gossip.snapshot().items():
            rec = view.record
            if pid != self.self_id and (rec.addresses or rec.relays):
                self.offer(pid, addresses=rec.addresses, relays=rec.relays, source="gossip")

    def _dead_since(self, c: Candidate) -> float | None:
        """When gossip says `c` died, if it does and there was no sighting since."""
        if self.gossip is None:
            return None
        since = self.gossip.dead_since(c.peer_id)
        if since is None or c.offered_at > since:
            return None
        return since

    def _review(self, nursery: trio.Nursery, now: float) -> None:
        kept = None if self._keep is None else self._keep()
        for c in self._candidates.values():
            if c.attempting:
                continue
            died = self._dead_since(c)
            if died is not None:
                if c.addresses and now >= max(c.next_probe, died):
                    # The gap grows with the time it has been dead: about half of it.
                    gap = min(
                        self.config.dead_probe_max, max(self.config.retry_initial, (now - died) / 2)
                    )
                    c.next_probe = now + gap
                    c.attempting = True
                    nursery.start_soon(self._probe, c)
                continue
            conn = self.overlay.connection(c.peer_id)
            if conn is None and now >= c.next_attempt and self._wanted(c.peer_id, kept):
                c.attempting = True
                nursery.start_soon(self._connect, c)
            elif (
                conn is not None and conn.path == RELAYED and c.addresses and now >= c.next_upgrade
            ):
                c.attempting = True
                c.next_upgrade = now + self.config.upgrade_interval
                nursery.start_soon(self._upgrade, c)
        if kept is not None:
            self._close_idle(nursery, now, kept)

    def _wanted(self, peer_id: str, kept: set[str] | None) -> bool:
        """Whether to stay connected to `peer_id`: every peer without a `keep`; with one,
        those it keeps, and a peer membership does not know yet (the connection is a join)."""
        if kept is None or peer_id in kept:
            return True
        return self.gossip is not None and self.gossip.record_of(peer_id) is None

    def _close_idle(self, nursery: trio.Nursery, now: float, kept: set[str]) -> None:
        """Close the connections this node opened to peers it does not keep, once they
        have carried nothing but membership for `idle_close` seconds."""
        closable = {
            conn.peer_id: conn
            for conn in self.overlay.connections()
            if conn.initiator
            and not conn.draining
            and self.overlay.connection(conn.peer_id) is conn
            and all(label in self._idle_labels for label in conn.stream_labels())
            and self._quiet_for(conn.peer_id) >= self._idle.idle_close
        }
        for peer in self._idle.to_close(now, closable, kept):
            log.debug("dialer.idle_close", peer=peer)
            nursery.start_soon(_close, closable[peer])

    async def _connect(self, c: Candidate) -> None:
        try:
            conn = None
            now = trio.current_time()
            relays_first = (now < c.direct_bad_until or c.punched) and self._has_relay(c)
            if not relays_first:
                conn = await self._try_direct(c, replace=False)
            if conn is None:
                conn = await self._try_relays(c)
            if conn is None:
                c.failures += 1
                delay = min(
                    self.config.retry_max, self.config.retry_initial * 2 ** (c.failures - 1)
                )
                c.next_attempt = trio.current_time() + delay * self._rng.uniform(0.8, 1.2)
                log.info(
                    "dialer.unreachable",
                    peer=c.peer_id,
                    addresses=list(c.addresses),
                    relays=list(c.relays),
                    retry_in=round(delay, 1),
                )
            else:
                c.failures = 0
                c.next_upgrade = trio.current_time() + self.config.first_upgrade
        finally:
            c.attempting = False

    async def _probe(self, c: Candidate) -> None:
        """Dial dead `c` if something listens at one of its direct addresses again."""
        try:
            timeout = self.config.gone_timeout
            for address in c.addresses:
                if await self.overlay.listening_at(address, timeout=timeout):
                    conn = await self._try_direct(c, replace=False)
                    if conn is not None:
                        log.info("dialer.dead_peer_back", peer=c.peer_id, address=address)
                    return
        finally:
            c.attempting = False

    async def _check_gone(self, peer_id: str) -> None:
        c = self._candidates.get(peer_id)
        if c is None or not c.addresses or self.gossip is None:
            return
        timeout = self.config.gone_timeout
        answers = [await self.overlay.listening_at(a, timeout=timeout) for a in c.addresses]
        if self.overlay.connection(peer_id) is not None:
            return  # it is back (it dialled us)
        if all(a is False for a in answers):
            self.gossip.declare_dead(
                peer_id, "its connection broke and nothing listens at its addresses"
            )
        elif any(answers):  # something listens there: a restart, probably; connect now
            c.next_attempt = trio.current_time()
            self._wake.set()

    async def _judge_silence(self, conn: Connection) -> None:
        peer, gossip = conn.peer_id, self.gossip
        try:
            since = trio.current_time()
            beat = gossip.beat_of(peer) if gossip is not None else 0
            await trio.sleep(self.config.silence_confirm)  # the others' silence grows too
            if conn.is_closed or conn.silent_for() < trio.current_time() - since:
                return  # it answered after all (or this connection is gone anyway)
            others = [link.peer_id for link in self.overlay.links() if link.peer_id != peer]
            answers = await self._ask_all(others, peer)  # seconds each has not heard it
            if conn.is_closed or conn.silent_for() < trio.current_time() - since:
                return  # it answered while the others were asked
            silent = round(conn.silent_for(), 1)
            hears = [a for a in answers if a < self.config.hears_within]
            beat_moved = gossip is not None and gossip.beat_of(peer) > beat
            # A peer still registered at one of our relays is alive there, whatever this
            # path says (two agents alone, whose punched path a NAT forgot, hear of each
            # other only through it): redial through the relay rather than bury it.
            on_relay = peer in self._relay_members()
            gone = not hears and not beat_moved and (bool(answers) or not others) and not on_relay
            if gone and gossip is not None:
                gossip.declare_dead(
                    peer, f"no answer for {silent} s, and {len(answers)} other peer(s) hear nothing"
                )
                conn.abort(f"no answer for {silent} s: the peer is gone")
                return
            log.info(
                "dialer.path_silent",
                peer=peer,
                silent=silent,
                path=conn.path,
                others_hear=len(hears),
                heartbeat_moved=beat_moved,
            )
            conn.abort(f"no answer for {silent} s on this path")
            c = self._candidates.get(peer)
            if c is not None:
                now = trio.current_time()
                c.next_attempt = now
                if conn.path == DIRECT:  # the same path would stall the redial: relays first
                    c.direct_bad_until = now + self.config.upgrade_interval
                self._wake.set()
        finally:
            self._judging.discard(peer)

    async def _ask_all(self, others: list[str], about: str) -> list[float]:
        """How long each of `others` has not heard from `about` (`hearing.ask`), for those
        that answered and have a connection to it."""
        answers: dict[str, float | None] = {}

        async def one(other: str) -> None:
            answers[other] = await hearing.ask(
                self.overlay, other, about, timeout=self.config.hears_within
            )

        async with trio.open_nursery() as nursery:
            for other in others:
                nursery.start_soon(one, other)
        return [a for a in answers.values() if a is not None]

    async def _upgrade(self, c: Candidate) -> None:
        """A relayed peer: its direct addresses, all at once; failing those, a hole punched
        through both NATs, by the side `punches` picks (`punch.py`)."""
        try:
            conn = await self._try_direct_at_once(c)
            if conn is not None:
                c.punched = False
                log.info("dialer.upgraded", peer=c.peer_id, path=conn.path, remote=conn.remote)
                return
            now = trio.current_time()
            if self._punch is None or not self.punches(c.peer_id) or now < c.next_punch:
                return
            mine, theirs = self._my_nat(), self._their_nat(c.peer_id)
            conn = self.overlay.connection(c.peer_id)
            since = conn.established_at if conn is not None else 0.0
            if nat.UNKNOWN in (mine, theirs) and now < since + _KINDS_WAIT:
                # Which side punches, and how, follows from both NATs' kinds: wait a little
                # for the relays to tell them (they do within a round trip or two).
                c.next_upgrade = now + self.config.check_interval
                return
            if mine == theirs == nat.DEPENDENT:
                c.punch_error = "both NATs map by destination (symmetric): nothing to punch"
                return
            c.punches += 1
            outcome = await self._punch(c.peer_id)
            if outcome.connection is not None:
                c.punched, c.punch_failures, c.punch_error = True, 0, None
                log.info(
                    "dialer.punched",
                    peer=c.peer_id,
                    remote=outcome.connection.remote,
                    attempts=c.punches,
                    relayed_rtt_ms=round(1000 * (outcome.rtt_s or 0), 1),
                )
                return
            c.punch_failures += 1
            c.punch_error = outcome.error
            c.next_punch = trio.current_time() + schedule(
                c.punch_failures, self.config.upgrade_interval
            )
            log.info("dialer.punch_failed", peer=c.peer_id, attempts=c.punches, error=outcome.error)
        finally:
            c.attempting = False

    def punches(self, peer_id: str) -> bool:
        """Whether this agent, not `peer_id`, punches between the two (`punch.punches`)."""
        return punches(self._my_nat(), self._their_nat(peer_id), self.self_id, peer_id)

    def behind_symmetric(self, peer_id: str) -> bool:
        """Whether `peer_id`'s own record says its NAT maps by destination."""
        return self._their_nat(peer_id) == nat.DEPENDENT

    def why_relayed(self, peer_id: str) -> str | None:
        """Why `peer_id` is reached through a relay, for `meshagent peers` (None: unknown)."""
        c = self._candidates.get(peer_id)
        if c is None:
            return None
        return why_relayed(
            self._my_nat(),
            self._their_nat(peer_id),
            punches=c.punches,
            error=c.punch_error,
            punching=self.punches(peer_id),
        )

    def _their_nat(self, peer_id: str) -> str:
        record = self.gossip.record_of(peer_id) if self.gossip is not None else None
        return record.nat if record is not None else ""

    async def _dial_direct(self, c: Candidate, address: str, *, replace: bool) -> Connection | None:
        """A direct connection to `c` at `address`, or None (logged)."""
        try:
            conn = await self.overlay.dial(
                Address.parse(address), peer_id=c.peer_id, path=DIRECT, replace=replace
            )
        except _DIAL_ERRORS as e:
            log.debug("dialer.direct_failed", peer=c.peer_id, address=address, error=str(e))
            return None
        except Exception as e:  # a malformed address from a record must not stop us
            log.warning("dialer.bad_address", peer=c.peer_id, address=address, error=str(e))
            return None
        return conn if conn.path == DIRECT else None

    async def _try_direct_at_once(self, c: Candidate) -> Connection | None:
        """Every direct address of `c` at once, for `upgrade_timeout`: the first that gives a
        direct connection (which replaces the relayed one)."""
        won: list[Connection] = []

        async def one(address: str, scope: trio.CancelScope) -> None:
            conn = await self._dial_direct(c, address, replace=True)
            if conn is not None:
                won.append(conn)
                scope.cancel()

        with trio.move_on_after(self.config.upgrade_timeout):
            async with trio.open_nursery() as nursery:
                for address in c.addresses:
                    nursery.start_soon(one, address, nursery.cancel_scope)
        return won[0] if won else None

    async def _try_direct(self, c: Candidate, *, replace: bool) -> Connection | None:
        for address in c.addresses:
            with trio.move_on_after(self.config.connect_timeout):
                conn = await self._dial_direct(c, address, replace=replace)
                if conn is not None:
                    log.info("dialer.connected", peer=c.peer_id, address=address, path=DIRECT)
                    return conn
        return None

    def _has_relay(self, c: Candidate) -> bool:
        return self._relay_dial is not None and bool(c.relays or self._local_relays())

    async def _try_relays(self, c: Candidate) -> Connection | None:
        if self._relay_dial is None:
            return None
        mine = self._local_relays()
        for relay in [r for r in c.relays if r in mine] or list(mine):
            try:
                with trio.move_on_after(self.config.connect_timeout * 2):
                    conn = await self._relay_dial(relay, c.peer_id)
                    log.info("dialer.connected", peer=c.peer_id, relay=relay, path=conn.path)
                    return conn
            except _DIAL_ERRORS as e:
                log.info("dialer.relay_failed", peer=c.peer_id, relay=relay, error=str(e))
        return None


async def _close(conn: Connection) -> None:
    """Close an idle connection at once: what it carries is membership's, whose messages a
    member takes as datagrams that may be lost."""
    await conn.aclose(ErrorCode.NO_ERROR, "idle: not kept")
