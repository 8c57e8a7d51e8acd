"""The compute devices llama.cpp sees besides the CPU (GPUs), their memory and their speed.

Devices come from ggml's backend registry, the same one llama.cpp offloads layers to: a CPU
build of llama-cpp-python has no device but the CPU, so `list_devices()` is empty there. A
device's speed is measured as the CPU's is (`capacity.matmul_gflops`): a float32 matrix
product in GFLOP/s, here run by ggml on that device, so that the planner compares the two in
one unit. The same code measures the CPU through ggml's CPU device, which is how it is tested
on machines without a GPU.

ggml's functions are called through ctypes on the libraries llama-cpp-python loaded (the same
copies, so the same registry); only stable, exported entry points are used.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np

from meshagent import wording
from meshagent.engine.native import ggml_library
from meshagent.engine.runtime import init_backend

# ggml_backend_dev_type
KINDS = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel", 4: "meta"}
# Devices whose memory layers can be offloaded to (dedicated or integrated GPU memory).
OFFLOAD_KINDS = ("gpu", "igpu")
GGML_TYPE_F32 = 0
# Left free on each device for the driver and other programs, as the CPU's RESERVE_BYTES.
VRAM_RESERVE = 500 * 10**6


@dataclass(frozen=True)
class Device:
    name: str  # ggml's name, e.g. "CUDA0", "Metal", "Vulkan0"
    description: str  # e.g. "NVIDIA H200"
    kind: str  # "gpu" or "igpu"
    total_bytes: int
    free_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class _InitParams(ctypes.Structure):
    _fields_ = [
        ("mem_size", ctypes.c_size_t),
        ("mem_buffer", ctypes.c_void_p),
        ("no_alloc", ctypes.c_bool),
    ]


@cache
def _ggml() -> tuple[ctypes.CDLL, ctypes.CDLL]:
    """(libggml: the backend registry, libggml-base: devices, tensors, graphs), as libllama
    loaded them, with the signatures used here."""
    init_backend()
    reg, base = ggml_library("libggml"), ggml_library("libggml-base")
    p, size, i64 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64
    sigs: dict[tuple[ctypes.CDLL, str], tuple[Any, list[Any]]] = {
        (reg, "ggml_backend_dev_count"): (size, []),
        (reg, "ggml_backend_dev_get"): (p, [size]),
        (reg, "ggml_backend_dev_by_type"): (p, [ctypes.c_int]),
        (base, "ggml_backend_dev_name"): (ctypes.c_char_p, [p]),
        (base, "ggml_backend_dev_description"): (ctypes.c_char_p, [p]),
        (base, "ggml_backend_dev_type"): (ctypes.c_int, [p]),
        (base, "ggml_backend_dev_memory"): (None, [p, ctypes.POINTER(size), ctypes.POINTER(size)]),
        (base, "ggml_backend_dev_init"): (p, [p, ctypes.c_char_p]),
        (base, "ggml_backend_free"): (None, [p]),
        (base, "ggml_init"): (p, [_InitParams]),
        (base, "ggml_free"): (None, [p]),
        (base, "ggml_tensor_overhead"): (size, []),
        (base, "ggml_graph_overhead"): (size, []),
        (base, "ggml_new_tensor_2d"): (p, [p, ctypes.c_int, i64, i64]),
        (base, "ggml_mul_mat"): (p, [p, p, p]),
        (base, "ggml_new_graph"): (p, [p]),
        (base, "ggml_build_forward_expand"): (None, [p, p]),
        (base, "ggml_backend_alloc_ctx_tensors"): (p, [p, p]),
        (base, "ggml_backend_buffer_free"): (None, [p]),
        (base, "ggml_backend_tensor_set"): (None, [p, p, size, size]),
        (base, "ggml_backend_graph_compute"): (ctypes.c_int, [p, p]),
    }
    for (lib, name), (res, args) in sigs.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    return reg, base


def _handles() -> list[tuple[ctypes.c_void_p, str]]:
    reg, base = _ggml()
    out = []
    for i in range(reg.ggml_backend_dev_count()):
        dev = reg.ggml_backend_dev_get(i)
        out.append((dev, KINDS.get(base.ggml_backend_dev_type(dev), "unknown")))
    return out


def _describe(dev: ctypes.c_void_p, kind: str) -> Device:
    _, base = _ggml()
    free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
    base.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
    return Device(
        name=base.ggml_backend_dev_name(dev).decode(errors="replace"),
        description=base.ggml_backend_dev_description(dev).decode(errors="replace"),
        kind=kind,
        total_bytes=int(total.value),
        free_bytes=int(free.value),
    )


def list_devices() -> list[Device]:
    """The devices llama.cpp can offload layers to, with their memory now (none on a CPU
    build)."""
    return [_describe(dev, kind) for dev, kind in _handles() if kind in OFFLOAD_KINDS]


@cache
def devices_at_start() -> tuple[Device, ...]:
    """The devices as this process first saw them. An agent offers what was free then: once it
    loads layers on a device, that device's free memory drops, and an offer that followed it
    would shrink under the plan that filled it."""
    return tuple(list_devices())


def backends() -> list[str]:
    """The names of every device ggml registered, the CPU's included (e.g. ["CPU"],
    ["CUDA0", "CPU"])."""
    _, base = _ggml()
    return [base.ggml_backend_dev_name(dev).decode(errors="replace") for dev, _ in _handles()]


def vram_offer(devices: Sequence[Device], limit: int = -1) -> list[int]:
    """Bytes offered on each device: its free memory less `VRAM_RESERVE`, then at most
    `limit` in all (-1: no cap; 0: nothing), taken from the first devices first."""
    out = []
    left = limit if limit >= 0 else None
    for d in devices:
        give = max(0, d.free_bytes - VRAM_RESERVE)
        if left is not None:
            give = min(give, left)
            left -= give
        out.append(give)
    return out


def device_gflops(name: str = "", n: int = 0, repeats: int = 3) -> float:
    """Best-of-`repeats` float32 n x n matrix product on the device `name` (the CPU when
    empty) through ggml, in GFLOP/s; `n` defaults to 1024 on the CPU and 4096 on a device,
    whose kernels a small product leaves idle. Blocking: run it in a worker thread."""
    reg, base = _ggml()
    if name:
        found = [dev for dev, _ in _handles() if base.ggml_backend_dev_name(dev).decode() == name]
        if not found:
            raise ValueError(f"no device {name!r}; llama.cpp sees {', '.join(backends())}")
        dev = found[0]
    else:
        dev = reg.ggml_backend_dev_by_type(0)
    n = n or (4096 if name else 1024)
    backend = base.ggml_backend_dev_init(dev, None)
    if not backend:
        raise RuntimeError(f"ggml could not start device {name or 'CPU'}")
    params = _InitParams(4 * base.ggml_tensor_overhead() + base.ggml_graph_overhead(), None, True)
    ctx = base.ggml_init(params)
    buf = None
    try:
        a = base.ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n, n)
        b = base.ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n, n)
        graph = base.ggml_new_graph(ctx)
        base.ggml_build_forward_expand(graph, base.ggml_mul_mat(ctx, a, b))
        buf = base.ggml_backend_alloc_ctx_tensors(ctx, backend)
        if not buf:
            raise RuntimeError(f"ggml could not allocate {wording.size(2 * n * n * 4)} on {name}")
        host = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
        for t in (a, b):
            base.ggml_backend_tensor_set(t, host.ctypes.data, 0, host.nbytes)
        base.ggml_backend_graph_compute(backend, graph)  # warm up
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            if base.ggml_backend_graph_compute(backend, graph) != 0:
                raise RuntimeError(f"ggml failed to compute on {name or 'CPU'}")
            best = min(best, time.perf_counter() - t0)
    finally:
        if buf:
            base.ggml_backend_buffer_free(buf)
        base.ggml_free(ctx)
        base.ggml_backend_free(backend)
    return round(2 * n**3 / best / 1e9, 2)
