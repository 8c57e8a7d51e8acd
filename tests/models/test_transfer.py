"""Stage artifacts move between two overlay nodes on loopback TCP, verified and resumable."""

from __future__ import annotations

import shutil

import pytest
import trio

from meshagent.identity.keys import NodeIdentity
from meshagent.identity.mesh import MeshSecret
from meshagent.models.artifacts import ArtifactStore
from meshagent.models.transfer import LABEL, ArtifactServer, TransferError, fetch_artifact
from meshagent.net.manager import ConnectionManager
from meshagent.net.tcp import TcpTransport
from meshagent.wire.handshake import LocalPeer

MESH = MeshSecret.generate()


@pytest.fixture(scope="module")
def big_slice(model_path, tmp_path_factory):
    """The last-stage artifact of SmolLM2 (layers 20-30 and the output head): about 54 MB."""
    store = ArtifactStore(tmp_path_factory.mktemp("source-store"))
    _, manifest = store.ensure_layers(model_path, 20, 30)
    assert manifest.size_bytes > 50 * 2**20
    return store, manifest


async def two_nodes(nursery, server: ArtifactServer):
    """A serving node and a fetching node, connected over real TCP on 127.0.0.1."""

    async def on_stream(stream):
        assert stream.label == LABEL
        await server.handle(stream)

    a = ConnectionManager(
        LocalPeer.create(NodeIdentity.generate(), MESH),
        TcpTransport(),
        listen=["127.0.0.1:0"],
        on_stream=on_stream,
    )
    addresses = await nursery.start(a.run)
    b = ConnectionManager(LocalPeer.create(NodeIdentity.generate(), MESH), TcpTransport())
    await nursery.start(b.run)
    await b.dial(addresses[0], peer_id=a.peer_id)
    return a, b


def copy_store(src: ArtifactStore, manifest, dst: ArtifactStore) -> None:
    shutil.copy(src.blob_path(manifest.sha256), dst.blob_path(manifest.sha256))
    (dst.manifests / f"{manifest.key}.json").write_text(
        (src.manifests / f"{manifest.key}.json").read_text()
    )


async def test_a_50mb_slice_arrives_verified(big_slice, tmp_path, nursery):
    src, manifest = big_slice
    a, b = await two_nodes(nursery, ArtifactServer(src))
    dst = ArtifactStore(tmp_path / "dst")
    seen = []
    path, got = await fetch_artifact(
        lambda: b.open_stream(a.peer_id, LABEL),
        manifest.key,
        dst,
        expected_sha256=manifest.sha256,
        progress=lambda done, total: seen.append((done, total)),
    )
    assert got == manifest
    assert path.read_bytes() == src.blob_path(manifest.sha256).read_bytes()
    assert dst.get(manifest.key) == manifest
    assert seen[-1] == (manifest.size_bytes, manifest.size_bytes)
    assert len(seen) == -(-manifest.size_bytes // 2**20)  # one report per 1 MiB chunk
    assert not any((dst.root / "partial").iterdir())


async def test_a_transfer_killed_halfway_resumes(big_slice, tmp_path, nursery):
    src, manifest = big_slice
    server = ArtifactServer(src)
    a, b = await two_nodes(nursery, server)
    dst = ArtifactStore(tmp_path / "dst")
    half = manifest.size_bytes // 2
    cut = trio.CancelScope()

    def stop_at_half(done: int, total: int) -> None:
        if done >= half:
            cut.cancel()

    with cut:
        await fetch_artifact(
            lambda: b.open_stream(a.peer_id, LABEL), manifest.key, dst, progress=stop_at_half
        )
    assert dst.get(manifest.key) is None  # nothing unverified was installed
    resumed_from = []

    def first_report(done: int, total: int) -> None:
        if not resumed_from:
            resumed_from.append(done)

    path, got = await fetch_artifact(
        lambda: b.open_stream(a.peer_id, LABEL), manifest.key, dst, progress=first_report
    )
    assert got.sha256 == manifest.sha256
    assert path.read_bytes() == src.blob_path(manifest.sha256).read_bytes()
    # The second transfer started past the half already verified, not from zero.
    assert resumed_from[0] > half


async def test_a_dropped_connection_resumes_on_a_new_one(big_slice, tmp_path, nursery):
    src, manifest = big_slice
    a, b = await two_nodes(nursery, ArtifactServer(src))
    dst = ArtifactStore(tmp_path / "dst")
    dropped = []

    def drop_once(done: int, total: int) -> None:
        if done >= total // 3 and not dropped:
            dropped.append(done)
            conn = b.connection(a.peer_id)
            nursery.start_soon(conn.aclose)

    async def open_stream():
        conn = b.connection(a.peer_id)
        if conn is None or not conn.accepting_streams:
            await b.dial(a.listen_addresses[0], peer_id=a.peer_id, replace=True)
        return await b.open_stream(a.peer_id, LABEL)

    path, _ = await fetch_artifact(open_stream, manifest.key, dst, progress=drop_once)
    assert dropped
    assert path.read_bytes() == src.blob_path(manifest.sha256).read_bytes()


async def test_a_flipped_byte_is_detected_and_refetched(big_slice, tmp_path, nursery):
    src, manifest = big_slice
    damaged = []

    def flip_one_byte_once(index: int, data: bytes) -> bytes:
        if index == 7 and not damaged:
            damaged.append(index)
            return data[:100] + bytes([data[100] ^ 0x01]) + data[101:]
        return data

    a, b = await two_nodes(nursery, ArtifactServer(src, corrupt=flip_one_byte_once))
    dst = ArtifactStore(tmp_path / "dst")
    path, _ = await fetch_artifact(lambda: b.open_stream(a.peer_id, LABEL), manifest.key, dst)
    assert damaged == [7]
    assert path.read_bytes() == src.blob_path(manifest.sha256).read_bytes()


async def test_a_peer_that_keeps_corrupting_fails_cleanly(big_slice, tmp_path, nursery):
    src, manifest = big_slice
    bad = ArtifactServer(src, corrupt=lambda i, d: bytes([d[0] ^ 0xFF]) + d[1:] if i == 2 else d)
    a, b = await two_nodes(nursery, bad)
    dst = ArtifactStore(tmp_path / "dst")
    with pytest.raises(TransferError, match="after 5 attempts"):
        await fetch_artifact(lambda: b.open_stream(a.peer_id, LABEL), manifest.key, dst)
    assert dst.get(manifest.key) is None


async def test_unknown_artifact_is_refused(big_slice, tmp_path, nursery):
    src, _ = big_slice
    a, b = await two_nodes(nursery, ArtifactServer(src))
    with pytest.raises(TransferError, match="no artifact"):
        await fetch_artifact(
            lambda: b.open_stream(a.peer_id, LABEL),
            "0" * 32 + "-layers-0-1",
            ArtifactStore(tmp_path / "dst"),
            max_attempts=1,
        )
