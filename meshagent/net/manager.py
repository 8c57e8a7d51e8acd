"""ConnectionManager: listens, dials with backoff, keeps one active connection per peer,
and retires replaced connections with drain-and-close."""

from __future__ import annotations

import errno
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import structlog
import trio

from meshagent.net.address import Address
from meshagent.net.config import OverlayConfig
from meshagent.net.connection import DIRECT, RELAYED, Connection, StreamAcceptor
from meshagent.net.errors import ConnectionUnavailable, DialError, HandshakeInterrupted
from meshagent.net.listener import Listener
from meshagent.net.secure import secure_handshake
from meshagent.net.stream import MeshStream
from meshagent.net.transport import Transport
from meshagent.wire.errors import ErrorCode, HandshakeError
from meshagent.wire.handshake import HandshakeResult, LocalPeer
from meshagent.wire.replay import ReplayGuard
from meshagent.wire.rtt import RttSnapshot

log = structlog.get_logger(__name__)

_PATH_RANK = {RELAYED: 0, DIRECT: 1}


@dataclass(frozen=True)
class PeerLink:
    """A snapshot of the active connection to one peer (for `meshagent peers`, gossip)."""

    peer_id: str
    session_id: str
    path: str
    remote: str
    initiator: bool
    rtt: RttSnapshot
    established_at: float
    bytes_sent: int = 0
    bytes_received: int = 0


def _refused(error: BaseException) -> bool:
    """Whether a failed connect was refused, at every address tried (trio's TCP connect
    wraps each attempt's error in a group)."""
    if getattr(error, "errno", None) == errno.ECONNREFUSED:  # ConnectionRefusedError too
        return True
    cause = error.__cause__
    if isinstance(cause, BaseExceptionGroup):
        return all(_refused(e) for e in cause.exceptions)
    return False


def choose_connection(current: Connection, new: Connection) -> tuple[Connection, str]:
    """Which of two live connections to the same peer to keep, and why. Both peers reach
    the same answer from their own view, so they keep the same connection."""
    rank_current, rank_new = _PATH_RANK.get(current.path, 0), _PATH_RANK.get(new.path, 0)
    if rank_current != rank_new:
        return (new if rank_new > rank_current else current), "better path"
    if current.remote_incarnation != new.remote_incarnation:
        return new, "peer restarted"
    if current.initiator_peer_id != new.initiator_peer_id:
        keep = current if current.initiator_peer_id < new.initiator_peer_id else new
        return keep, "simultaneous dial: keep the connection the lower peer id initiated"
    return new, "reconnect: the newer connection wins"


