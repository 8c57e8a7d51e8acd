"""Who may use the HTTP API (sans-IO): keys, loopback Host names, what stays open."""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import pytest

from meshagent import control
from meshagent.api.access import Access
from meshagent.api.app import OpenAIApp
from meshagent.api.inflight import InFlight
from meshagent.config import AgentConfig
from meshagent.discovery import probe
from meshagent.errors import ConfigError
from meshagent.net.address import is_loopback
from tests.api.asgi import HOST, call
from tests.api.test_forwarding import StaticDirectory


def bearer(key: str) -> list[tuple[bytes, bytes]]:
    return [HOST, (b"authorization", f"Bearer {key}".encode())]


def test_a_key_is_asked_on_every_path_but_health():
    access = Access.for_binding(["s3cret", "other"], "127.0.0.1", 9400)
    missing = access.refuse("GET", "/v1/models", [HOST])
    assert missing is not None and missing.status == 401 and missing.code == "invalid_api_key"
    assert "didn't provide an API key" in missing.message
    wrong = access.refuse("GET", "/control/status", bearer("nope"))
    assert wrong is not None and wrong.status == 401 and "Incorrect" in wrong.message
    assert access.refuse("GET", "/v1/chat/completions", bearer("s3cret")) is None
    assert access.refuse("GET", "/v1/chat/completions", bearer("other")) is None
    basic = [HOST, (b"authorization", b"Basic s3cret")]
    assert access.refuse("GET", "/v1/models", basic) is not None
    assert access.refuse("GET", "/health", []) is None
    body = missing.body()["error"]
    assert set(body) == {"message", "type", "param", "code"}


def test_a_loopback_api_answers_only_loopback_names():
    access = Access.for_binding([], "127.0.0.1", 9400)
    names = (b"127.0.0.1:9400", b"localhost:9400", b"LOCALHOST:9400", b"[::1]:9400", b"localhost")
    for host in names:
        assert access.refuse("GET", "/v1/models", [(b"host", host)]) is None, host
    for host in (b"evil.example:9400", b"127.0.0.1.nip.io:9400", b""):
        refused = access.refuse("GET", "/v1/models", [(b"host", host)])
        assert refused is not None and refused.status == 403, host
        assert refused.code == "host_not_allowed"
    # A LAN bind has no names to check against: the key guards it.
    assert Access.for_binding(["k"], "0.0.0.0", 9400).hosts == frozenset()


def test_no_key_is_allowed_only_on_loopback_unless_asked_for():
    for host in ("127.0.0.1", "::1", "localhost", "127.0.0.2"):
        assert is_loopback(host)
        AgentConfig(api_host=host).validate()
    for host in ("0.0.0.0", "192.168.1.5", "::", "myhost.lan"):
        assert not is_loopback(host)
        with pytest.raises(ConfigError, match="--api-key"):
            AgentConfig(api_host=host).validate()
        AgentConfig(api_host=host, api_keys=("k",)).validate()
        AgentConfig(api_host=host, insecure_no_api_key=True).validate()
    with pytest.raises(ConfigError, match="empty"):
        AgentConfig(api_keys=(" ",)).validate()


def test_the_console_page_needs_no_key_but_its_data_does_and_its_host_is_checked():
    access = Access.for_binding(["s3cret"], "127.0.0.1", 9400)
    assert access.refuse("GET", "/console", [HOST]) is None
    for path in ("/control/events", "/metrics"):
        refused = access.refuse("GET", path, [HOST])
        assert refused is not None and refused.status == 401, path
    foreign = access.refuse("GET", "/console", [(b"host", b"evil.example:9400")])
    assert foreign is not None and foreign.status == 403


# -- web pages of other sites, and bodies that are not JSON --------------------------------

