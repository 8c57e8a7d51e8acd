"""Who may use the HTTP API: a Bearer key where the agent has keys, and, on a loopback bind,
only requests addressed to a loopback name (a web page whose DNS name was rebound to 127.0.0.1
sends its own name in `Host`). `/health` answers everyone; the console's page
(`/console`) needs no key. Requests carried over the overlay
by members of the mesh are the mesh's to authorise and are not checked here."""

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


@dataclass(frozen=True)
class Access:
    keys: tuple[str, ...] = ()  # none: no key needed
    hosts: frozenset[str] = frozenset()  # the Host values accepted; empty: any

    @classmethod
    def for_binding(cls, keys: Iterable[str], bind_host: str, port: int) -> Access:
        """Keys for every request; on a loopback bind, `Host` must name loopback and `port`."""
        hosts: set[str] = set()
        if is_loopback(bind_host):
            for name in ("127.0.0.1", "localhost", "[::1]", bind_host.lower()):
                shown = f"[{name}]" if ":" in name and not name.startswith("[") else name
                hosts |= {shown, f"{shown}:{port}"}
        return cls(tuple(keys), frozenset(hosts))

    def refuse(self, path: str, headers: Iterable[tuple[bytes, bytes]]) -> ApiError | None:
        """Why a request with `headers` to `path` is refused; None when it may go on."""
        if path in OPEN_PATHS:
            return None
        found = {k.lower(): v for k, v in headers}
        if self.hosts:
            host = found.get(b"host", b"").decode("latin-1").lower()
            if host not in self.hosts:
                return ApiError(
                    403,
                    f"This agent answers only requests addressed to it on loopback, not to "
                    f"'{host}' (a page of another site reaching it through its own name).",
                    code="host_not_allowed",
                )
        if not self.keys or path in KEYLESS_PATHS:
            return None
        auth = found.get(b"authorization", b"").decode("latin-1")
        scheme, _, given = auth.partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            return ApiError(
                401,
                "You didn't provide an API key. This agent needs one: send it as "
                "'Authorization: Bearer KEY' (the openai client's api_key).",
                code="invalid_api_key",
            )
        given_b = given.strip().encode()
        if not any(hmac.compare_digest(given_b, k.encode()) for k in self.keys):
            return ApiError(
                401, "Incorrect API key provided for this agent.", code="invalid_api_key"
            )
        return None
