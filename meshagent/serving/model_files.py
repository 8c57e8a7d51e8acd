"""The model as this agent holds it: its file, what the file holds, and the store of the
artifacts cut from it (or fetched from peers)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from meshagent.engine.base import ModelInfo
from meshagent.models.artifacts import ArtifactStore
from meshagent.models.layout import ModelLayout


@dataclass(frozen=True)
class ModelFiles:
    path: Path  # the model file (a partial copy of a hub model, until completed)
    layout: ModelLayout  # its layers, tensors and family
    info: ModelInfo  # its name, vocabulary and chat template
    store: ArtifactStore  # stages and entries cut from it, and fetched ones