class ConnectionManager:
    """The overlay endpoint of one node.

    `run` listens on `listen` addresses; `dial` connects out (with backoff); at most one
    connection per peer is active, and `open_stream(peer_id)` always uses it. A connection
    that loses to a newer or better one gets GOAWAY, `drain_grace` seconds for its open
    streams, then closes with reason `replaced`. Inbound streams go to `on_stream`;
    `on_lost` hears of a peer's active connection that the transport ended (a reset, EOF
    without BYE), which is how a crashed peer shows first; `on_silent` of one whose peer
    stopped answering PINGs (a power cut, a partition, or only a bad path).
    """

    def __init__(
        self,
        local: LocalPeer,
        transport: Transport,
        *,
        listen: Sequence[Address | str] = (),
        on_stream: StreamAcceptor | None = None,
        on_lost: Callable[[Connection], None] | None = None,
        on_silent: Callable[[Connection], None] | None = None,
        config: OverlayConfig | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.local = local
        self._on_lost = on_lost
        self._on_silent = on_silent
        self.config = config or OverlayConfig()
        self._transport = transport
        self._listen = [Address.parse(a) for a in listen]
        self._on_stream = on_stream
        self._rng = rng or random.Random()
        self._guard = ReplayGuard()
        # Inbound handshakes over adopted streams (relay circuits), bounded like a listener's.
        self._adopted_handshakes = trio.CapacityLimiter(self.config.max_pending_handshakes)
        self._active: dict[str, Connection] = {}
        self._all: set[Connection] = set()
        self._ended_traffic: dict[str, list[int]] = {}  # path -> [sent, received] of ended ones
        self._nursery: trio.Nursery | None = None
        self._changed = trio.Event()
        self.listen_addresses: list[Address] = []
        # Connects to a peer now (the dialer's `reach`), for a stream to a peer this node
        # keeps no connection to (a bounded connection set); None: `open_stream` needs one.
        self.reach: Callable[[str], Awaitable[None]] | None = None

    @property
    def peer_id(self) -> str:
        return self.local.peer_id

    async def run(
        self, *, task_status: trio.TaskStatus[list[Address]] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Listen and own every connection until cancelled (or `aclose`)."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            for address in self._listen:
                listener = Listener(
                    self._transport,
                    address,
                    self.local,
                    on_connection=self._serve_inbound,
                    config=self.config,
                    replay_guard=self._guard,
                )
                self.listen_addresses.append(await nursery.start(listener.run))
            task_status.started(list(self.listen_addresses))
            await trio.sleep_forever()

    # ----- queries -----

    def connection(self, peer_id: str) -> Connection | None:
        """The active connection to `peer_id`, if any."""
        return self._active.get(peer_id)

    def connections(self) -> list[Connection]:
        """Every live connection, including ones draining."""
        return [c for c in self._all if not c.is_closed]

    def links(self) -> list[PeerLink]:
        return [
            PeerLink(
                peer_id=c.peer_id,
                session_id=c.session_id,
                path=c.path,
                remote=c.remote,
                initiator=c.initiator,
                rtt=c.rtt,
                established_at=c.established_at,
                bytes_sent=c.bytes_sent,
                bytes_received=c.bytes_received,
            )
            for c in sorted(self._active.values(), key=lambda c: c.peer_id)
        ]

    def traffic(self) -> dict[str, dict[str, int]]:
        """Bytes sent to and received from peers since the start, by path (direct or
        relayed): every connection's, ended or not."""
        totals = {path: list(t) for path, t in self._ended_traffic.items()}
        for c in self._all:
            t = totals.setdefault(c.path, [0, 0])
            t[0] += c.bytes_sent
            t[1] += c.bytes_received
        return {path: {"sent": t[0], "received": t[1]} for path, t in sorted(totals.items())}

    async def wait_connected(self, peer_id: str) -> Connection:
        """Wait until a connection to `peer_id` is active (use under a timeout)."""
        while (conn := self._active.get(peer_id)) is None:
            await self._changed.wait()
        return conn

    # ----- actions -----

    async def open_stream(
        self,
        peer_id: str,
        label: str = "",
        *,
        window_bytes: int | None = None,
        window_frames: int | None = None,
    ) -> MeshStream:
        """Open a stream on the active connection to `peer_id` (connected first by `reach`,
        where there is none and a `reach` is set)."""
        conn = self._active.get(peer_id)
        if conn is None and self.reach is not None:
            await self.reach(peer_id)
            conn = self._active.get(peer_id)
        if conn is None:
            raise ConnectionUnavailable(f"not connected to peer {peer_id}; dial it first")
        return await conn.open_stream(label, window_bytes=window_bytes, window_frames=window_frames)

    async def dial(
        self,
        address: Address | str,
        *,
        peer_id: str | None = None,
        path: str = DIRECT,
        replace: bool = False,
    ) -> Connection:
        """Connect to `address` (retrying with backoff on transport failures) and return the
        active connection to the peer found there. With `peer_id`, a different peer at the
        address is refused, and an existing active connection is reused unless `replace`."""
        if self._nursery is None:
            raise ConnectionUnavailable("ConnectionManager.run() has not started")
        address = Address.parse(address)
        if peer_id is not None and not replace:
            existing = self._active.get(peer_id)
            if existing is not None and existing.accepting_streams:
                return existing
        delays = self.config.dial_backoff.delays(self._rng)
        attempt = 0
        while True:
            attempt += 1
            try:
                return await self._dial_once(address, peer_id, path)
            except (OSError, HandshakeInterrupted) as e:
                delay = next(delays, None)
                log.info(
                    "dial.failed", address=str(address), attempt=attempt, error=str(e), retry=delay
                )
                if delay is None:
                    raise DialError(
                        f"could not reach {address} after {attempt} attempts: {e}"
                    ) from e
                await trio.sleep(delay)
            except HandshakeError as e:
                log.warning("dial.refused", address=str(address), reason=str(e))
                raise DialError(f"{address} refused the handshake: {e}") from e

    async def listening_at(self, address: Address | str, *, timeout: float) -> bool | None:
        """Whether anything accepts connections at `address`: True, False when the host
        refuses (nothing listens there: a process that was there is gone), None when there
        is no answer within `timeout` or the attempt fails otherwise. Opens and closes a bare
        transport connection; no handshake."""
        try:
            with trio.fail_after(timeout):
                stream = await self._transport.dial(Address.parse(address))
        except trio.TooSlowError:
            return None
        except OSError as e:
            return False if _refused(e) else None
        await trio.aclose_forcefully(stream)
        return True

    async def adopt(
        self,
        stream: trio.abc.Stream,
        *,
        initiator: bool,
        remote: str,
        path: str = RELAYED,
        peer_id: str | None = None,
    ) -> Connection:
        """Run the handshake over an already-open byte stream (a relay splice) and keep the
        connection like a dialed or accepted one; returns the peer's active connection.
        The stream is closed on any failure (HandshakeError, HandshakeInterrupted)."""
        if self._nursery is None:
            await trio.aclose_forcefully(stream)
            raise ConnectionUnavailable("ConnectionManager.run() has not started")
        if initiator:
            return await self._secure_and_run(stream, remote, peer_id, path, initiator=True)
        try:
            self._adopted_handshakes.acquire_on_behalf_of_nowait(stream)
        except trio.WouldBlock:
            await trio.aclose_forcefully(stream)
            log.warning("handshake.refused", remote=remote, reason="too many pending handshakes")
            raise ConnectionUnavailable(
                f"refused {remote}: {self.config.max_pending_handshakes} inbound handshakes "
                "are already in progress"
            ) from None
        try:
            return await self._secure_and_run(stream, remote, peer_id, path, initiator=False)
        finally:
            self._adopted_handshakes.release_on_behalf_of(stream)

    async def aclose(self, *, grace: float | None = None) -> None:
        """Drain every connection (reason `shutdown`) within `grace`, then stop."""
        grace = self.config.drain_grace if grace is None else grace
        async with trio.open_nursery() as nursery:
            for conn in self.connections():
                nursery.start_soon(self._retire, conn, ErrorCode.SHUTDOWN, "shutdown", grace)
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()

    # ----- internals -----

    async def _dial_once(self, address: Address, peer_id: str | None, path: str) -> Connection:
        try:
            with trio.fail_after(self.config.handshake_timeout):
                stream = await self._transport.dial(address)
        except trio.TooSlowError as e:
            raise HandshakeInterrupted(f"connecting to {address} timed out") from e
        return await self._secure_and_run(stream, str(address), peer_id, path, initiator=True)

    async def _secure_and_run(
        self,
        stream: trio.abc.Stream,
        remote: str,
        peer_id: str | None,
        path: str,
        *,
        initiator: bool,
    ) -> Connection:
        try:
            result, leftover = await secure_handshake(
                stream,
                self.local,
                initiator=initiator,
                timeout=self.config.handshake_timeout,
                expected_peer_id=peer_id,
                replay_guard=None if initiator else self._guard,
            )
        except BaseException:
            await trio.aclose_forcefully(stream)
            raise
        if result.peer_id == self.local.peer_id:
            await trio.aclose_forcefully(stream)
            raise DialError(f"{remote} is this node itself")
        conn = self._make(stream, result, leftover, remote, path)
        assert self._nursery is not None
        await self._nursery.start(self._run_connection, conn)
        return self._active.get(conn.peer_id, conn)

    def _make(
        self, stream: trio.abc.Stream, result: HandshakeResult, leftover: bytes, remote: str, path
    ) -> Connection:
        return Connection(
            stream,
            result,
            self.local,
            config=self.config,
            on_stream=self._on_stream,
            on_silent=self._silent,
            remote=remote,
            path=path,
            leftover=leftover,
        )

    async def _serve_inbound(
        self, stream: trio.abc.Stream, result: HandshakeResult, leftover: bytes, remote: str
    ) -> None:
        if result.peer_id == self.local.peer_id:
            log.info("peer.self_connection_refused", remote=remote)
            await trio.aclose_forcefully(stream)
            return
        # A relay splices bytes to us over a connection we'd know as relayed; a plain
        # listener only ever sees direct connections.
        await self._run_connection(self._make(stream, result, leftover, remote, DIRECT))

    def _over_budget(self, conn: Connection) -> str | None:
        """Why an authenticated connection the peer opened is refused, or None: past the
        inbound connections of all peers together, or of this peer id (a member may make
        identities, and connections under one, at will)."""
        inbound = [c for c in self._all if not c.initiator and not c.is_closed]
        most = self.config.max_inbound_connections
        if len(inbound) >= most:
            return f"{len(inbound)} inbound connections are open, the most this agent takes"
        most = self.config.max_connections_per_peer
        same = sum(1 for c in inbound if c.peer_id == conn.peer_id)
        if same >= most:
            return (
                f"this peer has {same} connections open to us already, the most one peer may "
                "(an active one and one being replaced)"
            )
        return None

    async def _refuse(self, conn: Connection, reason: str) -> None:
        """Run `conn` only long enough to tell the peer why it is refused (BYE REFUSED)."""
        log.warning(
            "peer.connection_refused",
            peer=conn.peer_id,
            remote=conn.remote,
            path=conn.path,
            reason=reason,
        )
        async with trio.open_nursery() as nursery:
            await nursery.start(conn.run)
            await conn.aclose(ErrorCode.REFUSED, f"connection refused: {reason}")

    async def _run_connection(
        self, conn: Connection, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        # Checked and counted with no checkpoint between: simultaneous arrivals cannot both
        # pass a budget with room for one.
        refused = None if conn.initiator else self._over_budget(conn)
        if refused is not None:
            await self._refuse(conn, refused)
            task_status.started()
            return
        self._all.add(conn)
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(conn.run)
                self._adopt(conn)
                task_status.started()
        finally:
            self._all.discard(conn)
            ended = self._ended_traffic.setdefault(conn.path, [0, 0])
            ended[0] += conn.bytes_sent
            ended[1] += conn.bytes_received
            if self._active.get(conn.peer_id) is conn:
                del self._active[conn.peer_id]
                log.info("peer.disconnected", peer=conn.peer_id, reason=conn.close_reason)
                if conn.lost and self._on_lost is not None:
                    self._on_lost(conn)
            self._signal()

    def _silent(self, conn: Connection) -> None:
        if self._on_silent is not None and self._active.get(conn.peer_id) is conn:
            self._on_silent(conn)

    def _adopt(self, conn: Connection) -> None:
        current = self._active.get(conn.peer_id)
        if current is None or not current.accepting_streams:
            self._active[conn.peer_id] = conn
            log.info("peer.connected", peer=conn.peer_id, session=conn.session_id, path=conn.path)
            self._signal()
            return
        keep, why = choose_connection(current, conn)
        retire = conn if keep is current else current
        self._active[conn.peer_id] = keep
        log.info(
            "peer.connection_replaced",
            peer=conn.peer_id,
            kept=keep.session_id,
            retired=retire.session_id,
            why=why,
        )
        retire.draining = True  # from this moment, no new streams on it
        assert self._nursery is not None
        self._nursery.start_soon(
            self._retire, retire, ErrorCode.REPLACED, "replaced", self.config.drain_grace
        )
        self._signal()

    async def _retire(self, conn: Connection, code: ErrorCode, reason: str, grace: float) -> None:
        conn.draining = True
        await conn.drain_and_close(grace=grace, code=code, reason=reason)

    def _signal(self) -> None:
        self._changed.set()
        self._changed = trio.Event()
