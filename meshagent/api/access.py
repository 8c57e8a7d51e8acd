"""Who may use the HTTP API.

Over HTTP: never a web page of another site (an `Origin` that is not this agent's own, or a
browser's `Sec-Fetch-Site` saying the request comes from another site or origin); a POST body
only when declared `application/json` (what a page may send without the browser asking the
agent first is `text/plain`, a form or undeclared bytes); a Bearer key where the agent has
keys; and, on a loopback bind, only requests addressed to a loopback name (a web page whose DNS
name was rebound to 127.0.0.1 sends its own name in `Host`). `/health` needs no key; the
console's page (`/console`) needs no key.

A member of the mesh never reaches this app: it asks another agent for inference over `gen/1`
(`api/entry.py`), which the mesh's secret and the peer's key authorise, not the API's keys."""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from dataclasses import dataclass

from meshagent.api.errors import ApiError
from meshagent.net.address import is_loopback

OPEN_PATHS = frozenset({"/health"})
# The console's page holds no data (it asks the agent with the key the user types in), so it
# needs no key; its Host is checked like any other request's.
KEYLESS_PATHS = frozenset({"/console"})
# `Sec-Fetch-Site` values a browser sends for a request made by a page of this agent itself
# ("same-origin") or typed or bookmarked by the user ("none").
_OWN_FETCHES = frozenset({b"same-origin", b"none"})
_SHOWN = 200  # characters of a refused path or origin quoted back


@dataclass(frozen=True)
class Access:
    keys: tuple[str, ...] = ()  # none: no key needed
    hosts: frozenset[str] = frozenset()  # the Host values accepted; empty: any

    @classmethod
    def for_binding(cls, keys: Iterable[str], bind_host: str, *ports: int) -> Access:
        """Keys for every request; on a loopback bind, `Host` must name loopback and one of
        `ports` (the API's, and ollama's where it also serves there)."""
        hosts: set[str] = set()
        if is_loopback(bind_host):
            for name in ("127.0.0.1", "localhost", "[::1]", bind_host.lower()):
                shown = f"[{name}]" if ":" in name and not name.startswith("[") else name
                hosts |= {shown} | {f"{shown}:{port}" for port in ports}
        return cls(tuple(keys), frozenset(hosts))

    def refuse(
        self, method: str, path: str, headers: Iterable[tuple[bytes, bytes]]
    ) -> ApiError | None:
        """Why an HTTP request is refused; None when it may go on."""
        found = {k.lower(): v for k, v in headers}
        host = found.get(b"host", b"").decode("latin-1").lower()
        if (page := _other_site(found, host)) is not None:
            return ApiError(
                403,
                f"This agent does not answer web pages of another site ({page}): a page you "
                "open in a browser must not use it. Call the API from a program, not from a "
                "page of another origin.",
                code="origin_not_allowed",
            )
        if path in OPEN_PATHS:
            return None
        if self.hosts and host not in self.hosts:
            return ApiError(
                403,
                f"This agent answers only requests addressed to it on loopback, not to "
                f"'{host[:_SHOWN]}' (a page of another site reaching it through its own name).",
                code="host_not_allowed",
            )
        if self.keys and path not in KEYLESS_PATHS and (refused := self._key(found)) is not None:
            return refused
        if method == "POST" and not _declares_json(found.get(b"content-type", b"")):
            declared = found.get(b"content-type", b"").decode("latin-1")[:_SHOWN]
            return ApiError(
                415,
                f"The request body must be JSON sent with 'Content-Type: application/json' "
                f"(this one declares {declared!r}; with curl, add "
                "-H 'Content-Type: application/json').",
                code="unsupported_media_type",
            )
        return None

    def _key(self, found: dict[bytes, bytes]) -> ApiError | None:
        auth = found.get(b"authorization", b"").decode("latin-1")
        scheme, _, given = auth.partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            # Anthropic's clients send the key as x-api-key.
            scheme, given = "bearer", found.get(b"x-api-key", b"").decode("latin-1")
        if not given.strip():
            return ApiError(
                401,
                "You didn't provide an API key. This agent needs one: send it as "
                "'Authorization: Bearer KEY' (the openai client's api_key) or 'x-api-key: KEY' "
                "(the anthropic client's).",
                code="invalid_api_key",
            )
        given_b = given.strip().encode()
        if not any(hmac.compare_digest(given_b, k.encode()) for k in self.keys):
            return ApiError(
                401, "Incorrect API key provided for this agent.", code="invalid_api_key"
            )
        return None


def _other_site(found: dict[bytes, bytes], host: str) -> str | None:
    """The other site a browser says the request comes from; None for this agent's own pages
    and for clients that are not browsers (they send neither header)."""
    origin = found.get(b"origin")
    if origin is not None:
        scheme, sep, netloc = origin.decode("latin-1").lower().partition("://")
        # Behind a TLS proxy that keeps the Host, the agent's own pages are https.
        if not (sep and scheme in ("http", "https") and netloc == host and host):
            return f"Origin: {origin.decode('latin-1')[:_SHOWN]}"
    fetch_site = found.get(b"sec-fetch-site")
    if fetch_site is not None and fetch_site.lower() not in _OWN_FETCHES:
        return f"Sec-Fetch-Site: {fetch_site.decode('latin-1')[:_SHOWN]}"
    return None


def _declares_json(content_type: bytes) -> bool:
    media = content_type.split(b";", 1)[0].strip().lower()
    return media == b"application/json"
