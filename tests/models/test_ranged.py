"""Stage-only downloads against a local hub server: a partial copy fetches the header, then
only the tensor ranges of the artifact cut from it, and the artifact is byte-identical to the
one cut from the whole file; interrupted and corrupted downloads resume and recover."""

from __future__ import annotations

import hashlib
import json

import pytest

from meshagent.errors import ModelError
from meshagent.models.artifacts import ArtifactStore
from meshagent.models.gguf_file import GGUFFile
from meshagent.models.hub import locate, model_for_agent, partial_file
from meshagent.models.layout import inspect_model
from meshagent.models.names import HubName
from meshagent.models.ranged import (
    PartialModel,
    add_range,
    coalesce,
    missing,
    sidecar,
)
from meshagent.models.slicer import tensors_read
from meshagent.testing.tiny_gguf import write_tiny_model
from tests.models.fake_hub import FakeHub

REPO = "org/tiny-GGUF"
FILE = "tiny-F32.gguf"
PROBE = 4096  # a tiny model's header is a few KiB: fetch it in small steps


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    path = tmp_path_factory.mktemp("whole") / FILE
    return write_tiny_model(path, "llama", n_layers=6)


@pytest.fixture
def hub(whole):
    server = FakeHub({REPO: {FILE: whole.read_bytes()}})
    yield server
    server.close()


def _partial(hub, root):
    remote = locate(HubName(REPO), hub.url)
    path = root / FILE
    PartialModel.begin(path, remote, probe=PROBE)
    return path


def test_interval_arithmetic():
    assert add_range([(0, 4), (8, 10)], 4, 8) == [(0, 10)]
    assert add_range([(5, 6)], 0, 2) == [(0, 2), (5, 6)]
    assert missing([(0, 10)], [(2, 4), (6, 7)]) == [(0, 2), (4, 6), (7, 10)]
    assert missing([(3, 5)], [(0, 10)]) == []
    assert coalesce([(10, 20), (0, 5), (22, 30)], gap=2) == [(0, 5), (10, 30)]


@pytest.mark.parametrize(
    ("kind", "start", "end"),
    [("entry", 0, 0), ("layers", 0, 2), ("layers", 2, 4), ("layers", 4, 6), ("layers", 0, 6)],
    ids=["entry", "first", "middle", "last", "whole"],
)
def test_an_artifact_from_ranges_is_the_one_cut_from_the_whole_file(
    whole, hub, tmp_path, kind, start, end
):
    reference = ArtifactStore(tmp_path / "ref")
    path = _partial(hub, tmp_path / "remote")
    header = PartialModel(path).header_bytes
    served_for_header = hub.served
    assert header < served_for_header < header + 2 * PROBE  # the header, and little more
    layout = inspect_model(path)
    assert layout.to_dict() | {"path": ""} == inspect_model(whole).to_dict() | {"path": ""}
    store = ArtifactStore(tmp_path / "store")
    if kind == "entry":
        cut, m = store.ensure_entry(path, layout)
        ref, r = reference.ensure_entry(whole)
    else:
        cut, m = store.ensure_layers(path, start, end, layout)
        ref, r = reference.ensure_layers(whole, start, end)
    assert m.sha256 == r.sha256 and cut.read_bytes() == ref.read_bytes()
    assert m.key == r.key  # the same source hash: the hub's sha256 of the whole file
    # What came over the wire for the artifact: its tensor bytes, give or take alignment.
    sizes = {t.name: t.n_bytes for t in GGUFFile(whole).tensors}
    tensors = sum(sizes[n] for n in tensors_read(layout, kind, start, end))
    # (The header's last request may have brought the first tensor's first bytes.)
    fetched = hub.served
    assert tensors <= fetched <= served_for_header + tensors * 1.01 + 4096, (fetched, tensors)
    if (start, end) != (0, 6):  # a stage's bytes, well under the whole file's
        assert fetched < 0.7 * whole.stat().st_size
    assert PartialModel(path).fetched == hub.served
    # A second cut of the same artifact asks nothing more.
    asked = len(hub.requests)
    store2 = ArtifactStore(tmp_path / "store2")
    if kind == "entry":
        store2.ensure_entry(path, layout)
    else:
        store2.ensure_layers(path, start, end, layout)
    assert len(hub.requests) == asked


def test_an_interrupted_download_resumes_where_it_stopped(hub, tmp_path, whole):
    path = _partial(hub, tmp_path)
    layout = inspect_model(path)
    store = ArtifactStore(tmp_path / "store")
    hub.cut_after = 100_000  # each response stops after 100 kB
    with pytest.raises(ModelError, match=r"stopped at byte .* the next try resumes there"):
        store.ensure_layers(path, 1, 5, layout)
    assert store.all() == []  # nothing half-cut is installed
    kept = PartialModel(path).held
    hub.cut_after = None
    before = hub.served
    _, m = store.ensure_layers(path, 1, 5, layout)
    _, r = ArtifactStore(tmp_path / "ref").ensure_layers(whole, 1, 5)
    assert m.sha256 == r.sha256
    need = sum(layout.layer_bytes[1:5])
    header = PartialModel(path).header_bytes
    # The resumed download fetched only what the first one had not.
    assert hub.served - before <= need - (kept - header - 2 * PROBE) + 4096


def test_a_server_that_stops_answering_gives_a_one_line_error(hub, tmp_path):
    path = _partial(hub, tmp_path)
    layout = inspect_model(path)
    hub.close()
    with pytest.raises(ModelError) as e:
        ArtifactStore(tmp_path / "store").ensure_layers(path, 0, 2, layout)
    assert "\n" not in str(e.value) and "the next try resumes there" in str(e.value)


