from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from meshagent import logs
from meshagent.engine.vocab import Vocab
from meshagent.launch import AgentProcess, start_agent
from meshagent.models.artifacts import ArtifactStore
from meshagent.models.default import default_model_path


@pytest.fixture(autouse=True)
def _loggers_never_cached(monkeypatch: pytest.MonkeyPatch) -> None:
    """A command run in process configures logging (`meshagent.logs`) to cache each logger
    on its first use, with that configuration's processors: a later configuration would leave
    those loggers out of every later test's `capture_logs`. In tests nothing is cached."""
    configure = logs.configure

    def uncached(*args, **kwargs) -> None:
        configure(*args, **kwargs)
        structlog.configure(cache_logger_on_first_use=False)

    monkeypatch.setattr(logs, "configure", uncached)


@pytest.fixture(scope="session")
def model_path() -> Path:
    return default_model_path()


@pytest.fixture(scope="session")
def vocab(model_path: Path) -> Iterator[Vocab]:
    """The embedded model's vocabulary alone (grammars, tokens)."""
    v = Vocab.load(model_path)
    yield v
    v.close()


@pytest.fixture(scope="session")
def model_id(model_path: Path) -> str:
    return model_path.name.removesuffix(".gguf")


@pytest.fixture
def spawn_agent(tmp_path: Path) -> Iterator:
    """Start real agent processes; each is stopped (and its log shown on failure) at the end."""
    started: list[AgentProcess] = []

    def spawn(*args: str, name: str = "agent", wait_model: bool = True) -> AgentProcess:
        agent = start_agent(tmp_path / name, *args, wait_model=wait_model)
        started.append(agent)
        return agent

    yield spawn
    for agent in started:  # all told to stop at once: each drains beside the others
        if agent.proc.poll() is None:
            agent.proc.terminate()
    for agent in started:
        agent.wait_stopped()


@pytest.fixture
def autojump_clock():
    import trio.testing

    return trio.testing.MockClock(autojump_threshold=0)


@pytest.fixture(scope="session")
def store(tmp_path_factory: pytest.TempPathFactory) -> ArtifactStore:
    """One artifact store for the session: each slice is cut once."""
    return ArtifactStore(Path(tmp_path_factory.mktemp("artifacts")))
