"""A stage host holding a partial copy gets an artifact from a peer that holds it first (over
real overlay connections on loopback), from the hub's byte ranges otherwise, and checks a cut
against the sha256 peers publish: wrong bytes are fetched again, and wrong twice is an error."""

from __future__ import annotations

from types import SimpleNamespace

import cbor2
import pytest
import trio
from structlog.testing import capture_logs

from meshagent.errors import ModelError
from meshagent.gossip.peer_record import ArtifactHeld, ModelHeld
from meshagent.models import ranged, transfer
from meshagent.models.artifacts import ArtifactStore, artifact_key
from meshagent.models.hub import locate
from meshagent.models.layout import inspect_model
from meshagent.models.names import HubName
from meshagent.models.ranged import PartialModel
from meshagent.models.transfer import ArtifactServer
from meshagent.placement.planner import Plan, StageAssignment
from meshagent.serving.obtain import ArtifactSource
from meshagent.testing.tiny_gguf import write_tiny_model
from tests.models.fake_hub import FakeHub
from tests.models.test_transfer import two_nodes
from tests.models.test_transfer_hostile import Liar

REPO, FILE = "org/tiny-GGUF", "tiny-F32.gguf"


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("whole") / FILE, "llama", n_layers=6)


@pytest.fixture
def hub(whole):
    server = FakeHub({REPO: {FILE: whole.read_bytes()}})
    yield server
    server.close()


def _views(peer_id: str, *manifests, models=()) -> dict:
    held = tuple(ArtifactHeld.from_manifest(m) for m in manifests)
    return {peer_id: SimpleNamespace(record=SimpleNamespace(artifacts=held, models=models))}


def _source(hub, tmp_path, views, open_stream=None) -> ArtifactSource:
    path = tmp_path / "models" / FILE
    PartialModel.begin(path, locate(HubName(REPO), hub.url), probe=4096)
    return ArtifactSource(
        peer_id="me",
        model_path=path,
        layout=inspect_model(path),
        store=ArtifactStore(tmp_path / "store"),
        views=lambda: views,
        open_stream=open_stream,
    )


async def _beside(nursery, theirs, manifest, hub, tmp_path) -> ArtifactSource:
    """A source whose one peer, over loopback TCP, serves `theirs` and publishes `manifest`."""
    a, b = await two_nodes(nursery, ArtifactServer(theirs))
    views = _views(a.peer_id, manifest)
    return _source(hub, tmp_path, views, lambda peer, label: b.open_stream(peer, label))


async def _watching(source: ArtifactSource, obtaining) -> list[dict]:
    """Runs `obtaining`, noting what `source.downloads()` lists at every checkpoint."""
    seen: list[dict] = []
    async with trio.open_nursery() as nursery:

        async def watch() -> None:
            while True:
                seen.extend(source.downloads())
                await trio.sleep(0)

        nursery.start_soon(watch)
        await obtaining
        nursery.cancel_scope.cancel()
    return seen


def a_peer(source: ArtifactSource) -> str:
    [peer] = source.views()
    return peer


class _Said:
    """Stands for the progress lines' logger: what was logged, as `capture_logs` gives it
    (which misses lines below the level an agent run earlier in this process configured)."""

    def __init__(self) -> None:
        self.lines: list[dict] = []

    def info(self, event: str, **fields) -> None:
        self.lines.append({"event": event, **fields})

    warning = error = debug = info


