"""`meshagent peers` and `meshagent relay` from the command line."""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time

import pytest

from meshagent.cli.common import size_arg as size
from meshagent.cli.peers import table


def test_peers_without_an_agent_says_so(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "meshagent", "peers", "--data-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1
    assert "no agent is running" in r.stderr and "meshagent up" in r.stderr


def _row(**changes):
    row = {
        "peer_id": "abcdefghijklmnopqrstuvwxyz",
        "self": False,
        "name": "laptop",
        "state": "alive",
        "path": "relayed",
        "address": "relay 10.0.0.1:9339",
        "rtt_ms": 12.345,
        "mem_weights_bytes": 6 << 30,
        "mem_kv_bytes": 2 << 30,
        "compute_speed": 85.4,
        "serving": [{"model": "m", "layers": [0, 30], "total_layers": 30}],
        "stages": [{"model": "m.gguf", "kind": "layers", "layers": [0, 10], "key": "k"}],
    }
    return row | changes


def test_peers_table():
    text = table([_row(self=True, path="local", rtt_ms=None), _row(state="dead", path=None)])
    lines = text.splitlines()
    assert lines[0].split() == [
        "NAME", "PEER", "STATE", "PATH", "ADDRESS", "RTT", "MEMORY", "W+KV", "SPEED", "VRAM",
        "GPU", "SPEED", "ARTIFACTS", "SERVES",
    ]  # fmt: skip
    # peers by name, the id after; sizes in decimal units, as every message writes them
    assert lines[1].startswith("laptop (this)  abcdefghijkl  alive")
    assert "relay 10.0.0.1:9339" in lines[1] and "6.44 GB+2.15 GB" in lines[1]
    assert "85GF" in lines[1] and lines[1].split()[-3:] == ["1", "m", "0-30"]
    assert lines[2].startswith("laptop         abcdefghijkl  dead ") and "12.3ms" in lines[2]


def test_peers_table_shows_each_gpus_offer_and_speed():
    gpus = [
        {"offer_bytes": 20 << 30, "total_bytes": 80 << 30, "speed": 41234.5},
        {"offer_bytes": 0, "total_bytes": 24 << 30, "speed": 0.0},
    ]
    text = table([_row(devices=gpus), _row()])
    gpu_row, cpu_row = text.splitlines()[1:]
    assert "21.5 GB/85.9 GB+0 B/25.8 GB" in gpu_row and "41234GF+-" in gpu_row
    # no GPU: VRAM and GPU SPEED (before the artifacts and "m 0-30")
    assert cpu_row.split()[-5:-3] == ["-", "-"]


@pytest.mark.parametrize(
    "text, value", [("4MiB", 4 << 20), ("500k", 500_000), ("1048576", 1 << 20), ("1.5g", 1.5e9)]
)
def test_sizes(text, value):
    assert size(text) == value


@pytest.mark.parametrize("text", ["fast", "-1", "4 parsecs", "0"])
def test_bad_sizes(text):
    with pytest.raises(argparse.ArgumentTypeError, match="is not a size"):
        size(text)


def test_relay_runs_until_sigterm():
    p = subprocess.Popen(
        [sys.executable, "-m", "meshagent", "relay", "--listen", "127.0.0.1:0"],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        lines = [p.stderr.readline() for _ in range(2)]  # the log line, then ours
        assert any(x.startswith("meshagent: relay listening on 127.0.0.1:") for x in lines)
        time.sleep(0.2)
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=30) == 0
    finally:
        if p.poll() is None:
            p.kill()


def test_relay_refuses_a_bad_listen_address():
    r = subprocess.run(
        [sys.executable, "-m", "meshagent", "relay", "--listen", "nonsense"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1 and "is not host:port" in r.stderr
