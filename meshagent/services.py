"""Every service of one agent, built from its configuration in one place.

`Services.build` reads what they need (identity, mesh secret, the model's layout) and returns
them all built and wired; `Agent` starts them in one nursery (`start`) and drains them. The
services reach each other only through the callbacks wired here (a relay's new member goes to
the dialer, an inbound stream to the service its label names), which run once they do.
"""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import structlog
import trio

from meshagent import advertisement, control
from meshagent.api import entry
from meshagent.api.access import Access
from meshagent.api.app import OpenAIApp
from meshagent.api.inflight import InFlight
from meshagent.capacity import memory_available
from meshagent.catalog.entry import CatalogEntry
from meshagent.catalog.model_file import read_model_file
from meshagent.catalog.service import Catalog
from meshagent.config import AgentConfig, ConfigError, DataDir
from meshagent.discovery import hearing, known, nat, probe, punch
from meshagent.discovery.alone import watch_alone
from meshagent.discovery.dialer import DialerConfig, PeerDialer
from meshagent.discovery.known import Known
from meshagent.discovery.lan import LanDiscovery
from meshagent.discovery.mdns import Sighting
from meshagent.discovery.reachable import Reachable
from meshagent.engine.llama import read_model_info
from meshagent.errors import MeshError, ModelError
from meshagent.gossip import service as gossip_service
from meshagent.gossip import swim_service
from meshagent.gossip.config import GossipConfig
from meshagent.gossip.membership import Membership
from meshagent.gossip.service import GossipService
from meshagent.gossip.swim_service import SwimService
from meshagent.identity.keys import NodeIdentity
from meshagent.identity.mesh import MeshSecret, mesh_fingerprint
from meshagent.identity.mesh_file import load_or_create_mesh
from meshagent.models import header_share, transfer
from meshagent.models.artifacts import ArtifactStore, SliceManifest
from meshagent.models.capability import CapabilityStore
from meshagent.models.default import local_file, resolve_model
from meshagent.models.layout import inspect_model
from meshagent.models.names import HubName, parse_model_name
from meshagent.net.budgets import StreamBudgets
from meshagent.net.manager import ConnectionManager
from meshagent.net.stream import MeshStream
from meshagent.net.tcp import TcpTransport
from meshagent.relay.client import RelayClient
from meshagent.serving.assigning import SEED_AFTER, Assigning
from meshagent.serving.capabilities import Capabilities
from meshagent.serving.directory import GENERATE_LABEL
from meshagent.serving.draft_loading import catalogued_draft
from meshagent.serving.mesh_model import MeshModel
from meshagent.serving.model_files import ModelFiles
from meshagent.serving.model_host import ModelHost
from meshagent.serving.settings import ServingSettings
from meshagent.wire.handshake import LocalPeer

log = structlog.get_logger(__name__)

StreamHandler = Callable[[MeshStream], Awaitable[None]]

# Inbound streams one peer may hold open here at once, by label (docs/protocol.md, section 11).
# An honest peer holds one gossip exchange, probe or header ask at a time, a hearing ask per
# peer it judges and an artifact fetch or two; the inference label carries its clients'
# requests, which this agent's queue bounds anyway (past slots + max_queue they end at once,
# answered 429). Together they stay below the multiplexer's 256 streams per connection, so a
# flood of one label leaves room for the others. Stage labels are not limited here: who may
# open them is the split's to judge.
STREAM_BUDGETS: dict[str, int] = {
    gossip_service.LABEL: 4,
    swim_service.LABEL: 16,
    probe.LABEL: 2,
    hearing.LABEL: 32,
    punch.LABEL: 2,
    header_share.LABEL: 4,
    transfer.LABEL: 8,
    GENERATE_LABEL: 128,
}


