"""Whether an agent may propose plans: not while it sees fewer agents than it lost lately.

An agent cannot tell a partition from deaths: the agents on the other side of a cut look dead.
Were the side that sees few to plan on its own, each agent it lost would break its plan in
turn (a proposal a second as its view shrinks), and when the cut heals, the highest epoch
wins everywhere: the few would replace the plans the many were serving (found by the scale
simulation, `meshagent/testing/scale_sim.py`: five agents cut off from sixty won every model
back at the heal, and the mesh waited on their loads). So an agent that sees fewer agents
alive (itself included) than it saw die within `WINDOW_S` proposes nothing: it follows the
plans in force, and its requests wait for them. Past the window it plans again, as after any
death: a mesh that lost most of its agents for good waits `WINDOW_S` before replanning.
"""

from __future__ import annotations

WINDOW_S = 60.0


def cut_off(alive: int, lost: int) -> str | None:
    """Why an agent that sees `alive` agents (itself included) and saw `lost` die within
    `WINDOW_S` may not propose a plan; None when it may (it sees at least as many as it
    lost: a crash of one of two agents still leaves the survivor free to plan)."""
    if alive >= lost:
        return None
    return (
        f"this agent sees {alive} agent{'s' if alive != 1 else ''} where {alive + lost} were "
        f"alive within {WINDOW_S:g} s (a partition?): it proposes no plan until it sees at "
        "least as many as it lost, and follows the plans in force meanwhile"
    )
