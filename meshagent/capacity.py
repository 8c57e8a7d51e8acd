"""Measuring what this agent can offer the mesh: memory and compute speed.

Compute speed is a quick float32 matrix-multiply benchmark (numpy, 1024 x 1024, best of 3
runs) in GFLOP/s, unit `matmul_gflops_f32`: comparable between agents, cheap (well under a
second), and independent of which model is loaded. Memory is what the kernel reports as
available (MemAvailable) less a reserve for the system, split 3:1 between weights and KV
cache unless configured.
"""

from __future__ import annotations

import os
import time

import numpy as np

COMPUTE_UNIT = "matmul_gflops_f32"
RESERVE_BYTES = 1 << 30
WEIGHTS_SHARE = 0.75


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


def memory_budget(weights_bytes: int = 0, kv_bytes: int = 0) -> tuple[int, int]:
    """(bytes for weights, bytes for KV cache): configured values, else measured."""
    spare = max(0, memory_available() - RESERVE_BYTES)
    weights = weights_bytes or int(spare * WEIGHTS_SHARE)
    kv = kv_bytes or int(spare - spare * WEIGHTS_SHARE)
    return weights, kv


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
