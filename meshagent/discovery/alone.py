"""An agent told where its mesh is (an invite, `--peer`, `--relay`) that has reached no peer
some time after its start says so, with the addresses it tried and what to try instead: in
its log, `meshagent status`, `meshagent peers`, the console and `up`'s stderr."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import trio

ALONE_AFTER = 30.0  # seconds without a peer before it is said


def alone_note(peers: Sequence[str], relays: Sequence[str], after: float = ALONE_AFTER) -> str:
    tried = ", ".join(peers) or "none (the invite carries no address)"
    via = ", ".join(relays) or "none"
    return (
        f"alone for {after:g} s: no peer of the mesh answered. The addresses tried: {tried}; "
        f"the relays: {via}. Check that the inviting agent runs and that this machine can "
        "reach one of those (a firewall, another network), or ask for an invite with "
        "`meshagent invite --address HOST:PORT` (an address this machine reaches) or "
        "`--relay HOST:PORT`."
    )


async def watch_alone(
    links: Callable[[], Sequence[object]],
    peers: Sequence[str],
    relays: Sequence[str],
    on_alone: Callable[[str], None],
    after: float = ALONE_AFTER,
) -> None:
    """Once: `on_alone(note)` if no peer is connected `after` seconds from now."""
    await trio.sleep(after)
    if not links():
        on_alone(alone_note(peers, relays, after))
