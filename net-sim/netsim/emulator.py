"""The link emulator: a process that owns one TUN device per host and moves packets between
them at the times the `Fabric` says.

Why a plain `select.select` loop in a process of its own, and not trio, epoll or a thread:

- timer precision: `select.select` takes a float timeout and sleeps with microsecond
  resolution (and we ask the kernel for 1 µs timer slack), while `select.epoll.poll` and
  `select.poll` round timeouts to whole milliseconds, and trio's run loop sleeps on epoll. A
  later goal compares per-token latency with a floor to within 2 ms; a millisecond of
  rounding per hop would eat it. Long sleeps end `EARLY_WAKE_S` early and sleep again, which
  cuts the wake-up overshoot of an idle CPU from about 200 µs to about 50 µs;
- isolation: in its own process the loop competes with no other Python code for the GIL, so
  a busy agent or test does not stretch link delays.

The loop: deliver every packet that is due; sleep in `select` until the next one is due, a TUN
has a packet, or a control message arrives; read a batch of packets from each ready TUN, route
them, and queue the deliveries on a heap ordered by time. The control channel (see `control`)
changes links at run time, reports counters, and stops the emulator; its end of file stops it
too.

TUN devices are created inside each host's network namespace: the process enters the
namespace with `setns(2)` (through ctypes: Python 3.11 has no `os.setns`), opens /dev/net/tun,
creates the device with TUNSETIFF, and returns to its own namespace. The device stays in the
namespace it was created in, and the file descriptor works from anywhere; when the emulator
exits the devices vanish with it.

Run as `python -m netsim.emulator --control-fd N` (with `net-sim` on PYTHONPATH); the harness
(`netsim.lab`) does this.
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import gc
import heapq
import itertools
import os
import select
import socket
import struct
import sys
import time
from typing import Any

from netsim.control import recv_message, send_message
from netsim.fabric import Fabric
from netsim.linkmodel import LinkSpec
from netsim.regimes import Topology

CLONE_NEWNET = 0x40000000
TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
PR_SET_TIMERSLACK = 29

# Sleeps longer than about half a millisecond overshoot by 150-250 µs here (the CPU idles
# more deeply), short ones by 30-50 µs: so sleep until just before the deadline, then again.
EARLY_WAKE_S = 0.0002
READ_BATCH = 64  # packets read from one TUN before looking at the others and the clock
MAX_PACKET = 65536

_libc = ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def open_tun(netns_path: str, ifname: str) -> int:
    """A non-blocking TUN device `ifname` (IFF_TUN | IFF_NO_PI: bare IP packets) created in
    the network namespace at `netns_path`; the calling thread ends in its own namespace."""
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(netns_path, os.O_RDONLY)
    try:
        _check(_libc.setns(target, CLONE_NEWNET), f"setns({netns_path})")
        try:
            fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
            try:
                ifreq = struct.pack("16sH", ifname.encode(), IFF_TUN | IFF_NO_PI)
                fcntl.ioctl(fd, TUNSETIFF, ifreq)
            except OSError:
                os.close(fd)
                raise
        finally:
            _check(_libc.setns(home, CLONE_NEWNET), "setns(back to the emulator's namespace)")
    finally:
        os.close(target)
        os.close(home)
    return fd


def set_timer_slack(nanoseconds: int) -> None:
    """Ask the kernel to wake us within `nanoseconds` of a timeout (default slack: 50 µs)."""
    _libc.prctl(PR_SET_TIMERSLACK, ctypes.c_ulong(nanoseconds), 0, 0, 0)


class Emulator:
    """The running emulator: a fabric, one TUN fd per host (in host order) and the control
    socket. `run()` returns when told to stop or when the control channel closes."""

    def __init__(self, fabric: Fabric, tun_fds: list[int], control: socket.socket) -> None:
        self.fabric = fabric
        self.tun_fds = tun_fds
        self.control = control
        self.started = time.monotonic()
        self.read_errors = 0
        self.write_errors = 0  # e.g. the destination's interface was set down
        # How far behind their due times packets were written: the emulator's own error.
        self.delivered = 0
        self.late_total_s = 0.0
        self.max_late_s = 0.0
        self._pending: list[tuple[float, int, int, bytes]] = []
        self._seq = itertools.count()
        self._heals: dict[tuple[str, str], float] = {}
        self._stop = False

    def run(self) -> None:
        pending = self._pending
        fds = self.tun_fds
        host_of = {fd: i for i, fd in enumerate(fds)}
        control_fd = self.control.fileno()
        watched = [*fds, control_fd]
        route = self.fabric.route
        seq = self._seq
        clock = time.monotonic
        heappush, heappop = heapq.heappush, heapq.heappop
        read, write = os.read, os.write
        while not self._stop:
            now = clock()
            if pending and pending[0][0] <= now:
                self.max_late_s = max(self.max_late_s, now - pending[0][0])
                while pending and pending[0][0] <= now:
                    due, _, dst, packet = heappop(pending)
                    self.delivered += 1
                    self.late_total_s += now - due
                    try:
                        write(fds[dst], packet)
                    except OSError:
                        self.write_errors += 1
            if self._heals:
                self._heal_due(now)
            wake = pending[0][0] if pending else None
            if self._heals:
                first_heal = min(self._heals.values())
                wake = first_heal if wake is None else min(wake, first_heal)
            timeout = None
            if wake is not None:
                timeout = max(0.0, wake - now)
                if timeout > 2 * EARLY_WAKE_S:
                    timeout -= EARLY_WAKE_S
            ready, _, _ = select.select(watched, [], [], timeout)
            if not ready:
                continue
            now = clock()
            for fd in ready:
                if fd == control_fd:
                    self._on_control()
                    continue
                src = host_of[fd]
                for _ in range(READ_BATCH):
                    try:
                        packet = read(fd, MAX_PACKET)
                    except BlockingIOError:
                        break
                    except OSError:
                        self.read_errors += 1
                        break
                    for when, dst in route(now, src, packet):
                        heappush(pending, (when, next(seq), dst, packet))

    def _heal_due(self, now: float) -> None:
        for pair, when in list(self._heals.items()):
            if when <= now:
                del self._heals[pair]
                self.fabric.set_up(*pair, up=True)

    def _on_control(self) -> None:
        message = recv_message(self.control)
        if message is None:
            self._stop = True
            return
        try:
            reply = {"ok": True, **self.handle(message)}
        except (ValueError, KeyError, TypeError) as e:
            reply = {"ok": False, "error": str(e)}
        send_message(self.control, reply)

    def handle(self, message: dict[str, Any]) -> dict[str, Any]:
        """Apply one control request; the reply's fields (without `ok`)."""
        op = message.get("op")
        fabric = self.fabric
        if op == "ping":
            return {}
        if op == "counters":
            return {
                **fabric.counters(),
                "uptime_s": time.monotonic() - self.started,
                "queued": len(self._pending),
                "read_errors": self.read_errors,
                "write_errors": self.write_errors,
                "delivered": self.delivered,
                "late_total_s": self.late_total_s,
                "max_late_s": self.max_late_s,
            }
        if op == "set_link":
            fabric.set_link(message["src"], message["dst"], LinkSpec.from_dict(message["spec"]))
            return {}
        if op == "spec":
            return {"spec": fabric.spec(message["src"], message["dst"]).to_dict()}
        if op == "partition":
            a, b = message["a"], message["b"]
            fabric.set_up(a, b, up=False)
            self._heals.pop((a, b), None)
            self._heals.pop((b, a), None)
            if message.get("seconds") is not None:
                self._heals[(a, b)] = time.monotonic() + float(message["seconds"])
            return {}
        if op == "heal":
            a, b = message["a"], message["b"]
            self._heals.pop((a, b), None)
            self._heals.pop((b, a), None)
            fabric.set_up(a, b, up=True)
            return {}
        if op == "stop":
            self._stop = True
            return {}
        raise ValueError(f"unknown control op {op!r}")


