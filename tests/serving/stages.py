"""Stage servers and decoders over fake stages, as the tests of split serving build them."""

from __future__ import annotations

from meshagent.serving import stage_messages as sm
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
