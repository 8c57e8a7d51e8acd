"""A stage host fetches the header of the embedded model (SmolLM2: 1.8 MB of its 2 MB header
is tokenizer) around the tokenizer, from a map a peer gives over the overlay (`header/1`):
its layout and tensors read the same, a middle stage's artifact is byte-identical to one cut
from the whole file, and an entry's is too once the tokenizer is fetched."""

from __future__ import annotations

import queue
import threading

import numpy as np
import pytest
import trio

from meshagent.engine.llama import read_model_info
from meshagent.identity.keys import NodeIdentity
from meshagent.identity.mesh import MeshSecret
from meshagent.models.artifacts import ArtifactStore
from meshagent.models.files import file_sha256
from meshagent.models.gguf_file import parse_header
from meshagent.models.header_map import HeaderMap, header_map
from meshagent.models.header_share import LABEL, HeaderMapServer, ask_peers, map_of
from meshagent.models.hub import locate
from meshagent.models.layout import inspect_model
from meshagent.models.names import HubName
from meshagent.models.ranged import PartialModel
from meshagent.net.manager import ConnectionManager
from meshagent.net.tcp import TcpTransport
from meshagent.wire.handshake import LocalPeer
from tests.models.fake_hub import FakeHub

REPO = "org/smol-GGUF"
MESH = MeshSecret.generate()


@pytest.fixture(scope="module")
def whole_map(model_path) -> HeaderMap:
    head = parse_header(memoryview(np.memmap(model_path, mode="r")))
    return header_map(head, file_sha256(model_path))


@pytest.fixture(scope="module")
def served(model_path):
    server = FakeHub({REPO: {model_path.name: model_path.read_bytes()}})
    yield server
    server.close()


@pytest.fixture
def hub(served):
    served.cut_after = None
    yield served


def _begin(hub, root, header_map=None):
    remote = locate(HubName(REPO), hub.url)
    path = root / remote.filename
    PartialModel.begin(path, remote, header_map=header_map)
    return path


def test_the_map_covers_the_tokenizer_and_the_header_reads_around_it(model_path, whole_map):
    data = bytearray(model_path.read_bytes()[: whole_map.end])
    whole = parse_header(data)
    assert 1_500_000 < whole_map.gap_bytes < whole_map.end  # most of SmolLM2's header
    for a, b, _ in whole_map.gaps:
        data[a:b] = bytes(b - a)  # what a sparse file holds there: zeros
    around = parse_header(data, whole_map.gaps)
    assert around.infos == whole.infos and around.data_offset == whole.data_offset
    kept = {k: f for k, f in whole.fields.items() if not k.startswith("tokenizer.")}
    assert around.fields == kept and around.gaps == whole_map.gaps
    # A gap that does not start where an entry does is refused.
    a, b, n = whole_map.gaps[0]
    with pytest.raises(ValueError):
        parse_header(data, ((a + 8, b, n),))


def test_a_header_fetched_around_the_tokenizer_cuts_the_same_artifacts(
    hub, whole_map, model_path, tmp_path
):
    before = hub.served
    path = _begin(hub, tmp_path / "part", whole_map)
    fetched = hub.served - before
    assert fetched == whole_map.end - whole_map.gap_bytes  # exactly the header but its gaps
    layout = inspect_model(path)
    assert layout.to_dict() | {"path": ""} == inspect_model(model_path).to_dict() | {"path": ""}
    info = read_model_info(path)  # no vocabulary here: the layout's figures
    assert info.n_vocab == layout.n_vocab and info.chat_template is None
    reference = ArtifactStore(tmp_path / "ref")
    store = ArtifactStore(tmp_path / "store")
    # A middle stage: no tokenizer fetched, and the same bytes as one cut from the whole file.
    before = hub.served
    _, m = store.ensure_layers(path, 10, 20, layout)
    _, r = reference.ensure_layers(model_path, 10, 20)
    assert m.sha256 == r.sha256
    assert hub.served - before <= m.size_bytes and PartialModel(path).gaps
    # The entry carries the tokenizer: fetched first, then the header is whole here.
    _, m = store.ensure_entry(path, layout)
    _, r = reference.ensure_entry(model_path)
    assert m.sha256 == r.sha256
    assert PartialModel(path).gaps == ()
    assert read_model_info(path).chat_template == read_model_info(model_path).chat_template


def test_a_map_that_does_not_fit_the_file_is_set_aside(hub, whole_map, model_path, tmp_path):
    wrong = HeaderMap(whole_map.sha256, whole_map.end + 32, whole_map.gaps)
    path = _begin(hub, tmp_path / "part", wrong)
    part = PartialModel(path)
    assert part.gaps == () and part.header_bytes == whole_map.end  # read whole instead
    assert inspect_model(path).n_layers == inspect_model(model_path).n_layers


