"""What this agent says about itself in its gossip record.

Static fields (name, memory offered, the model held) are published at start and again once
measured; dynamic ones (addresses, registered relays, artifacts held) gossip reads each time it
publishes; what of the model is served here the model publishes as its part changes
(`MeshModel.publish_serving`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import structlog
import trio

from meshagent import __version__, capacity, devices
from meshagent.config import AgentConfig
from meshagent.discovery import addresses
from meshagent.engine.runtime import inexact_build, inexact_model
from meshagent.errors import ModelError
from meshagent.gossip.peer_record import MAX_ARTIFACTS, ArtifactHeld, DeviceOffer, ModelHeld
from meshagent.gossip.service import GossipService
from meshagent.models.artifacts import ArtifactStore
from meshagent.models.ranged import PartialModel, is_partial
from meshagent.net.manager import ConnectionManager
from meshagent.relay.client import RelayClient
from meshagent.serving.capabilities import Capabilities
from meshagent.serving.mesh_model import MeshModel

log = structlog.get_logger(__name__)


def device_offers(config: AgentConfig, speeds: Sequence[float] = ()) -> tuple[DeviceOffer, ...]:
    """This agent's GPUs as its record lists them: memory, the share offered (`--max-vram`),
    and `speeds` once measured."""
    found = devices.devices_at_start()
    offers = devices.vram_offer(found, config.max_vram)
    speeds = list(speeds) + [0.0] * (len(found) - len(speeds))
    return tuple(
        DeviceOffer(d.name, d.description, d.kind, d.total_bytes, d.free_bytes, o, s)
        for d, o, s in zip(found, offers, speeds, strict=True)
    )


def static_fields(
    config: AgentConfig,
    name: str,
    model: MeshModel,
    sha256: str = "",
    device_speeds: Sequence[float] = (),
) -> dict[str, Any]:
    """Record fields that change only when measured: `sha256` is the model file's, once known;
    `device_speeds` each GPU's."""
    info = model.info
    gib = 1 << 30
    available = capacity.memory_available()
    offer = capacity.memory_offer(
        available,
        limit=config.max_memory,
        weights=int(config.mem_weights_gib * gib),
        kv=int(config.mem_kv_gib * gib),
    )
    return {
        "name": name,
        "agent_version": __version__,
        "mem_weights_bytes": offer.weights,
        "mem_kv_bytes": offer.kv,
        "mem_spare_bytes": capacity.spare_memory(available, offer),
        "devices": device_offers(config, device_speeds),
        # The whole model file, when it is here (a partial copy holds only stages' bytes).
        "models": (ModelHeld(info.id, sha256, info.architecture, info.n_layers, info.size_bytes),)
        if model.source.partial is None
        else (),
        # A split drafts by default only where all its stages compute windows exactly.
        "windows_inexact": inexact_build() or inexact_model(model.layout.weight_types),
    }


def dynamic_fields(
    overlay: ConnectionManager,
    relays: Sequence[RelayClient],
    store: ArtifactStore,
    capabilities: Capabilities,
    model_path: Path,
) -> dict[str, Any]:
    """Record fields that can change while running; gossip polls them."""
    return {
        "addresses": tuple(addresses.advertised(overlay.listen_addresses)),
        "relays": tuple(r.name for r in relays if r.registered),
        "artifacts": tuple(ArtifactHeld.from_manifest(m) for m in store.all())[:MAX_ARTIFACTS],
        "capabilities": capabilities.published(),
        "no_tokenizer": no_tokenizer(model_path),
    }


def no_tokenizer(model_path: Path) -> tuple[str, ...]:
    """The model file's sha256 while its partial copy's header lacks the tokenizer."""
    if not is_partial(model_path):
        return ()
    try:
        part = PartialModel(model_path)
    except ModelError:
        return ()
    return (part.sha256,) if part.gaps else ()


async def measure(
    gossip: GossipService, config: AgentConfig, name: str, model: MeshModel, store: ArtifactStore
) -> None:
    """Measured once at start, off the event loop: compute speed (the CPU's and each GPU's),
    the model's hash."""
    path = Path(model.info.path)
    if is_partial(path):
        # Its sha256 is in the sidecar: placement counts downloads from its first plan on,
        # before the speed published next lets it propose one.
        model.placement.source_sha256 = store.source_sha256(path)
    speed = await trio.to_thread.run_sync(capacity.matmul_gflops)
    gossip.update_local(compute_speed=speed, compute_unit=capacity.COMPUTE_UNIT)
    log.info("agent.measured", compute_speed=speed, unit=capacity.COMPUTE_UNIT)
    speeds = []
    for d in devices.devices_at_start():
        try:
            s = await trio.to_thread.run_sync(devices.device_gflops, d.name)
        except (RuntimeError, ValueError) as e:
            log.warning("agent.device_unmeasured", device=d.name, error=str(e))
            s = 0.0
        log.info("agent.measured_device", device=d.name, speed=s, unit=capacity.COMPUTE_UNIT)
        speeds.append(s)
    sha = await trio.to_thread.run_sync(lambda: store.source_sha256(path))
    gossip.update_local(**static_fields(config, name, model, sha, speeds))
    model.placement.source_sha256 = sha  # placement: who holds what of this file
    model.publish_serving()
