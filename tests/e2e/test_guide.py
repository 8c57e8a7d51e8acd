"""`docs/guide.md`, run as a user would: its commands, read from the guide verbatim, run on the
machines it names. Network namespaces stand in for the machines: three on one bridge for the
home network; for the internet part, a cloud machine with a public address and two laptops
each behind a NAT router (`meshagent/testing/nat_rules.py`). Each machine has a home folder of
its own (its data dir and files), and the virtual environment active.

What the user does by hand the test does where the guide says so: a token pasted where a
command reads one (`--join -`: the last `meshagent invite`'s), and the steps marked in the
guide by a `<!-- hands: ... -->` comment (Ctrl-C in an agent's terminal, a file copied to
another machine). Between steps it waits as a user would, until the agents agree on who is in
the mesh and the model is served; then it checks what each command printed. The commands and
what they printed are written to `guide-transcript.md` in the test's folder."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from meshagent.testing.nat_rules import ruleset
from meshagent.testing.tiny_gguf import write_tiny_model
from tests.e2e.netns import Lab, require_netns, wait_until
from tests.e2e.test_netns_nat import _require_nft
from tests.models.fake_hub import FakeHub

pytestmark = pytest.mark.slow

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guide.md"
MODEL = "SmolLM2-135M-Instruct.Q4_1"
LONG_RUNNING = ("up", "relay")  # `meshagent` commands that run until Ctrl-C


@dataclass
class Step:
    section: str  # the `##` heading it is under
    kind: str  # "sh", "python" or "hands"
    where: str  # a machine's name, "each machine" or "every machine"; for hands, the action
    text: str
    shows: str = ""  # the `text` box after it: what the guide says it prints


def read_guide(text: str) -> list[Step]:
    """The guide's steps in order: its `sh` and `python` boxes (each starts with `# on WHERE`)
    and its `<!-- hands: ... -->` comments."""
    steps: list[Step] = []
    section = ""
    lines = iter(text.splitlines())
    for line in lines:
        if line.startswith("## "):
            section = line[3:].strip()
        elif m := re.fullmatch(r"<!-- hands: (.+) -->", line.strip()):
            steps.append(Step(section, "hands", m.group(1), ""))
        elif line.startswith("```"):
            lang = line[3:].strip()
            body = []
            for inner in lines:
                if inner.startswith("```"):
                    break
                body.append(inner)
            if lang == "text":  # what the command before prints
                assert steps and steps[-1].kind != "hands" and not steps[-1].shows
                steps[-1].shows = "\n".join(body)
                continue
            assert lang in ("sh", "python"), f"a box of {lang!r} in the guide: sh or python"
            m = re.fullmatch(r"# on (.+)", body[0] if body else "")
            assert m, f"every command box starts with `# on MACHINE`: {body[:1]}"
            steps.append(Step(section, lang, m.group(1), "\n".join(body[1:]).strip()))
    return steps


def _long_running(command: str) -> bool:
    words = shlex.split(command)
    return words[:1] == ["meshagent"] and len(words) > 1 and words[1] in LONG_RUNNING


@dataclass
class Machine:
    name: str
    ns: str
    home: Path
    agent: subprocess.Popen | None = None
    relay: subprocess.Popen | None = None
    logs: list[Path] = field(default_factory=list)

    @property
    def data_dir(self) -> Path:
        return self.home / ".local" / "share" / "meshagent"


class Guide:
    """Runs the guide's steps on the machines of the part under way."""

    def __init__(self, lab: Lab, root: Path) -> None:
        self.lab = lab
        self.root = root
        self.machines: dict[str, Machine] = {}
        self.invite = ""
        self.transcript: list[str] = []
        self.outputs: dict[str, list[str]] = {}  # command -> what it printed, run after run

    # ----- machines -----

    def machine(self, name: str, ns: str) -> Machine:
        home = self.root / name
        home.mkdir(parents=True, exist_ok=True)
        venv = home / ".venv"
        if not venv.exists():
            venv.symlink_to(Path(sys.prefix))  # the README's install, already done
        m = self.machines[name] = Machine(name, ns, home)
        return m

    def env(self, m: Machine) -> dict[str, str]:
        keep = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("MESHAGENT_", "XDG_", "HF_", "OPENAI_", "OLLAMA_"))
        }
        return {
            **keep,
            "HOME": str(m.home),
            "PATH": f"{Path(sys.prefix) / 'bin'}:{os.environ.get('PATH', '/usr/bin:/bin')}",
            "VIRTUAL_ENV": sys.prefix,
            "PYTHONUNBUFFERED": "1",
            # pip finds what the guide installs already installed; it has no index to ask here
            "PIP_NO_INDEX": "1",
            "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        }

    def _argv(self, m: Machine, *cmd: str) -> list[str]:
        return ["ip", "netns", "exec", m.ns, *cmd] if m.ns else list(cmd)

    # ----- steps -----

    def run(self, step: Step) -> None:
        if step.kind == "hands":
            self.hands(step.where)
            return
        if step.where == "every machine":
            targets = list(self.machines.values())
        elif step.where == "each machine":
            targets = [m for m in self.machines.values() if m.agent is not None]
        else:
            targets = [self.machines[step.where]]
        for m in targets:
            if step.kind == "sh" and _long_running(step.text):
                self.start(m, step.text)
            else:
                self.settle()
                self.once(m, step)

    def start(self, m: Machine, command: str) -> None:
        assert "\n" not in command, f"a command that keeps running has a box of its own: {command}"
        words = shlex.split(command)
        log = self.root / f"{m.name}-{words[1]}-{len(m.logs)}.log"
        m.logs.append(log)
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                self._argv(m, "bash", "-c", f"exec {command}"),
                cwd=m.home,
                env=self.env(m),
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=out,
            )
        if "--join" in words and words[words.index("--join") + 1] == "-":
            assert self.invite, "a --join - before any `meshagent invite`"
            proc.stdin.write(self.invite.encode() + b"\n")  # pasted
        proc.stdin.close()
        self.transcript.append(f"## {m.name}\n$ {command}\n(runs; log {log.name})\n")

        def ready() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"{command} on {m.name} exited:\n{log.read_text()[-3000:]}")
            text = log.read_text(errors="replace")
            if words[1] == "relay":
                return '"relay.started"' in text
            return '"agent.ready"' in text and (m.data_dir / "agent.json").exists()

        wait_until(ready, 120, f"{command} on {m.name} ready")
        if words[1] == "relay":
            m.relay = proc
        else:
            assert m.agent is None, f"{m.name} already runs an agent: the guide stops it first"
            m.agent = proc

    def once(self, m: Machine, step: Step) -> str:
        if step.kind == "python":
            script = m.home / "step.py"
            script.write_text(step.text + "\n")
            argv = self._argv(m, str(Path(sys.prefix) / "bin" / "python"), str(script))
        else:
            argv = self._argv(m, "bash", "-e", "-c", step.text)
        r = subprocess.run(
            argv, cwd=m.home, env=self.env(m), capture_output=True, text=True, timeout=300
        )
        self.transcript.append(f"## {m.name}\n$ {step.text}\n{r.stdout}{r.stderr}\n")
        assert r.returncode == 0, f"on {m.name}: {step.text}\n{r.stdout}\n{r.stderr}"
        if step.text.strip() == "meshagent invite":
            self.invite = r.stdout.strip()
            assert self.invite.startswith("meshinv1")
            assert step.shows.startswith("meshinv1") or not step.shows
        else:
            _shows_alike(step.shows, r.stdout + r.stderr)
        self.outputs.setdefault(step.text, []).append(r.stdout)
        return r.stdout

    def hands(self, action: str) -> None:
        words = action.split()
        if words[0] == "ctrl-c":
            m = self.machines[words[1]]
            assert m.agent is not None, f"no agent runs on {m.name} to stop"
            m.agent.send_signal(signal.SIGINT)
            assert m.agent.wait(timeout=60) == 0, f"{m.name}'s agent exited badly after Ctrl-C"
            m.agent = None
        elif words[0] == "copy":
            (src_m, src), (dst_m, dst) = (w.split(":", 1) for w in words[1:3])
            source, target = self.machines[src_m].home / src, self.machines[dst_m].home / dst
            target.write_bytes(source.read_bytes())
            target.chmod(source.stat().st_mode & 0o777)
        else:
            raise AssertionError(f"the test does not know the hand step {action!r}")
        self.transcript.append(f"(by hand: {action})\n")

    # ----- waiting as a user would -----

    def _control(self, m: Machine, path: str) -> dict:
        """The agent's control API, from inside its machine (the API is on its loopback)."""
        url = json.loads((m.data_dir / "agent.json").read_text())["api"]
        key = m.home / "api-key"  # the key the guide gives an agent, where it gives one
        env = {**os.environ, "MESHAGENT_API_KEY": key.read_text().strip()} if key.exists() else None
        r = subprocess.run(
            self._argv(m, sys.executable, "-c", _GET, url + path, str(m.data_dir)),
            capture_output=True,
            text=True,
            timeout=30,
            env=env,
        )
        return json.loads(r.stdout) if r.returncode == 0 else {}

    def running(self) -> list[Machine]:
        return [m for m in self.machines.values() if m.agent is not None]

    def settled(self) -> bool:
        """Each running agent sees exactly the running agents alive, and where two or more
        run, the model is served (split) from every one of them."""
        running = self.running()
        if not running:
            return True
        names = {m.name for m in running}
        for m in running:
            peers = self._control(m, "/control/peers")
            alive = {p["name"] for p in peers.get("peers", []) if p["state"] == "alive"}
            if alive != names:
                return False
            if len(running) < 2:
                continue
            placed = self._control(m, "/control/status").get("placement", {}).get(MODEL) or {}
            if not (placed.get("routable") and len(placed.get("stages", [])) >= 2):
                return False
        return True

    def settle(self) -> None:
        wait_until(self.settled, 180, "the mesh settled: every agent sees the others, split")


