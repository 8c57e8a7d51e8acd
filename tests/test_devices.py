"""GPUs as llama.cpp's ggml registry lists them, what an agent offers of them, and the speed
measurement, run here through ggml's CPU device (a CPU build lists no GPU)."""

from __future__ import annotations

import pytest

from meshagent import advertisement, devices
from meshagent.config import VRAM_ALL, AgentConfig, ConfigError
from meshagent.devices import VRAM_RESERVE, Device

GIB = 1 << 30


def test_llama_cpp_lists_the_cpu_and_a_gpu_only_in_a_gpu_build():
    import llama_cpp

    assert "CPU" in devices.backends()
    found = devices.list_devices()
    if llama_cpp.llama_supports_gpu_offload():  # bench/device_check.sh runs these too
        assert found and all(d.kind in devices.OFFLOAD_KINDS for d in found)
        assert all(0 < d.free_bytes <= d.total_bytes for d in found)
    else:
        assert found == [] and devices.devices_at_start() == ()


def test_the_speed_measurement_runs_through_ggml_on_a_device():
    # The same code measures a GPU; here ggml's CPU device runs the product.
    speed = devices.device_gflops(n=256, repeats=2)
    assert speed > 0.1
    with pytest.raises(ValueError, match=r"no device 'CUDA7'.*CPU"):
        devices.device_gflops("CUDA7")
    for d in devices.list_devices():  # a GPU build: each device measures
        assert devices.device_gflops(d.name, n=1024) > speed


def two_gpus() -> tuple[Device, ...]:
    return (
        Device("CUDA0", "NVIDIA H200", "gpu", 141 * GIB, 140 * GIB),
        Device("CUDA1", "NVIDIA L4", "gpu", 24 * GIB, 22 * GIB),
    )


def test_the_vram_offer_is_free_memory_less_a_reserve_capped_in_all():
    gpus = two_gpus()
    assert devices.vram_offer(gpus) == [140 * GIB - VRAM_RESERVE, 22 * GIB - VRAM_RESERVE]
    assert devices.vram_offer(gpus, 0) == [0, 0]
    assert devices.vram_offer(gpus, 150 * GIB) == [
        140 * GIB - VRAM_RESERVE,
        10 * GIB + VRAM_RESERVE,
    ]
    full = Device("Vulkan0", "busy", "gpu", 8 * GIB, 100 << 20)
    assert devices.vram_offer([full]) == [0]


@pytest.mark.parametrize(
    ("given", "want"), [("20G", 20_000_000_000), ("0", 0), ("all", VRAM_ALL), ("512MiB", 1 << 29)]
)
def test_max_vram_is_a_size_zero_or_all(given, want):
    cfg = AgentConfig().merged({"max_vram": given})
    cfg.validate()
    assert cfg.max_vram == want
    assert AgentConfig().max_vram == VRAM_ALL


def test_a_bad_max_vram_is_refused_with_its_value_named():
    with pytest.raises(ConfigError, match=r"max-vram: '2OG' is not a size"):
        AgentConfig().merged({"max_vram": "2OG"})


def test_an_agent_publishes_its_gpus_with_the_offer_and_the_speeds_measured(monkeypatch):
    monkeypatch.setattr(devices, "devices_at_start", two_gpus)
    cfg = AgentConfig().merged({"max_vram": "100GiB"})
    offers = advertisement.device_offers(cfg, [50_000.0])
    assert [d.name for d in offers] == ["CUDA0", "CUDA1"]
    assert [d.offer_bytes for d in offers] == [100 * GIB, 0]
    assert [d.speed for d in offers] == [50_000.0, 0.0]  # the second not measured yet
    assert offers[0].total_bytes == 141 * GIB and offers[0].free_bytes == 140 * GIB
    none = advertisement.device_offers(AgentConfig().merged({"max_vram": "0"}))
    assert [d.offer_bytes for d in none] == [0, 0]
