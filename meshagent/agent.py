"""The agent process: every service of one node, started in one nursery, stopped with a drain."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from typing import Any

import structlog
import trio

from meshagent import __version__
from meshagent.api.app import OpenAIApp
from meshagent.api.inflight import InFlight
from meshagent.api.server import run_http
from meshagent.config import AgentConfig, DataDir
from meshagent.engine.llama import LlamaEngine
from meshagent.identity.keys import NodeIdentity
from meshagent.identity.mesh import MeshSecret, mesh_fingerprint
from meshagent.identity.mesh_file import load_or_create_mesh
from meshagent.models import transfer
from meshagent.models.artifacts import ArtifactStore
from meshagent.models.default import resolve_model
from meshagent.net.address import Address
from meshagent.net.errors import DialError
from meshagent.net.manager import ConnectionManager
from meshagent.net.stream import MeshStream
from meshagent.net.tcp import TcpTransport
from meshagent.serving.local_model import LocalModel
from meshagent.wire.handshake import LocalPeer

log = structlog.get_logger(__name__)

# hypercorn gets a little longer than our grace, so requests stopped at its end can still
# write their final error event.
_HTTP_GRACE_MARGIN = 3.0

StreamHandler = Callable[[MeshStream], Awaitable[None]]


class Agent:
    def __init__(
        self, config: AgentConfig, data_dir: DataDir, *, join: MeshSecret | None = None
    ) -> None:
        config.validate()
        self.config = config
        self.data_dir = data_dir
        self._join = join
        self.inflight = InFlight()
        self.api_url = ""
        self.identity: NodeIdentity | None = None
        self.mesh: MeshSecret | None = None
        self.model: LocalModel | None = None
        self.overlay: ConnectionManager | None = None
        self.store = ArtifactStore(data_dir.artifacts_path)
        self._handlers: dict[str, StreamHandler] = {
            transfer.LABEL: transfer.ArtifactServer(self.store).handle,
        }
        self._stop = trio.Event()
        self._stop_accepting = trio.Event()
        self._started_at = time.time()

    def request_stop(self) -> None:
        self._stop.set()

    @property
    def overlay_addresses(self) -> list[str]:
        return [str(a) for a in self.overlay.listen_addresses] if self.overlay else []

    def status(self) -> dict[str, Any]:
        assert self.identity is not None and self.model is not None and self.mesh is not None
        stats = self.model.batcher.stats()
        peers = []
        if self.overlay is not None:
            for link in self.overlay.links():
                rtt = link.rtt.smoothed if link.rtt is not None else None
                peers.append(
                    {
                        "peer_id": link.peer_id,
                        "path": link.path,
                        "address": str(link.remote),
                        "rtt_ms": None if rtt is None else round(rtt * 1000, 3),
                        "initiator": link.initiator,
                    }
                )
        return {
            "peer_id": self.identity.peer_id,
            "name": self.config.name or os.uname().nodename,
            "version": __version__,
            "pid": os.getpid(),
            "mesh": mesh_fingerprint(self.mesh),
            "api": self.api_url,
            "listen": self.overlay_addresses,
            "uptime_s": round(time.time() - self._started_at, 1),
            "state": "draining" if self.inflight.draining else "serving",
            "in_flight": len(self.inflight),
            "models": [
                {
                    "id": self.model.info.id,
                    "path": self.model.info.path,
                    "layers": [0, self.model.info.n_layers],
                    "slots": asdict(stats),
                }
            ],
            "artifacts": [m.to_dict() for m in self.store.all()],
            "peers": peers,
        }

    async def _route_stream(self, stream: MeshStream) -> None:
        """Inbound overlay streams go to the service named by their label."""
        handler = self._handlers.get(stream.label.split(":", 1)[0])
        if handler is None:
            stream.reset(f"no service for stream label {stream.label!r}")
            return
        await handler(stream)

    async def run(self, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        """Run until `request_stop` or SIGINT/SIGTERM; then drain and return."""
        cfg = self.config
        self.data_dir.ensure()
        self.identity, created = NodeIdentity.load_or_create(self.data_dir.identity_path)
        self.mesh, how = load_or_create_mesh(self.data_dir.mesh_path, self._join)
        log.info(
            "agent.identity",
            peer_id=self.identity.peer_id,
            created=created,
            mesh=mesh_fingerprint(self.mesh),
            mesh_source=how,
            data_dir=str(self.data_dir.root),
        )
        path = resolve_model(cfg.model)
        engine = await trio.to_thread.run_sync(
            lambda: LlamaEngine(path, slots=cfg.slots, slot_ctx=cfg.ctx_size, threads=cfg.threads)
        )
        self.model = LocalModel(engine, max_queue=cfg.max_queue)
        app = OpenAIApp([self.model], self.inflight, self.status)
        self.overlay = ConnectionManager(
            LocalPeer.create(self.identity, self.mesh),
            TcpTransport(),
            listen=[cfg.listen],
            on_stream=self._route_stream,
        )
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(self.model.run)
                await nursery.start(self.overlay.run)
                self.api_url = await nursery.start(
                    lambda task_status: run_http(
                        app,
                        cfg.api_host,
                        cfg.api_port,
                        graceful_timeout=cfg.grace + _HTTP_GRACE_MARGIN,
                        shutdown_trigger=self._stop_accepting.wait,
                        task_status=task_status,
                    )
                )
                for address in cfg.peers:
                    nursery.start_soon(self._bootstrap, address)
                self._write_run_file()
                log.info(
                    "agent.ready",
                    api=self.api_url,
                    overlay=self.overlay_addresses,
                    model=self.model.info.id,
                )
                task_status.started(self.api_url)
                with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                    # Still listening while draining: a second signal cuts the drain short.
                    nursery.start_soon(self._watch_signals, signals)
                    await self._stop.wait()
                    await self._drain()
                nursery.cancel_scope.cancel()
        finally:
            self.data_dir.run_path.unlink(missing_ok=True)
            engine.close()
        log.info("agent.stopped")

    async def _bootstrap(self, address: str) -> None:
        assert self.overlay is not None
        try:
            conn = await self.overlay.dial(Address.parse(address))
            log.info("agent.bootstrapped", address=address, peer=conn.peer_id)
        except DialError as e:
            log.warning("agent.bootstrap_failed", address=address, error=str(e))

    async def _watch_signals(self, signals: Any) -> None:
        async for signum in signals:
            log.info("agent.signal", signal=signal.Signals(signum).name)
            if self._stop.is_set():
                log.warning("agent.forced_stop", in_flight=len(self.inflight))
                self.inflight.expire_now()
            self._stop.set()

    async def _drain(self) -> None:
        assert self.model is not None
        self.model.batcher.close()
        self.inflight.draining = True
        self._stop_accepting.set()
        stopped = await self.inflight.drain(self.config.grace)
        log.info("agent.drained", stopped=stopped)
        if self.overlay is not None:
            with trio.move_on_after(self.config.grace + 1):
                await self.overlay.aclose(grace=min(self.config.grace, 5.0))

    def _write_run_file(self) -> None:
        assert self.identity is not None
        info = {
            "pid": os.getpid(),
            "api": self.api_url,
            "peer_id": self.identity.peer_id,
            "listen": self.overlay_addresses,
        }
        tmp = self.data_dir.run_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(info))
        os.replace(tmp, self.data_dir.run_path)
