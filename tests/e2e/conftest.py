from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import OpenAI

from meshagent.launch import AgentProcess, start_agent


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    """One agent process with default settings, shared by a test module."""
    proc = start_agent(Path(tmp_path_factory.mktemp("agent")))
    yield proc
    proc.stop()


@pytest.fixture
def client(agent: AgentProcess) -> OpenAI:
    return OpenAI(base_url=f"{agent.url}/v1", api_key="unused", max_retries=0, timeout=120)
