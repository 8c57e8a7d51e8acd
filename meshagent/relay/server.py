"""RelayServer: a rendezvous for the members of a mesh, and a byte splicer for agents that
cannot reach each other directly. It never holds a mesh secret and never sees plaintext:
what it splices is the two agents' overlay handshake and encrypted records.

Limits (RelayLimits): registered agents, circuits per agent and in total, bytes per second
per circuit, idle circuits, slow requests. Every refusal is sent to the client with a code
and a reason, and logged (`relay.refused`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog
import trio

from meshagent.errors import ConfigError
from meshagent.net.address import Address
from meshagent.net.frame_reader import receive_frame
from meshagent.net.transport import Transport
from meshagent.relay import protocol as p
from meshagent.relay.errors import Refusal, RelayProtocolError, RelayRefused
from meshagent.relay.limits import RateLimiter, RelayLimits
from meshagent.wire.framing import LengthPrefixDecoder

log = structlog.get_logger(__name__)

_READ = 64 * 1024
_TRANSPORT_ERRORS = (trio.BrokenResourceError, trio.ClosedResourceError, OSError)
# (circuit id, "a>b" or "b>a", bytes): lets tests see exactly what the relay carried.
BytesHook = Callable[[bytes, str, bytes], None]


@dataclass
class _Agent:
    peer_id: str
    tag: bytes
    stream: trio.abc.Stream
    scope: trio.CancelScope
    lock: trio.Lock = field(default_factory=trio.Lock)
    circuits: int = 0

    async def send(self, msg: p.Message) -> None:
        async with self.lock:
            await self.stream.send_all(msg.encode())


@dataclass
class _Pending:
    circuit: bytes
    dialer: str
    target: str
    accepted: trio.Event = field(default_factory=trio.Event)
    done: trio.Event = field(default_factory=trio.Event)
    stream: trio.abc.Stream | None = None
    leftover: bytes = b""


@dataclass
class _MeshUse:
    """What one mesh (its members' rendezvous tag) uses of this relay."""

    name: str  # the tag's first 12 hex digits: names the mesh in reports, reveals nothing
    limiter: RateLimiter | None  # all its circuits together (`mesh_rate_bytes_per_s`)
    circuits_open: int = 0
    circuits_total: int = 0
    bytes_relayed: int = 0
    refusals: dict[str, int] = field(default_factory=dict)

    def to_dict(self, agents: int) -> dict[str, object]:
        return {
            "agents": agents,
            "circuits_open": self.circuits_open,
            "circuits_total": self.circuits_total,
            "bytes_relayed": self.bytes_relayed,
            "refusals": dict(self.refusals),
        }


MAX_MESHES_KEPT = 4096  # meshes whose use is reported (the least recently active go first)


def _client_closed() -> trio.BrokenResourceError:
    return trio.BrokenResourceError("the client closed the connection")


async def _read_message(stream: trio.abc.Stream, frames: LengthPrefixDecoder) -> p.Message:
    return p.decode(await receive_frame(stream, frames, on_eof=_client_closed, receive_size=_READ))


class RelayServer:
    def __init__(
        self,
        transport: Transport,
        listen: Address | str,
        limits: RelayLimits | None = None,
        *,
        name: str = "",
        on_bytes: BytesHook | None = None,
        observe: Address | str | None = None,
    ) -> None:
        """`observe`: a second address to listen on, where the relay only says where it sees
        a connection come from (an agent compares it with the main port's, to learn whether
        its NAT maps by destination); None: no second port."""
        self.limits = limits or RelayLimits()
        self.limits.validate()
        self.name = name
        self._transport = transport
        self._listen = Address.parse(listen)
        self._on_bytes = on_bytes
        self._agents: dict[str, _Agent] = {}
        self._groups: dict[bytes, set[str]] = {}
        self._pending: dict[bytes, _Pending] = {}
        self.circuits_open = 0
        self.circuits_total = 0
        self.bytes_relayed = 0
        self.refusals: dict[str, int] = {}
        self._meshes: dict[bytes, _MeshUse] = {}  # by rendezvous tag, most recent last
        self.address: Address | None = None
        self._observe = Address.parse(observe) if observe is not None else None
        self.observe_address: Address | None = None

    async def run(self, *, task_status: trio.TaskStatus[Address] = trio.TASK_STATUS_IGNORED):
        async with trio.open_nursery() as nursery:
            if self._observe is not None:
                self.observe_address = await nursery.start(
                    self._transport.serve, self._observe, self._handle_observe
                )
            self.address = await nursery.start(self._transport.serve, self._listen, self._handle)
            log.info(
                "relay.started",
                address=str(self.address),
                observe=str(self.observe_address) if self.observe_address else None,
                limits=self.limits.__dict__,
            )
            task_status.started(self.address)

    def stats(self) -> dict[str, object]:
        return {
            "agents": len(self._agents),
            "meshes": len(self._groups),
            "circuits_open": self.circuits_open,
            "circuits_total": self.circuits_total,
            "bytes_relayed": self.bytes_relayed,
            "refusals": dict(self.refusals),
            "per_mesh": {
                use.name: use.to_dict(len(self._groups.get(tag, ())))
                for tag, use in self._meshes.items()
            },
        }

    def _mesh(self, tag: bytes) -> _MeshUse:
        """The use of the mesh of `tag`, made recent."""
        use = self._meshes.pop(tag, None)
        if use is None:
            rate = self.limits.mesh_rate_bytes_per_s
            use = _MeshUse(tag.hex()[:12], RateLimiter(rate) if rate else None)
            while len(self._meshes) >= MAX_MESHES_KEPT:
                del self._meshes[next(iter(self._meshes))]
        self._meshes[tag] = use
        return use

    def _refused(self, code: Refusal, tag: bytes | None) -> None:
        key = code.name.lower()
        self.refusals[key] = self.refusals.get(key, 0) + 1
        if tag is not None:
            use = self._mesh(tag)
            use.refusals[key] = use.refusals.get(key, 0) + 1

    # ----- one connection -----

    async def _handle(self, stream: trio.abc.Stream) -> None:
        remote = Transport.remote_of(stream)
        nonce = os.urandom(p.NONCE_LEN)
        frames = LengthPrefixDecoder(p.FRAMING)
        peer = "?"
        try:
            await stream.send_all(self._hello(nonce, remote).encode())
            with trio.fail_after(self.limits.request_timeout):
                msg = await _read_message(stream, frames)
            if msg.type not in (p.REGISTER, p.CONNECT, p.ACCEPT):
                raise RelayProtocolError(f"expected REGISTER, CONNECT or ACCEPT, got {msg.name}")
            peer, subject = p.verify_request(msg, nonce)
            if msg.type == p.REGISTER:
                await self._serve_control(stream, frames, peer, subject)
            elif msg.type == p.CONNECT:
                await self._serve_connect(stream, frames, peer, subject)
            else:
                await self._serve_accept(stream, frames, peer, subject)
        except (RelayRefused, RelayProtocolError) as e:
            code = e.code if isinstance(e, RelayRefused) else Refusal.BAD_MESSAGE
            reason = e.reason if isinstance(e, RelayRefused) else str(e)
            agent = self._agents.get(peer)
            self._refused(code, agent.tag if agent is not None else None)
            log.warning("relay.refused", peer=peer, remote=remote, code=code.name, reason=reason)
            with trio.move_on_after(1):
                with contextlib.suppress(_TRANSPORT_ERRORS):
                    await stream.send_all(p.refused(code, reason).encode())
        except trio.TooSlowError:
            log.info("relay.request_timeout", remote=remote, timeout=self.limits.request_timeout)
        except _TRANSPORT_ERRORS as e:
            log.debug("relay.connection_lost", peer=peer, remote=remote, error=str(e))
        finally:
            await trio.aclose_forcefully(stream)

    def _hello(self, nonce: bytes, remote: str) -> p.Message:
        try:
            observed = str(Address.parse(remote))
        except ConfigError:
            observed = ""  # a transport that cannot say
        port = self.observe_address.port if self.observe_address is not None else 0
        return p.hello(nonce, self.name, observed=observed, observe_port=port)

    async def _handle_observe(self, stream: trio.abc.Stream) -> None:
        """The observing port: a HELLO that says where the connection comes from, then
        close."""
        try:
            with trio.move_on_after(self.limits.request_timeout):
                hello = self._hello(os.urandom(p.NONCE_LEN), Transport.remote_of(stream))
                await stream.send_all(hello.encode())
        except _TRANSPORT_ERRORS:
            pass
        finally:
            await trio.aclose_forcefully(stream)

    async def _serve_control(
        self, stream: trio.abc.Stream, frames: LengthPrefixDecoder, peer: str, tag: bytes
    ) -> None:
        if len(tag) != 32:
            raise RelayProtocolError("a rendezvous tag is 32 bytes")
        old = self._agents.get(peer)
        if old is None and len(self._agents) >= self.limits.max_agents:
            raise RelayRefused(
                Refusal.RELAY_FULL, f"this relay serves at most {self.limits.max_agents} agents"
            )
        with trio.CancelScope() as scope:
            agent = _Agent(peer, tag, stream, scope, circuits=old.circuits if old else 0)
            if old is not None:
                old.scope.cancel()  # a reconnect replaces the old control connection
                self._leave(old)
            self._agents[peer] = agent
            group = self._groups.setdefault(tag, set())
            group.add(peer)
            log.info("relay.registered", peer=peer, mesh_members=len(group))
            try:
                await agent.send(p.registered(sorted(group - {peer})))
                await self._announce(tag, skip=peer)
                while True:
                    with trio.fail_after(self.limits.control_timeout):
                        msg = await _read_message(stream, frames)
                    if msg.type != p.PING:
                        raise RelayProtocolError(f"unexpected {msg.name} on a control connection")
                    await agent.send(p.Message(p.PONG))
            finally:
                if self._agents.get(peer) is agent:
                    self._leave(agent)
                    log.info("relay.unregistered", peer=peer)
                    with trio.CancelScope(shield=True), trio.move_on_after(2):
                        await self._announce(tag, skip=peer)

    def _leave(self, agent: _Agent) -> None:
        if self._agents.get(agent.peer_id) is agent:
            del self._agents[agent.peer_id]
        group = self._groups.get(agent.tag)
        if group is not None and self._agents.get(agent.peer_id) is None:
            group.discard(agent.peer_id)
            if not group:
                del self._groups[agent.tag]

    async def _announce(self, tag: bytes, *, skip: str) -> None:
        group = sorted(self._groups.get(tag, ()))
        for member in group:
            agent = self._agents.get(member)
            if member != skip and agent is not None:
                try:
                    await agent.send(p.members([m for m in group if m != member]))
                except _TRANSPORT_ERRORS:
                    agent.scope.cancel()

    async def _serve_connect(
        self, stream: trio.abc.Stream, frames: LengthPrefixDecoder, dialer: str, subject: bytes
    ) -> None:
        target = subject.decode(errors="replace")
        d = self._agents.get(dialer)
        if d is None:
            raise RelayRefused(
                Refusal.NOT_REGISTERED,
                f"peer {dialer} must register with this relay before opening circuits",
            )
        if target == dialer:
            raise RelayRefused(Refusal.SELF, "a circuit to oneself makes no sense")
        t = self._agents.get(target)
        if t is None or t.tag != d.tag:
            raise RelayRefused(
                Refusal.UNKNOWN_TARGET,
                f"peer {target} is not registered at this relay in your mesh",
            )
        limit = self.limits.circuits_per_agent
        for end in (d, t):
            if end.circuits >= limit:
                raise RelayRefused(
                    Refusal.CIRCUIT_LIMIT,
                    f"peer {end.peer_id} already has {limit} circuits through this relay "
                    "(the per-agent limit)",
                )
        if self.circuits_open + len(self._pending) >= self.limits.max_circuits:
            raise RelayRefused(
                Refusal.RELAY_FULL,
                f"this relay carries at most {self.limits.max_circuits} circuits",
            )
        use = self._mesh(d.tag)
        waiting = sum(
            1
            for x in self._pending.values()
            if (a := self._agents.get(x.dialer)) is not None and a.tag == d.tag
        )
        if use.circuits_open + waiting >= self.limits.circuits_per_mesh:
            raise RelayRefused(
                Refusal.CIRCUIT_LIMIT,
                f"this mesh already has {self.limits.circuits_per_mesh} circuits through this "
                "relay (the per-mesh limit)",
            )
        circuit = os.urandom(16)
        pending = self._pending[circuit] = _Pending(circuit, dialer, target)
        d.circuits += 1
        t.circuits += 1
        try:
            try:
                await t.send(p.incoming(circuit, dialer))
            except _TRANSPORT_ERRORS as e:
                raise RelayRefused(
                    Refusal.UNKNOWN_TARGET, f"peer {target} went away before it could be told"
                ) from e
            with trio.move_on_after(self.limits.accept_timeout):
                await pending.accepted.wait()
            if pending.stream is None:
                raise RelayRefused(
                    Refusal.ACCEPT_TIMEOUT,
                    f"peer {target} did not accept the circuit within "
                    f"{self.limits.accept_timeout:g} s",
                )
            del self._pending[circuit]
            await stream.send_all(p.spliced(target).encode())
            await pending.stream.send_all(p.spliced(dialer).encode())
            await self._splice(circuit, dialer, target, stream, frames.leftover(), pending, use)
        finally:
            self._pending.pop(circuit, None)
            pending.done.set()
            d.circuits -= 1
            t.circuits -= 1

    async def _serve_accept(
        self, stream: trio.abc.Stream, frames: LengthPrefixDecoder, peer: str, circuit: bytes
    ) -> None:
        pending = self._pending.get(circuit)
        if pending is None or pending.target != peer or pending.stream is not None:
            raise RelayRefused(
                Refusal.UNKNOWN_CIRCUIT, "no circuit with this id is waiting for you"
            )
        pending.stream = stream
        pending.leftover = frames.leftover()
        pending.accepted.set()
        await pending.done.wait()  # the dialer's task splices, and owns both streams until then

    # ----- splicing -----

    async def _splice(
        self,
        circuit: bytes,
        dialer: str,
        target: str,
        a: trio.abc.Stream,
        a_leftover: bytes,
        pending: _Pending,
        use: _MeshUse,
    ) -> None:
        b = pending.stream
        assert b is not None
        cid = circuit.hex()[:12]
        limiter = RateLimiter(self.limits.rate_bytes_per_s)
        moved = {"a>b": 0, "b>a": 0}
        last = [trio.current_time()]
        reason = ["closed by the agents"]
        finished = [0]
        self.circuits_open += 1
        self.circuits_total += 1
        use.circuits_open += 1
        use.circuits_total += 1
        started = trio.current_time()
        log.info("relay.circuit_open", circuit=cid, dialer=dialer, target=target)

        async def copy(src, dst, first: bytes, direction: str, scope: trio.CancelScope) -> None:
            try:
                data = first
                while True:
                    if data:
                        await limiter.take(len(data))
                        if use.limiter is not None:
                            await use.limiter.take(len(data))
                        last[0] = trio.current_time()
                        moved[direction] += len(data)
                        self.bytes_relayed += len(data)
                        use.bytes_relayed += len(data)
                        if self._on_bytes is not None:
                            self._on_bytes(circuit, direction, bytes(data))
                        await dst.send_all(data)
                    data = await src.receive_some(_READ)
                    if not data:
                        break
                send_eof = getattr(dst, "send_eof", None)
                if send_eof is not None:
                    with contextlib.suppress(_TRANSPORT_ERRORS):
                        await send_eof()
            except _TRANSPORT_ERRORS as e:
                reason[0] = f"transport error: {e}"
                scope.cancel()
                return
            finished[0] += 1
            if finished[0] == 2:
                scope.cancel()

        async def watchdog(scope: trio.CancelScope) -> None:
            idle = self.limits.idle_timeout
            while True:
                await trio.sleep_until(last[0] + idle)
                if trio.current_time() - last[0] >= idle:
                    reason[0] = f"idle for {idle:g} s"
                    scope.cancel()
                    return

        try:
            async with trio.open_nursery() as nursery:
                scope = nursery.cancel_scope
                nursery.start_soon(copy, a, b, a_leftover, "a>b", scope)
                nursery.start_soon(copy, b, a, pending.leftover, "b>a", scope)
                nursery.start_soon(watchdog, scope)
        finally:
            self.circuits_open -= 1
            use.circuits_open -= 1
            log.info(
                "relay.circuit_closed",
                mesh=use.name,
                circuit=cid,
                dialer=dialer,
                target=target,
                bytes_dialer_to_target=moved["a>b"],
                bytes_target_to_dialer=moved["b>a"],
                seconds=round(trio.current_time() - started, 2),
                reason=reason[0],
            )
