from __future__ import annotations

from pathlib import Path

import pytest

from meshagent.models.artifacts import ArtifactStore


@pytest.fixture(scope="session")
def store(tmp_path_factory: pytest.TempPathFactory) -> ArtifactStore:
    """One artifact store for the session: each slice is cut once."""
    return ArtifactStore(Path(tmp_path_factory.mktemp("artifacts")))
