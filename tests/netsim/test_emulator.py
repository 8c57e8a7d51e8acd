"""The emulator between real namespaces: delays, partitions, loss, multicast, a TCP transfer,
and cleanup. Needs root and /dev/net/tun; bounds are generous, this is no benchmark."""

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
from netsim import probe
from netsim.lab import Lab, cleanup_stale, requirements_missing
from netsim.linkmodel import LinkSpec
from netsim.regimes import MBIT, Topology, topology

_missing = requirements_missing()
pytestmark = pytest.mark.skipif(_missing is not None, reason=_missing or "")

ECHO = 7000


def pair(spec: LinkSpec) -> Topology:
    return topology("lan", 2).with_link("h0", "h1", spec)


def ping(lab: Lab, count: int, *, timeout: float = 1.0) -> dict:
    """UDP pings h0 -> h1 (which must run an echo on ECHO)."""
    argv = probe.command(
        "udp-ping", lab["h1"].address, str(ECHO), "--count", str(count), "--timeout", str(timeout)
    )
    return json.loads(lab["h0"].run(argv, timeout=60).stdout)


def start_echo(lab: Lab) -> None:
    lab["h1"].spawn(probe.command("udp-echo", "--port", str(ECHO))).wait_for("ready")


def namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def test_round_trip_is_twice_the_one_way_delay():
    with Lab(pair(LinkSpec(delay_s=0.015))) as lab:
        start_echo(lab)
        r = ping(lab, 40)
    assert r["lost"] == 0
    assert 29.0 <= statistics.median(r["rtts_ms"]) <= 40.0


def test_partition_blocks_traffic_then_heals_by_itself():
    with Lab(topology("lan", 2)) as lab:
        start_echo(lab)
        assert ping(lab, 3)["lost"] == 0
        lab.partition("h0", "h1", seconds=1.5)
        assert not lab.spec("h1", "h0").up
        assert ping(lab, 3, timeout=0.2)["lost"] == 3
        time.sleep(1.5)
        assert ping(lab, 3)["lost"] == 0
        dropped = lab.counters().links[("h0", "h1")].dropped
    assert dropped["partition"] == 3


def test_loss_drops_about_the_configured_share():
    with Lab(pair(LinkSpec(loss=0.2))) as lab:
        h0, h1 = lab.hosts
        sink = h1.spawn(probe.command("udp-sink", "--port", "7001", "--idle", "0.5"))
        sink.wait_for("ready")
        flood = probe.command(
            "udp-flood", h1.address, "7001", "--seconds", "1", "--rate", "2000", "--size", "100"
        )
        sent = json.loads(h0.run(flood).stdout)["sent"]
        received = sink.json_result()["received"]
        c = lab.counters().links[("h0", "h1")]
    assert sent > 1000
    assert 0.72 <= received / sent <= 0.88
    assert c.dropped["loss"] + c.packets == sent


def test_multicast_reaches_the_segment_but_not_a_far_host():
    with Lab(topology("mixed", 3)) as lab:
        h0, h1, h2 = lab.hosts
        receivers = [
            h.spawn(probe.command("mcast-recv", "224.0.0.251", "5353", "--seconds", "1.5"))
            for h in (h1, h2)
        ]
        for r in receivers:
            r.wait_for("ready")
        h0.run(probe.command("mcast-send", "224.0.0.251", "5353", "--count", "5"))
        near, far = (r.json_result()["received"] for r in receivers)
    assert near == 5
    assert far == 0


def test_isolated_hosts_reach_each_other_only_through_the_relay():
    with Lab(topology("lan", 2, relay=True, isolated=True)) as lab:
        h0, h1, relay = lab.hosts
        relay.spawn(probe.command("udp-echo", "--port", str(ECHO))).wait_for("ready")
        h1.spawn(probe.command("udp-echo", "--port", str(ECHO))).wait_for("ready")
        via_relay = probe.command("udp-ping", relay.address, str(ECHO), "--count", "3")
        direct = probe.command(
            "udp-ping", h1.address, str(ECHO), "--count", "2", "--timeout", "0.2"
        )
        assert json.loads(h0.run(via_relay).stdout)["lost"] == 0
        assert json.loads(h0.run(direct).stdout)["lost"] == 2
        assert lab.counters().links[("h0", "h1")].dropped["no_route"] == 2


