"""The mesh's catalogue over the control API: `GET /control/models` lists it, `POST` adds a
model by path or name (resolving it off the event loop), `DELETE /control/models/{name}`
removes one; `/v1/models` and ollama's `/api/tags` list every catalogued model, served or
not. The routes are the control plane's: the API key and the browser rules apply, and a
member of the mesh cannot reach them over `gen/1`."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import trio

from meshagent.api.access import Access
from meshagent.api.app import OpenAIApp
from meshagent.api.entry import prepare_carried
from meshagent.api.errors import ApiError
from meshagent.api.inflight import InFlight
from meshagent.catalog.service import Catalog
from meshagent.identity.keys import NodeIdentity
from meshagent.models.artifacts import ArtifactStore
from meshagent.models.files import file_sha256
from meshagent.testing.tiny_gguf import write_tiny_model
from tests.api.asgi import HOST, JSON, call
from tests.api.test_forwarding import StaticDirectory

ME = NodeIdentity.generate()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("m") / "tiny-llama.gguf", "llama")


@pytest.fixture
def catalogue(tmp_path: Path) -> Catalog:
    return Catalog(ME, tmp_path / "catalog.cbor", ArtifactStore(tmp_path / "artifacts"))


@pytest.fixture
def app(fake_model, catalogue) -> OpenAIApp:
    return OpenAIApp(StaticDirectory([fake_model]), InFlight(), lambda: {}, catalogue=catalogue)


def _cards(answer) -> dict[str, dict]:
    return {c["id"]: c["meshagent"] for c in answer.json()["data"]}


async def test_a_model_added_is_listed_by_the_catalogue_and_the_model_lists(app, tiny):
    assert (await call(app, "GET", "/control/models")).json() == {"models": []}
    r = await call(app, "POST", "/control/models", body={"model": str(tiny)})
    assert r.status == 200, r.body
    added = r.json()
    assert (added["name"], added["op"], added["author"]) == ("tiny-llama", "add", ME.peer_id)
    assert added["sha256"] == file_sha256(tiny) and added["source"] == str(tiny)
    listed = (await call(app, "GET", "/control/models")).json()["models"]
    assert listed == [added]
    cards = _cards(await call(app, "GET", "/v1/models"))
    assert cards["tiny-llama"]["catalogued"] is True and cards["tiny-llama"]["loaded"] is False
    assert cards["tiny-llama"]["size_bytes"] == tiny.stat().st_size
    assert cards["fake"]["catalogued"] is False and cards["fake"]["loaded"] is True
    card = (await call(app, "GET", "/v1/models/tiny-llama")).json()
    assert card["id"] == "tiny-llama" and card["meshagent"]["loaded"] is False
    tags = (await call(app, "GET", "/api/tags")).json()["models"]
    assert [t["name"] for t in tags] == ["fake", "tiny-llama"]
    assert tags[1]["details"]["family"] == "llama"


async def test_a_served_model_that_is_catalogued_says_so(fake_model, tmp_path, tiny):
    fake_file = tmp_path / "fake.gguf"
    fake_file.write_bytes(tiny.read_bytes())  # a file whose name is the served model's
    catalogue = Catalog(ME, tmp_path / "c.cbor", ArtifactStore(tmp_path / "a"))
    await catalogue.add(str(fake_file))
    app = OpenAIApp(StaticDirectory([fake_model]), InFlight(), lambda: {}, catalogue=catalogue)
    cards = (await call(app, "GET", "/v1/models")).json()["data"]
    assert [c["id"] for c in cards] == ["fake"]
    assert cards[0]["meshagent"]["catalogued"] is True
    assert cards[0]["meshagent"]["served_by"] == "local"


async def test_a_removed_model_leaves_every_list(app, tiny):
    await call(app, "POST", "/control/models", body={"model": str(tiny)})
    r = await call(app, "DELETE", "/control/models/tiny-llama", headers=[HOST])
    assert r.status == 200
    assert (r.json()["op"], r.json()["version"]) == ("remove", 2)
    assert (await call(app, "GET", "/control/models")).json() == {"models": []}
    assert list(_cards(await call(app, "GET", "/v1/models"))) == ["fake"]
    again = await call(app, "DELETE", "/control/models/tiny-llama", headers=[HOST])
    assert again.status == 404 and again.json()["error"]["code"] == "model_not_found"
    unknown = await call(app, "DELETE", "/control/models/never-added", headers=[HOST])
    assert unknown.status == 404


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"model": "/nowhere/missing.gguf"}, "not found"),
        ({"model": "not a:name:at all"}, "neither"),
        ({"model": 5}, "PATH_OR_NAME"),
        ({"model": ""}, "PATH_OR_NAME"),
        ({"name": "x"}, "PATH_OR_NAME"),
        ({"model": "x" * 5000}, "PATH_OR_NAME"),
    ],
)
async def test_a_bad_name_or_path_is_a_clear_400(app, body, says):
    r = await call(app, "POST", "/control/models", body=body)
    assert r.status == 400
    assert says in r.json()["error"]["message"]
    assert (await call(app, "GET", "/control/models")).json() == {"models": []}


async def test_a_file_that_is_not_a_model_is_a_400(app, tmp_path):
    (tmp_path / "notes.gguf").write_text("not a model")
    r = await call(app, "POST", "/control/models", body={"model": str(tmp_path / "notes.gguf")})
    assert r.status == 400 and "GGUF" in r.json()["error"]["message"]


async def test_other_requests_go_on_while_a_model_downloads(fake_model, tmp_path, tiny):
    release = threading.Event()

    def slow_resolve(spec: str) -> Path:  # a hub download, as long as the test wants
        release.wait(10)
        return tiny

    catalogue = Catalog(
        ME, tmp_path / "c.cbor", ArtifactStore(tmp_path / "a"), resolve=slow_resolve
    )
    app = OpenAIApp(StaticDirectory([fake_model]), InFlight(), lambda: {}, catalogue=catalogue)
    answers = []

    async def add() -> None:
        answers.append(await call(app, "POST", "/control/models", body={"model": "org/repo"}))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(add)
        await trio.sleep(0.05)
        with trio.fail_after(2):
            assert (await call(app, "GET", "/control/models")).json() == {"models": []}
            assert (await call(app, "GET", "/health")).status == 200
        assert answers == []
        release.set()
    assert answers[0].status == 200 and answers[0].json()["source"] == "org/repo"


async def test_the_routes_need_the_api_key_and_json(fake_model, catalogue, tiny):
    app = OpenAIApp(
        StaticDirectory([fake_model]),
        InFlight(),
        lambda: {},
        access=Access(keys=("sekrit",)),
        catalogue=catalogue,
    )
    key = (b"authorization", b"Bearer sekrit")
    assert (await call(app, "GET", "/control/models")).status == 401
    body = {"model": str(tiny)}
    assert (await call(app, "POST", "/control/models", body=body)).status == 401
    assert (await call(app, "DELETE", "/control/models/x", headers=[HOST])).status == 401
    refused = await call(app, "POST", "/control/models", headers=[HOST, key], body=body)
    assert refused.status == 415  # a page may send text/plain without asking first
    page = (b"origin", b"http://evil.example")
    r = await call(app, "POST", "/control/models", headers=[HOST, key, JSON, page], body=body)
    assert r.status == 403
    assert catalogue.entries() == {}
    r = await call(app, "POST", "/control/models", headers=[HOST, key, JSON], body=body)
    assert r.status == 200


async def test_an_app_without_a_catalogue_has_no_such_routes(fake_app):
    assert (await call(fake_app, "GET", "/control/models")).status == 404
    r = await call(fake_app, "DELETE", "/control/models/x", headers=[HOST])
    assert r.status == 404


async def test_a_member_over_gen_1_cannot_reach_the_catalogue(app):
    for path in ("/control/models", "/control/models/tiny-llama"):
        with pytest.raises(ApiError) as refused:
            prepare_carried(app.catalog, path, b'{"model": "x"}')
        assert refused.value.status == 404
