"""Starting an agent as a child process and waiting for its API (tests, benchmarks, net-sim)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx


@dataclass
class AgentProcess:
    proc: subprocess.Popen
    data_dir: Path
    url: str

    @property
    def log_path(self) -> Path:
        return self.data_dir / "agent.log"

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def interrupt(self) -> None:
        self.proc.send_signal(signal.SIGINT)

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def start_agent(
    data_dir: Path, *args: str, timeout: float = 60.0, wait_model: bool = True
) -> AgentProcess:
    """Run `meshagent up` with `data_dir` on free loopback ports; return once /health answers
    (and, with `wait_model`, once the API lists a model it can serve)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    run_file = data_dir / "agent.json"
    run_file.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "meshagent", "up", "--api-port", "0", "--data-dir", str(data_dir)]
    if "--listen" not in args:
        cmd += ["--listen", "127.0.0.1:0"]
    log = open(data_dir / "agent.log", "wb")  # noqa: SIM115 - the child owns it
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([*cmd, *args], stdout=log, stderr=log, env=env)
    log.close()
    agent = AgentProcess(proc, data_dir, "")
    keys = [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--api-key"]
    auth = {"authorization": f"Bearer {keys[0]}"} if keys else {}
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"agent exited with {proc.returncode}:\n{agent.log_text()[-3000:]}")
        if run_file.exists():
            url = json.loads(run_file.read_text())["api"]
            try:
                healthy = httpx.get(f"{url}/health", timeout=2).status_code == 200
                if healthy and (
                    not wait_model
                    or httpx.get(f"{url}/v1/models", headers=auth, timeout=2).json()["data"]
                ):
                    agent.url = url
                    return agent
            except httpx.HTTPError:
                pass
        if time.monotonic() > deadline:
            agent.stop()
            raise RuntimeError(
                f"agent did not start within {timeout}s:\n{agent.log_text()[-3000:]}"
            )
        time.sleep(0.05)


def cpu_seconds(pid: int) -> tuple[float, float]:
    """CPU time (user + system) of a process: (its main thread, all its other threads).
    The main thread runs trio (HTTP, overlay, serving logic); the others are mostly
    llama.cpp compute, reached through trio.to_thread."""
    tick = os.sysconf("SC_CLK_TCK")
    main = other = 0.0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # a thread that just ended
        seconds = (int(fields[11]) + int(fields[12])) / tick
        if int(task.name) == pid:
            main += seconds
        else:
            other += seconds
    return main, other