async def test_a_slice_a_peer_holds_comes_from_that_peer_not_the_hub(
    hub, whole, tmp_path, nursery, monkeypatch
):
    theirs = ArtifactStore(tmp_path / "theirs")
    _, manifest = theirs.ensure_layers(whole, 2, 4)
    source = await _beside(nursery, theirs, manifest, hub, tmp_path)
    header_only = hub.served
    monkeypatch.setattr(ranged, "log", _Said())
    seen = await _watching(source, source.obtain("layers", 2, 4))
    assert hub.served == header_only  # nothing more from the hub
    # While it comes, the status says so, and its progress is logged (a stage's artifact can
    # take minutes); once here, it is no longer listed.
    assert {(f["key"], f["source"]) for f in seen} == {(manifest.key, f"peer {a_peer(source)}")}
    said = [e for e in ranged.log.lines if e["event"] == "artifact.progress"]
    assert said and said[-1]["key"] == manifest.key and said[-1]["percent"] == 100
    assert said[-1]["bytes"] == said[-1]["of"] == manifest.size_bytes
    assert source.downloads() == []
    got = source.store.get(manifest.key)
    assert got is not None and got.sha256 == manifest.sha256
    part = PartialModel(source.model_path)
    assert part.artifacts == {manifest.key: "from peer"}
    assert part.from_peers == manifest.size_bytes
    # Not held by any peer: from the hub's ranges, and unverified (no hash to compare).
    seen = await _watching(source, source.obtain("layers", 4, 6))
    assert hub.served > header_only
    key = artifact_key(part.sha256, "layers", 4, 6)
    assert {(f["key"], f["source"]) for f in seen} == {(key, "hub")}
    said = [e for e in ranged.log.lines if e["event"] == "partial.progress" and e.get("key") == key]
    assert said and said[-1]["percent"] == 100 and said[-1]["bytes"] == said[-1]["of"] > 0
    assert source.downloads() == []
    assert source.store.get(key) is not None
    after = PartialModel(source.model_path)
    assert after.artifacts[key] == "unverified"
    # The stage's bytes live in the artifact: the partial copy gave their disk back, so the
    # agent's disk holds about its slice, not twice it.
    assert after.held <= after.header_fetched + 4096
    assert source.model_path.stat().st_blocks * 512 <= after.header_fetched + 65536


async def test_a_peer_that_cannot_send_it_leaves_the_hub_and_its_hash_checks_the_cut(
    hub, whole, tmp_path, nursery
):
    _, manifest = ArtifactStore(tmp_path / "ref").ensure_layers(whole, 0, 3)
    empty = ArtifactStore(tmp_path / "empty")  # publishes the hash, holds nothing to send
    source = await _beside(nursery, empty, manifest, hub, tmp_path)
    await source.obtain("layers", 0, 3)
    assert source.store.get(manifest.key).sha256 == manifest.sha256
    assert PartialModel(source.model_path).artifacts == {manifest.key: "verified"}


async def test_wrong_bytes_are_fetched_again_and_wrong_twice_is_an_error(hub, whole, tmp_path):
    _, manifest = ArtifactStore(tmp_path / "ref").ensure_layers(whole, 3, 5)
    views = _views("peer", manifest)  # no stream needed: every fetch from it fails
    source = _source(hub, tmp_path, views, _refuse)
    part = PartialModel(source.model_path)
    [(a, b)] = part.tensor_ranges(["blk.3.ffn_down.weight"])
    part.ensure([(a, b)])
    with source.model_path.open("r+b") as f:  # the bytes on disk go bad
        f.seek(a)
        f.write(bytes(b - a))
    await source.obtain("layers", 3, 5)  # cut, mismatch, forgotten, fetched again: right
    assert source.store.get(manifest.key).sha256 == manifest.sha256
    assert PartialModel(source.model_path).artifacts == {manifest.key: "verified"}
    # The hub itself sends wrong bytes: twice wrong, an error, nothing installed.
    _, other = ArtifactStore(tmp_path / "ref").ensure_layers(whole, 1, 2)
    views.update(_views("peer", manifest, other))
    hub.garble_from = part.header_bytes
    with pytest.raises(ModelError, match="twice does not match"):
        await source.obtain("layers", 1, 2)
    assert source.store.get(other.key) is None


async def test_a_peer_holding_the_whole_file_cuts_the_slice_on_request(
    hub, whole, tmp_path, nursery
):
    theirs = ArtifactStore(tmp_path / "theirs")  # holds no artifact: only the file
    cutter = _holder(theirs, whole).cut_for_peer
    server = ArtifactServer(theirs, cut=cutter, may_cut=lambda key: not key.endswith("-4-6"))
    a, b = await two_nodes(nursery, server)
    sha = theirs.source_sha256(whole)
    views = _views(a.peer_id, models=(ModelHeld("tiny", sha, "llama", 6, 1),))
    source = _source(hub, tmp_path, views, lambda peer, label: b.open_stream(peer, label))
    header_only = hub.served
    await source.obtain("entry", 0, 0)
    await source.obtain("layers", 1, 4)
    assert hub.served == header_only  # both came from the peer's file, none from the hub
    _, ref = ArtifactStore(tmp_path / "ref").ensure_layers(whole, 1, 4)
    assert source.store.get(ref.key).sha256 == ref.sha256
    assert set(PartialModel(source.model_path).artifacts.values()) == {"from peer"}
    # A range the peer may not cut (not a stage of its plan): refused, so from the hub.
    await source.obtain("layers", 4, 6)
    assert hub.served > header_only
    assert theirs.get(artifact_key(sha, "layers", 4, 6)) is None
    # A key of another model, or a malformed one, is refused, not cut.
    cut = _holder(theirs, whole).cut_for_peer
    assert cut("f" * 32 + "-layers-0-2") is None and cut("nonsense") is None


