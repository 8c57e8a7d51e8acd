"""The shortened certification run: split serving in wan with a short soak, through the same
code as `just sim` (whose other regimes differ only in their links' figures), and the report
it writes. Needs root; about 2 minutes on 2 cores.
Bounds on time are sanity checks only: the figures themselves are the report's business."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import sim
from netsim.lab import requirements_missing
from netsim.scenarios import SplitSettings

_missing = requirements_missing()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(_missing is not None, reason=_missing or "")]

REGIMES = ["wan"]
SHORT = SplitSettings(
    requests=8, calibration=3, decode_tokens=32, forwarded=1, idle_s=2.0, speculation=1
)
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("sim")
    sim.run_split("split", REGIMES, SHORT, out, ["split", "--regime", "wan"])
    return out, json.loads((out / "report.json").read_text())


def test_every_request_completes_and_every_stream_ends_properly(run):
    _, report = run
    for name in REGIMES:
        r = report["regimes"][name]
        t = r["totals"]
        assert t["failed"] == 0, r["failures"]
        # warm-up 1, prefill 3, decode 3, speculation 1 of each workload off and auto, soak 8,
        # forwarded 1 to each of 2 other agents
        assert t["requests"] == 1 + 3 + 3 + 4 + 8 + 2
        assert t["streams"] > 0 and t["streams_complete"] == t["streams"]
        assert r["soak"]["ok"] == 8 and r["forwarded"]["ok"] == 2


def test_three_stages_on_three_hosts_with_a_receipt(run):
    out, report = run
    for name in REGIMES:
        r = report["regimes"][name]
        assert sorted(s[0] for s in r["plan"]["stages"]) == ["h0", "h1", "h2"]
        assert [h["path"] for h in r["ring"]] == ["direct"] * 3
    records = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert len(records) == len(REGIMES) * 21
    for rec in records:
        assert len(rec["stages"].split(",")) == 3 and len(rec["stage_ms"]) == 3


def test_per_token_latency_is_reported_against_its_floor(run):
    _, report = run
    for name, one_way_ms in (("wan", 15.0),):
        iso = report["regimes"][name]["isolation"]
        floor = iso["floor"]
        assert floor["ring_ms"] == pytest.approx(3 * one_way_ms)
        assert all(c > 0 for c in iso["stage_compute_ms"])
        assert floor["floor_ms"] == pytest.approx(floor["compute_ms"] + floor["ring_ms"])
        vs = iso["median_vs_floor"]
        # No token can beat the propagation around the ring; generous upper bound.
        assert floor["ring_ms"] < vs["measured_ms"] < 3 * floor["floor_ms"] + 20
        assert vs["ratio"] > 0 and "software_ms" in iso["breakdown"]
        assert iso["ttft_ms"]["median"] > 0


def test_speculation_is_measured_against_drafts_off(run):
    _, report = run
    for name in REGIMES:
        spec = report["regimes"][name]["speculation"]
        for mix in ("copy", "prose"):
            m = spec[mix]
            assert m["ok"] == m["requests"] == 2 and m["same_text"] == "1/1", m
            assert m["tok_s_off"] > 0 and m["tok_s_auto"] > 0 and m["ratio"] > 0
        assert spec["copy"]["accepted"] > 0  # the copied text's drafts were taken


def test_soak_speed_ttft_and_bytes_on_the_wire_per_link(run):
    _, report = run
    for name in REGIMES:
        r = report["regimes"][name]
        soak = r["soak"]
        assert soak["tokens_per_s"]["median"] > 0 and soak["ttft_ms"]["median"] > 0
        ring = [f"{h['src']}>{h['dst']}" for h in r["ring"]]
        for leg in ring:
            assert soak["wire"][leg]["bytes_per_token"] > 0
        d = r["discovery"]
        assert 0 < d["membership_s"] <= d["routable_s"]


def test_the_report_files_hold_the_figures(run):
    out, report = run
    md = (out / "report.md").read_text()
    for text in ("floor", "What was tested", "What was not tested", "Bytes on the wire",
                 "bbr", "Regime `wan`", "Failed requests",
                 "### Speculation"):  # fmt: skip
        assert text in md, text
    for png in ("per_token_wan.png", "tokens_per_s.png", "ttft.png"):
        assert (out / png).read_bytes().startswith(PNG), png
    assert report["tested"] and report["not_tested"]
