"""Hole punching: two agents that reach each other only through a relay open a direct TCP
connection through their NATs, coordinated over the relayed one (`punch/1`).

Each NAT lets in only what answers something sent out from behind it. So both agents dial
each other at the same moment, from the port they listen on (`Transport.dial_from`): each
SYN opens its own NAT for the other's, and whichever arrives after the other side's left
finds the way open (a TCP simultaneous open, or an ordinary one where a SYN reaches the other
side's listener).

The conversation, on a stream the initiator opens over the
relayed connection; each message a frame (u16 length, CBOR map, key 0 the version):

    initiator -> OFFER  {1: 1, 2: [its candidates, host:port]}
    responder -> ANSWER {1: 2, 2: [its candidates]}        (the initiator times the round trip)
    initiator -> GO     {1: 3}

and both dial every candidate of the other at once, the initiator as soon as it said GO, the
other when GO arrives (half a round trip later, so the initiator's SYNs leave first). The
initiator is the side behind the more closed NAT (`punches`), by the lower peer id where the
two are alike. The initiator runs the overlay's Noise
handshake as the initiator over what connects, the responder as the responder (a connection
that reaches its listener instead is an ordinary inbound one), so both ends agree on their
roles whichever way the TCP connection came about. The new connection has path `direct` and
replaces the relayed one by drain-and-close (`choose_connection`).

**Behind a symmetric NAT** an agent's public port is new for every destination, so a peer
whose NAT lets in only the exact host:port it sent to (port-restricted) cannot aim at it. Then
the two spray (`SPRAY`): the symmetric side says its public host in the OFFER, the other its
public host:port in the ANSWER; the symmetric side opens `SPRAY` connections to that address
from ports of the system's choosing (each a new mapping, a new public port), and the other
sends as many SYNs from its listen port to random ports of the symmetric side's host. Where a
mapping and a SYN meet, each side's SYN matches the other's outbound entry and the TCP
connection opens (with 512 each, in 98 in 100 attempts).

Candidates are checked as any peer's values are: at most `MAX_CANDIDATES`, each host:port;
the spray host and the public address host text of at most `MAX_ADDRESS` characters.
"""

from __future__ import annotations

import math
import random
import resource
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import cbor2
import structlog
import trio

from meshagent.discovery import nat
from meshagent.discovery.reachable import Reachable
from meshagent.errors import ConfigError, MeshError
from meshagent.net.address import Address
from meshagent.net.connection import DIRECT, Connection
from meshagent.net.frame_reader import receive_cbor
from meshagent.net.manager import ConnectionManager
from meshagent.net.stream import MeshStream
from meshagent.net.transport import Transport
from meshagent.wire.framing import Framing, LengthPrefixDecoder

log = structlog.get_logger(__name__)

LABEL = "punch/1"
VERSION = 1
OFFER, ANSWER, GO = 1, 2, 3
MAX_CANDIDATES = 16
MAX_ADDRESS = 64
FRAMING = Framing("punch message", width=2, max_size=4096)
DIAL_TIMEOUT = 5.0  # seconds each side keeps dialing after GO
# Connections each side opens when one is behind a symmetric NAT and the other's maps alike
# for every destination: n random ports of the symmetric side's host, against n new mappings
# of it, meet with probability 1 - exp(-n^2 / 64512): 98% for 512.
SPRAY = 512
TALK_TIMEOUT = 10.0  # seconds for the conversation over the relay
# A peer's punches this agent answers: one per `ANSWER_EVERY` seconds (an honest peer punches
# again after 1 s at the soonest, then doubling), a spray one per `SPRAY_EVERY` seconds, and
# `MAX_SPRAYS` at once in all: a member cannot have this agent send SYNs without end.
ANSWER_EVERY = 0.9
SPRAY_EVERY = 4.0
MAX_SPRAYS = 8
_DIAL_ERRORS = (OSError, trio.BrokenResourceError, trio.ClosedResourceError)


class PunchError(MeshError):
    """A `punch/1` message that is not one, or a conversation that failed; says how."""


@dataclass(frozen=True)
class Outcome:
    """One punch as the initiator saw it."""

    connection: Connection | None
    rtt_s: float | None  # the relayed round trip it timed
    error: str | None  # why no connection


def encode(kind: int, candidates: Sequence[str] = (), extra: str | None = None) -> bytes:
    """An OFFER's `extra` is the public host to spray toward (the offering side is behind a
    symmetric NAT); an ANSWER's, the answering side's public host:port (its NAT maps alike
    for every destination)."""
    msg: dict[int, object] = {0: VERSION, 1: kind}
    if kind in (OFFER, ANSWER):
        msg[2] = list(candidates)[:MAX_CANDIDATES]
        if extra:
            msg[3] = extra
    return FRAMING.encode(cbor2.dumps(msg))


