"""OpenAI-shaped error bodies: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meshagent.errors import (
    ContextOverflow,
    EngineError,
    MeshError,
    QueueFull,
    ShuttingDown,
    SplitUnavailable,
)


@dataclass(frozen=True)
class ApiError(Exception):
    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    retry_after: int | None = None  # seconds, sent as a Retry-After header

    def headers(self) -> list[tuple[bytes, bytes]]:
        if self.retry_after is None:
            return []
        return [(b"retry-after", str(self.retry_after).encode())]

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def not_found(message: str, *, code: str | None = None, param: str | None = None) -> ApiError:
    return ApiError(404, message, param=param, code=code)


def queue_full(message: str) -> ApiError:
    return ApiError(429, message, type="requests", code="rate_limit_exceeded")


def unavailable(
    message: str, *, code: str = "unavailable", retry_after: int | None = None
) -> ApiError:
    return ApiError(503, message, type="server_error", code=code, retry_after=retry_after)


def server_error(message: str, *, code: str = "internal_error") -> ApiError:
    return ApiError(500, message, type="server_error", code=code)


# Seconds a client is asked to wait before retrying a request a split could not serve.
SPLIT_RETRY_AFTER = 5


def api_error_for(e: MeshError, *, prompt_param: str = "messages") -> ApiError:
    """The OpenAI-shaped error a client gets for one of the mesh's own errors."""
    if isinstance(e, ContextOverflow):
        return bad_request(str(e), param=prompt_param, code="context_length_exceeded")
    if isinstance(e, QueueFull):
        return queue_full(str(e))
    if isinstance(e, ShuttingDown):
        return unavailable(str(e), code="shutting_down")
    if isinstance(e, SplitUnavailable):
        # Temporary: the stage comes back or the mesh replans. Clients that honour
        # Retry-After (the openai client does, for 503) wait and try again.
        return unavailable(str(e), code="split_unavailable", retry_after=SPLIT_RETRY_AFTER)
    if isinstance(e, EngineError):
        return server_error(str(e), code="engine_error")
    return server_error(str(e))


def from_body(status: int, body: object, retry_after: int | None = None) -> ApiError:
    """The error whose `body()` is `body` (one carried from another agent)."""
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict):
        return server_error(f"a peer answered with a malformed error ({status})")

    def text(key: str) -> str | None:
        value = err.get(key)
        return value if isinstance(value, str) else None

    return ApiError(
        status,
        text("message") or "",
        text("type") or "server_error",
        text("param"),
        text("code"),
        retry_after,
    )