async def test_a_partial_copy_given_the_whole_model_completes_and_says_it_holds_the_file(
    hub, whole, tmp_path
):
    source = _source(hub, tmp_path, {})
    said = []
    other = ModelHeld("other", "e" * 64, "llama", 2, 1)  # another model held here stays said
    me = SimpleNamespace(record=SimpleNamespace(models=(other,)))
    gossip = SimpleNamespace(
        peer_id="me",
        snapshot=lambda: {"me": me},
        update_local=lambda **fields: said.append(fields),
    )
    info = SimpleNamespace(id="tiny", architecture="llama", n_layers=6, size_bytes=1)
    await source.complete(info, gossip)
    assert source.model_path.read_bytes() == whole.read_bytes()
    assert source.partial is None  # whole now, checked against the hub's sha256
    [fields] = said
    assert fields["models"][0] == other
    assert fields["models"][1].sha256 == PartialModel(source.model_path).sha256
    await source.complete(info, gossip)  # whole already: nothing more
    assert len(said) == 1


def _holder(store: ArtifactStore, whole) -> ArtifactSource:
    """The source of an agent holding the whole file (what answers a peer's cut)."""
    layout = inspect_model(whole)
    return ArtifactSource(
        peer_id="holder",
        model_path=whole,
        layout=layout,
        store=store,
        views=dict,
        open_stream=_refuse,
    )


async def _refuse(peer: str, label: str):
    raise OSError("no route to that peer")


def test_a_prune_follows_a_split_and_leaves_what_is_served_whole_alone(whole, tmp_path):
    from meshagent.placement.planner import Plan, StageAssignment

    store = ArtifactStore(tmp_path / "store")
    source = _holder(store, whole)
    cut = [store.ensure_layers(whole, a, b)[1].key for a, b in [(0, 2), (2, 4), (4, 6)]]
    # Served whole: artifacts cut by hand stay.
    assert source.prune(Plan("m", 256, replicas=("holder",))) == []
    assert len(store.all()) == 3
    # The last stage of a split: its own part stays, and of the others as many bytes again
    # as it takes, the most recently used first.
    split = Plan("m", 256, stages=(StageAssignment("b", 0, 4), StageAssignment("holder", 4, 6)))
    assert source.prune(split) == [cut[0]]
    assert {m.key for m in store.all()} == {cut[1], cut[2]}
    # A spare of that split keeps every stage's (none of these): with none here, none stay.
    spare = Plan("m", 256, stages=(StageAssignment("b", 0, 3), StageAssignment("c", 3, 6)))
    assert sorted(source.prune(spare)) == sorted(cut[1:])


def _malformed_header(manifest) -> bytes:
    fields = {
        transfer.K_VERSION: transfer.VERSION,
        transfer.K_TYPE: transfer.T_HEADER,
        transfer.K_MANIFEST: manifest.to_cbor(),
        transfer.K_CHUNK: "a lot",
        transfer.K_HASHES: b"",
    }
    return transfer.FRAMING.encode(cbor2.dumps(fields))


async def test_a_malformed_header_ends_one_fetch_not_the_spares_task(hub, whole, tmp_path, nursery):
    theirs = ArtifactStore(tmp_path / "theirs")
    _, manifest = theirs.ensure_layers(whole, 2, 4)
    liar = Liar(_malformed_header(manifest))
    a, b = await two_nodes(nursery, liar)
    views = _views(a.peer_id, manifest)
    source = _source(hub, tmp_path, views, lambda peer, label: b.open_stream(peer, label))
    stages = [
        StageAssignment(p, start, start + 2) for p, start in ((a.peer_id, 0), ("c", 2), ("d", 4))
    ]
    plan = Plan("m", 256, stages=tuple(stages))
    failed: set[tuple[str, int, int]] = set()
    with capture_logs() as logs:
        await source.prepare_spare(plan, failed, lambda: True)
    assert liar.gets == 1  # asked once: a peer that breaks the protocol is not asked again
    [why] = [e["error"] for e in logs if e["event"] == "artifact.peer_fetch_failed"]
    assert "chunk size" in why
    assert source.store.get(manifest.key) is None
