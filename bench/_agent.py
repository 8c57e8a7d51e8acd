"""Start a real agent process for a benchmark and find its API."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx


@contextmanager
def running_agent(*args: str, timeout: float = 60.0) -> Iterator[str]:
    """Run `meshagent up` on a free port with a fresh data dir; yield its base URL."""
    with tempfile.TemporaryDirectory(prefix="meshagent-bench-") as tmp:
        data = Path(tmp)
        cmd = [sys.executable, "-m", "meshagent", "up", "--api-port", "0", "--data-dir", tmp]
        log = open(data / "agent.log", "wb")  # noqa: SIM115 - closed below
        proc = subprocess.Popen([*cmd, *args], stdout=log, stderr=log, env=os.environ.copy())
        try:
            deadline = time.monotonic() + timeout
            run_file = data / "agent.json"
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"agent exited: {(data / 'agent.log').read_text()[-2000:]}")
                if run_file.exists():
                    url = json.loads(run_file.read_text())["api"]
                    if httpx.get(f"{url}/health").status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError("agent did not start in time")
                time.sleep(0.1)
            yield url
        finally:
            proc.terminate()
            proc.wait(timeout=30)
            log.close()
