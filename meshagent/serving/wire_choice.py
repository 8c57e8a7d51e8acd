"""What a split's hidden states cross the network as, and whether its drafts change no token.

The entry chooses the wire dtype for the whole chain from `--wire-dtype` and the model's
capability record (`models/capability.py`: a dtype certified exact, where one is). Drafts
(and kept prefixes) change no token only where every stage computes a window as it computes
one-token steps: the entry judges its own llama.cpp build, each other stage's agent says in
gossip whether its build does (`windows_inexact`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import structlog
import trio

from meshagent import wording
from meshagent.models.artifacts import ArtifactStore
from meshagent.models.capability import WireChoice, choose_wire_dtype
from meshagent.models.layout import ModelLayout
from meshagent.placement.planner import Plan
from meshagent.serving.capabilities import Capabilities
from meshagent.serving.pipeline import PipelineExecutor

log = structlog.get_logger(__name__)

_RECORD_WAIT = 10.0  # seconds a stage of a certified-only split waits for the record


async def choose_wire(
    setting: str,
    *,
    store: ArtifactStore,
    model_path: Path,
    layout: ModelLayout,
    capabilities: Capabilities,
    changed: Callable[[], Awaitable[None]],
) -> WireChoice:
    """The dtype this agent sends activations in (the entry's choice holds for the chain);
    `changed` waits for gossip to change, which may bring a capability record."""
    sha = await trio.to_thread.run_sync(lambda: store.source_sha256(model_path))
    signed = capabilities.for_model(sha)  # reads gossip: on the event loop
    if signed is None and layout.split_refusal is not None:
        # A split of a family split only once certified: a peer holds the record, and
        # gossip brings it here shortly (the plan may have arrived first).
        with trio.move_on_after(_RECORD_WAIT):
            while signed is None:
                await changed()
                signed = capabilities.for_model(sha)
    choice = choose_wire_dtype(setting, signed and signed.record)
    log.info("mesh_model.wire", **choice.to_dict())
    return choice


def judge_windows(
    pipeline: PipelineExecutor, plan: Plan, views: Mapping[str, Any], peer_id: str
) -> None:
    """Whether `pipeline`'s drafts change no token over `plan`'s stages: its own build's
    verdict, unless another stage's agent says in gossip that its build computes windows
    otherwise."""
    pipeline.exact_windows = pipeline.entry.exact_windows
    pipeline.windows_reason = pipeline.entry.windows_reason
    for st in plan.stages:
        view = views.get(st.peer_id)
        if st.peer_id != peer_id and view is not None and view.record.windows_inexact:
            pipeline.exact_windows = False
            who = wording.peer(st.peer_id, view.record.name)
            pipeline.windows_reason = (
                f"a split: the stage on {who} computes windows otherwise: "
                f"{view.record.windows_inexact}"
            )
            return