class Services:
    """The services of one agent, every one built; none runs until `start`."""

    @classmethod
    async def build(
        cls,
        config: AgentConfig,
        data_dir: DataDir,
        *,
        join: MeshSecret | None,
        api_url: str,
        ollama_url: str | None = None,
    ) -> Services:
        """Load identity, mesh secret and model (creating the first two on first start), then
        build the services; `api_url` is where the API will serve (and `ollama_url` where it
        also serves, on ollama's port: `--ollama-port`)."""
        data_dir.ensure()
        identity, created = NodeIdentity.load_or_create(data_dir.identity_path)
        mesh, how = load_or_create_mesh(data_dir.mesh_path, join)
        log.info(
            "agent.identity",
            peer_id=identity.peer_id,
            created=created,
            mesh=mesh_fingerprint(mesh),
            mesh_source=how,
            data_dir=str(data_dir.root),
        )
        store = ArtifactStore(data_dir.artifacts_path)
        files = []
        for spec in config.models:  # none: what the mesh's catalogue holds
            path = await trio.to_thread.run_sync(resolve_model, spec)  # may download
            layout = await trio.to_thread.run_sync(inspect_model, path)
            info = await trio.to_thread.run_sync(read_model_info, path)
            if any(f.info.id.casefold() == info.id.casefold() for f in files):
                raise ConfigError(f"two models given are both named {info.id}: {spec}")
            files.append(ModelFiles(path, layout, info, store))
        return cls(
            config,
            identity=identity,
            mesh=mesh,
            files=files,
            store=store,
            api_url=api_url,
            ollama_url=ollama_url,
            joined=join is not None,
            catalog=Catalog(identity, data_dir.catalog_path, store),
            models_dir=data_dir.models_path,
            known=Known.load(data_dir.known_path, mesh_fingerprint(mesh)),
        )

    def __init__(
        self,
        config: AgentConfig,
        *,
        identity: NodeIdentity,
        mesh: MeshSecret,
        files: Sequence[ModelFiles],
        store: ArtifactStore,
        api_url: str,
        ollama_url: str | None = None,
        joined: bool = False,
        catalog: Catalog,
        models_dir: Path | None = None,
        known: Known | None = None,
    ) -> None:
        self.config = config
        # The peers and relays this agent has known (kept in its data dir): a restart dials
        # them again.
        self.known = known if known is not None else Known(None, mesh_fingerprint(mesh))
        self.known.note_bootstrap(config.peers)
        self.known.note_relays(config.relays)
        self.models_dir = models_dir  # partial copies of hub models (their headers) go here
        self.joined = joined  # started with an invite
        self.catalog = catalog  # the mesh's catalogue of models
        self._own_catalogued = trio.Event()  # the models it was started with are in it
        self.alone_note: str | None = None  # said when told where the mesh is, but alone
        self.identity = identity
        self.mesh = mesh
        self.store = store
        self.api_url = api_url
        self.ollama_url = ollama_url
        self.name = config.name or os.uname().nodename
        self.started_at = time.time()
        self.inflight = InFlight()
        self.stream_budgets = StreamBudgets(STREAM_BUDGETS)
        self.transport = TcpTransport()
        self.overlay = ConnectionManager(
            LocalPeer.create(identity, mesh),
            self.transport,
            listen=[config.listen],
            on_stream=self._route_stream,
            on_lost=lambda conn: self.dialer.lost(conn),
            on_silent=lambda conn: self.dialer.silent(conn),
        )
        # How peers reach this agent: its addresses, its NAT as relays see it.
        self.reachable = Reachable(
            lambda: self.overlay.listen_addresses,
            config.addresses,
            on_change=lambda: self.gossip.republish(),
        )
        self.relays = tuple(
            RelayClient(
                a,
                identity,
                mesh,
                self.overlay,
                TcpTransport(),
                on_member=self._member,
                on_observed=self.reachable.observed,
            )
            for a in dict.fromkeys((*config.relays, *self.known.relays))
        )
        self.capabilities = Capabilities(
            CapabilityStore(store.capabilities_path), lambda: self.gossip.snapshot()
        )
        self.gossip = self._gossip()
        self._told_membership: set[str] = set()
        self.dialer = PeerDialer(
            self.overlay,
            gossip=self.gossip,
            relay_dial=self._relay_dial,
            punch=punch.initiator(self.overlay, self.transport, self.reachable),
            my_nat=self.nat_kind,
            relay_members=lambda: set().union(*(r.members for r in self.relays)),
            local_relays=lambda: tuple(r.name for r in self.relays if r.registered),
            config=DialerConfig(upgrade_interval=config.upgrade_interval),
        )
        self.lan = LanDiscovery(
            enabled=config.mdns,
            peer_id=identity.peer_id,
            mesh=mesh_fingerprint(mesh),
            name=self.name,
            listening=lambda: self.overlay.listen_addresses,
            on_peer=self._sighted,
        )
        self.models = ModelHost(self.gossip, self.overlay)
        for f in files:
            self.models.add(self._mesh_model(f))
        self.assigning = self._assigning()
        ports = [urlsplit(u).port or 0 for u in (api_url, ollama_url) if u is not None]
        self.access = Access.for_binding(config.api_keys, config.api_host, *ports)
        self.app = OpenAIApp(
            self.models.directory,
            self.inflight,
            partial(control.status, self),
            peers=partial(control.peers, self),
            probe=partial(control.probe, self.overlay, names=self._peer_names),
            access=self.access,
            catalogue=self.catalog,
            loads=self.assigning,
        )
        self._routes: dict[str, StreamHandler] = {
            transfer.LABEL: transfer.ArtifactServer(
                store, cut=self._cut_for_peer, may_cut=self._in_plan
            ).handle,
            header_share.LABEL: header_share.HeaderMapServer(self._model_files).handle,
            probe.LABEL: probe.serve,
            hearing.LABEL: partial(hearing.serve, self.overlay),
            punch.LABEL: punch.server(
                self.overlay, self.transport, self.reachable, self.dialer.behind_symmetric
            ),
            self._gossip_label: self.gossip.handle,
            self._other_label: self._other_membership,
            GENERATE_LABEL: lambda s: entry.serve(s, self.app.catalog, peer_id=s.peer_id),
            **self.models.handlers(),
        }

    def _cut_for_peer(self, key: str) -> SliceManifest | None:
        """Artifact `key` of a model held whole here, cut for a peer (blocking)."""
        return next(
            (m for m in (x.source.cut_for_peer(key) for x in self.models) if m is not None), None
        )

    def _in_plan(self, key: str) -> bool:
        return any(m.in_plan(key) for m in self.models)

    def _model_files(self) -> list[tuple[Path, Callable[[], str]]]:
        """Each model file here, with its sha256 (blocking: may hash it)."""
        return [
            (m.files.path, partial(self.store.source_sha256, m.files.path)) for m in self.models
        ]

    @property
    def _gossip_label(self) -> str:
        return swim_service.LABEL if self.config.membership == "swim" else gossip_service.LABEL

    @property
    def _other_label(self) -> str:
        return gossip_service.LABEL if self.config.membership == "swim" else swim_service.LABEL

    async def _other_membership(self, stream: MeshStream) -> None:
        """A peer that runs the other membership protocol: neither sees the other in its
        view, so say so (once a peer) rather than leave the two to wonder."""
        mine = self.config.membership
        theirs = "heartbeat" if mine == "swim" else "swim"
        if stream.peer_id not in self._told_membership:
            self._told_membership.add(stream.peer_id)
            log.warning(
                "gossip.membership_mismatch",
                peer=stream.peer_id,
                error=f"the peer runs --membership {theirs}, this agent {mine}: they do not "
                "see each other; start every agent of a mesh with the same",
            )
        stream.reset(f"this agent runs --membership {mine}")

    def _gossip(self) -> Membership:
        cfg = self.config
        fields = partial(
            advertisement.dynamic_fields,
            self.advertised,
            self.nat_kind,
            self.relays,
            self.store,
            self.capabilities,
            lambda: [m.files.path for m in self.models],
            self.catalog,
        )
        if cfg.membership == "swim":
            return SwimService(
                self.identity, mesh_fingerprint(self.mesh), self.overlay, local_fields=fields
            )
        return GossipService(
            self.identity,
            mesh_fingerprint(self.mesh),
            self.overlay,
            GossipConfig(
                interval=cfg.gossip_interval,
                suspect_after=cfg.suspect_after,
                dead_after=cfg.dead_after,
            ),
            local_fields=fields,
        )

    def _mesh_model(self, files: ModelFiles) -> MeshModel:
        cfg = self.config
        return MeshModel(
            peer_id=self.identity.peer_id,
            files=files,
            overlay=self.overlay,
            gossip=self.gossip,
            capabilities=self.capabilities,
            reach=self.dialer.reach,
            settings=ServingSettings.of(
                cfg, vram=sum(d.offer_bytes for d in advertisement.device_offers(cfg))
            ),
            find_draft=self._find_draft,
        )

    async def _find_draft(self, target: ModelFiles) -> Path | None:
        """`--draft-model auto`: the file of a catalogued model with `target`'s vocabulary
        that can draft for it here (`serving/draft_loading.py`)."""
        context = self.config.slots * self.config.ctx_size
        await self._own_catalogued.wait()  # (its own models are candidates too)
        return await catalogued_draft(
            self.catalog.entries().values(),
            target,
            need=lambda path: advertisement.draft_model_bytes(path, context),
            free=memory_available,
        )

    def _assigning(self) -> Assigning:
        cfg = self.config
        return Assigning(
            self.models,
            self.catalog,
            self.gossip,
            obtain=self._obtain,
            context_tokens=cfg.slots * cfg.ctx_size,
            headroom=ServingSettings.headroom,
            keep_alive=cfg.keep_alive_seconds(),
            # The models an agent is started with stay loaded (as they always have).
            pins=(*cfg.pins, *self.models.names),
            chains=cfg.chains,
            streams=cfg.slots,
            seed_default=not cfg.models,
            seed_after=SEED_AFTER if self.told else 0.0,
            load_timeout=cfg.load_timeout,
        )

    async def _obtain(self, entry: CatalogEntry) -> MeshModel | None:
        """This agent's part in a catalogued model, with the entry's sha256: from its file
        here (the embedded default, a path here, a hub model in its cache), or for a hub
        model not here, from its header alone (`_header_of`); None: it cannot have it."""
        path = await trio.to_thread.run_sync(local_file, entry.source)
        if path is None:
            path = await self._header_of(entry)
        if path is None:
            return None
        sha = await trio.to_thread.run_sync(self.store.source_sha256, path)
        if sha != entry.sha256:
            raise ModelError(f"the file here ({path}) is not the catalogued one (sha256 differs)")
        layout = await trio.to_thread.run_sync(inspect_model, path)
        info = await trio.to_thread.run_sync(read_model_info, path)
        model = self._mesh_model(ModelFiles(path, layout, info, self.store))
        model.placement.source_sha256 = sha
        return model

    async def _header_of(self, entry: CatalogEntry) -> Path | None:
        """A hub model this agent has no file of: its header alone, downloaded from the hub
        into a partial copy (`models/hub.py`, `model_for_agent`), as an agent too small for a
        model it is started with does. The layers a plan gives this agent come later, from
        peers that hold them first, the hub last (`serving/obtain.py`); the whole file only
        where it serves the model whole. None for a catalogued path not on this machine."""
        if self.models_dir is None or not entry.source:
            return None
        try:
            name = parse_model_name(entry.source)
        except ModelError:
            return None
        if not isinstance(name, HubName):
            return None
        from meshagent.models.hub import model_for_agent  # huggingface_hub, for names only

        fetch = partial(model_for_agent, name, self.models_dir, 0)
        try:
            path = await trio.to_thread.run_sync(fetch)
        except (MeshError, OSError) as e:
            raise ModelError(f"could not download the header of {entry.source}: {e}") from e
        log.info("catalog.header_fetched", model=entry.name, source=entry.source, path=str(path))
        return path

    async def _catalogue_own(self) -> None:
        """The models this agent was started with go into the mesh's catalogue (their files
        read in a worker thread: hashed once), then the assignment runs."""
        for model in list(self.models):
            try:
                read = partial(read_model_file, str(model.files.path), self.store)
                self.catalog.add_model(await trio.to_thread.run_sync(read))
            except MeshError as e:
                log.warning("catalog.add_failed", model=model.info.id, error=str(e))
        self._own_catalogued.set()
        await self.assigning.run()

    async def start(self, nursery: trio.Nursery) -> None:
        """Start every service in `nursery`, each once what it needs runs (the API aside)."""
        await nursery.start(self.app.catalog.rejoins.run)  # (before any gen/1 stream comes)
        await nursery.start(self.overlay.run)
        models = list(self.models)
        self.gossip.update_local(**advertisement.static_fields(self.config, self.name, models))
        await nursery.start(self.gossip.run)
        await nursery.start(self.catalog.run, self.gossip)
        await nursery.start(self.dialer.run)
        await nursery.start(self.models.run)
        nursery.start_soon(self._catalogue_own)
        for relay in self.relays:
            await nursery.start(relay.run)
        await nursery.start(self.lan.run)  # mDNS advertises the port the overlay listens on
        nursery.start_soon(
            advertisement.measure, self.gossip, self.config, self.name, models, self.store
        )
        for p in self.known.peers:
            self.dialer.offer(
                p.peer_id, addresses=p.addresses, relays=p.relays, source="remembered"
            )
        nursery.start_soon(known.keep, self.known, self._alive_peers)
        if self.told:
            nursery.start_soon(
                watch_alone,
                self.overlay.links,
                self.known.addresses(),
                tuple(r.name for r in self.relays),
                self._alone,
            )

    @property
    def told(self) -> bool:
        """Whether this agent was told where its mesh is: an invite, `--peer` or `--relay`,
        now or at an earlier start (its data dir remembers)."""
        return self.joined or bool(self.known)

    @property
    def bootstrap(self) -> tuple[str, ...]:
        """Addresses to dial at start (`--peer`, invites now and before)."""
        return self.known.bootstrap

    def advertised(self) -> list[str]:
        return self.reachable.advertised()

    def reachability(self) -> nat.Reachability:
        return self.reachable.reachability()

    def nat_kind(self) -> str:
        """This agent's NAT as its relays tell it ("" without a relay to ask)."""
        return self.reachability().nat if self.relays else ""

    def _alive_peers(self) -> list[tuple[str, tuple[str, ...], tuple[str, ...]]]:
        return [
            (pid, v.record.addresses, v.record.relays)
            for pid, v in self.gossip.snapshot().items()
            if pid != self.identity.peer_id and (v.record.addresses or v.record.relays)
        ]

    def _alone(self, note: str) -> None:
        self.alone_note = note
        log.warning("mesh.alone", note=note)

    @property
    def alone(self) -> str | None:
        """Why this agent has no peer though it was told where its mesh is, while so."""
        return self.alone_note if self.alone_note and not self.overlay.links() else None

    def _route_stream(self, stream: MeshStream) -> Awaitable[None]:
        """Inbound overlay streams go to the service named by their label, each within the
        peer's budget of streams for that service (`STREAM_BUDGETS`), judged as it arrives."""
        service = stream.label.split(":", 1)[0]
        handler = self._routes.get(service)
        if handler is None:
            stream.reset(f"no service for stream label {stream.label!r}")
            handler = _refused
        return self.stream_budgets.admit(stream, service, handler)

    def _peer_names(self) -> dict[str, str]:
        """Each live peer's name, as its record gives it."""
        return {pid: v.record.name for pid, v in self.gossip.snapshot().items()}

    def _sighted(self, sighting: Sighting) -> None:
        self.dialer.offer(sighting.peer_id, addresses=sighting.addresses, source="mdns", renew=True)

    def _member(self, peer_id: str, relay: str) -> None:
        # A (re)registration at the relay is a fresh sighting, like an mDNS announcement.
        self.dialer.offer(peer_id, relays=(relay,), source="relay", renew=True)

    async def _relay_dial(self, relay: str, peer_id: str) -> Any:
        client = next(r for r in self.relays if r.name == relay)
        return await client.dial(peer_id)


async def _refused(stream: MeshStream) -> None:
    """Nothing to serve: the stream was reset as it arrived."""
