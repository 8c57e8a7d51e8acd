"""`artifact/1` with a peer that lies, over real overlay connections on loopback: a malformed
or oversized header ends that transfer with a clear error before a byte is written, and is
not asked again; a server refuses bad requests, serves one peer two transfers at once and
drops a reader that stalls."""

from __future__ import annotations

import contextlib
import hashlib
import math
from typing import Any

import cbor2
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshagent.errors import ModelError
from meshagent.identity.keys import NodeIdentity
from meshagent.models import transfer
from meshagent.models.artifacts import ArtifactStore, SliceManifest
from meshagent.models.transfer import LABEL, ArtifactServer, TransferError, fetch_artifact
from meshagent.net.frame_reader import receive_frame
from meshagent.net.manager import ConnectionManager
from meshagent.net.tcp import TcpTransport
from meshagent.wire.framing import LengthPrefixDecoder
from meshagent.wire.handshake import LocalPeer
from tests.models.test_transfer import MESH, two_nodes
from tests.net.scripted import ScriptedStream

ARTIFACT = bytes(range(40))
MANIFEST = SliceManifest(
    "layers", "ab" * 32, "golden.gguf", "llama", 1, 3, 4, "middle",
    hashlib.sha256(ARTIFACT).hexdigest(), 40, 32, 64,
)  # fmt: skip
KEY = MANIFEST.key


def chunks_of(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


def header(
    manifest: Any = None, chunk: Any = 16, hashes: Any = None, **changes: Any
) -> dict[int, Any]:
    """A HEADER for ARTIFACT in chunks of `chunk`, with what the test changes."""
    manifest = MANIFEST.to_cbor() if manifest is None else manifest
    if hashes is None:
        hashes = b"".join(hashlib.sha256(c).digest() for c in chunks_of(ARTIFACT, 16))
    fields = {
        transfer.K_TYPE: transfer.T_HEADER,
        transfer.K_MANIFEST: manifest,
        transfer.K_CHUNK: chunk,
        transfer.K_HASHES: hashes,
    }
    fields.update(changes)
    return {k: v for k, v in fields.items() if v is not ...}


def frame(fields: dict[int, Any]) -> bytes:
    return transfer.FRAMING.encode(cbor2.dumps({transfer.K_VERSION: transfer.VERSION, **fields}))


def get(key: Any, first: Any = ...) -> bytes:
    fields = {transfer.K_TYPE: transfer.T_GET, transfer.K_KEY: key}
    return frame(fields if first is ... else fields | {transfer.K_FROM: first})


def framed_chunks(data: bytes, size: int = 16) -> bytes:
    return b"".join(transfer.FRAMING.encode(c) for c in chunks_of(data, size))


class Liar:
    """An `artifact/1` server that answers every GET with `reply` (bytes: a header, chunks),
    counting the GETs."""

    def __init__(self, reply: bytes) -> None:
        self.reply = reply
        self.gets = 0

    async def handle(self, stream) -> None:
        await receive_frame(stream, LengthPrefixDecoder(transfer.FRAMING), on_eof=EOFError)
        self.gets += 1
        await stream.send_all(self.reply)
        await stream.send_eof()


async def fetch_from(nursery, liar: Liar, tmp_path, **kwargs):
    a, b = await two_nodes(nursery, liar)
    store = ArtifactStore(tmp_path / "dst")
    with trio.fail_after(20):
        return await fetch_artifact(lambda: b.open_stream(a.peer_id, LABEL), KEY, store, **kwargs)


def manifest_with(**changes: Any) -> bytes:
    return cbor2.dumps(MANIFEST.to_dict() | changes)


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        (header(manifest=...), "without a manifest"),
        (header(manifest="not bytes"), "without a manifest"),
        (header(manifest=b"\xff\x00"), "malformed manifest"),
        (header(manifest=manifest_with(start="one")), "malformed manifest: start"),
        (header(manifest=manifest_with(size_bytes=-40)), "malformed manifest: size_bytes"),
        (header(manifest=manifest_with(end=2)), "asked for"),
        (header(chunk="16"), "chunk size"),
        (header(chunk=[16]), "chunk size"),
        (header(chunk=True), "chunk size"),
        (header(chunk=0), "chunk size"),
        (header(chunk=...), "chunk size"),
        (header(chunk=(1 << 32) - 1), "chunk size"),  # would be buffered whole
        (header(hashes=...), "hashes"),
        (header(hashes=[b"x" * 32] * 3), "hashes"),
        (header(hashes=b"x" * 33), "hashes"),
        (header(hashes=b"x" * 32 * 1000), "has 3 chunks, but the header gives 1000"),
        ({transfer.K_TYPE: 99}, "expected a transfer header"),
        ({transfer.K_TYPE: True}, "expected a transfer header"),
        # integers past the 4300 digits Python prints, as the peer's own error too
        (header(chunk=10**4400), "chunk size"),
        (header(manifest=manifest_with(end=-(10**4400))), "malformed manifest: end"),
        (header(manifest=manifest_with(version=10**4400)), "manifest version"),
        ({transfer.K_TYPE: transfer.T_ERROR, transfer.K_ERROR: 10**4400}, "refused"),
    ],
)
async def test_a_malformed_header_ends_the_transfer_at_once(fields, why, tmp_path, nursery):
    liar = Liar(frame(fields) + transfer.FRAMING.encode(ARTIFACT[:16]))
    with pytest.raises(TransferError, match=why):
        await fetch_from(nursery, liar, tmp_path)
    assert liar.gets == 1  # a peer that breaks the protocol is not asked again
    partial = tmp_path / "dst" / "partial"
    assert not any(p.suffix == ".part" for p in partial.iterdir())  # nothing was written


