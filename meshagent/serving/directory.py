"""The model directory: what the API asks to find a model.

It answers three questions: which models this agent serves itself (ready to take requests),
which models peers of the mesh serve instead, and a stream to such a peer. It also gives the
receipt of a local model: the response headers saying who serves it. Serving keeps the answers
current as placement moves models (`MeshModel`'s `MeshDirectory` is the agent's directory);
the API only asks, so serving never depends on the API.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from meshagent import wording
from meshagent.net.stream import MeshStream
from meshagent.serving.local_model import LocalModel

# The label of the overlay stream an inference request for a model a peer serves travels on:
# the asker keeps the client's connection and what it was sent, so a completion survives
# losing its entry (`api/elsewhere.py`, `api/carried.py`; the entry's side `api/entry.py`).
# The string is on the wire.
GENERATE_LABEL = "gen/1"

Headers = list[tuple[bytes, bytes]]


@dataclass(frozen=True)
class RemoteModel:
    """A model this agent does not run, served by a peer of the mesh (whole or as the entry
    stage of a split)."""

    id: str
    peer_id: str
    served_as: str  # "whole" or "split"
    stages: tuple[tuple[str, int, int], ...] = ()  # (peer id, first layer, end) of a split
    layers: int = 0
    context_length: int = 0
    peer_name: str = ""  # the name `peer_id` goes by, as its record gives it

    @property
    def label(self) -> str:
        """The peer as messages name it: `laptop (3f2a9c01b7d4)`."""
        return wording.peer(self.peer_id, self.peer_name)


class ModelDirectory(Protocol):
    def local_models(self) -> Sequence[LocalModel]:
        """The models this agent serves now, each ready to take requests."""
        ...

    def remote_models(self) -> Sequence[RemoteModel]:
        """Models that peers serve: each other replica of a model served whole (also where
        this agent is one of them), and a split's entry where this agent is not it."""
        ...

    def unserved_for_now(self, name: str) -> float:
        """Seconds worth waiting for `name` when no one serves it at the moment: for a
        model of this mesh whose placement is changing (a lost peer being replaced), how
        long requests may wait for it; 0 for a model this mesh does not have."""
        ...

    def why_unserved(self, name: str) -> str | None:
        """Why no agent can serve `name` (a model of this mesh) now, when the reason has
        held a few seconds (not while a plan is being agreed or loaded); else None."""
        ...

    def receipt(self, model: LocalModel) -> Headers:
        """Response headers saying who serves `model` (one of `local_models()`)."""
        ...

    async def changed(self) -> None:
        """Until what the directory answers may have changed (a part offered or withdrawn
        here, a placement decision): a request looking for its model's next entry looks
        again then."""
        ...

    async def open_stream(self, peer_id: str, label: str = GENERATE_LABEL) -> MeshStream:
        """A stream to `peer_id` for the API (`GENERATE_LABEL`); raises MeshError if the
        peer is unreachable."""
        ...