def test_wrong_bytes_are_forgotten_and_fetched_again(hub, tmp_path, whole):
    path = _partial(hub, tmp_path)
    layout = inspect_model(path)
    part = PartialModel(path)
    ranges = part.tensor_ranges(["blk.3.ffn_up.weight"])
    part.ensure(ranges)
    a, b = ranges[0]
    with path.open("r+b") as f:  # the bytes on disk go bad
        f.seek(a)
        f.write(bytes(b - a))
    store = ArtifactStore(tmp_path / "store")
    _, bad = store.ensure_layers(path, 3, 4, layout)
    _, good = ArtifactStore(tmp_path / "ref").ensure_layers(whole, 3, 4)
    assert bad.sha256 != good.sha256  # what the mesh's published hash would catch
    PartialModel(path).forget(PartialModel(path).tensor_ranges(["blk.3.ffn_up.weight"]))
    store.drop(bad.key)
    _, again = store.ensure_layers(path, 3, 4, layout)
    assert again.sha256 == good.sha256


def test_whole_completes_and_checks_the_hubs_sha256(hub, tmp_path, whole):
    path = _partial(hub, tmp_path)
    part = PartialModel(path)
    part.ensure_whole()
    assert path.read_bytes() == whole.read_bytes()
    assert PartialModel(path).complete
    assert PartialModel(path).fetched == whole.stat().st_size  # no byte twice


def test_a_file_that_changed_on_the_hub_is_caught(hub, tmp_path, whole):
    path = _partial(hub, tmp_path)
    data = bytearray(whole.read_bytes())
    data[-1] ^= 0xFF
    hub.repos[REPO][FILE] = bytes(data)  # another sha256 now (its ETag says so)
    with pytest.raises(ModelError, match="changed on the hub"):
        PartialModel(path).ensure_whole()


def _for_small_agent(hub, root, monkeypatch):
    """What `up` starts an agent that offers too little memory for the model with."""
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(root / "cache"))
    return model_for_agent(HubName(REPO), root / "models", weights_offer=1000)


def test_a_restart_finds_the_partial_copy_without_asking(hub, tmp_path, monkeypatch):
    path = _for_small_agent(hub, tmp_path, monkeypatch)
    assert PartialModel(path).header_bytes > 0 and PartialModel(path).held <= 256 << 10
    asked = len(hub.requests)
    assert partial_file(HubName(REPO, "F32"), tmp_path / "models") == path
    assert _for_small_agent(hub, tmp_path, monkeypatch) == path
    assert len(hub.requests) == asked
    meta = json.loads(sidecar(path).read_text())
    assert meta["remote"]["sha256"] == hashlib.sha256(hub.repos[REPO][FILE]).hexdigest()


def test_the_disk_check_refuses_a_download_that_cannot_fit(hub, tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    path = _partial(hub, tmp_path)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(10**6, 10**6, 1000))
    with pytest.raises(ModelError, match="B free: free some space"):
        PartialModel(path).ensure_whole()


@pytest.fixture
def small_disk(tmp_path):
    """A 640 KiB filesystem of its own (tmpfs; needs root, as the namespace tests do)."""
    import subprocess

    where = tmp_path / "disk"
    where.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=640k", "tmpfs", str(where)])
    if r.returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    yield where
    subprocess.run(["umount", str(where)], check=True)


def test_a_disk_that_fills_mid_download_says_so_and_keeps_what_landed(
    hub, small_disk, monkeypatch, whole
):
    import meshagent.models.ranged as ranged

    path = _partial(hub, small_disk)
    assert whole.stat().st_size > 640 << 10  # the whole file cannot fit
    with pytest.raises(ModelError, match="B free: free some space"):
        PartialModel(path).ensure_whole()  # refused before a byte is fetched
    monkeypatch.setattr(ranged, "check_room", lambda *a: None)  # as if the space went later
    with pytest.raises(ModelError) as e:
        PartialModel(path).ensure_whole()
    assert "is full while downloading" in str(e.value) and "\n" not in str(e.value)
    part = PartialModel(path)
    assert not part.complete and part.held < whole.stat().st_size
    data = whole.read_bytes()
    with path.open("rb") as f:  # what the sidecar says is here is the file's bytes
        for a, b in part.done:
            f.seek(a)
            assert f.read(b - a) == data[a:b]


def test_models_list_shows_a_partial_copy(hub, tmp_path, capsys, monkeypatch):
    from meshagent.cli.main import main

    _for_small_agent(hub, tmp_path / "d", monkeypatch)
    assert main(["models", "list", "--data-dir", str(tmp_path / "d")]) == 0
    out = capsys.readouterr().out
    assert f"partial  {REPO}/{FILE}" in out and "(stage-only)" in out
    assert main(["models", "list", "--json", "--data-dir", str(tmp_path / "d")]) == 0
    [part] = json.loads(capsys.readouterr().out)["partial"]
    assert part["file"] == FILE and not part["complete"]


def test_offline_a_missing_range_is_a_clear_error_not_a_request(hub, tmp_path, monkeypatch):
    from huggingface_hub import constants

    path = _partial(hub, tmp_path)
    asked = len(hub.requests)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelError, match="HF_HUB_OFFLINE is set"):
        ArtifactStore(tmp_path / "store").ensure_layers(path, 0, 2, inspect_model(path))
    assert len(hub.requests) == asked