def test_tcp_transfer_through_a_rate_limited_lossy_link_arrives_intact():
    spec = LinkSpec(delay_s=0.005, jitter_s=0.001, loss=0.002, rate_bps=100 * MBIT)
    with Lab(pair(spec)) as lab:
        h0, h1 = lab.hosts
        sink = h1.spawn(probe.command("tcp-sink", "--port", "7002"))
        sink.wait_for("ready")
        sent = json.loads(
            h0.run(probe.command("tcp-send", h1.address, "7002", "--bytes", str(6 << 20))).stdout
        )
        got = sink.json_result()
        c = lab.counters().links[("h0", "h1")]
    assert got["bytes"] == sent["bytes"] == 6 << 20
    assert got["sha256"] == sent["sha256"]
    assert c.bytes >= 6 << 20
    # 6 MiB at 100 Mbit/s takes 0.5 s on the wire: the rate is in force
    assert got["seconds"] >= 0.45


def test_everything_is_gone_after_the_lab():
    with Lab(topology("lan", 2)) as lab:
        tag = lab.tag
        emulator = lab.emulator_pid
        sleeper = lab["h0"].spawn(["sleep", "600"])
        assert any(n.startswith(tag) for n in namespaces())
    assert not any(n.startswith(tag) for n in namespaces())
    assert sleeper.returncode is not None
    with pytest.raises(ProcessLookupError):
        os.kill(emulator, 0)
    assert not lab.workdir.exists()


def test_an_exception_inside_the_lab_still_cleans_up():
    with pytest.raises(RuntimeError), Lab(topology("lan", 2)) as lab:
        tag = lab.tag
        raise RuntimeError("boom")
    assert not any(n.startswith(tag) for n in namespaces())
    assert (lab.workdir / "emulator.log").exists()  # kept for the post-mortem
    shutil.rmtree(lab.workdir)


def test_cleanup_stale_removes_namespaces_of_dead_labs_only():
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale, live = f"nsim{dead.pid}x0h0", f"nsim{os.getpid()}x999h0"
    for name in (stale, live):
        subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        removed = cleanup_stale()
        assert stale in removed
        assert stale not in namespaces() and live in namespaces()
    finally:
        for name in (stale, live):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


HARNESS = """
import signal, sys, time
# As a program started from a terminal has it (a suite started in the background from a
# script inherits SIGINT ignored, and the lab rightly leaves an ignored SIGINT alone).
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.path.insert(0, {net_sim!r})
from netsim.lab import Lab
from netsim.regimes import topology
with Lab(topology("lan", 2), workdir={workdir!r}) as lab:
    lab["h0"].spawn(["sleep", "600"])
    print(lab.tag, lab.emulator_pid, flush=True)
    time.sleep(600)
"""


def start_harness(workdir: Path) -> tuple[subprocess.Popen, str, int]:
    net_sim = str(Path(__file__).resolve().parents[2] / "net-sim")
    code = HARNESS.format(net_sim=net_sim, workdir=str(workdir))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    tag, emulator = proc.stdout.readline().split()
    return proc, tag, int(emulator)


def wait_gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_harness_cleans_up(sig, tmp_path):
    proc, tag, emulator = start_harness(tmp_path)
    proc.send_signal(sig)
    # Cleanup runs several `ip` commands and stops processes: seconds alone, longer on a
    # loaded machine. What is checked is that it happens.
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        print(subprocess.run(["ps", "-ef", "--forest"], capture_output=True, text=True).stdout)
        raise
    assert wait_gone(emulator)
    assert not any(n.startswith(tag) for n in namespaces())


def test_a_killed_harness_leaves_namespaces_for_cleanup_stale_only(tmp_path):
    proc, tag, emulator = start_harness(tmp_path)
    proc.kill()
    proc.wait()
    assert wait_gone(emulator)  # its control channel closed
    assert any(n.startswith(tag) for n in namespaces())
    cleanup_stale()
    assert not any(n.startswith(tag) for n in namespaces())
