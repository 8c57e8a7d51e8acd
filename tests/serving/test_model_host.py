"""A split's stream names its model in its label; a peer naming a model this agent runs no part
of, or none, is refused at once (`ModelHost.handlers`)."""

from __future__ import annotations

from types import SimpleNamespace

from meshagent.serving.model_host import ModelHost
from meshagent.serving.pipeline import REPLY_LABEL, STAGE_LABEL


class Stream:
    def __init__(self, label: str) -> None:
        self.label = label
        self.reset_with: str | None = None

    def reset(self, reason: str) -> None:
        self.reset_with = reason


async def test_a_split_stream_goes_to_its_model_and_one_naming_another_is_refused():
    host = ModelHost(SimpleNamespace(), overlay=None)
    routed = []

    async def to_split(stream) -> None:
        routed.append(stream.label)

    host._models["chat"] = SimpleNamespace(to_split=to_split)  # a model taken part in
    handlers = host.handlers()
    for label in (STAGE_LABEL, REPLY_LABEL):
        await handlers[label](Stream(f"{label}:CHAT"))  # ids compare without case
    assert routed == [f"{STAGE_LABEL}:CHAT", f"{REPLY_LABEL}:CHAT"]
    for label in (STAGE_LABEL, f"{STAGE_LABEL}:", f"{STAGE_LABEL}:other", f"{REPLY_LABEL}:x" * 40):
        stream = Stream(label)
        await handlers[label.partition(":")[0]](stream)
        assert stream.reset_with is not None and len(stream.reset_with) < 200
    assert len(routed) == 2
