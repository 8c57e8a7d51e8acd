"""Serving the ASGI app with hypercorn's trio worker."""

from __future__ import annotations

import errno
import logging
from collections.abc import Awaitable, Callable

import trio
from hypercorn.config import Config
from hypercorn.trio.run import worker_serve
from hypercorn.utils import wrap_app

from meshagent.api.exchange import ASGIApp
from meshagent.errors import ConfigError


def hypercorn_config(host: str, port: int, *, graceful_timeout: float) -> Config:
    config = Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")
    config.graceful_timeout = graceful_timeout
    config.keep_alive_timeout = 30
    return config


class HttpBinding:
    """The API's sockets, bound but not yet listening: an agent binds them first, so a busy
    port fails at once rather than after the model is read, and connections made before it
    serves are refused rather than left waiting."""

    def __init__(
        self, host: str, port: int, *, graceful_timeout: float, flag: str = "--api-port"
    ) -> None:
        self.config = hypercorn_config(host, port, graceful_timeout=graceful_timeout)
        try:
            self.sockets = self.config.create_sockets()
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                who = "ollama itself?" if flag == "--ollama-port" else "another agent?"
                raise ConfigError(
                    f"{host}:{port} is already in use: a program listens there ({who}). "
                    f"Stop it or choose another {flag}."
                ) from e
            raise ConfigError(f"cannot serve the API on {host}:{port}: {e.strerror or e}") from e
        bound = self.sockets.insecure_sockets[0].getsockname()
        shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
        self.url = f"http://{shown}:{bound[1]}"

    def close(self) -> None:
        for sock in self.sockets.insecure_sockets:
            sock.close()


async def serve_http(
    app: ASGIApp,
    binding: HttpBinding,
    *,
    shutdown_trigger: Callable[[], Awaitable[None]],
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve on `binding` until `shutdown_trigger` returns; reports the URL once listening."""
    config = binding.config
    try:
        for sock in binding.sockets.insecure_sockets:
            sock.listen(config.backlog)
        await worker_serve(
            wrap_app(app, config.wsgi_max_body_size, "asgi"),
            config,
            sockets=binding.sockets,
            shutdown_trigger=shutdown_trigger,
            task_status=_Rename(task_status, binding.url),
        )
    finally:
        binding.close()


class _Rename:
    """Reports our URL when hypercorn reports its binds."""

    def __init__(self, inner: trio.TaskStatus[str], url: str) -> None:
        self._inner = inner
        self._url = url

    def started(self, _value: object = None) -> None:
        self._inner.started(self._url)