def test_a_peer_gives_its_map_over_the_overlay(model_path, whole_map, hub, tmp_path):
    """`ask_peers` as `up` calls it, against a node serving `header/1` over loopback TCP: the
    whole file's map; a partial copy read around its tokenizer has none to give."""
    gapped = _begin(hub, tmp_path / "part", whole_map)
    servers = {
        "whole": HeaderMapServer.of(model_path, lambda: whole_map.sha256),
        "gapped": HeaderMapServer.of(gapped, lambda: whole_map.sha256),
    }
    addresses: queue.Queue = queue.Queue()
    stop = threading.Event()

    def serve(which: str) -> None:
        async def main() -> None:
            async def on_stream(stream):
                assert stream.label == LABEL
                await servers[which].handle(stream)

            node = ConnectionManager(
                LocalPeer.create(NodeIdentity.generate(), MESH),
                TcpTransport(),
                listen=["127.0.0.1:0"],
                on_stream=on_stream,
            )
            async with trio.open_nursery() as nursery:
                listening = await nursery.start(node.run)
                addresses.put((which, str(listening[0])))
                await trio.to_thread.run_sync(stop.wait)
                nursery.cancel_scope.cancel()

        trio.run(main)

    threads = [threading.Thread(target=serve, args=(w,)) for w in servers]
    for t in threads:
        t.start()
    try:
        at = dict(addresses.get(timeout=10) for _ in threads)
        assert ask_peers([at["whole"]], MESH, whole_map.sha256) == whole_map
        assert ask_peers([at["gapped"]], MESH, whole_map.sha256) is None
        assert ask_peers([at["whole"]], MESH, "0" * 64) is None  # another file
        # The first that has one answers.
        assert ask_peers([at["gapped"], at["whole"]], MESH, whole_map.sha256) == whole_map
        # Another mesh's member gets nothing, and no hang.
        assert ask_peers([at["whole"]], MeshSecret.generate(), whole_map.sha256) is None
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=10)
    assert map_of(gapped, whole_map.sha256) is None


def test_an_entry_on_a_copy_read_without_the_tokenizer_chats_as_the_whole_model(
    hub, whole_map, model_path, tmp_path
):
    """The agent's model facts come from its partial copy (no chat template there); the
    split's entry takes the template and special tokens from its own artifact."""
    from meshagent.engine.stage import StageEngine
    from meshagent.serving.pipeline import EntryEngine

    path = _begin(hub, tmp_path / "part", whole_map)
    info = read_model_info(path)
    assert info.chat_template is None
    store = ArtifactStore(tmp_path / "store")
    layout = inspect_model(path)
    entry_path, _ = store.ensure_entry(path, layout)
    first = StageEngine(
        store.ensure_layers(path, 0, 2, layout)[0],
        start=0,
        end=2,
        total_layers=layout.n_layers,
        slots=1,
        slot_ctx=64,
        threads=1,
    )
    entry = EntryEngine(entry_path, first, info)
    try:
        whole = read_model_info(model_path)
        assert entry.info.chat_template == whole.chat_template is not None
        assert (entry.info.bos_token, entry.info.eos_token) == (whole.bos_token, whole.eos_token)
        assert entry.info.id == info.id and entry.info.n_vocab == whole.n_vocab
    finally:
        entry.vocab.close()
        first.close()


async def test_placement_knows_a_partial_copys_file_before_the_agent_publishes_its_speed(
    hub, whole_map, tmp_path, monkeypatch
):
    """A plan proposed once the speeds are in counts downloads: the agent's own placement
    knows which file its peers' holdings are of before its speed lets a plan be made (a plan
    made in between put the agent that read the header whole on the middle stage)."""
    from types import SimpleNamespace

    from meshagent import advertisement, capacity
    from meshagent.config import AgentConfig

    path = _begin(hub, tmp_path / "part", whole_map)
    info = read_model_info(path)
    placement = SimpleNamespace(source_sha256="")
    seen = []

    class Gossip:
        def update_local(self, **fields):
            seen.append((set(fields), placement.source_sha256))

    model = SimpleNamespace(
        info=info,
        layout=inspect_model(path),
        placement=placement,
        source=SimpleNamespace(partial=PartialModel(path)),
        publish_serving=lambda: None,
    )
    monkeypatch.setattr(capacity, "matmul_gflops", lambda: 50.0)
    store = ArtifactStore(tmp_path / "store")
    await advertisement.measure(Gossip(), AgentConfig(), "x", [model], store)
    first_speed = next(sha for fields, sha in seen if "compute_speed" in fields)
    assert first_speed == whole_map.sha256 == placement.source_sha256
    # And its record says it read the header without the tokenizer.
    assert advertisement.no_tokenizer(path) == (whole_map.sha256,)
