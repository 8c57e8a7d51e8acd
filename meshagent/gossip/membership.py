"""Which membership protocol an agent runs: gossip of heartbeats (`service.py`, the default) or
probes (`swim_service.py`, `membership = "swim"`). Both offer the same API to placement, the
dialer and the control API."""

from __future__ import annotations

from meshagent.gossip.service import GossipService
from meshagent.gossip.swim_service import SwimService

PROTOCOLS = ("heartbeat", "swim")

Membership = GossipService | SwimService
