"""Starting an agent as a child process and waiting for its API (tests, benchmarks, net-sim)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
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
        return self.wait_stopped(timeout)

    def wait_stopped(self, timeout: float = 30.0) -> int:
        """Its exit code once it stopped (told to already: a second SIGTERM would cut its
        drain short), killed after `timeout` seconds."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def start_agent(
    data_dir: Path,
    *args: str,
    timeout: float = 60.0,
    wait_model: bool = True,
    env: Mapping[str, str] | None = None,
    stdin: str | None = None,
    launcher: Sequence[str] = (),
) -> AgentProcess:
    """Run `meshagent up` with `data_dir` on free loopback ports; return once /health answers
    (and, with `wait_model`, once the API lists a model some agent serves). `env` adds to the
    environment; `stdin` is written to the agent's standard input (`--join -`); `launcher`
    replaces `python -m meshagent` (a script that runs the CLI, `bench/profiled_agent.py`)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    run_file = data_dir / "agent.json"
    run_file.unlink(missing_ok=True)
    cli = list(launcher) or [sys.executable, "-m", "meshagent"]
    cmd = [*cli, "up", "--api-port", "0", "--data-dir", str(data_dir)]
    if "--listen" not in args:
        cmd += ["--listen", "127.0.0.1:0"]
    log = open(data_dir / "agent.log", "wb")  # noqa: SIM115 - the child owns it
    environ = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [*cmd, *args],
        stdout=log,
        stderr=log,
        env=environ,
        stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE,
    )
    log.close()
    if stdin is not None:
        assert proc.stdin is not None
        proc.stdin.write(stdin.encode())
        proc.stdin.close()
    agent = AgentProcess(proc, data_dir, "")
    key = api_key_of(args, environ, stdin)
    auth = {"authorization": f"Bearer {key}"} if key else {}
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
                    or _serves(httpx.get(f"{url}/v1/models", headers=auth, timeout=2).json())
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


def _serves(models: dict) -> bool:
    """Whether `/v1/models` lists a model some agent serves (not only catalogued)."""
    return any(card.get("meshagent", {}).get("loaded", True) for card in models["data"])


def api_key_of(args: Sequence[str], environ: Mapping[str, str], stdin: str | None) -> str | None:
    """A key the agent `up ARGS` asks clients for, wherever it was given: `--api-key KEY`
    (`-`: standard input), `--api-key-file PATH`, or $MESHAGENT_API_KEY."""
    for i, a in enumerate(args):
        flag, _, value = a.partition("=")
        if not value and i + 1 < len(args):
            value = args[i + 1]
        if flag == "--api-key" and value:
            if value != "-":
                return value
            if stdin and stdin.strip():
                return stdin.split()[0]
        if flag == "--api-key-file" and value:
            keys = Path(value).read_text().split()
            if keys:
                return keys[0]
    return environ.get("MESHAGENT_API_KEY") or None


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
