"""`meshagent doctor` on real sockets and files: a busy port, a key file others can read and a
relay nobody answers at each fail with a one-line fix; a sound setup passes."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from meshagent import doctor
from meshagent.cli.main import main
from meshagent.config import AgentConfig, DataDir
from meshagent.identity.keys import NodeIdentity


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def data_dir(tmp_path: Path, **config: object) -> Path:
    root = tmp_path / "data"
    root.mkdir(mode=0o700)
    lines = {"api_port": 0, "listen": "127.0.0.1:0", **config}
    (root / "config.toml").write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in lines.items()))
    return root


def run_doctor(root: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, list[dict]]:
    rc = main(["doctor", "--data-dir", str(root), "--json"])
    return rc, json.loads(capsys.readouterr().out)


def failures(findings: list[dict]) -> list[dict]:
    return [f for f in findings if f["level"] == "fail"]


def test_a_sound_setup_passes(tmp_path, capsys):
    root = data_dir(tmp_path)
    NodeIdentity.generate().save(root / "identity.key")
    rc, findings = run_doctor(root, capsys)
    assert rc == 0, failures(findings)
    checks = {f["check"] for f in findings}
    assert {"data dir", "ports", "mdns", "relay", "llama.cpp", "gpu", "memory"} <= checks


def test_a_busy_port_is_named_with_a_fix(tmp_path, capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        root = data_dir(tmp_path, api_port=port)
        rc, findings = run_doctor(root, capsys)
    assert rc == 1
    [f] = failures(findings)
    assert f["check"] == "ports" and f"127.0.0.1:{port} is in use" in f["said"]
    assert "--api-port" in f["fix"] and "\n" not in f["fix"]


def test_a_key_file_others_can_read_fails_with_chmod(tmp_path, capsys):
    root = data_dir(tmp_path)
    key = root / "identity.key"
    NodeIdentity.generate().save(key)
    key.chmod(0o644)
    rc, findings = run_doctor(root, capsys)
    assert rc == 1
    [f] = failures(findings)
    assert "readable by other users" in f["said"] and f["fix"] == f"chmod 600 {key}"


def test_a_relay_that_cannot_be_reached_fails_with_a_fix(tmp_path, capsys):
    relay = f"127.0.0.1:{free_port()}"  # nothing listens there
    root = data_dir(tmp_path, relays=[relay])
    rc, findings = run_doctor(root, capsys)
    assert rc == 1
    [f] = failures(findings)
    assert f["check"] == "relay" and relay in f["said"] and "refused" in f["said"].lower()
    assert "meshagent relay" in f["fix"]


def test_the_text_report_prints_each_fix_and_exits_non_zero(tmp_path, capsys):
    relay = f"127.0.0.1:{free_port()}"
    root = data_dir(tmp_path, relays=[relay])
    assert main(["doctor", "--data-dir", str(root)]) == 1
    out = capsys.readouterr()
    assert f"FAIL  relay      the relay {relay} cannot be reached" in out.out
    assert "fix: check the address" in out.out and "1 problem(s)" in out.err


def test_ports_a_running_agent_holds_are_its_own():
    config = AgentConfig(api_port=9400, listen="0.0.0.0:9401")
    status = {"api": "http://127.0.0.1:9400", "listen": ["0.0.0.0:9401"]}
    s = doctor.Situation(DataDir(Path("/nonexistent")), config, status)
    found = doctor.check_ports(s)
    assert [f.level for f in found] == ["ok", "ok"]
    assert all("this agent's" in f.said for f in found)


def test_a_relay_the_agent_is_not_registered_at_is_a_warning():
    config = AgentConfig(relays=("relay.example:9339",))
    status = {"relays": [{"address": "relay.example:9339", "registered": False, "error": "x"}]}
    s = doctor.Situation(DataDir(Path("/nonexistent")), config, status)
    [f] = doctor.check_relays(s, connect=lambda host, port: None)
    assert f.level == "warn" and "not registered" in f.said


def test_llamas_tiled_kernels_turned_on_are_a_warning_with_the_fix(monkeypatch):
    from meshagent.engine.runtime import TILED_ENV

    def said() -> list[doctor.Finding]:
        return [f for f in doctor.check_build() if TILED_ENV in f.said]

    monkeypatch.setenv(TILED_ENV, "0")
    assert said() == []
    monkeypatch.setenv(TILED_ENV, "1")
    (warning,) = said()
    assert warning.level == doctor.WARN and warning.fix == f"unset {TILED_ENV}"


def test_repacked_weights_are_a_warning_with_what_they_turn_off(monkeypatch, tmp_path):
    import llama_cpp

    from meshagent.engine.runtime import REPACK_ENV
    from tests.engine.tiny_models import quantize, write_tiny_model

    f32 = write_tiny_model(tmp_path / "f32.gguf", "llama", n_layers=2, n_embd=256, n_ff=512)
    q4k = quantize(f32, tmp_path / "q4_k_m.gguf", llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M)
    monkeypatch.setattr("meshagent.engine.runtime.cpu_has_amx", lambda: False)
    monkeypatch.delenv(REPACK_ENV, raising=False)
    assert doctor.check_windows(q4k) == []  # agents load without repacking by default
    monkeypatch.setenv(REPACK_ENV, "1")
    (said,) = doctor.check_windows(q4k)
    assert said.level == doctor.WARN and said.check == "windows" and "Q4_K" in said.said
    assert said.fix == f"unset {REPACK_ENV}"
    assert doctor.check_windows(f32) == []  # f32 weights are never repacked