async def test_hashes_for_more_than_the_size_fill_no_disk(tmp_path, nursery):
    # 1000 chunks, each matching its hash, for an artifact said to be 40 bytes.
    junk = [bytes([i % 256]) * 16 for i in range(1000)]
    hashes = b"".join(hashlib.sha256(c).digest() for c in junk)
    liar = Liar(frame(header(hashes=hashes)) + b"".join(transfer.FRAMING.encode(c) for c in junk))
    with pytest.raises(TransferError, match="hashes"):
        await fetch_from(nursery, liar, tmp_path)
    assert all(p.stat().st_size <= 40 for p in (tmp_path / "dst" / "partial").iterdir())


async def test_a_chunk_shorter_than_its_place_is_refused(tmp_path, nursery):
    short = ARTIFACT[:8]
    hashes = b"".join(hashlib.sha256(c).digest() for c in (short, ARTIFACT[16:32], ARTIFACT[32:]))
    liar = Liar(frame(header(hashes=hashes)) + transfer.FRAMING.encode(short))
    with pytest.raises(TransferError, match=r"chunk 0 of .* is 8 bytes, not 16"):
        await fetch_from(nursery, liar, tmp_path)
    assert liar.gets == 1


async def test_a_size_other_than_published_is_refused_before_a_byte_is_written(tmp_path, nursery):
    big = (1 << 30) + 7  # one GiB and a bit, in well-formed chunks of 4 MiB
    n = math.ceil(big / (4 << 20))
    fields = header(manifest=manifest_with(size_bytes=big), chunk=4 << 20, hashes=b"h" * 32 * n)
    liar = Liar(frame(fields))
    with pytest.raises(TransferError, match=f"is {big} bytes, not 40"):
        await fetch_from(nursery, liar, tmp_path, expected_size=40)
    liar = Liar(frame(fields))
    with pytest.raises(TransferError, match="over the 1000"):
        await fetch_from(nursery, liar, tmp_path, max_size=1000)


