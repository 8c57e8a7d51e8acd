"""The artifact store under concurrent use: a spare cutting ahead of time and a load that
needs the same artifact at once get one good artifact, cut once."""

from __future__ import annotations

import threading

from meshagent.models.artifacts import ArtifactStore
from meshagent.models.layout import file_sha256


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
