"""OpenAI-shaped error bodies: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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