def _shows_alike(shown: str, printed: str) -> None:
    """What the guide shows a command print reads like what it printed: each line the guide
    shows starts with the word that one of the printed lines starts with (the row labels of
    `status`, the peers' names and the table's header, a JSON body's first key); ids,
    addresses and timings differ from run to run."""
    starts = {line.split()[0] for line in printed.splitlines() if line.split()}
    for line in shown.splitlines():
        if line.split():
            assert line.split()[0] in starts, f"the guide shows {line!r}; it printed:\n{printed}"


# A control GET from inside a namespace, with the data dir's API key where it has one.
_GET = """
import json, sys, httpx
from pathlib import Path
from meshagent.cli.common import auth_headers
from meshagent.config import DataDir
r = httpx.get(sys.argv[1], headers=auth_headers(DataDir(Path(sys.argv[2]))), timeout=20)
print(json.dumps(r.json()))
"""


def _answers(outputs: list[str]) -> list[str]:
    return [json.loads(o)["choices"][0]["message"]["content"] for o in outputs]


def _home_network(guide: Guide, lab: Lab) -> None:
    bridge = lab.bridge()
    for name, ip in (
        ("laptop-a", "192.168.1.10"),
        ("laptop-b", "192.168.1.11"),
        ("desktop", "192.168.1.30"),
    ):
        ns = lab.ns(name)
        lab.attach(ns, bridge, f"{ip}/24")
        guide.machine(name, ns)


