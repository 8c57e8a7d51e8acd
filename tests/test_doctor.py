"""`meshagent doctor` on real sockets and files: a busy port, a key file others can read and a
relay nobody answers at each fail with a one-line fix; a sound setup passes."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
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
    # ...and where the troubleshooting guide explains it.
    assert 'more: docs/troubleshooting.md, "My machine doesn\'t see the others"' in out.out


def test_every_check_points_to_a_section_the_guide_has():
    guide = (Path(__file__).resolve().parent.parent / "docs" / "troubleshooting.md").read_text()
    headings = {line[3:] for line in guide.splitlines() if line.startswith("## ")}
    assert set(doctor.TROUBLESHOOTING.values()) <= headings
    checks = {"ports", "mdns", "relay", "nat", "memory", "llama.cpp", "gpu", "secrets"}
    assert checks <= set(doctor.TROUBLESHOOTING)


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


def test_a_symmetric_nat_is_a_warning_with_what_the_user_can_change():
    config = AgentConfig(relays=("relay.example:9339",))
    relays = [{"address": "relay.example:9339", "registered": True}]

    def nat_finding(reach: dict) -> doctor.Finding:
        status = {"relays": relays, "listen": ["0.0.0.0:9338"], "reachability": reach}
        [f] = doctor.check_nat(doctor.Situation(DataDir(Path("/nonexistent")), config, status))
        return f

    f = nat_finding({"nat": "dependent", "public": [], "public_hosts": ["203.0.113.5"]})
    assert f.level == "warn" and "symmetric" in f.said and "203.0.113.5" in f.said
    assert "forward TCP port 9338" in f.fix and "UPnP" in f.fix and "--listen" in f.fix
    cone = nat_finding({"nat": "independent", "public": ["203.0.113.5:9338"]})
    assert cone.level == "ok" and "hole punched" in cone.said
    assert nat_finding({"nat": "none", "public": []}).level == "ok"
    # No relay, no agent: nothing to say.
    assert doctor.check_nat(doctor.Situation(DataDir(Path("/x")), AgentConfig(), None)) == []


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
    from meshagent.testing.tiny_gguf import quantize, write_tiny_model

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


@pytest.fixture
def fake_agent(tmp_path):
    """A process whose command line is an agent's, named by the data dir's run file."""
    started: list[subprocess.Popen] = []

    def start(root: Path, *args: str) -> subprocess.Popen:
        sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
        proc = subprocess.Popen([*sleeper, "up", "--data-dir", str(root), *args], cwd=tmp_path)
        started.append(proc)
        (root / "agent.json").write_text(json.dumps({"pid": proc.pid, "api": "http://127.0.0.1:9"}))
        return proc

    yield start
    for proc in started:
        proc.kill()
        proc.wait()


def secrets_found(findings: list[dict]) -> list[dict]:
    return [f for f in findings if f["check"] == "secrets" and f["level"] != "ok"]


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="no /proc on this host")
def test_keys_on_the_running_agents_command_line_are_warned_about(tmp_path, capsys, fake_agent):
    root = data_dir(tmp_path)
    proc = fake_agent(root, "--api-key", "hunter2-key", "--join=meshinv1sometoken")
    rc, findings = run_doctor(root, capsys)
    assert rc == 0  # a warning, not a failure
    warned = {f["said"].split("(")[2].split(")")[0]: f for f in secrets_found(findings)}
    assert set(warned) == {"--api-key", "--join"}, findings
    for f in warned.values():
        assert f"pid {proc.pid}" in f["said"] and "process list" in f["said"]
        assert "hunter2" not in f["said"] + f["fix"] and "\n" not in f["fix"]
    assert "--api-key-file" in warned["--api-key"]["fix"]
    assert "--join -" in warned["--join"]["fix"]


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="no /proc on this host")
def test_keys_from_a_file_or_standard_input_are_not_warned_about(tmp_path, capsys, fake_agent):
    root = data_dir(tmp_path)
    (tmp_path / "keys").write_text("a-key\n")
    (tmp_path / "keys").chmod(0o600)
    fake_agent(root, "--api-key", "-", "--api-key-file", "keys", "--join", "-")
    _, findings = run_doctor(root, capsys)
    assert secrets_found(findings) == []


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="no /proc on this host")
def test_a_key_file_others_can_read_is_warned_about_with_chmod(tmp_path, capsys, fake_agent):
    root = data_dir(tmp_path)
    keys = tmp_path / "keys"
    keys.write_text("a-key\n")
    keys.chmod(0o640)
    fake_agent(root, "--api-key-file", "keys")  # relative to the agent's directory
    _, findings = run_doctor(root, capsys)
    [f] = secrets_found(findings)
    assert f["level"] == "warn" and str(keys) in f["said"] and "mode 640" in f["said"]
    assert f["fix"] == f"chmod 600 {keys}"


@pytest.mark.parametrize("mode", [0o644, 0o600])
def test_a_config_holding_keys_others_can_read_is_warned_about(tmp_path, capsys, mode):
    root = data_dir(tmp_path, api_keys=["a-key"])
    config = root / "config.toml"
    config.chmod(mode)
    rc, findings = run_doctor(root, capsys)
    warned = secrets_found(findings)
    if mode == 0o600:
        assert warned == []
        return
    [f] = warned
    assert rc == 0 and "holds API keys" in f["said"] and f["fix"] == f"chmod 600 {config}"


def test_an_api_key_file_in_the_config_is_checked_too(tmp_path, capsys):
    keys = tmp_path / "keys"
    keys.write_text("a-key\n")
    keys.chmod(0o604)
    root = data_dir(tmp_path, api_key_file=str(keys))
    _, findings = run_doctor(root, capsys)
    [f] = secrets_found(findings)
    assert str(keys) in f["said"] and f["fix"] == f"chmod 600 {keys}"


def test_doctor_downloads_nothing_for_a_hub_model_named_in_the_config(
    tmp_path, monkeypatch, capsys
):
    from tests.models.fake_hub import FakeHub

    hub = FakeHub({"org/big-GGUF": {"big-Q4_K_M.gguf": b"GGUF" + bytes(64)}})
    try:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
        dd = tmp_path / "dd"
        dd.mkdir()
        (dd / "config.toml").write_text('model = "org/big-GGUF:Q4_K_M"\n')
        main(["doctor", "--data-dir", str(dd)])
        out = capsys.readouterr().out
        assert "org/big-GGUF:Q4_K_M is not on this machine yet" in out
        assert hub.requests == []  # doctor changes nothing: not even a download
    finally:
        hub.close()