def extra_of(msg: dict[int, object]) -> str | None:
    """An OFFER's spray host or an ANSWER's public address (host[:port] text), if any."""
    v = msg.get(3)
    if v is None:
        return None
    if not isinstance(v, str) or not 0 < len(v) <= MAX_ADDRESS:
        raise PunchError(f"a punch message's field 3 must be host text, not {v!r:.80}")
    return v


def candidates_of(msg: dict[int, object]) -> list[Address]:
    """The candidates of an OFFER or ANSWER, each a host:port; PunchError otherwise."""
    raw = msg.get(2)
    if not isinstance(raw, list) or len(raw) > MAX_CANDIDATES:
        raise PunchError(f"punch candidates must be a list of at most {MAX_CANDIDATES}")
    out = []
    for text in raw:
        if not isinstance(text, str) or len(text) > MAX_ADDRESS:
            raise PunchError(f"a punch candidate must be host:port text, not {text!r:.80}")
        try:
            out.append(Address.parse(text))
        except ConfigError as e:
            raise PunchError(f"punch candidate {text!r:.80} is not host:port") from e
    return out


async def _receive(stream: MeshStream, frames: LengthPrefixDecoder, kind: int) -> dict:
    msg = await receive_cbor(
        stream,
        frames,
        version=VERSION,
        on_eof=lambda: PunchError("the peer ended the punch conversation"),
        error=PunchError,
        what="punch message",
    )
    if msg.get(1) != kind:
        raise PunchError(f"expected punch message {kind}, got {msg.get(1)!r:.40}")
    return msg


async def _dial_all(
    overlay: ConnectionManager,
    transport: Transport,
    local: Address,
    peer_id: str,
    targets: Sequence[Address],
    *,
    initiator: bool,
    from_anywhere: Sequence[Address] = (),
) -> Connection | None:
    """Dial every target from `local`, and every one of `from_anywhere` from a port of the
    system's choosing, all at once for `DIAL_TIMEOUT`. The initiator takes the first TCP
    connection that opens and closes the others before any handshake (a spray may open
    several: one handshake, one overlay connection); the responder runs its side of the
    handshake on each that opens, and the one the initiator took completes."""
    won: list[Connection] = []
    first: list[tuple[trio.abc.Stream, Address]] = []

    async def one(target: Address, scope: trio.CancelScope, listen_port: bool) -> None:
        try:
            if listen_port:
                stream = await transport.dial_from(target, local)
            else:
                stream = await transport.dial(target)
        except _DIAL_ERRORS as e:
            log.debug("punch.dial_failed", peer=peer_id, target=str(target), error=str(e))
            return
        if initiator:
            if first:
                await trio.aclose_forcefully(stream)
            else:
                first.append((stream, target))
                scope.cancel()
            return
        conn = await _handshake(stream, target, initiator=False)
        if conn is not None:
            won.append(conn)
            scope.cancel()

    async def _handshake(
        stream: trio.abc.Stream, target: Address, *, initiator: bool
    ) -> Connection | None:
        try:
            conn = await overlay.adopt(
                stream, initiator=initiator, remote=str(target), path=DIRECT, peer_id=peer_id
            )
        except (MeshError, *_DIAL_ERRORS) as e:
            log.info("punch.handshake_failed", peer=peer_id, target=str(target), error=str(e))
            return None
        return conn if conn.peer_id == peer_id and conn.path == DIRECT else None

    with trio.move_on_after(DIAL_TIMEOUT):
        async with trio.open_nursery() as nursery:
            for target in targets:
                nursery.start_soon(one, target, nursery.cancel_scope, True)
            for target in from_anywhere:
                nursery.start_soon(one, target, nursery.cancel_scope, False)
    if initiator and first:
        return await _handshake(*first[0], initiator=True)
    return won[0] if won else None


class Answering:
    """Which peers' punches this agent answers now (sans-IO, times given): one a peer per
    `ANSWER_EVERY` seconds, a spray one a peer per `SPRAY_EVERY` and `MAX_SPRAYS` at once
    (`spraying` counts those under way). The peers remembered are bounded: the oldest go
    first."""

    def __init__(self, most: int = 1024) -> None:
        self._answered: dict[str, float] = {}
        self._sprayed: dict[str, float] = {}
        self.spraying = 0
        self._most = most

    def answer(self, peer_id: str, now: float) -> bool:
        return self._take(self._answered, peer_id, now, ANSWER_EVERY)

    def spray(self, peer_id: str, now: float) -> bool:
        return self.spraying < MAX_SPRAYS and self._take(self._sprayed, peer_id, now, SPRAY_EVERY)

    def _take(self, seen: dict[str, float], peer_id: str, now: float, every: float) -> bool:
        last = seen.get(peer_id)
        if last is not None and now - last < every:
            return False
        seen.pop(peer_id, None)
        seen[peer_id] = now
        while len(seen) > self._most:
            del seen[next(iter(seen))]
        return True