async def test_an_artifact_larger_than_the_free_disk_is_refused(tmp_path, nursery, monkeypatch):
    monkeypatch.setattr(transfer, "free_disk", lambda path: 1 << 20)
    liar = Liar(frame(header()) + framed_chunks(ARTIFACT))
    with pytest.raises(TransferError, match="make room"):
        await fetch_from(nursery, liar, tmp_path)
    assert liar.gets == 1


async def test_an_honest_header_still_fetches(tmp_path, nursery):
    liar = Liar(frame(header()) + framed_chunks(ARTIFACT))
    path, manifest = await fetch_from(nursery, liar, tmp_path, expected_size=40, max_size=40)
    assert manifest == MANIFEST and path.read_bytes() == ARTIFACT


# ----- the server ---------------------------------------------------------------------------


@pytest.fixture
def source(tmp_path) -> ArtifactStore:
    store = ArtifactStore(tmp_path / "source")
    blob = tmp_path / "blob"
    blob.write_bytes(ARTIFACT)
    store.install(MANIFEST, blob)
    return store


def reply_of(stream: ScriptedStream) -> dict[int, Any]:
    body = LengthPrefixDecoder(transfer.FRAMING, bytes(stream.sent)).next_frame()
    assert body is not None
    return cbor2.loads(body)


# Integers past the 4300 digits Python prints (a CBOR bignum of some 2 KB): quoted with repr()
# or str() they raise ValueError, not the transfer's error.
huge = st.integers(4400, 5000).map(lambda n: 10**n)
wide = st.one_of(huge, huge.map(lambda v: -v))

any_value = st.one_of(
    st.integers(-(2**70), 2**70),
    wide,
    st.booleans(),
    st.none(),
    st.floats(),
    st.text(max_size=300),
    st.binary(max_size=20),
    st.lists(st.integers(), max_size=3),
    st.just(KEY),
    st.just(transfer.T_GET),
)


# A GET for the artifact the source holds, any of whose fields may be anything.
requests = st.fixed_dictionaries(
    {},
    optional={
        transfer.K_VERSION: any_value,
        transfer.K_TYPE: st.one_of(st.just(transfer.T_GET), any_value),
        transfer.K_KEY: st.one_of(st.just(KEY), any_value),
        transfer.K_FROM: any_value,
        transfer.K_CHUNK: any_value,
    },
)


