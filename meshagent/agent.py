"""The agent process: every service of one node, started in one nursery, stopped with a drain."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import structlog
import trio

from meshagent import __version__
from meshagent.api import forwarding
from meshagent.api.app import OpenAIApp
from meshagent.api.inflight import InFlight
from meshagent.api.server import HttpBinding, serve_http
from meshagent.config import AgentConfig, DataDir, parse_size
from meshagent.discovery import addresses, probe
from meshagent.discovery.dialer import DialerConfig, PeerDialer
from meshagent.discovery.mdns import MdnsDiscovery, Sighting
from meshagent.discovery.mesh_view import peer_rows
from meshagent.engine.llama import read_model_info
from meshagent.gossip import capacity
from meshagent.gossip import service as gossip_service
from meshagent.gossip.config import GossipConfig
from meshagent.gossip.record import MAX_ARTIFACTS, ArtifactHeld, ModelHeld, Serving
from meshagent.gossip.service import GossipService
from meshagent.identity.keys import NodeIdentity
from meshagent.identity.mesh import MeshSecret, mesh_fingerprint
from meshagent.identity.mesh_file import load_or_create_mesh
from meshagent.models import transfer
from meshagent.models.artifacts import ArtifactStore
from meshagent.models.default import resolve_model
from meshagent.models.layout import inspect_model
from meshagent.net.address import Address
from meshagent.net.errors import DialError
from meshagent.net.manager import ConnectionManager
from meshagent.net.stream import MeshStream
from meshagent.net.tcp import TcpTransport, check_listenable
from meshagent.relay.client import RelayClient
from meshagent.serving.directory import FORWARD_LABEL
from meshagent.serving.local_model import LocalModel
from meshagent.serving.mesh_model import MeshModel, MeshModelSettings
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
        self.mesh_model: MeshModel | None = None
        self.info: Any = None  # the configured model's ModelInfo
        self.overlay: ConnectionManager | None = None
        self.gossip: GossipService | None = None
        self.dialer: PeerDialer | None = None
        self.relays: list[RelayClient] = []
        self.mdns: MdnsDiscovery | None = None
        self.mdns_note = "not started"
        self.store = ArtifactStore(data_dir.artifacts_path)
        self._handlers: dict[str, StreamHandler] = {
            transfer.LABEL: transfer.ArtifactServer(self.store).handle,
            probe.LABEL: probe.serve,
        }
        self._stop = trio.Event()
        self._stop_accepting = trio.Event()
        self._started_at = time.time()

    def request_stop(self) -> None:
        self._stop.set()

    @property
    def model(self) -> LocalModel | None:
        """What this agent serves itself now (whole, or as the entry of a split)."""
        return self.mesh_model.local if self.mesh_model is not None else None

    @property
    def overlay_addresses(self) -> list[str]:
        return [str(a) for a in self.overlay.listen_addresses] if self.overlay else []

    def status(self) -> dict[str, Any]:
        assert self.identity is not None and self.mesh is not None and self.info is not None
        model = self.model
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
                    "id": model.info.id,
                    "path": model.info.path,
                    "layers": self._local_layers(),
                    "slots": asdict(model.batcher.stats()),
                }
            ]
            if model is not None
            else [],
            "placement": {
                self.info.id: self.mesh_model.placement_summary() if self.mesh_model else None
            },
            "artifacts": [m.to_dict() for m in self.store.all()],
            "peers": peers,
            "advertised": self._advertised(),
            "relays": [
                {
                    "address": r.name,
                    "registered": r.registered,
                    "members": sorted(r.members),
                    "error": r.last_error,
                }
                for r in self.relays
            ],
            "mdns": {
                "enabled": self.mdns is not None,
                "note": self.mdns_note,
                "advertised": self.mdns.registered if self.mdns else False,
                "interfaces": self.mdns.interfaces if self.mdns else [],
                "seen": [s.to_dict() for s in self.mdns.sightings.values()] if self.mdns else [],
            },
            "gossip": self._gossip_status(),
        }

    def _gossip_status(self) -> dict[str, Any]:
        if self.gossip is None:
            return {}
        cfg = self.gossip.config
        states: dict[str, int] = {}
        for e in self.gossip.state.entries.values():
            states[e.state.value] = states.get(e.state.value, 0) + 1
        return {
            **self.gossip.stats(),
            "states": states,
            "interval_s": cfg.interval,
            "suspect_after_s": cfg.suspect_after,
            "dead_after_s": cfg.dead_after,
        }

    def peers(self) -> dict[str, Any]:
        """The `GET /control/peers` body: every peer gossip knows, with its link."""
        assert self.identity is not None and self.mesh is not None
        views = self.gossip.snapshot(include_dead=True) if self.gossip else {}
        links = self.overlay.links() if self.overlay else []
        return {
            "self": self.identity.peer_id,
            "mesh": mesh_fingerprint(self.mesh),
            "peers": peer_rows(self.identity.peer_id, views, links),
        }

    async def probe(self, body: dict[str, Any]) -> dict[str, Any]:
        """`POST /control/probe`: push bytes to a peer over the overlay and verify them."""
        assert self.overlay is not None
        want = str(body.get("peer", ""))
        matches = [link.peer_id for link in self.overlay.links() if link.peer_id.startswith(want)]
        if not want or len(matches) != 1:
            raise probe.ProbeError(
                f"peer {want!r} matches {len(matches)} connected peers; give more of its id"
            )
        total = int(body.get("bytes", 1 << 20))
        seconds = float(body.get("seconds", 0.0))
        return await probe.probe(self.overlay, matches[0], total=total, seconds=seconds)

    def _serving(self, sha256: str = "") -> tuple[Serving, ...]:
        if self.model is None:
            return ()
        a, b = self._local_layers()
        return (Serving(self.info.id, sha256, a, b, self.info.n_layers),)

    def _local_layers(self) -> list[int]:
        mm = self.mesh_model
        if mm is not None and mm.split is not None and mm.split.part is not None:
            return [mm.split.part.start, mm.split.part.end]
        return [0, self.info.n_layers]

    def _advertised(self) -> list[str]:
        return addresses.advertised(self.overlay.listen_addresses) if self.overlay else []

    def _dynamic_fields(self) -> dict[str, Any]:
        """Record fields that can change while running; gossip polls them."""
        return {
            "addresses": tuple(self._advertised()),
            "relays": tuple(r.name for r in self.relays if r.registered),
            "artifacts": tuple(ArtifactHeld.from_manifest(m) for m in self.store.all())[
                :MAX_ARTIFACTS
            ],
        }

    def _static_fields(self, sha256: str = "") -> dict[str, Any]:
        info = self.info
        gib = 1 << 30
        weights, kv = capacity.memory_budget(
            int(self.config.mem_weights_gib * gib), int(self.config.mem_kv_gib * gib)
        )
        cap = parse_size(self.config.max_memory) if self.config.max_memory else 0
        if cap and weights + kv > cap:
            weights, kv = int(cap * capacity.WEIGHTS_SHARE), cap - int(cap * capacity.WEIGHTS_SHARE)
        return {
            "name": self.config.name or os.uname().nodename,
            "agent_version": __version__,
            "mem_weights_bytes": weights,
            "mem_kv_bytes": kv,
            "models": (
                ModelHeld(info.id, sha256, info.architecture, info.n_layers, info.size_bytes),
            ),
            "serving": self._serving(sha256),
        }

    async def _measure(self) -> None:
        """Measured once at start, off the event loop: compute speed, the model's hash."""
        assert self.gossip is not None and self.info is not None
        speed = await trio.to_thread.run_sync(capacity.matmul_gflops)
        self.gossip.update_local(compute_speed=speed, compute_unit=capacity.COMPUTE_UNIT)
        log.info("agent.measured", compute_speed=speed, unit=capacity.COMPUTE_UNIT)
        path = self.info.path
        sha = await trio.to_thread.run_sync(lambda: self.store.source_sha256(Path(path)))
        self.gossip.update_local(**self._static_fields(sha))

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
        # Ports first, before this agent reads or writes anything: a busy one is an error at
        # once, not after the model has been inspected.
        check_listenable(Address.parse(cfg.listen), advice="Stop it or choose another --listen.")
        http = HttpBinding(
            cfg.api_host, cfg.api_port, graceful_timeout=cfg.grace + _HTTP_GRACE_MARGIN
        )
        try:
            await self._run(http, task_status)
        finally:
            http.close()

    async def _run(self, http: HttpBinding, task_status: trio.TaskStatus[str]) -> None:
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
        layout = await trio.to_thread.run_sync(inspect_model, path)
        self.info = await trio.to_thread.run_sync(read_model_info, path)
        self.overlay = ConnectionManager(
            LocalPeer.create(self.identity, self.mesh),
            TcpTransport(),
            listen=[cfg.listen],
            on_stream=self._route_stream,
        )
        self.gossip = GossipService(
            self.identity,
            mesh_fingerprint(self.mesh),
            self.overlay,
            GossipConfig(
                interval=cfg.gossip_interval,
                suspect_after=cfg.suspect_after,
                dead_after=cfg.dead_after,
            ),
            local_fields=self._dynamic_fields,
        )
        self._handlers[gossip_service.LABEL] = self.gossip.handle
        self.mesh_model = MeshModel(
            peer_id=self.identity.peer_id,
            model_path=path,
            layout=layout,
            info=self.info,
            store=self.store,
            overlay=self.overlay,
            gossip=self.gossip,
            settings=MeshModelSettings(
                slots=cfg.slots,
                slot_ctx=cfg.ctx_size,
                threads=cfg.threads,
                max_queue=cfg.max_queue,
                wire_dtype=cfg.wire_dtype,
            ),
        )
        app = OpenAIApp(
            self.mesh_model, self.inflight, self.status, peers=self.peers, probe=self.probe
        )
        self._handlers.update(self.mesh_model.handlers())
        self._handlers[FORWARD_LABEL] = lambda s: forwarding.serve_forwarded(
            s, app, peer_id=s.peer_id
        )
        self.relays = [
            RelayClient(
                address,
                self.identity,
                self.mesh,
                self.overlay,
                TcpTransport(),
                on_member=self._relay_member,
            )
            for address in dict.fromkeys(cfg.relays)
        ]
        self.dialer = PeerDialer(
            self.overlay,
            gossip=self.gossip,
            relay_dial=self._relay_dial,
            local_relays=lambda: tuple(r.name for r in self.relays if r.registered),
            config=DialerConfig(upgrade_interval=cfg.upgrade_interval),
        )
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(self.overlay.run)
                self.gossip.update_local(**self._static_fields())
                await nursery.start(self.gossip.run)
                await nursery.start(self.dialer.run)
                await nursery.start(self.mesh_model.run)
                for relay in self.relays:
                    await nursery.start(relay.run)
                self._start_mdns(nursery)
                nursery.start_soon(self._measure)
                self.api_url = await nursery.start(
                    lambda task_status: serve_http(
                        app,
                        http,
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
                    model=self.info.id,
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
            if self.mesh_model is not None:
                with trio.CancelScope(shield=True):
                    await self.mesh_model.aclose()
        log.info("agent.stopped")

    def _start_mdns(self, nursery: trio.Nursery) -> None:
        assert self.overlay is not None and self.identity is not None and self.mesh is not None
        listen = self.overlay.listen_addresses
        if not self.config.mdns:
            self.mdns_note = "disabled by configuration"
            return
        if addresses.is_loopback_only(listen):
            self.mdns_note = "off: the overlay listens on loopback only"
            log.info("mdns.off", reason=self.mdns_note)
            return
        hosts = [a.host for a in listen if a.host not in ("0.0.0.0", "::", "")]
        interfaces = hosts or addresses.interface_ipv4s()
        if not interfaces:
            self.mdns_note = "off: no network interface with an IPv4 address"
            log.info("mdns.off", reason=self.mdns_note)
            return
        self.mdns = MdnsDiscovery(
            peer_id=self.identity.peer_id,
            mesh=mesh_fingerprint(self.mesh),
            port=listen[0].port,
            name=self.config.name or os.uname().nodename,
            interfaces=interfaces,
            on_peer=self._mdns_peer,
        )
        self.mdns_note = "running"
        nursery.start_soon(self._run_mdns)

    async def _run_mdns(self) -> None:
        assert self.mdns is not None
        try:
            await self.mdns.run()
        except Exception as e:  # zeroconf failing must not take the agent down
            self.mdns_note = f"failed: {type(e).__name__}: {e}"
            log.warning("mdns.failed", error=self.mdns_note)

    def _mdns_peer(self, sighting: Sighting) -> None:
        if self.dialer is not None:
            self.dialer.offer(
                sighting.peer_id, addresses=sighting.addresses, source="mdns", renew=True
            )

    def _relay_member(self, peer_id: str, relay: str) -> None:
        if self.dialer is not None:
            # A (re)registration at the relay is a fresh sighting, like an mDNS announcement.
            self.dialer.offer(peer_id, relays=(relay,), source="relay", renew=True)

    async def _relay_dial(self, relay: str, peer_id: str) -> Any:
        client = next(r for r in self.relays if r.name == relay)
        return await client.dial(peer_id)

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
        if self.model is not None:
            self.model.batcher.close()
        self.inflight.draining = True
        self._stop_accepting.set()
        stopped = await self.inflight.drain(self.config.grace)
        log.info("agent.drained", stopped=stopped)
        if self.gossip is not None:
            await self.gossip.leave()
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
