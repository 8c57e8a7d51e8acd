"""What this agent hears itself beats hearsay.

Gossip carries items about peers from peers: any member may sign an obituary for any other,
and any member may make up identities and sign their records and heartbeats. What an agent
hears directly, over a connection of its own, no member can forge. Two rules follow:

* **An obituary about a peer this agent hears is disputed.** When an obituary from another
  issuer arrives about a peer this agent has heard directly within `HEARS_WITHIN_S` (a PONG
  on its connection to it: the overlay PINGs every 0.5 s), the peer stays alive here and the
  obituary is not taken (nor passed on). Once the link goes silent, a copy pushed again is
  taken as before. A peer's own obituary (it is leaving) is always taken.
* **Made-up members cannot crowd out real ones.** A peer may introduce members other than
  itself, ones this agent does not hear, `INTRODUCE_BURST` at once and then
  `INTRODUCE_PER_MINUTE` a minute (`Introductions`). When the table is full, a member this
  agent hears gets room: the member heard only by hearsay whose heartbeat advanced least
  recently is dropped for it. Hearsay never takes anyone's room.

The core asks "when did this agent last hear `peer_id` directly" through a `Heard` function
(the trio side reads its overlay connections; tests pass a dict's `get`), on the same clock
as the `now` the core is given.
"""

from __future__ import annotations

from collections.abc import Callable

from meshagent.gossip.budget import Buckets

# When this agent last heard a peer directly (a local monotonic time), None if it has no
# connection to it.
Heard = Callable[[str], float | None]

# A connection PINGs every 0.5 s: four periods without an answer and the peer is no longer
# heard. The overlay calls a link silent after 1.25 s; an obituary about a peer it lost is
# taken at most this long after its last answer.
HEARS_WITHIN_S = 2.0
# New members one peer may introduce (a joining agent learns a whole mesh from its first
# exchange; the members its partner hears directly come first), then so many a minute.
INTRODUCE_BURST = 128
INTRODUCE_PER_MINUTE = 60


def hears(heard: Heard | None, peer_id: str, now: float) -> bool:
    """Whether this agent heard `peer_id` directly within `HEARS_WITHIN_S` of `now`."""
    if heard is None:
        return False
    at = heard(peer_id)
    return at is not None and now - at <= HEARS_WITHIN_S


def introductions() -> Buckets:
    """The budget of new members per introducing peer."""
    return Buckets(INTRODUCE_BURST, INTRODUCE_PER_MINUTE / 60)
