"""`artifact/1` framing on the wire: bytes captured from the framer before it moved onto
`meshagent.wire.framing` (old and new agents must understand each other)."""

from __future__ import annotations

import hashlib

import pytest
from structlog.testing import capture_logs

from meshagent.models.artifacts import ArtifactStore, SliceManifest
from meshagent.models.transfer import ArtifactServer, TransferError, fetch_artifact
from tests.net.scripted import ScriptedStream

ARTIFACT = bytes(range(40))  # three chunks of 16, 16 and 8 bytes
MANIFEST = SliceManifest(
    "layers", "ab" * 32, "golden.gguf", "llama", 1, 3, 4, "middle",
    hashlib.sha256(ARTIFACT).hexdigest(), 40, 32, 64,
)  # fmt: skip

# Produced by the old code: a client's GET from chunk 0 and from chunk 2, the answers of an
# ArtifactServer(chunk_size=16) holding ARTIFACT (HEADER then chunks), and its answer to a
# GET for a key it lacks ("nope").
TRANSFER_GET = bytes.fromhex(
    "00000035a40001010102782b6162616261626162616261626162616261626162616261626162616261626162"
    "2d6c61796572732d312d330300"
)
TRANSFER_GET_FROM_2 = bytes.fromhex(
    "00000035a40001010102782b6162616261626162616261626162616261626162616261626162616261626162"
    "2d6c61796572732d312d330302"
)
TRANSFER_REPLY = bytes.fromhex(
    "000001aaa5000101020459013cad646b696e64666c61796572736d736f757263655f73686132353678406162"
    "6162616261626162616261626162616261626162616261626162616261626162616261626162616261626162"
    "6162616261626162616261626162616261626b736f757263655f6e616d656b676f6c64656e2e676775666c61"
    "7263686974656374757265656c6c616d616573746172740163656e64036c746f74616c5f6c61796572730464"
    "726f6c65666d6964646c65667368613235367840356661613465656333363131353536383132633264373462"
    "343337633863343961646433663931306631303036336438303134343166376437356364356533626a73697a"
    "655f627974657318286c7765696768745f62797465731820781c6b765f62797465735f7065725f746f6b656e"
    "5f7065725f6c6179657218406776657273696f6e010510065860be45cb2605bf36bebde684841a28f0fd43c6"
    "9850a3dce5fedba69928ee3a8991fc2e2c73072bfa2bda03ff9307472debd3cc8105028a8a9e235e35ba8d2e"
    "37f41efc915d1274d56c3a2800a0eadaf508be4ea8fbb30093445d94b7864a5c578b00000010000102030405"
    "060708090a0b0c0d0e0f00000010101112131415161718191a1b1c1d1e1f000000082021222324252627"
)
TRANSFER_REPLY_FROM_2 = bytes.fromhex(
    "000001aaa5000101020459013cad646b696e64666c61796572736d736f757263655f73686132353678406162"
    "6162616261626162616261626162616261626162616261626162616261626162616261626162616261626162"
    "6162616261626162616261626162616261626b736f757263655f6e616d656b676f6c64656e2e676775666c61"
    "7263686974656374757265656c6c616d616573746172740163656e64036c746f74616c5f6c61796572730464"
    "726f6c65666d6964646c65667368613235367840356661613465656333363131353536383132633264373462"
    "343337633863343961646433663931306631303036336438303134343166376437356364356533626a73697a"
    "655f627974657318286c7765696768745f62797465731820781c6b765f62797465735f7065725f746f6b656e"
    "5f7065725f6c6179657218406776657273696f6e010510065860be45cb2605bf36bebde684841a28f0fd43c6"
    "9850a3dce5fedba69928ee3a8991fc2e2c73072bfa2bda03ff9307472debd3cc8105028a8a9e235e35ba8d2e"
    "37f41efc915d1274d56c3a2800a0eadaf508be4ea8fbb30093445d94b7864a5c578b00000008202122232425"
    "2627"
)
TRANSFER_ERROR = bytes.fromhex("0000001ca30001010307756e6f206172746966616374206e6f70652068657265")


@pytest.fixture
def source(tmp_path) -> ArtifactStore:
    store = ArtifactStore(tmp_path / "source")
    blob = tmp_path / "blob"
    blob.write_bytes(ARTIFACT)
    store.install(MANIFEST, blob)
    return store


def opener(*streams: ScriptedStream):
    pending = list(streams)

    async def open_stream() -> ScriptedStream:
        return pending.pop(0)

    return open_stream


@pytest.mark.parametrize(
    ("request_bytes", "reply"),
    [(TRANSFER_GET, TRANSFER_REPLY), (TRANSFER_GET_FROM_2, TRANSFER_REPLY_FROM_2)],
)
async def test_the_server_answers_old_requests_as_before(source, request_bytes, reply):
    stream = ScriptedStream(request_bytes)
    await ArtifactServer(source, chunk_size=16).handle(stream)
    assert bytes(stream.sent) == reply
    assert stream.eof_sent


async def test_a_missing_artifact_is_refused_as_before(source):
    get = TRANSFER_GET.replace(b"\x78\x2b" + MANIFEST.key.encode(), b"\x64nope")
    get = (len(get) - 4).to_bytes(4, "big") + get[4:]
    stream = ScriptedStream(get)
    await ArtifactServer(source, chunk_size=16).handle(stream)
    assert bytes(stream.sent) == TRANSFER_ERROR


async def test_a_client_fetches_and_resumes_from_an_old_server(tmp_path):
    dst = ArtifactStore(tmp_path / "dst")
    cut = ScriptedStream(TRANSFER_REPLY[:-5])  # the third chunk never arrives whole
    with pytest.raises(TransferError, match="after 1 attempts"):
        await fetch_artifact(opener(cut), MANIFEST.key, dst, max_attempts=1)
    assert bytes(cut.sent) == TRANSFER_GET
    rest = ScriptedStream(*(TRANSFER_REPLY_FROM_2[i : i + 7] for i in range(0, 600, 7)))
    path, manifest = await fetch_artifact(opener(rest), MANIFEST.key, dst)
    assert bytes(rest.sent) == TRANSFER_GET_FROM_2
    assert manifest == MANIFEST and path.read_bytes() == ARTIFACT


async def test_a_chunk_over_the_chunk_size_is_refused(tmp_path):
    header_end = len(TRANSFER_REPLY) - (3 * 4 + 40)
    oversize = TRANSFER_REPLY[:header_end] + (17).to_bytes(4, "big") + bytes(17)
    with capture_logs() as logs, pytest.raises(TransferError, match="after 1 attempts"):
        await fetch_artifact(
            opener(ScriptedStream(oversize)), MANIFEST.key, ArtifactStore(tmp_path), max_attempts=1
        )
    assert logs[0]["error"] == "chunk of 17 bytes is over the 16-byte limit"
