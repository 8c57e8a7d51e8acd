"""A model of this mesh that no one serves for a moment (its placement is changing after a
lost peer) is waited for, within the directory's bound, rather than reported missing."""

from __future__ import annotations

import httpx
import trio

from meshagent.api.app import OpenAIApp
from meshagent.api.inflight import InFlight
from meshagent.serving.local_model import LocalModel
from meshagent.testing.fake_engine import FakeEngine
from tests.api.test_forwarding import StaticDirectory, serve


class Placing(StaticDirectory):
    """Serves `model` only while `local` holds it; says it is worth waiting `bound` s."""

    def __init__(self, model: LocalModel, bound: float) -> None:
        super().__init__()
        self.model, self.bound = model, bound
        self.why: str | None = None

    def unserved_for_now(self, name: str) -> float:
        return self.bound if name.casefold() == self.model.info.id.casefold() else 0.0

    def why_unserved(self, name: str) -> str | None:
        return self.why


async def test_a_request_waits_for_a_model_being_placed_again(nursery):
    model = LocalModel.whole(FakeEngine(), max_queue=4)
    await nursery.start(model.run)
    directory = Placing(model, bound=10.0)
    url, stop = await serve(nursery, OpenAIApp(directory, InFlight(), lambda: {}))

    async def placed_again() -> None:
        await trio.sleep(1.0)
        directory.local = [model]

    nursery.start_soon(placed_again)
    body = {"model": model.info.id, "prompt": "alpha", "max_tokens": 4}
    async with httpx.AsyncClient(timeout=30) as client:
        t0 = trio.current_time()
        r = await client.post(f"{url}/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert trio.current_time() - t0 >= 0.9  # it waited for the model to be served
        # A model this mesh does not have is missing at once.
        t0 = trio.current_time()
        r = await client.post(f"{url}/v1/completions", json={**body, "model": "nope"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert trio.current_time() - t0 < 0.5
        # One that does not come back within the bound is temporarily unavailable.
        directory.local, directory.bound = [], 0.5
        r = await client.post(f"{url}/v1/completions", json=body)
        assert r.status_code == 503 and r.json()["error"]["code"] == "split_unavailable"
        assert r.headers["retry-after"] == "5"
        # One that no plan can host says why at once, rather than after the bound.
        directory.bound = 30.0
        directory.why = "it needs 210 MB more memory"
        t0 = trio.current_time()
        r = await client.post(f"{url}/v1/completions", json=body)
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_not_served"
        assert "not served: it needs 210 MB more memory" in r.json()["error"]["message"]
        assert trio.current_time() - t0 < 1.0
    stop.set()
