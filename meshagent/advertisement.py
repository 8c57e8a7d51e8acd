"""What this agent says about itself in its gossip record.

Static fields (name, memory offered, the model held) are published at start and again once
measured; dynamic ones (addresses, registered relays, artifacts held) gossip reads each time it
publishes; what of the model is served here the model publishes as its part changes
(`MeshModel.publish_serving`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import structlog
import trio

from meshagent import __version__, capacity, devices
from meshagent.catalog.service import Catalog
from meshagent.config import AgentConfig
from meshagent.engine.runtime import inexact_build, inexact_model
from meshagent.errors import ModelError
from meshagent.gossip.membership import Membership
from meshagent.gossip.peer_record import MAX_ARTIFACTS, ArtifactHeld, DeviceOffer, ModelHeld
from meshagent.models.artifacts import ArtifactStore
from meshagent.models.default import draft_model_path
from meshagent.models.layout import inspect_model
from meshagent.models.ranged import PartialModel, is_partial
from meshagent.placement.costs import ModelCost
from meshagent.relay.client import RelayClient
from meshagent.serving.capabilities import Capabilities
from meshagent.serving.draft_loading import AUTO_RATIO
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
    models: Sequence[MeshModel],
    sha256: Mapping[str, str] | None = None,
    device_speeds: Sequence[float] = (),
) -> dict[str, Any]:
    """Record fields that change only when measured: `sha256` holds each model file's (by
    model id), once known; `device_speeds` each GPU's."""
    sha256 = sha256 or {}
    gib = 1 << 30
    available = capacity.memory_available()
    offer = capacity.memory_offer(
        available,
        limit=config.max_memory,
        weights=int(config.mem_weights_gib * gib),
        kv=int(config.mem_kv_gib * gib),
    )
    spare = capacity.spare_memory(available, offer)
    draft = (0.0, 0.0)
    if config.draft_model:  # its weights and KV cache are not the mesh's to place
        path = draft_model_path(config.draft_model)
        need = draft_model_bytes(path, config.slots * config.ctx_size)
        offer = capacity.MemoryOffer.split(max(0, offer.total - need))
        draft = draft_compute(path, auto=config.draft_model == "auto")
    return {
        "name": name,
        "agent_version": __version__,
        "mem_weights_bytes": offer.weights,
        "mem_kv_bytes": offer.kv,
        "mem_spare_bytes": spare,
        "devices": device_offers(config, device_speeds),
        "draft_gflops": draft,
        # Each whole model file here (a partial copy holds only stages' bytes).
        "models": tuple(
            ModelHeld(i.id, sha256.get(i.id, ""), i.architecture, i.n_layers, i.size_bytes)
            for i in (m.info for m in models if m.source.partial is None)
        ),
        # A split drafts by default only where all its stages compute windows exactly (one
        # reason for every model here: the first found).
        "windows_inexact": inexact_build()
        or next((w for m in models if (w := inexact_model(m.layout.weight_types))), ""),
    }


def dynamic_fields(
    advertised: Callable[[], Sequence[str]],
    nat: Callable[[], str],
    relays: Sequence[RelayClient],
    store: ArtifactStore,
    capabilities: Capabilities,
    model_paths: Callable[[], Sequence[Path]],
    catalog: Catalog,
) -> dict[str, Any]:
    """Record fields that can change while running; gossip polls them."""
    return {
        "addresses": tuple(advertised()),
        "nat": nat(),
        "relays": tuple(r.name for r in relays if r.registered),
        "artifacts": tuple(ArtifactHeld.from_manifest(m) for m in store.all())[:MAX_ARTIFACTS],
        "capabilities": capabilities.published(),
        "catalog": catalog.published(),
        "no_tokenizer": tuple(s for p in model_paths() for s in no_tokenizer(p)),
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
    gossip: Membership,
    config: AgentConfig,
    name: str,
    models: Sequence[MeshModel],
    store: ArtifactStore,
) -> None:
    """Measured once at start, off the event loop: compute speed (the CPU's and each GPU's),
    the models' hashes."""
    for model in models:
        path = Path(model.info.path)
        if is_partial(path):
            # Its sha256 is in the sidecar: placement counts downloads from its first plan
            # on, before the speed published next lets it propose one.
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
    shas = {}
    for model in models:
        path = Path(model.info.path)
        shas[model.info.id] = await trio.to_thread.run_sync(lambda p=path: store.source_sha256(p))
    gossip.update_local(**static_fields(config, name, models, shas, speeds))
    for model in models:
        model.placement.source_sha256 = shas[model.info.id]  # placement: who holds what
        model.publish_serving()


def draft_model_bytes(path: Path, context_tokens: int) -> int:
    """What a draft model takes here: its weights, the KV cache of every slot and its
    compute buffer (as placement counts a model served whole)."""
    cost = ModelCost.from_layout(path.name, inspect_model(path.expanduser()))
    return cost.stage_bytes(0, cost.n_layers, context_tokens)


def draft_compute(path: Path, *, auto: bool) -> tuple[float, float]:
    """What a draft model computes per token, as placement counts it at the entry (GFLOP per
    token: its layers and its output head), and the smallest model it drafts for in the same
    unit: `auto` drafts only for a target `AUTO_RATIO` times its size, a model named for
    every target."""
    layout = inspect_model(path.expanduser())
    gflops = 2.0 * (sum(layout.layer_params) + layout.n_vocab * layout.n_embd) / 1e9
    return gflops, AUTO_RATIO * gflops if auto else 0.0
