"""The catalogue of one agent: a model added here by path or name is read, signed and kept
on disk; a removal is a signed tombstone; what peers gossip is merged in, and what changed
is published to gossip at once."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio
from structlog.testing import capture_logs

from meshagent.catalog.book import MAX_LIVE
from meshagent.catalog.book_file import load_entries, save_entries
from meshagent.catalog.entry import SignedEntry
from meshagent.catalog.service import Catalog
from meshagent.errors import CatalogError, ModelError, NotCatalogued
from meshagent.identity.keys import NodeIdentity
from meshagent.models.artifacts import ArtifactStore
from meshagent.models.files import file_sha256
from meshagent.models.layout import inspect_model
from meshagent.placement.planner import ModelCost
from meshagent.testing.tiny_gguf import write_tiny_model
from tests.catalog.support import T0, signed_add, signed_remove

ME, PEER = NodeIdentity.generate(), NodeIdentity.generate()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("m") / "tiny-llama.gguf", "llama")


def catalog_in(tmp_path: Path, **kw: Any) -> Catalog:
    """A catalogue whose clock reads a minute past the tests' entries' time (`T0`)."""
    kw.setdefault("clock", lambda: T0 + 60.0)
    return Catalog(ME, tmp_path / "catalog.cbor", ArtifactStore(tmp_path / "artifacts"), **kw)


def gossiping(*blobs: bytes) -> SimpleNamespace:
    return SimpleNamespace(record=SimpleNamespace(catalog=blobs))


async def test_a_model_added_by_path_is_read_signed_and_kept(tmp_path, tiny):
    catalog = catalog_in(tmp_path)
    signed = await catalog.add(str(tiny))
    entry = catalog.entries()["tiny-llama"]
    assert signed.entry == entry and signed.author == ME.peer_id
    assert entry.source == str(tiny) and entry.sha256 == file_sha256(tiny)
    assert entry.size == tiny.stat().st_size
    assert entry.cost() == ModelCost.from_layout("tiny-llama", inspect_model(tiny))
    assert catalog.published() == (signed.to_bytes(),)
    assert catalog.entry("TINY-LLAMA") == entry
    # Kept on disk: the next start has it, and gossips it.
    again = catalog_in(tmp_path)
    assert again.entries() == catalog.entries()
    assert again.published() == catalog.published()


async def test_a_relative_path_is_recorded_absolute(tmp_path, tiny, monkeypatch):
    monkeypatch.chdir(tiny.parent)
    signed = await catalog_in(tmp_path).add("./tiny-llama.gguf")
    assert signed.entry.source == str(tiny)


async def test_a_model_added_by_name_records_the_name_and_resolves_it_here(tmp_path, tiny):
    asked = []

    def resolve(spec: str) -> Path:
        asked.append(spec)
        return tiny

    signed = await catalog_in(tmp_path, resolve=resolve).add("org/repo:q4_k_m")
    assert asked == ["org/repo:q4_k_m"]
    assert signed.entry.source == "org/repo:q4_k_m" and signed.entry.name == "tiny-llama"


async def test_what_cannot_be_had_is_a_model_error_and_adds_nothing(tmp_path):
    catalog = catalog_in(tmp_path)
    with pytest.raises(ModelError, match="not found"):
        await catalog.add(str(tmp_path / "missing.gguf"))
    (tmp_path / "text.gguf").write_text("not a model")
    with pytest.raises(ModelError, match="GGUF"):
        await catalog.add(str(tmp_path / "text.gguf"))
    with pytest.raises(ModelError, match="neither"):
        await catalog.add("not a:name:at all")
    assert catalog.entries() == {} and catalog.generation == 0


async def test_the_same_file_added_again_keeps_its_entry(tmp_path, tiny):
    catalog = catalog_in(tmp_path)
    first = await catalog.add(str(tiny))
    assert await catalog.add(str(tiny)) == first
    assert catalog.generation == 1


async def test_a_removal_is_a_tombstone_that_a_readd_overrules(tmp_path, tiny):
    catalog = catalog_in(tmp_path)
    await catalog.add(str(tiny))
    tomb = catalog.remove("Tiny-Llama")
    assert (tomb.entry.op, tomb.entry.version, tomb.entry.name) == ("remove", 2, "tiny-llama")
    assert catalog.entries() == {}
    assert catalog.published() == (tomb.to_bytes(),)  # the tombstone travels
    with pytest.raises(NotCatalogued):
        catalog.remove("tiny-llama")
    with pytest.raises(NotCatalogued):
        catalog.remove("never-added")
    again = await catalog.add(str(tiny))
    assert again.entry.version == 3 and "tiny-llama" in catalog.entries()
    assert catalog_in(tmp_path).entries() == catalog.entries()


async def test_a_full_catalogue_refuses_another_model(tmp_path, tiny):
    catalog = catalog_in(tmp_path)
    catalog.heard(
        {"peer": gossiping(*(signed_add(PEER, name=f"m-{i}").to_bytes() for i in range(MAX_LIVE)))}
    )
    with pytest.raises(CatalogError, match=f"holds {MAX_LIVE} models"):
        await catalog.add(str(tiny))


def test_what_peers_gossip_is_merged_and_kept(tmp_path):
    catalog = catalog_in(tmp_path)
    add = signed_add(PEER)
    assert catalog.heard({"peer": gossiping(add.to_bytes())})
    assert catalog.signed_entries() == [add] and catalog.generation == 1
    assert not catalog.heard({"peer": gossiping(add.to_bytes())})
    # A removal heard from a third agent wins; the older add heard again does not undo it.
    tomb = signed_remove(NodeIdentity.generate(), version=2)
    assert catalog.heard({"peer": gossiping(add.to_bytes()), "other": gossiping(tomb.to_bytes())})
    assert catalog.entries() == {}
    assert not catalog.heard({"late": gossiping(add.to_bytes())})
    assert [s.entry.op for (s,) in [load_entries(tmp_path / "catalog.cbor")[0]]] == ["remove"]


def test_its_own_record_is_not_merged_again(tmp_path):
    catalog = catalog_in(tmp_path)
    assert not catalog.heard({ME.peer_id: gossiping(signed_add(PEER).to_bytes())})


def test_a_tombstone_expires_after_seven_days(tmp_path):
    now = [float(T0)]
    catalog = catalog_in(tmp_path, clock=lambda: now[0])
    catalog.heard({"peer": gossiping(signed_remove(PEER, time=T0).to_bytes())})
    assert catalog.published()
    now[0] += 7 * 24 * 3600 + 1
    assert catalog.expire()
    assert catalog.published() == ()


def test_a_file_that_is_not_a_catalogue_starts_an_empty_one(tmp_path):
    (tmp_path / "catalog.cbor").write_bytes(b"\x00garbage")
    with capture_logs() as logs:
        catalog = catalog_in(tmp_path)
    assert catalog.entries() == {}
    assert any(e["event"] == "catalog.refused" for e in logs)


def test_an_entry_altered_on_disk_is_left_out(tmp_path):
    good, other = signed_add(PEER, name="good"), signed_add(PEER, name="other")
    save_entries(tmp_path / "catalog.cbor", [good, other])
    data = bytearray((tmp_path / "catalog.cbor").read_bytes())
    i = data.find(b"other")
    data[i] ^= 1
    (tmp_path / "catalog.cbor").write_bytes(bytes(data))
    with capture_logs() as logs:
        catalog = catalog_in(tmp_path)
    assert list(catalog.entries()) == ["good"]
    assert [e["event"] for e in logs] == ["catalog.refused"]


class FakeGossip:
    """Gossip as the catalogue sees it: a snapshot, a generation, what was published."""

    def __init__(self) -> None:
        self.views: dict[str, Any] = {}
        self.generation = 0
        self.published: list[tuple[bytes, ...]] = []
        self.spread = 0
        self._changed = trio.Event()

    def snapshot(self) -> dict[str, Any]:
        return dict(self.views)

    def update_local(self, **fields: Any) -> None:
        self.published.append(fields["catalog"])
        self.bump()

    def spread_now(self) -> None:
        self.spread += 1

    def bump(self) -> None:
        self.generation += 1
        self._changed.set()
        self._changed = trio.Event()

    async def wait_changed(self, after: int) -> int:
        while self.generation <= after:
            await self._changed.wait()
        return self.generation


async def test_run_merges_what_gossip_brings_and_spreads_what_changed(tmp_path, tiny, nursery):
    catalog, gossip = catalog_in(tmp_path), FakeGossip()
    await nursery.start(catalog.run, gossip)
    await trio.testing.wait_all_tasks_blocked()
    assert gossip.published == []  # nothing to say yet
    add = signed_add(PEER, name="from-peer")
    gossip.views["peer"] = gossiping(add.to_bytes())
    gossip.bump()
    await trio.testing.wait_all_tasks_blocked()
    assert "from-peer" in catalog.entries()
    assert gossip.published[-1] == (add.to_bytes(),) and gossip.spread == 1
    # A model added here is published at once, without a gossip change.
    mine = await catalog.add(str(tiny))
    await trio.testing.wait_all_tasks_blocked()
    assert set(gossip.published[-1]) == {add.to_bytes(), mine.to_bytes()}
    assert gossip.spread == 2


async def test_wait_changed_returns_once_the_catalogue_changes(tmp_path, nursery):
    catalog = catalog_in(tmp_path)
    seen = []

    async def waiter() -> None:
        seen.append(await catalog.wait_changed(catalog.generation))

    nursery.start_soon(waiter)
    await trio.testing.wait_all_tasks_blocked()
    assert seen == []
    catalog.heard({"peer": gossiping(signed_add(PEER).to_bytes())})
    await trio.testing.wait_all_tasks_blocked()
    assert seen == [1]


def test_signed_entries_round_trip_through_the_file(tmp_path):
    entries = [signed_add(PEER, name=f"m-{i}") for i in range(3)] + [signed_remove(ME)]
    save_entries(tmp_path / "c.cbor", entries)
    loaded, refused = load_entries(tmp_path / "c.cbor")
    assert loaded == entries and refused == []
    assert all(isinstance(s, SignedEntry) for s in loaded)


async def test_a_download_that_fails_on_disk_is_a_model_error(tmp_path):
    def full_disk(spec: str) -> Path:
        raise OSError(28, "No space left on device")

    with pytest.raises(ModelError, match="No space left"):
        await catalog_in(tmp_path, resolve=full_disk).add("org/repo")
