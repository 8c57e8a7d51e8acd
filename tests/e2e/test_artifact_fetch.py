"""`meshagent models fetch` pulls a stage artifact from a running agent of the same mesh."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx

from meshagent.identity.mesh_file import load_or_create_mesh


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "meshagent", *args], capture_output=True, text=True, timeout=300
    )


def test_fetch_from_a_running_agent(spawn_agent, tmp_path):
    holder_dir = tmp_path / "holder"
    cut = _cli("models", "slice", "--layers", "10:20", "--json", "--data-dir", str(holder_dir))
    assert cut.returncode == 0, cut.stderr
    manifest = json.loads(cut.stdout)
    holder = spawn_agent(name="holder")  # same data dir: tmp_path / "holder"
    listen = httpx.get(f"{holder.url}/control/status").json()["listen"][0]

    fetcher_dir = tmp_path / "fetcher"
    fetcher_dir.mkdir()
    (fetcher_dir / "mesh.key").write_bytes((holder_dir / "mesh.key").read_bytes())
    (fetcher_dir / "mesh.key").chmod(0o600)
    key = f"{manifest['source_sha256'][:32]}-layers-10-20"
    r = _cli(
        "models",
        "fetch",
        key,
        "--from",
        listen,
        "--sha256",
        manifest["sha256"],
        "--data-dir",
        str(fetcher_dir),
    )
    assert r.returncode == 0, r.stderr
    assert manifest["sha256"] in r.stdout
    assert "100%" in r.stderr  # progress was reported
    fetched = json.loads(_cli("models", "list", "--json", "--data-dir", str(fetcher_dir)).stdout)
    assert [m["sha256"] for m in fetched["artifacts"]] == [manifest["sha256"]]

    # A different mesh cannot fetch: the handshake is refused.
    stranger = tmp_path / "stranger"
    stranger.mkdir()
    _cli("invite", "--data-dir", str(stranger))  # no mesh yet: nothing to fetch with
    r = _cli("models", "fetch", key, "--from", listen, "--data-dir", str(stranger))
    assert r.returncode == 1
    assert "no mesh" in r.stderr
    load_or_create_mesh(stranger / "mesh.key")  # a mesh of its own
    r = _cli("models", "fetch", key, "--from", listen, "--data-dir", str(stranger))
    assert r.returncode == 1
    assert "refused" in r.stderr
    assert not (stranger / "artifacts" / "blobs").exists() or not any(
        (stranger / "artifacts" / "blobs").iterdir()
    )
