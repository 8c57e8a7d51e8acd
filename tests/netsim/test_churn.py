"""A shortened churn soak through the same code as `just sim-churn`: four agents in `wan`, a
fault every 12 s (kill, SIGINT, power cut, partition in turn) while 12 mixed requests run.
Needs root; about 3-4 minutes on 2 cores. What it checks is what the issue promises: nothing
fails, every stream ends properly, greedy text is the undisturbed text."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import sim
from netsim.lab import requirements_missing
from netsim.scenarios import ChurnSettings

_missing = requirements_missing()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(_missing is not None, reason=_missing or "")]

SHORT = ChurnSettings(requests=12, period_s=12.0)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("churn")
    sim.run_churn(SHORT, out, ["churn", "--requests", "12", "--period-s", "12"])
    return out, json.loads((out / "report.json").read_text())


def test_requests_survive_every_kind_of_fault(run):
    _, report = run
    c = report["churn"]
    t = c["totals"]
    assert t["requests"] == SHORT.requests and t["failed"] == 0, c["failures"]
    assert t["streams"] > 0 and t["streams_complete"] == t["streams"]
    injected = [f for f in c["faults"] if not f.get("skipped")]
    assert {f["kind"] for f in injected} >= {"kill", "sigint"}, c["faults"]
    assert t["replayed"] >= 1  # some request was in flight at a fault and went on
    for f in injected:
        if f["kind"] == "sigint":
            assert f.get("exit_code") == 0 and f["exit_s"] < SHORT.grace_s, f


def test_greedy_text_is_the_undisturbed_text(run):
    _, report = run
    g = report["churn"]["greedy"]
    assert g["checked"] >= 3 and g["identical"] == g["checked"], g["mismatches"]


def test_the_report_says_what_happened(run):
    out, _ = run
    md = (out / "report.md").read_text()
    assert "0 failed" in md and "entry's chain broke after" in md
    assert len((out / "requests.jsonl").read_text().splitlines()) == SHORT.requests
