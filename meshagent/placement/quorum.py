"""Whether an agent may propose plans: not while it sees fewer agents than it lost lately, nor
while agents are dying in a burst.

An agent cannot tell a partition from deaths: the agents on the other side of a cut look dead.
Were the side that sees few to plan on its own, each agent it lost would break its plan in
turn (a proposal a second as its view shrinks), and when the cut heals, the highest epoch
wins everywhere: the few would replace the plans the many were serving (found by the scale
simulation, `meshagent/testing/scale_sim.py`: five agents cut off from sixty won models back
at the heal, and the mesh waited on their loads). So:
- an agent that sees fewer agents alive (itself included) than it saw die within `WINDOW_S`
  proposes nothing: it follows the plans in force, and its requests wait for them. Past the
  window it plans again, as after any death: a mesh that lost most of its agents for good
  waits `WINDOW_S` before replanning;
- while agents die or come in a burst (`BURST` or more within `BURST_WINDOW_S`, the last
  under `QUIET_S` ago), it waits for the view to settle first: a cut reaches each side's
  views over seconds, death by death, and until it has, the small side still sees more than
  it lost; when it heals, the agents across come back into each view over seconds, and an
  agent whose view lags would replace a stage whose agent it still holds dead. A single
  crash or join is planned for at once.
"""

from __future__ import annotations

import collections
from collections.abc import Collection

WINDOW_S = 60.0
BURST = 2
BURST_WINDOW_S = 10.0
QUIET_S = 3.0


def cut_off(alive: int, lost: int, burst: int = 0, latest: int = 0) -> str | None:
    """Why an agent may not propose a plan now; None when it may. `alive`: the agents it
    sees, itself included; `lost`: those it saw die within `WINDOW_S`; `burst`: the agents
    it saw die or come within `BURST_WINDOW_S`; `latest`: within `QUIET_S`."""
    if burst >= BURST and latest > 0:
        return (
            f"{burst} agents died or came within {BURST_WINDOW_S:g} s: this agent proposes no "
            f"plan until {QUIET_S:g} s pass with none (a cut, and its healing, reach a view "
            "agent by agent)"
        )
    if alive >= lost:
        return None
    return (
        f"this agent sees {alive} agent{'s' if alive != 1 else ''} where {alive + lost} were "
        f"alive within {WINDOW_S:g} s (a partition?): it proposes no plan until it sees at "
        "least as many as it lost, and follows the plans in force meanwhile"
    )


class Turnover:
    """The agents that left an agent's view and those that came into it, with when: what
    `cut_off` counts. `note` each view as it is read (a peer that comes back still counts as
    lost for the window, so an agent whose view grows back after a cut waits for it to be
    whole again; arrivals count toward a burst, so it also waits for its view to stop
    growing)."""

    def __init__(self) -> None:
        self._before: set[str] | None = None
        self._changes: collections.deque[tuple[float, bool]] = collections.deque()  # gone?

    def note(self, alive: Collection[str], now: float) -> None:
        alive = set(alive)
        if self._before is not None:
            self._changes.extend([(now, True)] * len(self._before - alive))
            self._changes.extend([(now, False)] * len(alive - self._before))
        self._before = alive
        while self._changes and now - self._changes[0][0] > WINDOW_S:
            self._changes.popleft()

    def cut_off(self, alive: int, now: float) -> str | None:
        """`cut_off` for an agent that sees `alive` agents now."""
        ages = [(now - t, gone) for t, gone in self._changes if now - t <= WINDOW_S]
        return cut_off(
            alive,
            sum(gone for _, gone in ages),
            sum(a <= BURST_WINDOW_S for a, _ in ages),
            sum(a <= QUIET_S for a, _ in ages),
        )
