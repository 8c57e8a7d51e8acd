"""Helpers for tests that drive real agent processes."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable

import httpx

from meshagent.launch import AgentProcess


def status(agent: AgentProcess) -> dict:
    return httpx.get(f"{agent.url}/control/status", timeout=10).json()


def wait_for(pred: Callable[[], object], timeout: float = 60.0) -> None:
    """Poll `pred` until it is true; an agent not answering yet counts as not yet, and so does
    a status without the model asked about (an agent takes part in a model once the mesh's
    catalogue reached it)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if pred():
                return
        except (httpx.HTTPError, KeyError):
            pass
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.1)


def invite(agent: AgentProcess) -> str:
    r = subprocess.run(
        [sys.executable, "-m", "meshagent", "invite", "--data-dir", str(agent.data_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return r.stdout.strip()
