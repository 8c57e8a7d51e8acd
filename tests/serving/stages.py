"""Stage servers and decoders over fake stages, as the tests of split serving build them."""

from __future__ import annotations

import trio

from meshagent.serving import stage_messages as sm
from meshagent.serving.recovery import Route
from meshagent.serving.stage_server import MAX_KEPT, OpenStream, StageServer
from meshagent.testing.fake_engine import FakeStage

ROOMY = 1 << 30  # kept-prefix bytes a test's stage allows: more than any test keeps


def fake_server(
    stage: FakeStage,
    *,
    open_next: OpenStream | None = None,
    open_reply: OpenStream | None = None,
    kept_budget: int = ROOMY,
    max_kept: int = MAX_KEPT,
) -> StageServer:
    return StageServer(
        stage,
        n_vocab=stage.n_vocab,
        kept_budget=kept_budget,
        max_kept=max_kept,
        open_next=open_next,
        open_reply=open_reply,
    )


def reply_decoder(stage: FakeStage | None = None) -> sm.StageDecoder:
    """A decoder of what a fake last stage sends back to the entry."""
    stage = stage or FakeStage(last=True)
    return sm.StageDecoder(sm.StageLimits(stage.n_slots, stage.slot_ctx, stage.n_vocab))


def upstream_decoder(stage: FakeStage | None = None) -> sm.StageDecoder:
    """A decoder of what a fake stage receives from upstream (or a middle one sends on)."""
    stage = stage or FakeStage(last=False)
    limits = sm.StageLimits(stage.n_slots, stage.slot_ctx, stage.n_vocab, stage.n_embd)
    return sm.StageDecoder(limits)


class SameRoute:
    """Routes a request that lost its chain back to `model`'s own runner (the same pipeline
    opens its chain again), its text by `token_bytes` (the model's own by default)."""

    def __init__(self, model, token_bytes=None) -> None:
        self.model = model
        self.token_bytes = token_bytes or model.engine.token_bytes

    def route(self) -> Route:
        return Route(self.model.runner, self.token_bytes)

    async def changed(self) -> None:
        await trio.sleep(0.01)
