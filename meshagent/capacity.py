"""What one agent offers the mesh: memory for a model's weights and KV cache, and compute speed.

Compute speed is a quick float32 matrix-multiply benchmark (numpy, 1024 x 1024, best of 3
runs) in GFLOP/s, unit `matmul_gflops_f32`: comparable between agents, cheap (well under a
second), and independent of which model is loaded.

Memory is one number, the bytes an agent offers in all for weights and KV cache: what the
kernel reports as available (MemAvailable) less a reserve for the system, capped by
`--max-memory`. Placement uses only that total, and the memory beyond it (`spare_memory`) for
llama.cpp's compute buffers. Gossip records carry the total as two fields, for weights and
for KV cache (split 3:1 unless configured), and every agent reads them back as their sum;
`MemoryOffer` is the one place where the total becomes the two fields and the two fields
become the total again.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

COMPUTE_UNIT = "matmul_gflops_f32"
RESERVE_BYTES = 10**9
WEIGHTS_SHARE = 0.75


@dataclass(frozen=True)
class MemoryOffer:
    """Bytes offered for model weights and for KV cache: the two memory fields of a gossip
    record (`mem_weights_bytes`, `mem_kv_bytes`)."""

    weights: int
    kv: int

    @property
    def total(self) -> int:
        return self.weights + self.kv

    @classmethod
    def split(cls, total: int) -> MemoryOffer:
        """`total` bytes split 3:1 between weights and KV cache; the parts add up to it."""
        weights = int(total * WEIGHTS_SHARE)
        return cls(weights, total - weights)

    @classmethod
    def of(cls, record: Any) -> MemoryOffer:
        """The offer in a gossip record (or anything with its two memory fields)."""
        return cls(int(record.mem_weights_bytes), int(record.mem_kv_bytes))


def offered_memory(record: Any) -> int:
    """Total bytes a peer offers the mesh, read from its gossip record."""
    return MemoryOffer.of(record).total


def memory_offer(available: int, *, limit: int = 0, weights: int = 0, kv: int = 0) -> MemoryOffer:
    """What to offer given `available` bytes: that less the reserve, split 3:1, except the
    parts configured (`weights`, `kv`; 0: measured); then at most `limit` bytes in all
    (0: no cap), split 3:1."""
    measured = MemoryOffer.split(max(0, available - RESERVE_BYTES))
    offer = MemoryOffer(weights or measured.weights, kv or measured.kv)
    if limit and offer.total > limit:
        return MemoryOffer.split(limit)
    return offer


def spare_memory(available: int, offer: MemoryOffer) -> int:
    """Memory beyond the offer (what `--max-memory` leaves of what is available, less the
    reserve): where llama.cpp's compute buffers go first, since the offer is for weights and
    KV cache. 0 when the offer is all there is: the buffers then come out of it."""
    return max(0, available - RESERVE_BYTES - offer.total)


def memory_available() -> int:
    """Bytes of memory available to new allocations (Linux MemAvailable, else physical)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 0


def matmul_gflops(n: int = 1024, repeats: int = 3) -> float:
    """Best-of-`repeats` float32 n x n matmul throughput in GFLOP/s (blocking: run it in
    a worker thread)."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    a @ b  # warm up BLAS threads and caches
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return round(2 * n**3 / best / 1e9, 2)
