from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from meshagent.engine.llama import LlamaEngine


@pytest.fixture(scope="session")
def engine(model_path: Path) -> Iterator[LlamaEngine]:
    eng = LlamaEngine(model_path, slots=4, slot_ctx=512)
    yield eng
    eng.close()
