import socket
import subprocess
import sys
from contextlib import contextmanager

import httpx
import pytest

from meshagent.cli.main import main


def test_status_without_an_agent_says_so(tmp_path, capsys):
    assert main(["status", "--data-dir", str(tmp_path)]) == 1
    assert "no agent is running" in capsys.readouterr().err


def test_up_with_a_missing_model_fails_clearly(tmp_path, capsys):
    rc = main(
        [
            "up",
            "--data-dir",
            str(tmp_path),
            "--api-port",
            "0",
            "--listen",
            "127.0.0.1:0",
            "--model",
            str(tmp_path / "nope.gguf"),
        ]
    )
    assert rc == 1
    assert "model file not found" in capsys.readouterr().err


@contextmanager
def listening_port():
    """A port something else listens on, as another agent would."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_up_on_a_busy_port_fails_clearly(tmp_path):
    with listening_port() as port:
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "meshagent",
                "up",
                "--api-port",
                str(port),
                "--data-dir",
                str(tmp_path / "second"),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert r.returncode == 1
    assert "already in use" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("flag", ["--api-port", "--listen"])
def test_a_busy_port_is_refused_before_the_model_is_read(flag, tmp_path, capsys):
    # The model does not exist: only an agent that checks its ports first says "in use".
    with listening_port() as port:
        ports = {"--api-port": "0", "--listen": "127.0.0.1:0"}
        ports[flag] = str(port) if flag == "--api-port" else f"127.0.0.1:{port}"
        args = [x for kv in ports.items() for x in kv]
        rc = main(["up", "--data-dir", str(tmp_path), *args, "--model", str(tmp_path / "no.gguf")])
    assert rc == 1
    err = capsys.readouterr().err
    assert f"127.0.0.1:{port} is already in use" in err
    assert f"choose another {flag}" in err
    assert "model file not found" not in err


def test_status_of_a_running_agent(spawn_agent, model_id, capsys):
    agent = spawn_agent()
    assert main(["status", "--data-dir", str(agent.data_dir)]) == 0
    out = capsys.readouterr().out
    assert "SmolLM2-135M-Instruct" in out
    assert agent.url in out
    # The mesh's catalogue, seeded with the embedded default, which the agent pins.
    assert "model     SmolLM2-135M-Instruct.Q4_1  placed on " in out and "pinned" in out
    assert "drafts    " not in out
    assert "speculation auto by default; windows exact: a window's logits equal one-token" in out
    # A request served with speculation shows in the model's totals.
    prompt = "one two three four five six seven eight; one two three four five six seven eight;"
    body = {"model": model_id, "prompt": prompt, "max_tokens": 24, "temperature": 0}
    body["meshagent"] = {"speculation": "on"}
    usage = httpx.post(f"{agent.url}/v1/completions", json=body, timeout=120).json()["usage"]
    accepted = usage["meshagent"]["speculation"]["accepted"]
    assert main(["status", "--data-dir", str(agent.data_dir)]) == 0
    out = capsys.readouterr().out
    assert f"drafts    {usage['meshagent']['speculation']['windows']} windows, {accepted} of" in out
    [steps] = [x for x in out.splitlines() if x.startswith("steps     ")]
    assert " decode steps timed (" in steps and "a window of n tokens costs 1 + " in steps


def test_an_agent_that_cannot_serve_its_model_says_why(spawn_agent, capsys):
    # Alone with too little memory for the model: `up` and `status` both say it is not
    # served, and why (not only `status --json`), and `up` said where the API is.
    from tests.e2e.agents import wait_for

    agent = spawn_agent("--max-memory", "80M", wait_model=False)
    log = agent.data_dir / "agent.log"
    model = "SmolLM2-135M-Instruct.Q4_1"
    wait_for(lambda: "is not served: " in log.read_text(errors="replace"), timeout=60)
    said = log.read_text(errors="replace")
    assert f"meshagent: API at {agent.url}/v1 (console: {agent.url}/console); serving " in said
    assert "meshagent: serving" not in said
    assert said.count(f"meshagent: {model} is not served") == 1  # not the empty mesh at start
    assert main(["status", "--data-dir", str(agent.data_dir)]) == 0
    out = capsys.readouterr().out
    [line] = [x for x in out.splitlines() if x.startswith("placement ")]
    assert line.startswith(f"placement {model} is not served: ")
    reason = line.split("is not served: ", 1)[1]
    # ...and so do the `up` line, the log, `meshagent peers` and the API, in the same words
    # (`wording.not_served`).
    assert f"meshagent: {model} is not served: {reason}" in said
    assert "placement.not_served" in said and reason in said.split("placement.not_served")[-1]
    assert main(["peers", "--data-dir", str(agent.data_dir)]) == 0
    assert f"{model} is not served: {reason}" in capsys.readouterr().out
    body = {"model": model, "prompt": "hi", "max_tokens": 2}
    r = httpx.post(f"{agent.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 503 and r.json()["error"]["code"] == "model_not_served"
    assert r.json()["error"]["message"] == f"The model {model} is not served: {reason}"


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


async def test_an_agent_that_joined_but_reached_no_one_says_what_to_try(autojump_clock):
    from meshagent.discovery.alone import watch_alone

    said: list[str] = []
    await watch_alone(list, ("10.1.2.3:9338",), ("r.lan:9339",), said.append)  # none in 30 s
    [note] = said
    assert note.startswith("alone for 30 s: no peer of the mesh answered")
    assert "10.1.2.3:9338" in note and "r.lan:9339" in note and "--address HOST:PORT" in note
    await watch_alone(lambda: ["a peer"], ("10.1.2.3:9338",), (), said.append)  # one answered
    assert len(said) == 1
    await watch_alone(list, (), (), said.append)
    assert "none (the invite carries no address)" in said[-1]


def test_an_agent_alone_says_so_in_its_log_status_peers_and_up(spawn_agent, capsys):
    # Told of a peer where nothing listens: after 30 s each place says it is alone.
    import socket

    from tests.e2e.agents import wait_for

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        nowhere = f"127.0.0.1:{s.getsockname()[1]}"
    agent = spawn_agent("--peer", nowhere, "--slots", "1", "--ctx-size", "256")
    log = agent.data_dir / "agent.log"
    wait_for(lambda: "meshagent: alone for 30 s" in log.read_text(errors="replace"), 60)
    said = log.read_text(errors="replace")
    assert "mesh.alone" in said and nowhere in said.split("meshagent: alone")[1]
    assert main(["status", "--data-dir", str(agent.data_dir)]) == 0
    [line] = [x for x in capsys.readouterr().out.splitlines() if x.startswith("ALONE")]
    assert nowhere in line and "meshagent invite --address" in line
    assert main(["peers", "--data-dir", str(agent.data_dir)]) == 0
    assert f"The addresses tried: {nowhere}" in capsys.readouterr().out


def test_invite_before_the_agent_runs_carries_the_configured_listen_port(tmp_path, capsys):
    from meshagent.identity.mesh import decode_invite
    from meshagent.identity.mesh_file import load_or_create_mesh

    load_or_create_mesh(tmp_path / "mesh.key")
    (tmp_path / "config.toml").write_text('listen = "0.0.0.0:9555"\n')
    assert main(["invite", "--data-dir", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    invite = decode_invite(out.strip())
    assert invite.bootstrap and all(a.endswith(":9555") for a in invite.bootstrap)
    assert "no agent is running yet" in err and "9555" in err
    # A port picked at each start cannot be known before: no address, and says so.
    (tmp_path / "config.toml").write_text('listen = "0.0.0.0:0"\n')
    assert main(["invite", "--data-dir", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert decode_invite(out.strip()).bootstrap == ()
    assert "--address HOST:PORT" in err


def test_invite_of_loopback_addresses_only_warns(tmp_path, capsys):
    from meshagent.identity.mesh import decode_invite
    from meshagent.identity.mesh_file import load_or_create_mesh

    load_or_create_mesh(tmp_path / "mesh.key")
    (tmp_path / "config.toml").write_text(
        'listen = "127.0.0.1:9555"\naddresses = ["198.51.100.4:19555"]\n'
    )
    assert main(["invite", "--data-dir", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    # `addresses` (--address) come first; with one that is not loopback, no warning.
    assert decode_invite(out.strip()).bootstrap == ("198.51.100.4:19555", "127.0.0.1:9555")
    assert "only loopback" not in err
    (tmp_path / "config.toml").write_text('listen = "127.0.0.1:9555"\n')
    assert main(["invite", "--data-dir", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert decode_invite(out.strip()).bootstrap == ("127.0.0.1:9555",)
    assert "only loopback addresses (127.0.0.1:9555)" in err and "--listen 0.0.0.0" in err
    # A relay in the token is a way in: no warning then.
    assert main(["invite", "--data-dir", str(tmp_path), "--relay", "r.example:9339"]) == 0
    assert "only loopback" not in capsys.readouterr().err


def _options(parser, path=("meshagent",)):
    """Every option of `meshagent` and its subcommands, with the command it belongs to."""
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _options(sub, (*path, name))
        elif not isinstance(action, argparse._HelpAction):
            yield " ".join(path), action


def test_every_option_has_help_and_a_metavar_of_its_own():
    # argparse's default metavar is the option's name in capitals (--api-host API_HOST): each
    # option that takes a value names what it takes (HOST, PORT, SIZE, PATH...).
    from meshagent.cli.main import build_parser

    seen = 0
    for command, action in _options(build_parser()):
        where = f"{command} {'/'.join(action.option_strings) or action.dest}"
        assert action.help, f"{where} has no help"
        takes_value = action.option_strings and action.nargs != 0 and not action.choices
        if takes_value:
            assert action.metavar is not None, f"{where} shows argparse's default metavar"
        seen += 1
    assert seen > 60  # every subcommand was walked


def test_every_command_but_two_takes_a_data_dir():
    # docs/cli.md, "Data dir": --data-dir on every command but `models pull` and `relay`.
    import argparse

    from meshagent.cli.main import build_parser

    def leaves(parser, path=()):
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            yield " ".join(path), parser
        for action in subs:
            for name, sub in action.choices.items():
                yield from leaves(sub, (*path, name))

    without = {
        command
        for command, parser in leaves(build_parser())
        if not any("--data-dir" in a.option_strings for a in parser._actions)
    }
    assert without == {"models pull", "relay"}
