"""Secrets given to a real agent: an API key from a file and an invite token on standard
input stay out of the process list, which every user of the host can read; the same secrets
as command-line values still work, and the agent's log and `meshagent doctor` say they show."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from meshagent.cli.main import main
from meshagent.identity.mesh import Invite, MeshSecret, encode_invite
from meshagent.identity.mesh_file import load_mesh
from meshagent.launch import AgentProcess, start_agent

KEY = "file-key-5c1d9e"
SMALL = ("--slots", "1", "--ctx-size", "512", "--threads", "1", "--no-mdns")

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/cmdline").exists(), reason="reads the process list from /proc"
)


def command_line(agent: AgentProcess) -> str:
    return Path(f"/proc/{agent.proc.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def secret_warnings(data_dir: Path, capsys) -> list[dict]:
    main(["doctor", "--data-dir", str(data_dir), "--json"])
    found = json.loads(capsys.readouterr().out)
    return [f for f in found if f["check"] == "secrets" and f["level"] != "ok"]


def assert_guarded_by(agent: AgentProcess, key: str) -> None:
    assert httpx.get(f"{agent.url}/v1/models", timeout=10).status_code == 401
    auth = {"authorization": f"Bearer {key}"}
    assert httpx.get(f"{agent.url}/v1/models", headers=auth, timeout=10).status_code == 200


def test_a_key_file_and_a_token_on_standard_input_stay_out_of_the_process_list(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.delenv("MESHAGENT_API_KEY", raising=False)
    keys = tmp_path / "keys"
    keys.write_text(KEY + "\n")
    keys.chmod(0o600)
    mesh = MeshSecret.generate()
    token = encode_invite(Invite(mesh))
    dd = tmp_path / "agent"
    agent = start_agent(
        dd, *SMALL, "--api-key-file", str(keys), "--join", "-", stdin=token, wait_model=False
    )
    try:
        assert KEY not in command_line(agent) and token not in command_line(agent)
        assert_guarded_by(agent, KEY)
        assert load_mesh(dd / "mesh.key") == mesh  # joined the invite's mesh
        assert "secret.on_command_line" not in agent.log_text()
        assert secret_warnings(dd, capsys) == []
    finally:
        agent.stop()


def test_secrets_as_command_line_values_still_work_and_are_warned_about(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.delenv("MESHAGENT_API_KEY", raising=False)
    mesh = MeshSecret.generate()
    token = encode_invite(Invite(mesh))
    dd = tmp_path / "agent"
    agent = start_agent(dd, *SMALL, "--api-key", KEY, "--join", token, wait_model=False)
    try:
        assert KEY in command_line(agent)  # what the warning is about
        assert_guarded_by(agent, KEY)
        assert load_mesh(dd / "mesh.key") == mesh
        log = agent.log_text()
        assert log.count("secret.on_command_line") == 2
        assert "--api-key-file" in log and "--join -" in log
        assert KEY not in log and token not in log
        warned = secret_warnings(dd, capsys)
        assert len(warned) == 2 and all("process list" in f["said"] for f in warned)
        assert all(KEY not in f["said"] + f["fix"] for f in warned)
    finally:
        agent.stop()