@settings(max_examples=300, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(requests)
async def test_any_request_is_answered_or_refused_never_raised(source, fields):
    stream = ScriptedStream(frame(fields))
    await ArtifactServer(source, chunk_size=16).handle(stream)
    assert reply_of(stream)[transfer.K_TYPE] in (transfer.T_HEADER, transfer.T_ERROR)


MANIFEST_INTS = ["start", "end", "total_layers", "size_bytes", "weight_bytes", "version"]


@given(
    st.sampled_from([*MANIFEST_INTS, "kind", "sha256"]),
    st.one_of(wide, st.integers(1 << 63, 1 << 70), st.integers(max_value=-1)),
)
def test_a_manifest_field_out_of_range_is_refused_with_the_model_error(field, value):
    with pytest.raises(ModelError):
        SliceManifest.from_cbor(manifest_with(**{field: value}))


# A HEADER for KEY, any of whose fields may be anything.
headers = st.fixed_dictionaries(
    {},
    optional={
        transfer.K_TYPE: st.one_of(st.sampled_from([transfer.T_HEADER, transfer.T_ERROR]), wide),
        transfer.K_MANIFEST: st.one_of(
            st.just(MANIFEST.to_cbor()),
            st.sampled_from(MANIFEST_INTS).flatmap(
                lambda f: any_value.map(lambda v, f=f: manifest_with(**{f: v}))
            ),
            any_value,
        ),
        transfer.K_CHUNK: st.one_of(st.just(16), any_value),
        transfer.K_HASHES: st.one_of(st.just(header()[transfer.K_HASHES]), any_value),
        transfer.K_ERROR: any_value,
    },
)


@settings(max_examples=300)
@given(headers)
def test_any_header_is_taken_or_refused_with_the_transfers_error(fields):
    with contextlib.suppress(transfer.PeerRefused):
        transfer._Header.decode(fields, KEY, transfer.Expected())


@pytest.mark.parametrize("first", ["x", [1], -1, 2**70, True, 1.5, None])
async def test_a_get_whose_first_chunk_is_not_a_count_is_refused(source, first):
    stream = ScriptedStream(
        frame({transfer.K_TYPE: transfer.T_GET, transfer.K_KEY: KEY, transfer.K_FROM: first})
    )
    await ArtifactServer(source, chunk_size=16).handle(stream)
    assert reply_of(stream)[transfer.K_TYPE] == transfer.T_ERROR


@pytest.mark.parametrize("key", ["../../../etc/passwd", "x" * 5000, 7, b"key"])
async def test_a_get_for_what_is_no_artifact_key_is_refused(source, key):
    stream = ScriptedStream(get(key))
    await ArtifactServer(source, chunk_size=16).handle(stream)
    reply = reply_of(stream)
    assert reply[transfer.K_TYPE] == transfer.T_ERROR and len(reply[transfer.K_ERROR]) < 300


class Stalled(ScriptedStream):
    """A reader that takes the request and header, then nothing more."""

    def __init__(self, *chunks: bytes) -> None:
        super().__init__(*chunks)
        self.sends = 0

    async def send_all(self, data) -> None:
        self.sends += 1
        if self.sends > 1:
            await trio.sleep_forever()
        await super().send_all(data)


async def test_a_reader_that_stalls_loses_its_transfer(source, monkeypatch):
    monkeypatch.setattr(transfer, "CHUNK_DEADLINE", 0.2)
    server = ArtifactServer(source, chunk_size=16, max_uploads=1)
    stalled = Stalled(get(KEY))
    with trio.fail_after(5):
        await server.handle(stalled)
    # Its slot is free again: the next asker is served.
    honest = ScriptedStream(get(KEY))
    with trio.fail_after(5):
        await server.handle(honest)
    assert reply_of(honest)[transfer.K_TYPE] == transfer.T_HEADER


@pytest.fixture
def big(tmp_path) -> tuple[ArtifactStore, SliceManifest]:
    """A 24 MiB artifact: more than the windows of the streams that carry it."""
    data = hashlib.sha256(b"seed").digest() * (24 << 15)
    manifest = SliceManifest(
        "layers", "cd" * 32, "big.gguf", "llama", 0, 2, 4, "first",
        hashlib.sha256(data).hexdigest(), len(data), len(data), 64,
    )  # fmt: skip
    store = ArtifactStore(tmp_path / "big")
    blob = tmp_path / "bigblob"
    blob.write_bytes(data)
    store.install(manifest, blob)
    return store, manifest


async def test_one_peer_cannot_take_every_upload_slot(big, tmp_path, nursery):
    store, manifest = big
    server = ArtifactServer(store, max_uploads=4)
    a, hostile = await two_nodes(nursery, server)
    # The hostile peer asks four times and reads nothing: a stalled transfer holds a slot.
    streams = []
    for _ in range(4):
        s = await hostile.open_stream(a.peer_id, LABEL)
        await s.send_all(get(manifest.key))
        await s.send_eof()
        streams.append(s)
    await trio.sleep(0.5)
    honest = ConnectionManager(LocalPeer.create(NodeIdentity.generate(), MESH), TcpTransport())
    await nursery.start(honest.run)
    await honest.dial(a.listen_addresses[0], peer_id=a.peer_id)
    with trio.fail_after(30):
        _, got = await fetch_artifact(
            lambda: honest.open_stream(a.peer_id, LABEL),
            manifest.key,
            ArtifactStore(tmp_path / "h"),
        )
    assert got == manifest
