"""Errors of relay clients and servers."""

from __future__ import annotations

from enum import IntEnum

from meshagent.errors import MeshError


class Refusal(IntEnum):
    """Why a relay refused a request (sent to the client with a text reason)."""

    BAD_MESSAGE = 1
    BAD_SIGNATURE = 2
    NOT_REGISTERED = 3  # the dialer must be registered (in the same mesh) first
    UNKNOWN_TARGET = 4  # the target is not registered here under the dialer's mesh
    CIRCUIT_LIMIT = 5
    RELAY_FULL = 6
    ACCEPT_TIMEOUT = 7
    UNKNOWN_CIRCUIT = 8
    VERSION = 9
    SELF = 10


class RelayError(MeshError):
    """Talking to a relay failed; the message says how."""


class RelayRefused(RelayError):
    """The relay refused the request; `code` and the message say why."""

    def __init__(self, code: Refusal, reason: str) -> None:
        super().__init__(f"relay refused ({code.name.lower()}): {reason}")
        self.code = code
        self.reason = reason


class RelayProtocolError(RelayError):
    """A relay message broke the protocol (malformed, oversized, out of order)."""
