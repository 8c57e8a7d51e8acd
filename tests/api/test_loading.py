"""A catalogued model no agent serves is loaded for the request that asks for it: the request
is metered as the model's demand (with its keep_alive), waits for the model, and a stream that
waits long opens early and is kept alive with SSE comments; a model that cannot be placed, or
does not load in time, is a 503 saying so (an error event once the stream is open)."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import trio

from meshagent.api import catalog as api_catalog
from meshagent.api import completions
from meshagent.api.app import OpenAIApp
from meshagent.api.inflight import InFlight
from meshagent.serving.local_model import LocalModel
from meshagent.testing.fake_engine import FakeEngine
from tests.api.test_forwarding import StaticDirectory, serve


class Catalogue:
    def __init__(self, *names: str) -> None:
        self._entries = {
            n: SimpleNamespace(
                name=n, architecture="llama", n_layers=4, size=1, sha256="a" * 64, time=0
            )
            for n in names
        }

    def entries(self) -> dict:
        return dict(self._entries)


class Loads:
    def __init__(self, load_timeout: float = 30.0) -> None:
        self.load_timeout = load_timeout
        self.began: list[str] = []
        self.ended: list[tuple[str, int, float | None]] = []
        self.why: str | None = None
        self.waiting = False

    def begin(self, model_id: str) -> None:
        self.began.append(model_id)

    def end(self, model_id: str, tokens: int, keep_alive: float | None = None) -> None:
        self.ended.append((model_id, tokens, keep_alive))

    def why_not_placed(self, name: str) -> str | None:
        return self.why

    def may_yet_place(self, name: str) -> bool:
        return self.waiting

    def expires_at(self, name: str) -> float | None:
        return None


async def _setup(nursery, loads: Loads):
    model = LocalModel.whole(FakeEngine(), max_queue=4)
    await nursery.start(model.run)
    directory = StaticDirectory()
    app = OpenAIApp(
        directory, InFlight(), lambda: {}, catalogue=Catalogue(model.info.id), loads=loads
    )
    url, _ = await serve(nursery, app)
    return model, directory, url


async def test_a_stream_waiting_for_its_model_is_kept_alive_then_answered(nursery, monkeypatch):
    monkeypatch.setattr(completions, "LOAD_KEEP_ALIVE", 0.2)
    loads = Loads()
    model, directory, url = await _setup(nursery, loads)

    async def loaded() -> None:
        await trio.sleep(1.0)
        directory.local = [model]

    nursery.start_soon(loaded)
    body = {"model": model.info.id, "prompt": "alpha", "max_tokens": 4, "stream": True}
    async with httpx.AsyncClient(timeout=30) as client:
        r = await client.post(f"{url}/v1/completions", json={**body, "keep_alive": "2m"})
    assert r.status_code == 200
    text = r.text
    assert text.startswith(f": loading {model.info.id}\n\n")  # kept alive while it loaded
    assert text.count(": loading") >= 3 and text.rstrip().endswith("data: [DONE]")
    assert loads.began == [model.info.id]
    with trio.fail_after(2):  # (the request ends on the server just after its last byte)
        while not loads.ended:
            await trio.sleep(0.01)
    [(name, tokens, keep_alive)] = loads.ended
    assert name == model.info.id and tokens > 0 and keep_alive == 120.0


async def test_a_model_that_cannot_be_placed_ends_the_open_stream_with_an_error_event(
    nursery, monkeypatch
):
    monkeypatch.setattr(completions, "LOAD_KEEP_ALIVE", 0.2)
    monkeypatch.setattr(api_catalog, "LOAD_SETTLE", 0.5)
    loads = Loads()
    loads.why = "no memory anywhere: needs 2.1 GB on one peer"
    model, _, url = await _setup(nursery, loads)
    body = {"model": model.info.id, "prompt": "alpha", "max_tokens": 4, "stream": True}
    async with httpx.AsyncClient(timeout=30) as client:
        r = await client.post(f"{url}/v1/completions", json=body)
        assert r.status_code == 200  # opened (kept alive) before the reason held
        assert '"code": "model_not_served"' in r.text and "no memory anywhere" in r.text
        assert "[DONE]" not in r.text
        # Not streamed: a 503 with the reason, and no comment.
        r = await client.post(f"{url}/v1/completions", json={**body, "stream": False})
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_not_served"
        assert r.headers["retry-after"] == str(api_catalog.LOAD_RETRY_AFTER)
    assert loads.began == [model.info.id] * 2
    with trio.fail_after(2):
        while len(loads.ended) < 2:
            await trio.sleep(0.01)


async def test_a_model_that_does_not_load_in_time_is_a_503_and_a_bad_keep_alive_a_400(nursery):
    loads = Loads(load_timeout=0.5)
    model, _, url = await _setup(nursery, loads)
    body = {"model": model.info.id, "prompt": "alpha", "max_tokens": 4}
    async with httpx.AsyncClient(timeout=30) as client:
        r = await client.post(f"{url}/v1/completions", json=body)
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading"
        assert "did not load within 0.5 s" in r.json()["error"]["message"]
        r = await client.post(f"{url}/v1/completions", json={**body, "keep_alive": [1]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "keep_alive"
    assert loads.began == [model.info.id]  # the refused request was never demand


async def test_a_request_waits_past_a_reason_while_the_mesh_may_yet_place_its_model(
    nursery, monkeypatch
):
    # Peers still taking the model up (or busy models holding its memory): the reason the
    # mesh gives now is not believed, the request waits and is answered once it loads.
    monkeypatch.setattr(api_catalog, "LOAD_SETTLE", 0.2)
    loads = Loads()
    loads.why = "needs 1.14 GB across the mesh, the mesh offers 0.81 GB"
    loads.waiting = True
    model, directory, url = await _setup(nursery, loads)

    async def loaded() -> None:
        await trio.sleep(1.0)
        directory.local = [model]

    nursery.start_soon(loaded)
    body = {"model": model.info.id, "prompt": "alpha", "max_tokens": 4}
    async with httpx.AsyncClient(timeout=30) as client:
        r = await client.post(f"{url}/v1/completions", json=body)
    assert r.status_code == 200, r.text
