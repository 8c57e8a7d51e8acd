"""The agent process: every service of one node, started in one nursery, stopped with a drain."""

from __future__ import annotations

import json
import os
import signal
import time
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
from meshagent.models.default import resolve_model
from meshagent.serving.local_model import LocalModel

log = structlog.get_logger(__name__)

# hypercorn gets a little longer than our grace, so requests stopped at its end can still
# write their final error event.
_HTTP_GRACE_MARGIN = 3.0


class Agent:
    def __init__(self, config: AgentConfig, data_dir: DataDir) -> None:
        config.validate()
        self.config = config
        self.data_dir = data_dir
        self.inflight = InFlight()
        self.api_url = ""
        self.identity: NodeIdentity | None = None
        self.model: LocalModel | None = None
        self._stop = trio.Event()
        self._stop_accepting = trio.Event()
        self._started_at = time.time()

    def request_stop(self) -> None:
        self._stop.set()

    def status(self) -> dict[str, Any]:
        assert self.identity is not None and self.model is not None
        stats = self.model.batcher.stats()
        return {
            "peer_id": self.identity.peer_id,
            "name": self.config.name or os.uname().nodename,
            "version": __version__,
            "pid": os.getpid(),
            "api": self.api_url,
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
            "peers": [],
        }

    async def run(self, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        """Run until `request_stop` or SIGINT/SIGTERM; then drain and return."""
        cfg = self.config
        self.data_dir.ensure()
        self.identity, created = NodeIdentity.load_or_create(self.data_dir.identity_path)
        log.info(
            "agent.identity",
            peer_id=self.identity.peer_id,
            created=created,
            data_dir=str(self.data_dir.root),
        )
        path = resolve_model(cfg.model)
        engine = await trio.to_thread.run_sync(
            lambda: LlamaEngine(path, slots=cfg.slots, slot_ctx=cfg.ctx_size, threads=cfg.threads)
        )
        self.model = LocalModel(engine, max_queue=cfg.max_queue)
        app = OpenAIApp([self.model], self.inflight, self.status)
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(self.model.run)
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
                self._write_run_file()
                log.info("agent.ready", api=self.api_url, model=self.model.info.id)
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

    def _write_run_file(self) -> None:
        assert self.identity is not None
        info = {"pid": os.getpid(), "api": self.api_url, "peer_id": self.identity.peer_id}
        tmp = self.data_dir.run_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(info))
        os.replace(tmp, self.data_dir.run_path)