def _start(control: socket.socket) -> Emulator | None:
    """Wait for the `start` request, open the TUNs, reply; None if the harness went away."""
    message = recv_message(control)
    if message is None:
        return None
    fds: list[int] = []
    try:
        if message.get("op") != "start":
            raise ValueError(f"expected a start request, got {message.get('op')!r}")
        topology = Topology.from_dict(message["topology"])
        fabric = Fabric(topology, message["network"], seed=int(message.get("seed", 0)))
        for host in topology.hosts:
            fds.append(open_tun(message["netns"][host], message["ifname"]))
    except (OSError, ValueError, KeyError, TypeError) as e:
        for fd in fds:
            os.close(fd)
        send_message(control, {"ok": False, "error": f"{type(e).__name__}: {e}"})
        return None
    send_message(control, {"ok": True, "pid": os.getpid()})
    return Emulator(fabric, fds, control)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="netsim.emulator", description=__doc__.split("\n")[0])
    parser.add_argument("--control-fd", type=int, required=True)
    args = parser.parse_args(argv)
    control = socket.socket(fileno=args.control_fd)
    control.setblocking(True)
    set_timer_slack(1000)
    emulator = _start(control)
    if emulator is None:
        return 1
    # The loop makes no reference cycles; a collector pass would only add pauses to delays.
    gc.freeze()
    gc.disable()
    emulator.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
