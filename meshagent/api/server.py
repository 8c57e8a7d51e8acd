"""Serving the ASGI app with hypercorn's trio worker."""

from __future__ import annotations

import errno
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from hypercorn.config import Config
from hypercorn.trio.run import worker_serve
from hypercorn.utils import wrap_app

from meshagent.errors import ConfigError


def hypercorn_config(host: str, port: int, *, graceful_timeout: float) -> Config:
    config = Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")
    config.graceful_timeout = graceful_timeout
    config.keep_alive_timeout = 30
    return config


async def run_http(
    app: Any,
    host: str,
    port: int,
    *,
    graceful_timeout: float,
    shutdown_trigger: Callable[[], Awaitable[None]],
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until `shutdown_trigger` returns; reports the bound URL (port 0 picks one)."""
    config = hypercorn_config(host, port, graceful_timeout=graceful_timeout)
    # Bind here, not inside hypercorn, so a busy port becomes one clear error.
    try:
        sockets = config.create_sockets()
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise ConfigError(
                f"{host}:{port} is already in use: is another agent running? "
                "Stop it or choose another --api-port."
            ) from e
        raise ConfigError(f"cannot serve the API on {host}:{port}: {e.strerror or e}") from e
    for sock in sockets.insecure_sockets:
        sock.listen(config.backlog)
    bound = sockets.insecure_sockets[0].getsockname()
    shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
    await worker_serve(
        wrap_app(app, config.wsgi_max_body_size, "asgi"),
        config,
        sockets=sockets,
        shutdown_trigger=shutdown_trigger,
        task_status=_Rename(task_status, f"http://{shown}:{bound[1]}"),
    )


class _Rename:
    """Reports our URL when hypercorn reports its binds."""

    def __init__(self, inner: trio.TaskStatus[str], url: str) -> None:
        self._inner = inner
        self._url = url

    def started(self, _value: Any = None) -> None:
        self._inner.started(self._url)
