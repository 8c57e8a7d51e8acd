"""Who may use the HTTP API (sans-IO): keys, loopback Host names, what stays open."""

from __future__ import annotations

import pytest

from meshagent.api.access import Access
from meshagent.config import AgentConfig
from meshagent.errors import ConfigError
from meshagent.net.address import is_loopback

HOST = [(b"host", b"127.0.0.1:9400")]


def bearer(key: str) -> list[tuple[bytes, bytes]]:
    return [*HOST, (b"authorization", f"Bearer {key}".encode())]


def test_a_key_is_asked_on_every_path_but_health():
    access = Access.for_binding(["s3cret", "other"], "127.0.0.1", 9400)
    missing = access.refuse("/v1/models", HOST)
    assert missing is not None and missing.status == 401 and missing.code == "invalid_api_key"
    assert "didn't provide an API key" in missing.message
    wrong = access.refuse("/control/status", bearer("nope"))
    assert wrong is not None and wrong.status == 401 and "Incorrect" in wrong.message
    assert access.refuse("/v1/chat/completions", bearer("s3cret")) is None
    assert access.refuse("/v1/chat/completions", bearer("other")) is None
    assert access.refuse("/v1/models", [*HOST, (b"authorization", b"Basic s3cret")]) is not None
    assert access.refuse("/health", []) is None
    body = missing.body()["error"]
    assert set(body) == {"message", "type", "param", "code"}


def test_a_loopback_api_answers_only_loopback_names():
    access = Access.for_binding([], "127.0.0.1", 9400)
    names = (b"127.0.0.1:9400", b"localhost:9400", b"LOCALHOST:9400", b"[::1]:9400", b"localhost")
    for host in names:
        assert access.refuse("/v1/models", [(b"host", host)]) is None, host
    for host in (b"evil.example:9400", b"127.0.0.1.nip.io:9400", b""):
        refused = access.refuse("/v1/models", [(b"host", host)])
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
    assert access.refuse("/console", HOST) is None
    for path in ("/control/events", "/metrics"):
        refused = access.refuse(path, HOST)
        assert refused is not None and refused.status == 401, path
    foreign = access.refuse("/console", [(b"host", b"evil.example:9400")])
    assert foreign is not None and foreign.status == 403
