"""One direction of an emulated link, as a pure function of (time, packet length).

No I/O and no clock: the emulator passes `now` in and gets back the time at which the packet
leaves the far end of the link, or the reason it was dropped. Randomness (loss, jitter) comes
from a seeded `random.Random`, so a run with the same seed and the same arrivals makes the
same decisions.

The model, in the order a packet meets it:

1. partition: a link that is down drops everything (packets already on the wire still arrive);
2. queue: with a rate, a packet waits behind the bytes not yet serialised; if those plus this
   packet would exceed the queue's byte cap the packet is dropped (drop-tail);
3. serialisation: at `rate_bps` a packet takes `8 * len / rate_bps` seconds to put on the wire,
   starting when the previous packet on this link has finished;
4. loss: the packet is lost on the wire with probability `loss` (it still used its slot);
5. propagation: `delay_s`, varied uniformly within `±jitter_s`, never below zero.

Jitter never reorders packets on one link: a packet whose draw would make it arrive before
the previous one arrives together with it instead. TCP treats reordering as loss (three
duplicate ACKs trigger a fast retransmit and halve the window), and real paths rarely reorder,
so a reordering emulator would measure the emulator rather than the network.
"""

from __future__ import annotations

import enum
import random
from dataclasses import asdict, dataclass, replace
from typing import Any

# A queue never smaller than this, so that a link with little delay still absorbs a burst.
MIN_QUEUE_BYTES = 64 * 1024


class Drop(enum.Enum):
    """Why a link did not deliver a packet."""

    PARTITION = "partition"
    QUEUE = "queue"
    LOSS = "loss"


@dataclass(frozen=True)
class LinkSpec:
    """One direction of a link: one-way `delay_s`, uniform `jitter_s` around it, `loss`
    probability per packet, `rate_bps` (None: unlimited), queue cap in bytes (None: one
    bandwidth-delay product, see `queue_cap`), and `up` (False: partitioned)."""

    delay_s: float = 0.0
    jitter_s: float = 0.0
    loss: float = 0.0
    rate_bps: float | None = None
    queue_bytes: int | None = None
    up: bool = True

    def __post_init__(self) -> None:
        if self.delay_s < 0 or self.jitter_s < 0:
            raise ValueError("delay_s and jitter_s must be >= 0")
        if not 0.0 <= self.loss <= 1.0:
            raise ValueError(f"loss must be a probability, got {self.loss}")
        if self.rate_bps is not None and self.rate_bps <= 0:
            raise ValueError(f"rate_bps must be positive or None, got {self.rate_bps}")
        if self.queue_bytes is not None and self.queue_bytes <= 0:
            raise ValueError(f"queue_bytes must be positive or None, got {self.queue_bytes}")

    @classmethod
    def with_jitter_fraction(cls, delay_s: float, fraction: float, **kw: Any) -> LinkSpec:
        """A spec whose jitter is `fraction` of its delay (the regimes state jitter so)."""
        return cls(delay_s=delay_s, jitter_s=delay_s * fraction, **kw)

    @property
    def queue_cap(self) -> int:
        """Bytes the queue holds: `queue_bytes`, or else one bandwidth-delay product over a
        round trip of twice this delay (the classic buffer for one long TCP flow), at least
        `MIN_QUEUE_BYTES`."""
        if self.queue_bytes is not None:
            return self.queue_bytes
        if self.rate_bps is None:
            return MIN_QUEUE_BYTES
        return max(MIN_QUEUE_BYTES, int(self.rate_bps / 8 * 2 * self.delay_s))

    def replace(self, **changes: Any) -> LinkSpec:
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LinkSpec:
        known = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        unknown = set(d) - set(known)
        if unknown:
            raise ValueError(f"unknown LinkSpec fields: {sorted(unknown)}")
        return cls(**known)


class Link:
    """The state of one direction of a link: when its transmitter is next free and when
    its last packet arrives. `send(now, length)` returns a departure time or a `Drop`."""

    def __init__(self, spec: LinkSpec, rng: random.Random | int | None = None) -> None:
        self.spec = spec
        self._rng = rng if isinstance(rng, random.Random) else random.Random(rng)
        self._tx_free_at = 0.0  # when the last accepted packet has been serialised
        self._last_departure = 0.0

    def set_spec(self, spec: LinkSpec) -> None:
        """Change the link in place; packets already accepted keep their times, and order
        with later packets is kept."""
        self.spec = spec

    def backlog_bytes(self, now: float) -> float:
        """Bytes accepted but not yet serialised at `now`."""
        rate = self.spec.rate_bps
        if rate is None or self._tx_free_at <= now:
            return 0.0
        return (self._tx_free_at - now) * rate / 8

    def send(self, now: float, length: int) -> float | Drop:
        spec = self.spec
        if not spec.up:
            return Drop.PARTITION
        done = now
        if spec.rate_bps is not None:
            backlog = self.backlog_bytes(now)
            # An empty queue takes any packet, so a cap below one packet cannot wedge a link.
            if backlog > 0 and backlog + length > spec.queue_cap:
                return Drop.QUEUE
            start = max(now, self._tx_free_at)
            done = start + length * 8 / spec.rate_bps
            self._tx_free_at = done
        if spec.loss and self._rng.random() < spec.loss:
            return Drop.LOSS
        propagation = spec.delay_s
        if spec.jitter_s:
            propagation = max(0.0, propagation + self._rng.uniform(-spec.jitter_s, spec.jitter_s))
        departure = max(done + propagation, self._last_departure)
        self._last_departure = departure
        return departure