def _internet(guide: Guide, lab: Lab) -> None:
    """`cloud` at 203.0.113.10 on the internet (a router namespace); `home` at 192.168.1.10
    behind a NAT whose public address is 198.51.100.7, `office` at 10.0.0.20 behind one at
    192.0.2.44. Both NATs map by endpoint, filter by address and port (port-restricted cone),
    as most home routers do."""
    internet = lab.ns("net")
    lab.sysctl(internet, "net.ipv4.ip_forward", "1")
    cloud = lab.ns("cloud")
    lab.link(cloud, "eth0", "203.0.113.10/24", internet, "rc", "203.0.113.1/24")
    lab.run(cloud, "ip", "route", "add", "default", "via", "203.0.113.1")
    guide.machine("cloud", cloud)
    for name, public, lan, host in (
        ("home", "198.51.100.7", "192.168.1", "192.168.1.10"),
        ("office", "192.0.2.44", "10.0.0", "10.0.0.20"),
    ):
        router, laptop = lab.ns(f"{name}gw"), lab.ns(name)
        gateway = public.rsplit(".", 1)[0] + ".1"
        lab.link(router, "wan", f"{public}/24", internet, f"r{name}", f"{gateway}/24")
        lab.link(laptop, "eth0", f"{host}/24", router, "lan", f"{lan}.1/24")
        lab.sysctl(router, "net.ipv4.ip_forward", "1")
        lab.run(router, "ip", "route", "add", "default", "via", gateway)
        lab.run(laptop, "ip", "route", "add", "default", "via", f"{lan}.1")
        rules = guide.root / f"{name}.nft"
        rules.write_text(ruleset("port-restricted", outside="wan", inside="lan", host=host))
        lab.run(router, "nft", "-f", str(rules))
        guide.machine(name, laptop)


def _direct_between_laptops(guide: Guide) -> bool:
    home, office = guide.machines["home"], guide.machines["office"]
    peers = guide._control(home, "/control/peers").get("peers", [])
    row = next((p for p in peers if p["name"] == office.name), None)
    return bool(row and row["path"] == "direct")