OWN = [HOST]
JSON = (b"content-type", b"application/json")
FOREIGN_PAGES = [
    [(b"origin", b"http://evil.example")],
    [(b"origin", b"null")],  # a sandboxed frame, a file:// page
    [(b"origin", b"http://127.0.0.1:8080")],  # another local server's page
    [(b"origin", b"http://127.0.0.1:9400.evil.example")],
    [(b"sec-fetch-site", b"cross-site")],  # an <img> or a form: no Origin on a GET
    [(b"sec-fetch-site", b"same-site")],  # localhost:8080 is the same site as localhost:9400
]


@pytest.mark.parametrize("keys", [[], ["s3cret"]])
def test_a_request_from_a_page_of_another_site_is_refused_on_every_path(keys):
    access = Access.for_binding(keys, "127.0.0.1", 9400)
    auth = [(b"authorization", b"Bearer s3cret")] if keys else []
    for page in FOREIGN_PAGES:
        for method, path in (("POST", "/v1/chat/completions"), ("GET", "/control/status")):
            refused = access.refuse(method, path, [*OWN, *auth, *page, JSON])
            assert refused is not None and refused.status == 403, (page, path)
            assert refused.code == "origin_not_allowed"
            assert "another site" in refused.message
        assert access.refuse("GET", "/health", [*OWN, *page]) is not None, page


def test_the_agents_own_pages_and_clients_without_a_browser_are_served():
    access = Access.for_binding([], "127.0.0.1", 9400)
    assert access.refuse("POST", "/v1/chat/completions", [*OWN, JSON]) is None  # curl, SDKs
    for page in (
        [(b"origin", b"http://127.0.0.1:9400")],
        [(b"origin", b"HTTP://127.0.0.1:9400")],
        [(b"sec-fetch-site", b"same-origin")],  # the console's own fetch
        [(b"sec-fetch-site", b"none")],  # the user typed the address
        [(b"origin", b"http://127.0.0.1:9400"), (b"sec-fetch-site", b"same-origin")],
    ):
        assert access.refuse("GET", "/console", [*OWN, *page]) is None, page
        assert access.refuse("POST", "/control/probe", [*OWN, *page, JSON]) is None, page
    # Behind a TLS proxy that keeps the Host, the page's origin is https.
    lan = Access.for_binding(["k"], "0.0.0.0", 9400)
    proxied = [
        (b"host", b"mesh.example"),
        (b"origin", b"https://mesh.example"),
        (b"authorization", b"Bearer k"),
    ]
    assert lan.refuse("GET", "/control/status", proxied) is None


def test_a_post_body_must_be_declared_json():
    access = Access.for_binding([], "127.0.0.1", 9400)
    for given in (
        [(b"content-type", b"text/plain")],  # what a page may send without asking first
        [(b"content-type", b"application/x-www-form-urlencoded")],  # curl -d, a form
        [(b"content-type", b"multipart/form-data; boundary=x")],
        [(b"content-type", b"application/jsonx")],
        [],  # fetch() of raw bytes declares nothing
    ):
        refused = access.refuse("POST", "/v1/chat/completions", [*OWN, *given])
        assert refused is not None and refused.status == 415, given
        assert refused.code == "unsupported_media_type"
        assert "Content-Type: application/json" in refused.message
    for declared in (b"application/json", b"application/json; charset=utf-8", b"Application/JSON"):
        assert access.refuse("POST", "/v1/embeddings", [*OWN, (b"content-type", declared)]) is None
    assert access.refuse("GET", "/v1/models", OWN) is None  # no body, nothing to declare


# -- the same, through the app -------------------------------------------------------------


class OneLink:
    """An overlay with one connected peer that fails the test if a stream is opened to it."""

    def links(self):
        return [SimpleNamespace(peer_id="ab12cd34")]

    async def open_stream(self, *_):
        raise AssertionError("the probe went out")


def keyless_app() -> OpenAIApp:
    return OpenAIApp(
        StaticDirectory(),
        InFlight(),
        lambda: {"peer_id": "me"},
        peers=lambda: {"peers": []},
        probe=partial(control.probe, OneLink(), names=dict),
        access=Access.for_binding([], "127.0.0.1", 9400),
    )


