"""What a relay allows: registrations, circuits, bandwidth, idleness."""

from __future__ import annotations

from dataclasses import dataclass

import trio

from meshagent.errors import ConfigError


@dataclass(frozen=True)
class RelayLimits:
    max_agents: int = 1024  # registered agents at once
    circuits_per_agent: int = 16  # circuits an agent may be an end of at once
    max_circuits: int = 4096
    rate_bytes_per_s: float = 4 << 20  # per circuit, both directions together
    circuits_per_mesh: int = 256  # circuits among the members of one mesh at once
    mesh_rate_bytes_per_s: float = 0.0  # all of one mesh's circuits together; 0: no cap
    idle_timeout: float = 120.0  # a circuit that moves no byte this long is closed
    accept_timeout: float = 10.0  # how long a dialer waits for the target to accept
    request_timeout: float = 10.0  # how long a new connection has to say what it is for
    control_timeout: float = 90.0  # a control connection silent this long is dropped

    def validate(self) -> None:
        if self.rate_bytes_per_s <= 0 or self.idle_timeout <= 0:
            raise ConfigError("relay rate and idle timeout must be > 0")
        if self.circuits_per_agent < 1 or self.max_agents < 1 or self.circuits_per_mesh < 1:
            raise ConfigError("relay limits on agents and circuits must be >= 1")
        if self.mesh_rate_bytes_per_s < 0:
            raise ConfigError("the relay's per-mesh rate must be >= 0 (0: no cap)")


class RateLimiter:
    """Token bucket in bytes; `await take(n)` sleeps until n bytes may pass."""

    def __init__(self, rate: float, burst: float | None = None) -> None:
        self.rate = rate
        self.burst = burst if burst is not None else max(rate / 8, 64 * 1024)
        self._tokens = self.burst
        self._at = trio.current_time()

    async def take(self, n: int) -> None:
        now = trio.current_time()
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now
        self._tokens -= n
        if self._tokens < 0:
            # Debt is paid by sleeping; chunks larger than the burst still pass, just late.
            await trio.sleep(-self._tokens / self.rate)
