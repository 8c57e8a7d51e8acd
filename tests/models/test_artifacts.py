"""The artifact store under concurrent use: a spare cutting ahead of time and a load that
needs the same artifact at once get one good artifact, cut once."""

from __future__ import annotations

import os
import threading

from meshagent.models.artifacts import ArtifactStore
from meshagent.models.files import file_sha256


def test_two_threads_cutting_the_same_layers_get_one_good_artifact(model_path, tmp_path, capsys):
    store = ArtifactStore(tmp_path)
    got: list = []
    start = threading.Barrier(2)

    def cut() -> None:
        start.wait()
        got.append(store.ensure_layers(model_path, 0, 3))

    threads = [threading.Thread(target=cut) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    (path_a, manifest_a), (path_b, manifest_b) = got
    assert path_a == path_b and manifest_a == manifest_b
    assert file_sha256(path_a) == manifest_a.sha256  # not two writers' bytes interleaved
    assert len(store.all()) == 1
    assert not list(store.blobs.glob("*.tmp"))


def test_a_prune_keeps_what_is_needed_and_as_many_bytes_again_of_the_newest(model_path, tmp_path):
    store = ArtifactStore(tmp_path)
    cut = {r: store.ensure_layers(model_path, *r)[1] for r in [(0, 5), (5, 10), (10, 20), (20, 30)]}
    for age, r in enumerate([(20, 30), (5, 10), (0, 5)]):  # newest first; (10, 20) is kept
        t = 1_000_000 - 1000 * age
        os.utime(store.manifests / f"{cut[r].key}.json", (t, t))
    source = cut[(0, 5)].source_sha256
    keep = {cut[(10, 20)].key}
    # Room for as many bytes again as the 10 layers kept: (20, 30), the newest, is bigger
    # (it carries the output head); (5, 10) fits; (0, 5) no longer does (each artifact has
    # its header too).
    assert store.prune(source, keep) == [cut[(20, 30)].key, cut[(0, 5)].key]
    assert {m.key for m in store.all()} == {cut[(10, 20)].key, cut[(5, 10)].key}
    assert not store.blob_path(cut[(0, 5)].sha256).exists()
    assert not store.blob_path(cut[(20, 30)].sha256).exists()
    # Using an artifact makes it the newest: cut again, (0, 5) stays and (5, 10) goes.
    store.ensure_layers(model_path, 0, 5)
    os.utime(store.manifests / f"{cut[(5, 10)].key}.json", (1_000_000, 1_000_000))
    assert store.prune(source, keep) == [cut[(5, 10)].key]
    store.ensure_layers(model_path, 0, 5)  # a use touches it
    assert store.prune(source, keep) == []
    # Artifacts of another model are not touched, nor those kept.
    assert store.prune("0" * 64, set()) == []
    assert store.prune(source, {m.key for m in store.all()}) == []
