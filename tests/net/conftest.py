import pytest
import trio.testing

from tests.net.support import NetEnv


@pytest.fixture(params=["tcp", "sim"])
def env(request) -> NetEnv:
    """Every overlay test runs over real loopback TCP and over the simulated network."""
    return NetEnv(request.param)


@pytest.fixture
def clock(env):
    """The simulated network runs on a virtual clock that jumps whenever all tasks wait."""
    return trio.testing.MockClock(autojump_threshold=0) if env.kind == "sim" else None


@pytest.fixture
def sim_env() -> NetEnv:
    return NetEnv("sim")
