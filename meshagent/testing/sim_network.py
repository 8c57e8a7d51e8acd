"""An in-process simulated network with per-link latency, bandwidth and loss.

It provides reliable, ordered byte streams (what TCP gives the overlay), so packet loss is
modelled as what TCP turns it into: a segment that is lost arrives one retransmission delay
later, holding back everything behind it. All timing uses trio's clock, so under
`trio.testing.MockClock(autojump_threshold=0)` a 150 ms RTT test runs in milliseconds.
No background tasks: senders stamp each segment with its delivery time and receivers sleep
until it is due.
"""

from __future__ import annotations

import errno
import random
from collections import deque
from dataclasses import dataclass, field

import trio

from meshagent.net.address import Address
from meshagent.net.transport import StreamHandler, Transport


@dataclass(frozen=True)
class LinkSpec:
    """One direction of a link. `latency` is one-way, in seconds; `bandwidth` in bytes per
    second (None: unlimited); `loss` the chance a segment needs a retransmission;
    `buffer` the bytes that may be sent but not yet read before the sender blocks (the two
    socket buffers of a TCP connection together)."""

    latency: float = 0.0
    bandwidth: float | None = None
    loss: float = 0.0
    retransmit_delay: float | None = None  # default: max(0.2 s, 3 x latency), like an RTO
    segment: int = 64 * 1024
    buffer: int = 4 << 20

    @property
    def rto(self) -> float:
        if self.retransmit_delay is not None:
            return self.retransmit_delay
        return max(0.2, 3 * self.latency)


