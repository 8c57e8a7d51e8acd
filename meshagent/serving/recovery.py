"""A request's recovery, in one place: what it does when it loses what served it.

A completion can lose its split's chain (a stage's peer crashed, the plan was repaired around
it), its entry (the agent it was carried to left: `api/carried.py`), or its replica (the mesh
moved the model). Whatever was lost, one `Recovery` per request decides: wait for something
that serves the model again, replay the prompt and the tokens so far there, or fail with the
reason once `deadline` seconds have passed since the loss. The deadline, the tries and the
reason live here, and so do the `Replay`s a request reports. It waits on events (`changed`: a
plan change, a part loaded or unloaded, a peer's state in gossip), never on a timer, except
for the pause between tries of a chain that is not back yet.

`Rerouting` answers the chain's question for the model this agent serves: which runner serves
it now (`route`), which of the plan's stages were lost, and whether the mesh moved the model
to another agent (then the request is handed on: `ModelMoved`). It also fails a split's
requests in flight as soon as its plan stops being routable (`watch`): their tokens will not
come.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import structlog
import trio

from meshagent.errors import ModelMoved, SplitUnavailable
from meshagent.gossip.failure import PeerState
from meshagent.placement.planner import Plan
from meshagent.serving.generation import Replay
from meshagent.serving.runner import ModelRunner

log = structlog.get_logger(__name__)

T = TypeVar("T")

_RETRY_FIRST, _RETRY_MAX = 0.25, 2.0  # seconds between tries of a chain that is not back yet


class GaveUp(SplitUnavailable):
    """Nothing served the request again within its deadline."""


@dataclass(frozen=True)
class Route:
    """What serves a model here now: its runner, and the token text of that runner's model
    (a new plan brings a new engine; the old one's vocabulary may be freed already)."""

    runner: ModelRunner
    token_bytes: Callable[[int], bytes]
    lost: tuple[str, ...] = ()  # the stages found lost since the request broke


class RouteFinder(Protocol):
    def route(self) -> Route | None: ...

    async def changed(self) -> None: ...


class Recovery:
    """The losses of one request and its recovery from each (see the module's docstring).
    `changed` waits for the next change worth looking again after (None: a short pause);
    `routes` finds what serves the model here after a lost chain (`Rerouting`)."""

    def __init__(
        self,
        deadline: float,
        *,
        routes: RouteFinder | None = None,
        changed: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.deadline = deadline
        self.routes = routes
        self._changed = changed or (routes.changed if routes is not None else None)
        self.replays: list[Replay] = []
        self._broke: tuple[str, float] | None = None  # the first loss's reason, and when
        self._latest = ""  # the reason of the last failed try
        self._asked = 0.0  # when the request was last submitted (or asked) after the loss
        self.tries = 0  # since the loss
        self._lost: tuple[str, ...] = ()  # the stages found lost meanwhile

    @property
    def why(self) -> str | None:
        """The loss being recovered from, if any."""
        return None if self._broke is None else self._broke[0]

    def broke(self, why: str) -> None:
        """The request lost what served it (again, when a try failed: the first loss's time
        and reason hold until something serves it)."""
        self._latest = why
        if self._broke is None:
            self._broke = (why, trio.current_time())
            self.tries = 0
            self._lost = ()

    def lost(self, stages: tuple[str, ...]) -> None:
        self._lost = tuple(sorted({*self._lost, *stages}))

    def left(self) -> float:
        """Seconds left before the request gives up; GaveUp when there are none."""
        assert self._broke is not None
        left = self.deadline - (trio.current_time() - self._broke[1])
        if left <= 0:
            raise GaveUp(
                f"{self._latest} (no chain served this model again within {self.deadline:g} s)"
            )
        return left

    async def pause(self) -> None:
        """Before trying again what failed on the last try: longer each time."""
        if self.tries:
            await trio.sleep(min(_RETRY_FIRST * 2 ** (self.tries - 1), _RETRY_MAX))
        self.tries += 1

    async def until(self, find: Callable[[], T | None]) -> T:
        """What `find` gives once it gives something, looked for again at each change;
        GaveUp past the deadline. `find` may raise to end the recovery (ModelMoved)."""
        while True:
            left = self.left()
            found = find()
            if found is not None:
                self._asked = trio.current_time()
                return found
            with trio.move_on_after(left):
                if self._changed is not None:
                    await self._changed()
                else:
                    await trio.sleep(0.05)

    def served(self, tokens: int) -> None:
        """Something served the request after the loss (a token came): the loss is over,
        and its `Replay` says how long it took and how many tokens ran again."""
        if self._broke is None:
            return
        why, since = self._broke
        now = trio.current_time()
        ms = round((now - since) * 1000, 1)
        wait_ms = round((max(self._asked, since) - since) * 1000, 1)
        self.replays.append(Replay(why, tokens, ms, wait_ms, self._lost))
        self._broke, self._lost = None, ()

    async def after(self, error: SplitUnavailable, tokens: int) -> Route:
        """After a lost chain: what serves the model here once it is worth trying again
        (`tokens`: the prompt's and those generated, to run again); the error itself where
        nothing finds routes."""
        if self.routes is None:
            raise error
        self.broke(str(error))
        try:
            self.left()
            await self.pause()
            log.info("generation.replay", reason=str(error), tokens=tokens, tries=self.tries)
            route = await self.until(self.routes.route)
        except GaveUp as e:
            raise e from error
        self.lost(route.lost)
        return route


class Offered(Protocol):
    """What this agent offers of its model now (`serving/mesh_directory.py`)."""

    @property
    def model(self) -> Any: ...  # a LocalModel, or None

    @property
    def plans(self) -> list[Plan]: ...  # the plan served now, and one replaced lately

    async def changed(self) -> None: ...


class Placement(Protocol):
    routable: bool
    in_force: Any  # a Claim, or None
    gossip: Any
    changed: trio.Event  # set (and replaced) at each decision


class Rerouting:
    """Which runner serves the model here after a loss, for the requests of one model."""

    def __init__(self, peer_id: str, placement: Placement, offered: Offered) -> None:
        self.peer_id = peer_id
        self.placement = placement
        self.offered = offered

    def route(self) -> Route | None:
        """The runner that serves the model here now (the same plan keeps its runner, and the
        pipeline opens its chain again on the next step; a new plan that keeps this agent the
        entry, or makes it a replica, brings a new one); None while there is none or the plan
        in force is not routable (a request tried on a chain that is not back would only fail
        again). ModelMoved when the mesh moved the model to other agents."""
        lost = self.lost_stages()
        local = self.offered.model
        if local is not None and local.runner.aborted is None and self.placement.routable:
            return Route(local.runner, local.engine.token_bytes, tuple(sorted(lost)))
        if self.served_elsewhere():
            raise ModelMoved("the mesh moved this model: another agent serves it now; retry")
        return None

    async def changed(self) -> None:
        await self.offered.changed()

    def lost_stages(self) -> set[str]:
        """The stages of the plan served here, and of the one it replaced lately (a request
        may have broken on that one), whose peers gossip has declared dead (or forgotten)."""
        views = self.placement.gossip.snapshot()  # alive and suspect peers only
        lost: dict[str, str] = {}  # peer -> its stage, in the newest plan that has it
        for plan in self.offered.plans:
            for st in plan.stages if plan.split else ():
                v = views.get(st.peer_id)
                if (v is None or v.state == PeerState.DEAD) and st.peer_id not in lost:
                    lost[st.peer_id] = stage_name(st)
        return set(lost.values())

    def served_elsewhere(self) -> bool:
        """A routable plan is in force and requests enter it at other agents only."""
        claim = self.placement.in_force
        if not self.placement.routable or claim is None:
            return False
        plan = claim.plan
        entries = plan.replicas if not plan.split else tuple(c[0].peer_id for c in plan.pipelines)
        return self.peer_id not in entries

    async def watch(self, interrupt: Callable[[str], None]) -> None:
        """As the entry of a split, fail the requests in flight as soon as the plan stops
        being routable (a stage's peer declared dead by gossip): their tokens will not come,
        and a peer that vanished without a reset would otherwise hold them until the
        overlay's dead-peer timeout. Woken by each placement decision."""
        while True:
            await self.placement.changed.wait()
            if not self.placement.routable or self._chain_lost():
                interrupt("the split lost a stage (its peer is gone or left the plan)")

    def _chain_lost(self) -> bool:
        """This agent's chain of a split of several lost a peer the plan in force still
        names (another chain may serve on)."""
        claim = self.placement.in_force
        if claim is None or not claim.plan.chains:
            return False
        chain = claim.plan.chain_of(self.peer_id).stages
        if not chain or chain[0].peer_id != self.peer_id:
            return False
        views = self.placement.gossip.snapshot()
        return any((v := views.get(s.peer_id)) is None or v.state == PeerState.DEAD for s in chain)


def stage_name(stage: Any) -> str:
    """A stage as receipts name it: `<peer id>:<first layer>-<end>`."""
    return f"{stage.peer_id}:{stage.start}-{stage.end}"