def test_the_guide_runs_as_written(tmp_path: Path):
    require_netns()
    _require_nft()
    steps = read_guide(GUIDE.read_text())
    sections = list(dict.fromkeys(s.section for s in steps))
    assert sections == [
        "Before you start",
        "One network: three machines at home",
        "Across the internet: two laptops and a cloud machine",
        "Your own model",
    ], sections
    parts = {s: [x for x in steps if x.section == s] for s in sections}
    chat = next(s.text for s in steps if "/v1/chat/completions" in s.text)
    transcript = tmp_path / "guide-transcript.md"
    said: list[str] = []  # the transcript of every part so far
    answers: list[str] = []

    # The home network, and what every machine does before it starts.
    lab = Lab(tmp_path)
    guide = Guide(lab, tmp_path / "home-network")
    try:
        _home_network(guide, lab)
        for step in parts["Before you start"] + parts["One network: three machines at home"]:
            guide.run(step)
        peers = guide.outputs["meshagent peers"]
        assert all(name in peers[0] for name in ("laptop-a", "laptop-b", "desktop")), peers[0]
        assert "dead" in peers[-1] and "desktop" in peers[-1], peers[-1]
        assert "split" in guide.outputs["meshagent status"][0]
        answers += _answers(guide.outputs[chat])
        assert len(answers) == 3 and answers[0], answers
        tags = json.loads(guide.outputs["curl -s http://127.0.0.1:11434/api/tags"][0])
        (tag,) = [t for t in tags["models"] if t["name"] == MODEL]
        assert tag["size"] > 0 and tag["details"]["family"] == "llama", tag
        spoken = [v[0] for k, v in guide.outputs.items() if k.startswith(("import", "from"))]
        assert len(spoken) == 2 and all(x.strip() for x in spoken), spoken
    finally:
        said += guide.transcript
        transcript.write_text("\n".join(said))
        _stop(guide)
        lab.close()

    # Across the internet: the same model and prompt, the same answer.
    lab = Lab(tmp_path)
    guide = Guide(lab, tmp_path / "internet")
    try:
        _internet(guide, lab)
        for step in parts["Across the internet: two laptops and a cloud machine"]:
            if step.text == "meshagent peers":
                # the user looks once the laptops have punched through (the relay's
                # introduction, then a try every few seconds)
                wait_until(lambda: _direct_between_laptops(guide), 90, "home-office direct")
            guide.run(step)
        peers = guide.outputs["meshagent peers"][0]
        assert all(name in peers for name in ("cloud", "home", "office")), peers
        assert "relayed" not in peers, peers
        far = _answers(guide.outputs[chat])
        assert far == [answers[0]] * 3, (far, answers)
        assert answers == [answers[0]] * 3, answers
    finally:
        said += guide.transcript
        transcript.write_text("\n".join(said))
        _stop(guide)
        lab.close()

    # A hub model: `models inspect` reads its header only (a hub on this host's loopback).
    (inspect,) = parts["Your own model"]
    name = shlex.split(inspect.text)[-1]
    repo, quant = name.rsplit(":", 1)
    file = f"{repo.split('/')[1].removesuffix('-GGUF')}-{quant}.gguf"
    model = write_tiny_model(tmp_path / file, "qwen2", n_layers=8, n_embd=256, n_head=8, n_ff=1024)
    hub = FakeHub({repo: {file: model.read_bytes()}})
    try:
        guide = Guide(lab, tmp_path / "own-model")
        m = guide.machine(inspect.where, "")
        env = {**guide.env(m), "HF_ENDPOINT": hub.url}
        r = subprocess.run(
            ["bash", "-e", "-c", inspect.text], cwd=m.home, env=env, capture_output=True,
            text=True, timeout=120,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        assert "architecture   qwen2" in r.stdout and "split          yes" in r.stdout
        assert 0 < hub.served < model.stat().st_size / 100
    finally:
        hub.close()


def _stop(guide: Guide) -> None:
    for m in guide.machines.values():
        for p in (m.agent, m.relay):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
    for m in guide.machines.values():
        for p in (m.agent, m.relay):
            if p is not None:
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    p.kill()


def test_every_command_box_of_the_guide_names_its_machine():
    # Runs anywhere: the guide's boxes parse, and none is skipped by the test above.
    steps = read_guide(GUIDE.read_text())
    names = {"laptop-a", "laptop-b", "desktop", "cloud", "home", "office"}
    assert {s.where for s in steps if s.kind != "hands"} <= names | {
        "each machine",
        "every machine",
    }
    for s in steps:
        if s.kind == "sh" and _long_running(s.text):
            assert "\n" not in s.text
    assert sum(1 for s in steps if s.kind == "hands") >= 3
    # the guide shows what the commands a user looks at print
    shown = {s.text for s in steps if s.shows}
    assert {"meshagent peers", "meshagent status", "meshagent invite", "meshagent doctor"} <= {
        line for t in shown for line in t.splitlines()
    }
