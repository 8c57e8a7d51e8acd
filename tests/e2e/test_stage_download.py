"""Three agents too small for a model they do not hold, started by its hub name: each
downloads its header (those that join, without the tokenizer a peer tells them where to find)
and then only its stage's byte ranges, within 5% of its slice in all; cuts artifacts
byte-identical to those cut from the whole file; and the split gives the whole model's greedy
text. A fourth agent joining as a spare fetches the slices from the peers that hold them, not
the hub."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from meshagent.config import DataDir
from meshagent.launch import start_agent
from meshagent.models.artifacts import ArtifactStore, artifact_key
from tests.e2e.agents import invite, status, wait_for
from tests.e2e.test_split_serving import SMALL, WHOLE
from tests.models.fake_hub import FakeHub

NAME = "org/smol-GGUF:Q4_1"
PROMPT = "Name three rivers in Europe."


@pytest.fixture
def hub(model_path, monkeypatch, tmp_path):
    server = FakeHub({"org/smol-GGUF": {model_path.name: model_path.read_bytes()}})
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))  # empty: nothing cached
    yield server
    server.close()


def _key(m: dict) -> str:
    return artifact_key(m["source_sha256"], m["kind"], m["start"], m["end"])


def _greedy(agent, model_id: str) -> str:
    body = {
        "model": model_id,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 24,
        "temperature": 0,
    }
    r = httpx.post(f"{agent.url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_stage_hosts_download_only_their_layers(
    hub, spawn_agent, model_id, model_path, tmp_path, monkeypatch
):
    a = spawn_agent(*SMALL, "--model", NAME, name="a", wait_model=False)
    token = invite(a)
    b = spawn_agent(*SMALL, "--model", NAME, "--join", token, name="b", wait_model=False)
    # c holds, from before, the layers artifact of the whole model (bigger than its part will
    # be): no plan needs it here, and once the split serves it is deleted.
    old, _ = ArtifactStore(DataDir(tmp_path / "c").artifacts_path).ensure_layers(model_path, 0, 30)
    c = spawn_agent(*SMALL, "--model", NAME, "--join", token, name="c", wait_model=False)
    agents = [a, b, c]
    assert "downloads the header now, and only the layers" in a.log_text()

    def routable():
        return all(status(x)["placement"][model_id]["routable"] for x in agents)

    wait_for(routable, timeout=180)

    # The prune deletes, then logs, on a worker thread: a status request answered meanwhile
    # sees the deletion before the line is written. Wait for both.
    def pruned() -> bool:
        gone = not any(m["end"] - m["start"] == 30 for m in status(c)["artifacts"])
        return gone and "artifact.pruned" in c.log_text()

    wait_for(pruned, 30)
    assert not old.exists()
    size = model_path.stat().st_size
    reference = ArtifactStore(tmp_path / "reference")
    for x in agents:
        st = status(x)
        d = st["download"]
        assert d["size_bytes"] == size and not d["complete"]
        assert d["fetching"] == []  # every download is over once the split routes
        held = st["artifacts"]
        assert held, x.data_dir.name
        # Byte-identical to the artifacts cut from the whole file.
        for m in held:
            if m["kind"] == "entry":
                _, r = reference.ensure_entry(model_path)
            else:
                _, r = reference.ensure_layers(model_path, m["start"], m["end"])
            assert m["sha256"] == r.sha256 and m["source_sha256"] == r.source_sha256
        slice_bytes = sum(m["size_bytes"] for m in held)
        fetched = d["fetched_from_hub_bytes"]
        header = d["header_fetched_bytes"]
        parts = [(m["kind"], m["start"], m["end"]) for m in held]
        print(
            f"{x.data_dir.name} {parts}: fetched {fetched} B (header {header} B), "
            f"slice {slice_bytes} B, file {size} B"
        )
        # Everything it fetched, header included, within 5% of its slice. The first agent
        # read the whole header (1.8 MB of it tokenizer); the two that joined it asked it
        # where the tokenizer lies and fetched the header without it, and the tokenizer
        # only for a first or last stage, which carries it. Which stage the first agent
        # holds follows from the random identities: a middle one carries no tokenizer, and
        # its header then comes on top of its slice.
        n_layers = status(x)["placement"][model_id]["stages"][-1][2]
        carries = any(m["kind"] == "entry" or m["end"] == n_layers for m in held)
        expect = slice_bytes + (header if x is a and not carries else 0)
        assert 0.95 * expect <= fetched <= 1.05 * expect
        assert fetched < 0.6 * size
        if x is a:
            assert d["header_bytes"] <= header <= d["header_bytes"] * 1.5
        else:
            assert header < 0.05 * d["header_bytes"]
        assert set(d["artifacts"].values()) == {"unverified"}  # no peer had published them
        assert '"percent": 100' in x.log_text()  # a stage's download logs its progress
        # On disk: the artifacts and the header, not the stage's bytes twice.
        assert d["disk_bytes"] <= d["header_bytes"] + (1 << 20), d
    # `meshagent status` says the same.
    said = subprocess.run(
        [sys.executable, "-m", "meshagent", "status", "--data-dir", str(a.data_dir)],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    d = status(a)["download"]
    assert f"fetched {d['fetched_from_hub_bytes'] / 1e6:.1f} MB from the hub" in said, said
    whole = spawn_agent(*WHOLE, "--model", str(model_path), name="whole")
    expected = _greedy(whole, model_id)
    for x in agents:
        assert _greedy(x, model_id) == expected
    # A fourth agent, as small, joins: a spare. It prepares every stage of the split ahead of
    # need, from the peers that hold them; from the hub it fetched the header alone, without
    # the tokenizer.
    served = hub.served
    d = spawn_agent(*SMALL, "--model", NAME, "--join", token, name="d", wait_model=False)
    keys = {_key(m) for x in agents for m in status(x)["artifacts"]}

    def prepared():
        return keys <= {_key(m) for m in status(d)["artifacts"]}

    wait_for(prepared, timeout=120)
    got = status(d)["download"]
    assert got["fetched_from_hub_bytes"] == got["header_fetched_bytes"] < 64 << 10
    assert hub.served - served == got["fetched_from_hub_bytes"]
    assert got["fetched_from_peers_bytes"] == sum(m["size_bytes"] for m in status(d)["artifacts"])
    assert set(got["artifacts"].values()) == {"from peer"}
    # A stage host restarts offline: its partial copy and artifacts are here, and it asks
    # the hub nothing (the others, online, may fetch for a new plan meanwhile).
    before = status(b)["download"]["fetched_from_hub_bytes"]
    b.stop()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    again = start_agent(b.data_dir, *SMALL, "--model", NAME, "--join", token, wait_model=False)
    try:
        said = status(again)["download"]
        assert said["file"] == model_path.name
        assert said["fetched_from_hub_bytes"] == before
    finally:
        again.stop()
