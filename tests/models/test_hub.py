"""Models by name against a local hub server: downloaded, verified and then found in the
cache without a request; every failure a one-line error that says what to do, and nothing
half-written left as if whole."""

from __future__ import annotations

import os

import pytest

from meshagent.errors import ModelError
from meshagent.models.hub import fetch
from meshagent.models.names import HubName
from tests.models.fake_hub import FakeHub

REPO = "org/tiny-GGUF"
FILES = {
    "tiny-Q4_1.gguf": b"GGUF" + os.urandom(3000),
    "tiny-Q8_0.gguf": b"GGUF" + os.urandom(5000),
    "README.md": b"# tiny",
}


@pytest.fixture
def hub():
    server = FakeHub({REPO: FILES, "org/closed": FILES}, gated={"org/closed"})
    yield server
    server.close()


def test_a_name_downloads_verifies_and_then_comes_from_the_cache(hub, tmp_path):
    path = fetch(HubName(REPO, "q4_1"), tmp_path, hub.url)
    assert path.read_bytes() == FILES["tiny-Q4_1.gguf"]
    asked = len(hub.requests)
    again = fetch(HubName(REPO, "Q4_1"), tmp_path, hub.url)
    assert again == path and len(hub.requests) == asked  # no request the second time


@pytest.mark.parametrize(
    ("name", "message"),
    [
        (HubName("org/nothing"), "no model org/nothing on the Hugging Face Hub"),
        (HubName(REPO), "ambiguous: name one of Q4_1, Q8_0"),
        (HubName(REPO, "Q2_K"), "has no Q2_K file"),
        (HubName("org/closed", "Q4_1"), "is gated: accept its terms"),
    ],
)
def test_failures_say_what_to_do(hub, tmp_path, name, message):
    with pytest.raises(ModelError, match=message):
        fetch(name, tmp_path, hub.url)


def test_a_download_that_does_not_match_its_sha256_is_deleted(hub, tmp_path):
    hub.corrupt.add("tiny-Q8_0.gguf")
    with pytest.raises(ModelError, match="does not match the hub's sha256"):
        fetch(HubName(REPO, "Q8_0"), tmp_path, hub.url)
    assert not [p for p in tmp_path.rglob("*.gguf") if p.is_file()]
    hub.corrupt.clear()  # the next try downloads it again, whole
    assert fetch(HubName(REPO, "Q8_0"), tmp_path, hub.url).read_bytes() == FILES["tiny-Q8_0.gguf"]


def test_offline_a_missing_model_says_how_to_get_it(hub, tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelError, match="HF_HUB_OFFLINE is set"):
        fetch(HubName(REPO, "Q4_1"), tmp_path, hub.url)
    assert hub.requests == []


def test_up_serves_a_model_by_name_then_starts_from_the_cache_offline(
    tmp_path, monkeypatch, model_path
):
    from meshagent.launch import start_agent

    server = FakeHub({"org/smol-GGUF": {"smol.Q4_1.gguf": model_path.read_bytes()}})
    try:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
        agent = start_agent(tmp_path / "a", "--model", "org/smol-GGUF:Q4_1", timeout=120)
        try:
            import httpx

            models = httpx.get(f"{agent.url}/v1/models", timeout=10).json()["data"]
            assert [m["id"] for m in models] == ["smol.Q4_1"]
            # Progress on stderr: a line per tenth where it is not a terminal.
            lines = [x for x in agent.log_text().splitlines() if "downloading org/smol" in x]
            assert len(lines) >= 5 and lines[-1].startswith("100%"), lines
        finally:
            agent.stop()
        asked = len(server.requests)
        assert asked > 0
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        again = start_agent(tmp_path / "b", "--model", "org/smol-GGUF:Q4_1", timeout=120)
        again.stop()
        assert len(server.requests) == asked  # the cache, without a request
    finally:
        server.close()


def test_pull_downloads_and_list_shows_it(hub, tmp_path, monkeypatch, capsys):
    from meshagent.cli.main import main

    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "cache"))
    assert main(["models", "pull", f"{REPO}"]) == 1  # ambiguous: one line says so
    assert "ambiguous" in capsys.readouterr().err
    assert main(["models", "pull", f"{REPO}:Q8_0"]) == 0
    path = capsys.readouterr().out.strip()
    assert path.endswith("tiny-Q8_0.gguf") and os.path.isfile(path)
    assert main(["models", "list", "--data-dir", str(tmp_path / "d")]) == 0
    assert f"model    {REPO}/tiny-Q8_0.gguf" in capsys.readouterr().out


def test_a_server_that_stops_mid_download_leaves_nothing_as_if_whole(hub, tmp_path):
    hub.cut_after = 1000  # every response stops after 1000 bytes
    with pytest.raises(ModelError) as e:
        fetch(HubName(REPO, "Q8_0"), tmp_path, hub.url)
    assert "\n" not in str(e.value) and "the next try resumes there" in str(e.value)
    assert not [p for p in tmp_path.rglob("*.gguf") if p.is_file()]  # no file as if whole
    hub.cut_after = None
    assert fetch(HubName(REPO, "Q8_0"), tmp_path, hub.url).read_bytes() == FILES["tiny-Q8_0.gguf"]
    assert hub.ranges and hub.ranges[-1][1] > 0  # the second try resumed where it stopped


def test_a_full_disk_refuses_the_download_before_it_starts(hub, tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(10**6, 10**6, 100))
    with pytest.raises(ModelError, match="B free: free some space, or set HF_HUB_CACHE"):
        fetch(HubName(REPO, "Q8_0"), tmp_path, hub.url)
    assert hub.ranges == [] and not list(tmp_path.rglob("*.gguf*"))
