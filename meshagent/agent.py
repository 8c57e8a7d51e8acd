"""The agent process: every service of one node, started in one nursery, stopped with a drain.

What the services are and how they are wired is `services.py`; the control API's documents
are `control.py`. This module is the lifecycle: ports first, then build, start, serve, and on
SIGINT/SIGTERM (or `request_stop`) drain and stop.
"""

from __future__ import annotations

import json
import os
import signal
from functools import partial
from typing import Any

import structlog
import trio

from meshagent.api.server import HttpBinding, serve_http
from meshagent.config import AgentConfig, DataDir
from meshagent.identity.mesh import MeshSecret
from meshagent.net.address import Address
from meshagent.net.errors import DialError
from meshagent.net.manager import ConnectionManager
from meshagent.net.tcp import check_listenable
from meshagent.services import Services

log = structlog.get_logger(__name__)

# hypercorn gets a little longer than our grace, so requests stopped at its end can still
# write their final error event.
_HTTP_GRACE_MARGIN = 3.0


class Agent:
    def __init__(
        self, config: AgentConfig, data_dir: DataDir, *, join: MeshSecret | None = None
    ) -> None:
        config.validate()
        self.config = config
        self.data_dir = data_dir
        self._join = join
        self._stop = trio.Event()

    def request_stop(self) -> None:
        self._stop.set()

    async def run(
        self, *, task_status: trio.TaskStatus[Services] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Run until `request_stop` or SIGINT/SIGTERM; then drain and return. Reports the
        services once the API serves."""
        cfg = self.config
        # Ports first, before this agent reads or writes anything: a busy one is an error at
        # once, not after the model has been inspected.
        check_listenable(Address.parse(cfg.listen), advice="Stop it or choose another --listen.")
        grace = cfg.grace + _HTTP_GRACE_MARGIN
        http = HttpBinding(cfg.api_host, cfg.api_port, graceful_timeout=grace)
        ollama = None
        try:
            if cfg.ollama_port >= 0:
                ollama = HttpBinding(
                    cfg.api_host, cfg.ollama_port, graceful_timeout=grace, flag="--ollama-port"
                )
            services = await Services.build(
                cfg,
                self.data_dir,
                join=self._join,
                api_url=http.url,
                ollama_url=ollama.url if ollama else None,
            )
            try:
                await self._serve(services, http, task_status, ollama)
            finally:
                self.data_dir.run_path.unlink(missing_ok=True)
                with trio.CancelScope(shield=True):
                    await services.models.aclose()
        finally:
            http.close()
            if ollama is not None:
                ollama.close()
        log.info("agent.stopped")

    async def _serve(
        self,
        services: Services,
        http: HttpBinding,
        task_status: trio.TaskStatus[Services],
        ollama: HttpBinding | None = None,
    ) -> None:
        stop_accepting = trio.Event()
        async with trio.open_nursery() as nursery:
            await services.start(nursery)
            for binding in (http, ollama):
                if binding is not None:
                    serve = partial(serve_http, services.app, binding)
                    await nursery.start(partial(serve, shutdown_trigger=stop_accepting.wait))
            for address in services.bootstrap:
                nursery.start_soon(_bootstrap, services.overlay, address)
            self._write_run_file(services)
            log.info(
                "agent.ready",
                api=services.api_url,
                ollama=services.ollama_url,
                overlay=[str(a) for a in services.overlay.listen_addresses],
                models=services.models.names,
            )
            task_status.started(services)
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                # Still listening while draining: a second signal cuts the drain short.
                nursery.start_soon(self._watch_signals, signals, services)
                await self._stop.wait()
                await self._drain(services, stop_accepting)
            nursery.cancel_scope.cancel()

    async def _watch_signals(self, signals: Any, services: Services) -> None:
        async for signum in signals:
            log.info("agent.signal", signal=signal.Signals(signum).name)
            if self._stop.is_set():
                log.warning("agent.forced_stop", in_flight=len(services.inflight))
                services.inflight.expire_now()
            self._stop.set()

    async def _drain(self, services: Services, stop_accepting: trio.Event) -> None:
        """Refuse new requests, give those in flight the grace to finish, leave the mesh."""
        grace = self.config.grace
        services.models.close_runners()
        services.inflight.draining = True
        stop_accepting.set()
        stopped = await services.inflight.drain(grace)
        log.info("agent.drained", stopped=stopped)
        # Leaving: no more plans or parts, no more dialling; then the mesh hears of it.
        services.models.stop()
        services.dialer.stop()
        await services.gossip.leave()
        # A split's streams end as soon as they are idle (a stage still forwarding for the
        # entry serves on through the drain, while the mesh moves the plan off this agent),
        # so no connection waits out its grace for a stream nobody uses any more.
        with trio.move_on_after(grace + 1):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(services.models.end_idle_streams)
                await services.overlay.aclose(grace=min(grace, 5.0))
                nursery.cancel_scope.cancel()

    def _write_run_file(self, services: Services) -> None:
        info = {
            "pid": os.getpid(),
            "api": services.api_url,
            "ollama": services.ollama_url,
            "peer_id": services.identity.peer_id,
            "listen": [str(a) for a in services.overlay.listen_addresses],
        }
        path = self.data_dir.run_path
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(info))
        os.replace(tmp, path)


async def _bootstrap(overlay: ConnectionManager, address: str) -> None:
    try:
        conn = await overlay.dial(Address.parse(address))
        log.info("agent.bootstrapped", address=address, peer=conn.peer_id)
    except DialError as e:
        log.warning("agent.bootstrap_failed", address=address, error=str(e))