class _Pipe:
    """One direction of a simulated connection."""

    def __init__(self, spec: LinkSpec, rng: random.Random) -> None:
        self.spec = spec
        self._rng = rng
        self._queue: deque[tuple[float, bytes]] = deque()
        self._unread = 0
        self._link_free_at = 0.0
        self._last_delivery = 0.0
        self._eof_at: float | None = None
        self._reader_gone = False
        self._writer_gone = False
        self._wake_reader = trio.lowlevel.ParkingLot()
        self._wake_sender = trio.lowlevel.ParkingLot()
        # A cut link delivers nothing, not even an EOF or a reset, until it heals: what a
        # partition or a pulled cable looks like to TCP (bytes wait to be retransmitted).
        self.cut = False

    def set_cut(self, cut: bool) -> None:
        self.cut = cut
        if not cut:
            self._wake_reader.unpark_all()
            self._wake_sender.unpark_all()

    async def send_some(self, data: bytes | bytearray | memoryview) -> int:
        """Queue a prefix of `data` and return its length. While the buffer is full it
        waits, cancellably, having queued nothing: like a socket's send()."""
        await trio.lowlevel.checkpoint_if_cancelled()
        view = memoryview(data).cast("B")
        spec = self.spec
        parked = False
        while self._unread >= spec.buffer and not (
            (self._reader_gone and not self.cut) or self._writer_gone
        ):
            await self._wake_sender.park()
            parked = True
        if self._writer_gone:
            raise trio.ClosedResourceError("the stream was closed while sending")
        if self._reader_gone and not self.cut:
            raise trio.BrokenResourceError("the peer closed the simulated connection")
        take = min(len(view), spec.buffer - self._unread)
        pos = 0
        while pos < take:
            seg = bytes(view[pos : min(take, pos + spec.segment)])
            pos += len(seg)
            now = trio.current_time()
            start = max(now, self._link_free_at)
            tx = len(seg) / spec.bandwidth if spec.bandwidth else 0.0
            self._link_free_at = start + tx
            deliver = start + tx + spec.latency
            while spec.loss and self._rng.random() < spec.loss:
                deliver += spec.rto
            deliver = max(deliver, self._last_delivery)  # a reliable stream stays in order
            self._last_delivery = deliver
            self._queue.append((deliver, seg))
        self._unread += take
        self._wake_reader.unpark_all()
        if not parked:
            await trio.lowlevel.cancel_shielded_checkpoint()
        return take

    async def send(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        if not view:
            await trio.lowlevel.checkpoint()
        pos = 0
        while pos < len(view):
            pos += await self.send_some(view[pos:])

    def send_eof(self) -> None:
        if self._eof_at is None:
            self._eof_at = max(trio.current_time() + self.spec.latency, self._last_delivery)
            self._wake_reader.unpark_all()

    def close_writer(self) -> None:
        """Our end closed: a send blocked on a full buffer ends (as closing a socket does)."""
        self._writer_gone = True
        self._wake_sender.unpark_all()
        self.send_eof()

    def close_reader(self) -> None:
        self._reader_gone = True
        self._queue.clear()
        self._wake_sender.unpark_all()

    async def receive(self, max_bytes: int) -> bytes:
        while True:
            if self.cut:
                await self._wake_reader.park()
                continue
            if self._queue:
                due = self._queue[0][0]
                if due > trio.current_time():
                    await trio.sleep_until(due)
                    continue
                return self._take(max_bytes)
            if self._eof_at is not None:
                await trio.sleep_until(self._eof_at)
                await trio.lowlevel.checkpoint()
                return b""
            await self._wake_reader.park()

    def _take(self, max_bytes: int) -> bytes:
        now = trio.current_time()
        parts = []
        want = max_bytes
        while self._queue and want > 0 and self._queue[0][0] <= now:
            due, seg = self._queue[0]
            if len(seg) <= want:
                self._queue.popleft()
                parts.append(seg)
                want -= len(seg)
            else:
                parts.append(seg[:want])
                self._queue[0] = (due, seg[want:])
                want = 0
        data = b"".join(parts)
        self._unread -= len(data)
        self._wake_sender.unpark_all()
        return data


class SimStream(trio.abc.HalfCloseableStream):
    """One end of a simulated connection."""

    def __init__(self, outbound: _Pipe, inbound: _Pipe, *, local: Address, remote: Address):
        self._out = outbound
        self._in = inbound
        self.local = local
        self.remote = remote
        self._closed = False
        self._eof_sent = False
        self._send_conflict = False
        self._recv_conflict = False

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        if self._send_conflict:
            raise trio.BusyResourceError("another task is sending on this stream")
        if self._closed:
            raise trio.ClosedResourceError("stream is closed")
        if self._eof_sent:
            raise trio.ClosedResourceError("send_eof() was called")
        self._send_conflict = True
        try:
            await self._out.send(data)
        finally:
            self._send_conflict = False

    async def send_some(self, data: bytes | bytearray | memoryview) -> int:
        """Send a prefix of `data`, returning its length; cancelled only before sending
        anything (what the overlay's record writer needs to stay cancellation-safe)."""
        if self._send_conflict:
            raise trio.BusyResourceError("another task is sending on this stream")
        if self._closed or self._eof_sent:
            raise trio.ClosedResourceError("stream is closed for sending")
        self._send_conflict = True
        try:
            return await self._out.send_some(data)
        finally:
            self._send_conflict = False

    async def wait_send_all_might_not_block(self) -> None:
        await trio.lowlevel.checkpoint()

    async def send_eof(self) -> None:
        if self._closed:
            raise trio.ClosedResourceError("stream is closed")
        self._eof_sent = True
        self._out.send_eof()
        await trio.lowlevel.checkpoint()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if self._recv_conflict:
            raise trio.BusyResourceError("another task is receiving on this stream")
        if self._closed:
            raise trio.ClosedResourceError("stream is closed")
        self._recv_conflict = True
        try:
            return await self._in.receive(max_bytes or 65536)
        finally:
            self._recv_conflict = False

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            self._out.close_writer()
            self._in.close_reader()
        await trio.lowlevel.checkpoint()


@dataclass
class _Listening:
    channel: trio.MemorySendChannel[SimStream]


@dataclass
class SimNetwork:
    """Hosts are names; a link between two hosts has one LinkSpec per direction."""

    default: LinkSpec = field(default_factory=LinkSpec)
    seed: int = 0
    _links: dict[tuple[str, str], LinkSpec] = field(default_factory=dict)
    _listening: dict[Address, _Listening] = field(default_factory=dict)
    _next_port: int = 40000
    _cut: set[tuple[str, str]] = field(default_factory=set)
    _pipes: dict[tuple[str, str], list[_Pipe]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def set_link(self, a: str, b: str, spec: LinkSpec, *, reverse: LinkSpec | None = None) -> None:
        """Set a -> b to `spec` and b -> a to `reverse` (default: the same)."""
        self._links[(a, b)] = spec
        self._links[(b, a)] = reverse or spec

    def link(self, src: str, dst: str) -> LinkSpec:
        return self._links.get((src, dst), self.default)

    def cut(self, a: str, b: str) -> None:
        """Partition a and b, both ways: nothing sent either way arrives (no reset, no EOF)
        and a connect between them waits, until `heal`."""
        for key in ((a, b), (b, a)):
            self._cut.add(key)
            for pipe in self._pipes.get(key, []):
                pipe.set_cut(True)

    def heal(self, a: str, b: str) -> None:
        """Undo `cut`: what waited is delivered now."""
        for key in ((a, b), (b, a)):
            self._cut.discard(key)
            for pipe in self._pipes.get(key, []):
                pipe.set_cut(False)

    def isolate(self, host: str) -> None:
        """Cut every link of `host` (a power cut, or its cable pulled): its peers hear
        nothing more from it, not even a reset when its processes then die."""
        hosts = {h for pair in (*self._links, *self._pipes) for h in pair} | {
            a.host for a in self._listening
        }
        for other in hosts - {host}:
            self.cut(host, other)

    def transport(self, host: str) -> SimTransport:
        return SimTransport(self, host)

    def _port(self) -> int:
        self._next_port += 1
        return self._next_port

    async def _connect(self, src: str, address: Address) -> SimStream:
        forward, back = self.link(src, address.host), self.link(address.host, src)
        # A TCP connect costs one round trip before the first byte can be sent.
        await trio.sleep(forward.latency + back.latency)
        while (src, address.host) in self._cut:  # no answer to the SYN (until healed)
            await trio.sleep(0.1)
        entry = self._listening.get(address)
        if entry is None:
            raise OSError(errno.ECONNREFUSED, f"connection refused by {address}")
        local = Address(src, self._port())
        out_pipe, in_pipe = _Pipe(forward, self._rng), _Pipe(back, self._rng)
        self._pipes.setdefault((src, address.host), []).append(out_pipe)
        self._pipes.setdefault((address.host, src), []).append(in_pipe)
        client = SimStream(out_pipe, in_pipe, local=local, remote=address)
        server = SimStream(in_pipe, out_pipe, local=address, remote=local)
        try:
            entry.channel.send_nowait(server)
        except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError) as e:
            raise OSError(errno.ECONNREFUSED, f"connection refused by {address}") from e
        return client


class SimTransport(Transport):
    """The view of a SimNetwork from one host."""

    def __init__(self, network: SimNetwork, host: str) -> None:
        self.network = network
        self.host = host

    async def dial(self, address: Address) -> trio.abc.Stream:
        return await self.network._connect(self.host, address)

    async def serve(
        self,
        address: Address,
        handler: StreamHandler,
        *,
        task_status: trio.TaskStatus[Address] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        if address.host != self.host:
            raise OSError(errno.EADDRNOTAVAIL, f"{address.host} is not this host ({self.host})")
        bound = address if address.port else Address(self.host, self.network._port())
        if bound in self.network._listening:
            raise OSError(errno.EADDRINUSE, f"{bound} is already in use")
        send, receive = trio.open_memory_channel[SimStream](128)
        self.network._listening[bound] = _Listening(send)
        try:
            async with trio.open_nursery() as nursery:
                task_status.started(bound)
                async with receive:
                    async for stream in receive:
                        nursery.start_soon(handler, stream)
        finally:
            del self.network._listening[bound]
            send.close()
