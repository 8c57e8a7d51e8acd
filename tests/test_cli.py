import subprocess
import sys

from meshagent.cli.main import main


def test_status_without_an_agent_says_so(tmp_path, capsys):
    assert main(["status", "--data-dir", str(tmp_path)]) == 1
    assert "no agent is running" in capsys.readouterr().err


def test_up_with_a_missing_model_fails_clearly(tmp_path, capsys):
    rc = main(["up", "--data-dir", str(tmp_path), "--model", str(tmp_path / "nope.gguf")])
    assert rc == 1
    assert "model file not found" in capsys.readouterr().err


def test_up_on_a_busy_port_fails_clearly(spawn_agent, tmp_path):
    agent = spawn_agent()
    port = agent.url.rsplit(":", 1)[1]
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "meshagent",
            "up",
            "--api-port",
            port,
            "--data-dir",
            str(tmp_path / "second"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1
    assert "already in use" in r.stderr


def test_status_of_a_running_agent(spawn_agent, capsys):
    agent = spawn_agent()
    assert main(["status", "--data-dir", str(agent.data_dir)]) == 0
    out = capsys.readouterr().out
    assert "SmolLM2-135M-Instruct" in out
    assert agent.url in out


def test_invite_needs_a_mesh_first(tmp_path, capsys):
    assert main(["invite", "--data-dir", str(tmp_path)]) == 1
    assert "meshagent up" in capsys.readouterr().err


def test_invite_carries_the_stored_secret_and_addresses(tmp_path, capsys):
    from meshagent.identity.mesh import decode_invite
    from meshagent.identity.mesh_file import load_or_create_mesh

    secret, how = load_or_create_mesh(tmp_path / "mesh.key")
    assert how == "created"
    args = ["invite", "--data-dir", str(tmp_path), "--address", "10.1.2.3:9338"]
    assert main(args) == 0
    invite = decode_invite(capsys.readouterr().out.strip())
    assert invite.secret == secret
    assert invite.bootstrap == ("10.1.2.3:9338",)
    assert main(["invite", "--data-dir", str(tmp_path), "--address", "nonsense"]) == 1