async def test_the_default_agent_refuses_a_page_of_another_site_and_text_bodies():
    app = keyless_app()
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    page = (b"origin", b"http://evil.example")
    for headers in ([HOST, page, JSON], [HOST, page, (b"content-type", b"text/plain")]):
        r = await call(app, "POST", "/v1/chat/completions", headers=headers, body=chat)
        assert r.status == 403, r.body
        error = r.json()["error"]
        assert error["code"] == "origin_not_allowed"
        assert set(error) == {"message", "type", "param", "code"}
    r = await call(app, "GET", "/control/status", headers=[HOST, page])
    assert r.status == 403
    r = await call(app, "POST", "/control/probe", headers=[HOST, page, JSON], body={})
    assert r.status == 403

    text = [HOST, (b"content-type", b"text/plain")]
    r = await call(app, "POST", "/v1/chat/completions", headers=text, body=chat)
    assert r.status == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    r = await call(app, "POST", "/control/probe", headers=[HOST], body={"peer": "ab"})
    assert r.status == 415

    # Its own pages and plain clients are served as before.
    own = (b"origin", b"http://127.0.0.1:9400")
    assert (await call(app, "GET", "/control/status", headers=[HOST, own])).status == 200
    assert (await call(app, "GET", "/control/status", headers=[HOST])).status == 200
    console = [HOST, (b"sec-fetch-site", b"none")]
    page_of_console = await call(app, "GET", "/console", headers=console)
    assert page_of_console.status == 200 and b"/control/events" in page_of_console.body
    r = await call(app, "POST", "/v1/chat/completions", headers=[HOST, own, JSON], body=chat)
    assert r.status == 404 and r.json()["error"]["code"] == "model_not_found"  # it got through


async def test_a_probe_is_capped_in_size_and_time_before_it_goes_out():
    app = keyless_app()
    for body, named in (
        ({"peer": "ab12", "bytes": probe.MAX_BYTES + 1}, f"{probe.MAX_BYTES}"),
        ({"peer": "ab12", "bytes": 1 << 30}, f"{probe.MAX_BYTES}"),
        ({"peer": "ab12", "bytes": 1 << 20, "seconds": probe.MAX_SECONDS + 1}, "seconds"),
        ({"peer": "ab12", "bytes": 1 << 20, "seconds": float("nan")}, "seconds"),
        ({"peer": "ab12", "bytes": "lots"}, "bytes"),
    ):
        r = await call(app, "POST", "/control/probe", body=body)
        assert r.status == 400, (body, r.body)
        assert named in r.json()["error"]["message"], r.json()


async def test_anthropics_clients_send_their_key_as_x_api_key_and_get_its_error_shape():
    access = Access.for_binding(["s3cret"], "127.0.0.1", 9400, 11434)
    assert access.refuse("GET", "/v1/models", [HOST, (b"x-api-key", b"s3cret")]) is None
    assert access.refuse("GET", "/v1/models", [HOST, (b"x-api-key", b"nope")]) is not None
    # The ollama port is the API's too: its Host names are loopback's with either port.
    key = (b"x-api-key", b"s3cret")
    assert access.refuse("GET", "/v1/models", [(b"host", b"127.0.0.1:11434"), key]) is None
    assert access.refuse("GET", "/v1/models", [(b"host", b"127.0.0.1:9999"), key]) is not None
    app = OpenAIApp(StaticDirectory(), InFlight(), lambda: {}, access=access)
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    r = await call(app, "POST", "/v1/messages", headers=[HOST, JSON], body=body)
    assert r.status == 401
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "authentication_error"
    r = await call(app, "POST", "/v1/messages", headers=[HOST, JSON, key], body=body)
    assert r.status == 404 and r.json()["error"]["type"] == "not_found_error"
    r = await call(app, "POST", "/v1/chat/completions", headers=[HOST, JSON], body=body)
    assert r.status == 401 and r.json()["error"]["code"] == "invalid_api_key"  # OpenAI's shape
