"""The fake model served whole, and an app over it alone, for the endpoints' tests."""

from __future__ import annotations

import pytest

from meshagent.api.app import OpenAIApp
from meshagent.api.inflight import InFlight
from meshagent.serving.local_model import LocalModel
from meshagent.testing.fake_engine import FakeEngine
from tests.api.test_forwarding import StaticDirectory


@pytest.fixture
async def fake_model(nursery) -> LocalModel:
    model = LocalModel.whole(FakeEngine(slots=2, delay=0.002), max_queue=4)
    await nursery.start(model.run)
    return model


@pytest.fixture
def fake_app(fake_model) -> OpenAIApp:
    return OpenAIApp(StaticDirectory([fake_model]), InFlight(), lambda: {})
