"""RelayClient: an agent's registration with one relay, and circuits through it.

`run` keeps a control connection registered (reconnecting with backoff), learns which
members of our mesh are registered there (`members`, and `on_member` for the dialer), and
accepts the circuits other members open to us: each becomes an overlay connection with
path RELAYED, the Noise handshake running end to end over the spliced bytes. `dial(peer)`
opens a circuit to a member and returns the overlay connection over it.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import structlog
import trio

from meshagent.discovery.nat import Observation
from meshagent.identity.keys import NodeIdentity
from meshagent.identity.mesh import MeshSecret
from meshagent.net.address import Address
from meshagent.net.backoff import Backoff
from meshagent.net.connection import RELAYED, Connection
from meshagent.net.errors import ConnectionUnavailable
from meshagent.net.frame_reader import receive_frame
from meshagent.net.manager import ConnectionManager
from meshagent.net.transport import Transport
from meshagent.relay import protocol as p
from meshagent.relay.errors import RelayError, RelayProtocolError, RelayRefused
from meshagent.relay.spliced import SplicedStream
from meshagent.wire.errors import HandshakeError
from meshagent.wire.framing import LengthPrefixDecoder

log = structlog.get_logger(__name__)

_READ = 16 * 1024
_TRANSPORT_ERRORS = (trio.BrokenResourceError, trio.ClosedResourceError, OSError)
PING_INTERVAL = 20.0


class RelayClient:
    def __init__(
        self,
        address: Address | str,
        identity: NodeIdentity,
        mesh: MeshSecret,
        overlay: ConnectionManager,
        transport: Transport,
        *,
        on_member: Callable[[str, str], None] | None = None,
        on_observed: Callable[[Observation], None] | None = None,
        timeout: float = 10.0,
        backoff: Backoff | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.address = Address.parse(address)
        self.identity = identity
        self._tag = p.rendezvous_tag(mesh)
        self.overlay = overlay
        self._transport = transport
        self._on_member = on_member
        # Where the relay sees us come from, dialed from the port we listen on (`nat.py`).
        self._on_observed = on_observed
        self.observed: Address | None = None
        self._timeout = timeout
        self._backoff = backoff or Backoff(initial=1.0, maximum=30.0, attempts=1 << 30)
        self._rng = rng or random.Random()
        self.members: set[str] = set()
        self.registered = False
        self.last_error: str | None = None
        self._registered_event = trio.Event()
        self._observe_port = 0
        self._nursery: trio.Nursery | None = None

    @property
    def name(self) -> str:
        return str(self.address)

    async def wait_registered(self) -> None:
        await self._registered_event.wait()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED):
        """Stay registered until cancelled. Starts at once; registration happens in the
        background (see `registered`, `last_error`)."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            delays = self._backoff.delays(self._rng)
            while True:
                try:
                    await self._session(nursery)
                    delays = self._backoff.delays(self._rng)  # it worked for a while
                except* (RelayError, trio.TooSlowError, *_TRANSPORT_ERRORS) as group:
                    # A session's reader runs beside its pinger: what ends it comes in a group.
                    self.last_error = "; ".join(str(e) or type(e).__name__ for e in _leaves(group))
                    log.warning("relay.client_disconnected", relay=self.name, error=self.last_error)
                self.registered = False
                self.members = set()
                await trio.sleep(next(delays))

    async def dial(self, peer_id: str) -> Connection:
        """A connection to `peer_id` through this relay (path RELAYED). Raises RelayError
        (RelayRefused with the relay's reason) or the overlay's HandshakeError."""
        stream, frames, nonce = await self._open()
        try:
            await stream.send_all(p.connect(self.identity, nonce, peer_id).encode())
            with trio.fail_after(self._timeout * 2):  # the relay waits for the target too
                msg = await _read_message(stream, frames)
            p.raise_if_refused(msg)
            if msg.type != p.SPLICED:
                raise RelayProtocolError(f"expected SPLICED, got {msg.name}")
        except BaseException:
            await trio.aclose_forcefully(stream)
            raise
        spliced = SplicedStream(stream, frames.leftover(), remote=f"relay {self.address}")
        return await self.overlay.adopt(
            spliced, initiator=True, remote=spliced.remote, path=RELAYED, peer_id=peer_id
        )

    # ----- internals -----

    async def _open(
        self, *, address: Address | None = None, from_listen: bool = False
    ) -> tuple[trio.abc.Stream, LengthPrefixDecoder, bytes]:
        """A connection to the relay (or its observing port, `address`) past its HELLO.
        `from_listen`: dial from the overlay's listen port, so that the relay sees how a NAT
        maps that port (reported to `on_observed`); where the port cannot be used for it (a
        connection from it to the relay lingers), from any port."""
        address = address or self.address
        try:
            with trio.fail_after(self._timeout):
                stream = await self._dial(address, from_listen)
        except trio.TooSlowError as e:
            raise RelayError(
                f"relay {self.address} did not answer within {self._timeout:g} s"
            ) from e
        except OSError as e:
            raise RelayError(f"cannot reach relay {self.address}: {e}") from e
        frames = LengthPrefixDecoder(p.FRAMING)
        try:
            with trio.fail_after(self._timeout):
                msg = await _read_message(stream, frames)
            if msg.type != p.HELLO:
                raise RelayProtocolError(f"expected HELLO, got {msg.name}")
            nonce = p.hello_nonce(msg)
            self._observe_port = p.hello_observe_port(msg)
            seen = p.hello_observed(msg)
        except BaseException:
            await trio.aclose_forcefully(stream)
            raise
        local = _local_of(stream)
        listen = self._listen_address()
        heard = from_listen and seen is not None and local is not None and listen is not None
        if heard and local.port == listen.port:
            if address == self.address:
                self.observed = seen
            if self._on_observed is not None:
                self._on_observed(Observation(address, local, seen))
        return stream, frames, nonce

    def _listen_address(self) -> Address | None:
        addresses = self.overlay.listen_addresses
        return addresses[0] if addresses else None

    async def _dial(self, address: Address, from_listen: bool) -> trio.abc.Stream:
        listen = self._listen_address()
        if from_listen and listen is not None:
            try:
                return await self._transport.dial_from(address, listen)
            except OSError as e:
                log.debug("relay.dial_from_listen_failed", relay=self.name, error=str(e))
        return await self._transport.dial(address)

    async def _observe(self) -> None:
        """Once registered: where the relay's observing port sees us from (a second
        destination, for `nat.py` to tell a cone from a symmetric NAT)."""
        if not self._observe_port:
            return
        try:
            stream, _, _ = await self._open(
                address=Address(self.address.host, self._observe_port), from_listen=True
            )
        except (RelayError, trio.TooSlowError, *_TRANSPORT_ERRORS) as e:
            log.info("relay.observe_failed", relay=self.name, error=str(e))
            return
        await trio.aclose_forcefully(stream)

    async def _session(self, nursery: trio.Nursery) -> None:
        stream, frames, nonce = await self._open(from_listen=True)
        lock = trio.Lock()
        try:
            await stream.send_all(p.register(self.identity, nonce, self._tag).encode())
            with trio.fail_after(self._timeout):
                msg = await _read_message(stream, frames)
            p.raise_if_refused(msg)
            if msg.type != p.REGISTERED:
                raise RelayProtocolError(f"expected REGISTERED, got {msg.name}")
            self.registered = True
            self.last_error = None
            self._registered_event.set()
            log.info("relay.client_registered", relay=self.name, members=len(p.peer_list(msg)))
            self._set_members(p.peer_list(msg))
            nursery.start_soon(self._observe)
            async with trio.open_nursery() as inner:
                inner.start_soon(self._pinger, stream, lock)
                while True:
                    with trio.fail_after(PING_INTERVAL * 3):
                        msg = await _read_message(stream, frames)
                    if msg.type == p.MEMBERS:
                        self._set_members(p.peer_list(msg))
                    elif msg.type == p.INCOMING:
                        circuit, from_peer = p.incoming_circuit(msg)
                        nursery.start_soon(self._accept, circuit, from_peer)
                    elif msg.type == p.PONG:
                        pass
                    else:
                        raise RelayProtocolError(f"unexpected {msg.name} from the relay")
        finally:
            await trio.aclose_forcefully(stream)

    async def _pinger(self, stream: trio.abc.Stream, lock: trio.Lock) -> None:
        while True:
            await trio.sleep(PING_INTERVAL)
            async with lock:
                await stream.send_all(p.Message(p.PING).encode())

    def _set_members(self, peers: list[str]) -> None:
        new = set(peers) - self.members
        self.members = set(peers)
        for peer in sorted(new):
            if self._on_member is not None:
                self._on_member(peer, self.name)

    async def _accept(self, circuit: bytes, from_peer: str) -> None:
        """Take the circuit `from_peer` opened to us and run the overlay over it."""
        try:
            stream, frames, nonce = await self._open()
            try:
                await stream.send_all(p.accept(self.identity, nonce, circuit).encode())
                with trio.fail_after(self._timeout):
                    msg = await _read_message(stream, frames)
                p.raise_if_refused(msg)
                if msg.type != p.SPLICED:
                    raise RelayProtocolError(f"expected SPLICED, got {msg.name}")
            except BaseException:
                await trio.aclose_forcefully(stream)
                raise
            spliced = SplicedStream(stream, frames.leftover(), remote=f"relay {self.address}")
            conn = await self.overlay.adopt(
                spliced, initiator=False, remote=spliced.remote, path=RELAYED
            )
            log.info("relay.circuit_accepted", relay=self.name, peer=conn.peer_id)
        except (
            RelayError,
            RelayRefused,
            HandshakeError,
            ConnectionUnavailable,  # the overlay refused it: too many handshakes pending
            trio.TooSlowError,
            *_TRANSPORT_ERRORS,
        ) as e:
            log.warning("relay.accept_failed", relay=self.name, peer=from_peer, error=str(e))


def _local_of(stream: trio.abc.Stream) -> Address | None:
    sock = getattr(stream, "socket", None)
    if sock is None:
        return None
    try:
        host, port = sock.getsockname()[:2]
    except OSError:
        return None
    return Address(host, port)


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    out: list[BaseException] = []
    for e in group.exceptions:
        out += _leaves(e) if isinstance(e, BaseExceptionGroup) else [e]
    return out


def _relay_closed() -> RelayError:
    return RelayError("the relay closed the connection")


async def _read_message(stream: trio.abc.Stream, frames: LengthPrefixDecoder) -> p.Message:
    return p.decode(await receive_frame(stream, frames, on_eof=_relay_closed, receive_size=_READ))