def may_spray_at(
    behind_symmetric: Callable[[str], bool], peer_id: str, host: str, theirs: Sequence[Address]
) -> bool:
    return behind_symmetric(peer_id) and any(c.host == host for c in theirs)


def spray_size() -> int:
    """How many connections each side of a spray opens: `SPRAY`, fewer where the process may
    hold few files."""
    try:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (OSError, ValueError):
        return SPRAY // 4
    if soft == resource.RLIM_INFINITY:
        return SPRAY
    return max(0, min(SPRAY, (soft - 256) // 2))


def spray_ports(n: int, rng: random.Random) -> list[int]:
    """`n` distinct ports a NAT may map to (1024-65535), in no order."""
    return rng.sample(range(1024, 65536), n)


async def initiate(
    overlay: ConnectionManager,
    transport: Transport,
    peer_id: str,
    candidates: Sequence[str],
    *,
    spray_host: str | None = None,
    clock: Callable[[], float] = trio.current_time,
) -> Outcome:
    """Punch toward `peer_id` (connected through a relay) from this agent's listen port.
    `spray_host`: this agent's public host, where its NAT maps by destination (symmetric):
    the other side then sprays SYNs at many of its ports while this side opens as many
    connections toward the other's public address, each through a new mapping, until one
    mapping and one SYN meet (`SPRAY`)."""
    if not overlay.listen_addresses:
        return Outcome(None, None, "this agent does not listen")
    local = overlay.listen_addresses[0]
    rtt = None
    stream = None
    try:
        try:
            with trio.fail_after(TALK_TIMEOUT):
                stream = await overlay.open_stream(peer_id, LABEL)
                frames = LengthPrefixDecoder(FRAMING)
                began = clock()
                await stream.send_all(encode(OFFER, candidates, spray_host))
                answer = await _receive(stream, frames, ANSWER)
                theirs, their_public = candidates_of(answer), extra_of(answer)
                rtt = clock() - began
                await stream.send_all(encode(GO))
                await stream.send_eof()  # the stream stays open till the dialing ends
        except (MeshError, trio.TooSlowError, *_DIAL_ERRORS) as e:
            return Outcome(None, rtt, f"the conversation over the relay failed: {e}")
        if not theirs:
            return Outcome(None, rtt, "the peer has no address to punch toward")
        # Dial at once: this side's SYNs leave first (the GO still has half a round trip to
        # go), so the other's arrive at a socket already connecting (a simultaneous open)
        # rather than at the listener, where they would find a responder like themselves.
        many: list[Address] = []
        if spray_host and their_public:
            try:
                many = [Address.parse(their_public)] * spray_size()
            except ConfigError:
                many = []
        conn = await _dial_all(
            overlay, transport, local, peer_id, theirs, initiator=True, from_anywhere=many
        )
    finally:
        if stream is not None:
            await stream.aclose()
    if conn is None:
        tried = ", ".join(str(t) for t in theirs)
        return Outcome(None, rtt, f"no candidate answered within {DIAL_TIMEOUT:g} s ({tried})")
    return Outcome(conn, rtt, None)


async def serve(
    overlay: ConnectionManager,
    transport: Transport,
    stream: MeshStream,
    candidates: Callable[[], Sequence[str]],
    public: Callable[[], str | None] = lambda: None,
    *,
    behind_symmetric: Callable[[str], bool] = lambda peer_id: False,
    rng: random.Random | None = None,
    answering: Answering | None = None,
) -> None:
    """Answer a peer's punch: our candidates (and `public()`, our public address where our NAT
    maps alike for every destination), then on its GO dial its candidates; where it said it is
    behind a symmetric NAT (a spray host) and we have a public address, also SYNs from our
    listen port to `spray_size()` random ports of that host. `answering`: how often each peer
    may have that (by default, every time)."""
    local = overlay.listen_addresses[0] if overlay.listen_addresses else None
    answering = answering or Answering()
    if not answering.answer(stream.peer_id, trio.current_time()):
        stream.reset(f"one punch a peer per {ANSWER_EVERY:g} s")
        log.info("punch.too_soon", peer=stream.peer_id)
        await stream.aclose()
        return
    try:
        try:
            with trio.fail_after(TALK_TIMEOUT):
                frames = LengthPrefixDecoder(FRAMING)
                offer = await _receive(stream, frames, OFFER)
                theirs, spray_host = candidates_of(offer), extra_of(offer)
                ours = public() if local else None
                await stream.send_all(encode(ANSWER, candidates() if local else (), ours))
                await _receive(stream, frames, GO)
                await stream.send_eof()
        except (PunchError, trio.TooSlowError, *_DIAL_ERRORS) as e:
            stream.reset(str(e)[:200])
            log.info("punch.refused", peer=stream.peer_id, error=str(e))
            return
        if local is None or not theirs:
            return
        # A spray sends hundreds of SYNs at one host: only toward a peer whose own record says
        # it is behind a symmetric NAT, and at a host it offered as a candidate (a member
        # cannot aim this agent's SYNs at a third party's host it did not also name), and
        # not more often than `answering` allows.
        if (
            spray_host
            and ours
            and not (
                may_spray_at(behind_symmetric, stream.peer_id, spray_host, theirs)
                and answering.spray(stream.peer_id, trio.current_time())
            )
        ):
            log.info("punch.spray_refused", peer=stream.peer_id, host=spray_host)
            spray_host = None
        spraying = bool(spray_host and ours)
        if spraying:
            ports = spray_ports(spray_size(), rng or random.Random())
            theirs = [*theirs, *(Address(spray_host, port) for port in ports)]  # type: ignore[arg-type]
            answering.spraying += 1
        try:
            conn = await _dial_all(
                overlay, transport, local, stream.peer_id, theirs, initiator=False
            )
        finally:
            if spraying:
                answering.spraying -= 1
        log.info("punch.answered", peer=stream.peer_id, connected=conn is not None)
    finally:
        await stream.aclose()


def initiator(
    overlay: ConnectionManager, transport: Transport, reach: Reachable
) -> Callable[[str], Awaitable[Outcome]]:
    """The dialer's `punch`: `initiate` with what `reach` says of this agent now."""
    return lambda peer_id: initiate(
        overlay, transport, peer_id, reach.punch_candidates(), spray_host=reach.spray_host()
    )


def server(
    overlay: ConnectionManager,
    transport: Transport,
    reach: Reachable,
    behind_symmetric: Callable[[str], bool],
) -> Callable[[MeshStream], Awaitable[None]]:
    """The `punch/1` stream handler: `serve` with what `reach` says of this agent now, each
    peer within one `Answering`."""
    answering = Answering()
    return lambda stream: serve(
        overlay,
        transport,
        stream,
        reach.punch_candidates,
        reach.public_address,
        behind_symmetric=behind_symmetric,
        answering=answering,
    )


def schedule(attempts: int, base: float) -> float:
    """Seconds before punching again after `attempts` failed ones: `base`, doubling to a
    minute."""
    return min(60.0, base * math.pow(2, max(0, attempts - 1)))


# How little a NAT lets in, as far as its mapping tells: the more closed side punches.
_CLOSED = {nat.DEPENDENT: 2, nat.INDEPENDENT: 1, nat.UNKNOWN: 1, "": 1, nat.NONE: 0}


def punches(my_nat: str, their_nat: str, my_id: str, their_id: str) -> bool:
    """Whether this side of a relayed pair punches (and is the handshake's initiator): the
    side behind the more closed NAT, by the lower peer id where they are alike. Its SYNs
    come from ports the other cannot foresee (symmetric) or are let in only as answers, so
    they must be the ones that reach the other's listener or its connecting socket; the
    other side's own SYNs only open its NAT."""
    mine, theirs = _CLOSED.get(my_nat, 1), _CLOSED.get(their_nat, 1)
    return mine > theirs if mine != theirs else my_id < their_id


def why_relayed(
    my_nat: str, their_nat: str, *, punches: int, error: str | None, punching: bool
) -> str:
    """Why a peer is still reached through a relay, for `meshagent peers`. `punching`: this
    agent is the one of the two that punches (`punches`)."""
    if my_nat == their_nat == nat.DEPENDENT:
        return (
            "both NATs map by destination (symmetric): no hole can be punched; a port forward, "
            "--listen on a public address, or UPnP on either router would give a direct path"
        )
    if not punching:
        return "the peer punches toward this agent (the side behind the more closed NAT does)"
    if punches == 0:
        return "no punch tried yet"
    tried = f"{punches} punch{'es' if punches > 1 else ''} failed"
    return f"{tried}; the last: {error}" if error else tried
