"""The planner with GPUs and compute buffers, fed tables of peers: layers go on device memory
first, at the device's speed, and llama.cpp's compute buffers are counted."""

from __future__ import annotations

from dataclasses import replace

from meshagent.placement.planner import (
    ModelCost,
    PeerCapacity,
    Plan,
    PlanError,
    offloaded_layers,
    plan,
)
from meshagent.placement.service import capacities

GB = 1_000_000_000
CTX = 4096

# A 70B-shaped model at about 4.5 bits: 80 layers of 0.45 GB (36 GB), GQA KV cache.
BIG = ModelCost(
    model_id="big",
    n_layers=80,
    layer_bytes=(450_000_000,) * 80,
    embedding_bytes=500_000_000,
    head_bytes=500_000_000,
    other_bytes=0,
    kv_bytes_per_token_per_layer=4096,
    n_embd=8192,
    n_vocab=32000,
)


def gpu_agent(pid: str, vram_gb: float, ram_gb: float, vram_speed: float) -> PeerCapacity:
    """An agent with a GPU: its CPU is slow next to it (layers per second)."""
    return PeerCapacity(
        pid, int(ram_gb * GB), 20.0, vram_bytes=int(vram_gb * GB), vram_speed=vram_speed
    )


def laptop(pid: str, ram_gb: float, speed: float = 30.0) -> PeerCapacity:
    return PeerCapacity(pid, int(ram_gb * GB), speed)


def layers_of(p: Plan) -> dict[str, int]:
    return {s.peer_id: s.layers for s in p.stages}


def test_compute_buffers_are_counted_per_stage():
    # The last stage holds the logits of a micro-batch, a middle one the layers' rows.
    assert BIG.compute_bytes(last=True) == 512 * 4 * max(32000, 12 * 8192) + (3 << 20)
    small_vocab_head = replace(BIG, n_embd=576, n_vocab=49152)
    assert small_vocab_head.compute_bytes(last=True) > small_vocab_head.compute_bytes(last=False)
    weights_kv = BIG.weight_bytes(0, 80) + 4096 * CTX * 80
    assert BIG.stage_bytes(0, 80, CTX) == weights_kv + BIG.compute_bytes(last=True)
    # Hand-made tables without the model's shape count none.
    assert replace(BIG, n_embd=0).compute_bytes(last=True) == 0


def test_a_model_whose_compute_buffer_does_not_fit_is_not_served_whole_there():
    weights_kv = BIG.weight_bytes(0, 80) + 4096 * CTX * 80
    offer = int(weights_kv / 0.9) + 1  # weights and KV cache fit, with the headroom
    alone = PeerCapacity("a", offer, 100.0)
    helper = PeerCapacity("b", offer, 100.0)
    split = plan(BIG, [alone, helper], context_tokens=CTX)
    assert split.split
    # Memory beyond the offer holds the compute buffer: then the offer is enough.
    roomy = replace(alone, spare_bytes=GB)
    whole = plan(BIG, [roomy, helper], context_tokens=CTX)
    assert whole.replicas == ("a",)


def test_a_gpu_agent_serves_whole_what_its_vram_and_ram_hold_faster_than_a_laptop():
    small = replace(BIG, n_layers=40, layer_bytes=BIG.layer_bytes[:40])  # 18 GB
    gpu = gpu_agent("gpu", vram_gb=24, ram_gb=8, vram_speed=400.0)
    lap = laptop("laptop", ram_gb=32, speed=30.0)
    p = plan(small, [lap, gpu], context_tokens=CTX)
    assert p.replicas == ("gpu", "laptop")  # both hold it; the GPU agent is the faster
    assert p.est_token_ms == gpu.stage_ms(small, 0, 40, CTX)
    assert p.est_token_ms < lap.stage_ms(small, 0, 40, CTX) / 5


def test_a_split_over_a_24gb_gpu_and_a_16gb_laptop_puts_on_the_gpu_what_its_memory_holds():
    gpu = gpu_agent("gpu", vram_gb=24, ram_gb=16, vram_speed=400.0)
    lap = laptop("laptop", ram_gb=16, speed=30.0)
    p = plan(BIG, [lap, gpu], context_tokens=CTX)
    got = layers_of(p)
    assert sum(got.values()) == 80 and set(got) == {"gpu", "laptop"}
    # The GPU's 21.6 usable GB hold about 47 layers; its system memory takes more, at its
    # CPU's speed, only while the laptop (faster per layer than that CPU) cannot.
    assert got["gpu"] >= 45
    on_device = offloaded_layers(BIG, 0, got["gpu"], CTX, int(24 * GB * 0.9))
    assert 40 <= on_device <= got["gpu"]
    # Counted as CPU memory only (an agent whose GPU is not measured yet), the same agents
    # split by CPU speed, and the laptop, faster per layer, takes all it can.
    blind = replace(gpu, vram_speed=0.0)
    cpu_split = plan(BIG, [lap, blind], context_tokens=CTX)
    assert layers_of(cpu_split)["laptop"] >= got["laptop"]
    assert p.est_token_ms < cpu_split.est_token_ms


def test_between_two_gpus_the_faster_device_gets_more_layers_and_the_laptop_none():
    fast = gpu_agent("fast", vram_gb=24, ram_gb=4, vram_speed=400.0)
    slow = gpu_agent("slow", vram_gb=24, ram_gb=4, vram_speed=200.0)
    lap = laptop("laptop", ram_gb=16)
    p = plan(BIG, [lap, slow, fast], context_tokens=CTX)
    got = layers_of(p)
    assert set(got) == {"fast", "slow"}
    assert got["fast"] > got["slow"]
    # Every stage fits its peer, device and system memory together.
    for s in p.stages:
        peer = {"fast": fast, "slow": slow}[s.peer_id]
        assert peer.needs(BIG, s.start, s.end, CTX) <= (peer.memory_bytes + peer.vram_bytes) * 0.9


def test_offloaded_layers_are_the_stages_last_that_fit_the_vram_offered():
    n = BIG.n_layers
    assert offloaded_layers(BIG, 0, n, CTX, 0) == 0
    assert offloaded_layers(BIG, 0, n, CTX, 100 * GB) == n + 1  # all, and the output head
    per_layer = 450_000_000 + 4096 * CTX
    room = BIG.compute_bytes(last=True) + 10 * per_layer
    assert offloaded_layers(BIG, 0, n, CTX, room) == 10
    assert offloaded_layers(BIG, 0, n, CTX, room - 1) == 9
    # A middle stage of 20 layers: its compute buffer (no output head) first, then layers.
    middle = offloaded_layers(BIG, 20, 40, CTX, BIG.compute_bytes(last=False) + 5 * per_layer)
    assert middle == 5


def test_no_plan_says_when_the_last_stage_fits_no_peer():
    four = replace(BIG, n_layers=4, layer_bytes=BIG.layer_bytes[:4])
    # Enough memory in all, but a last stage (output head, compute buffer, one layer) needs
    # 1.17 GB on one peer.
    peers = [PeerCapacity(f"p{i}", int(1.1 * GB), 100.0) for i in range(6)]
    try:
        plan(four, peers, context_tokens=CTX)
    except PlanError as e:
        assert "last stage needs at least" in str(e) and "give one peer more memory" in str(e)
    else:
        raise AssertionError("planned a last stage no peer can hold")


class _Device:
    def __init__(self, offer: int, speed: float) -> None:
        self.offer_bytes, self.speed = offer, speed


class _Record:
    def __init__(self, devices: tuple = (), spare: int = 0) -> None:
        self.mem_weights_bytes, self.mem_kv_bytes = 6 * GB, 2 * GB
        self.compute_speed, self.compute_unit = 100.0, "matmul_gflops_f32"
        self.rtts_ms, self.models, self.artifacts = (), (), ()
        self.devices, self.mem_spare_bytes = devices, spare


class _View:
    state = "alive"

    def __init__(self, record: _Record) -> None:
        self.record = record


def test_capacities_read_the_gpus_offer_and_speed_from_gossip():
    two = (_Device(20 * GB, 30_000.0), _Device(10 * GB, 15_000.0))
    views = {
        "gpu": _View(_Record(two, spare=GB)),
        "cpu": _View(_Record()),
        "unmeasured": _View(_Record((_Device(20 * GB, 0.0),))),
    }
    caps = {c.peer_id: c for c in capacities(views, flops_per_layer=1e9)}
    gpu = caps["gpu"]
    assert gpu.memory_bytes == 8 * GB and gpu.vram_bytes == 30 * GB and gpu.spare_bytes == GB
    # The offer-weighted device speed, in layers per second as the CPU's.
    assert gpu.speed == 100.0
    assert abs(gpu.vram_speed - 25_000.0) < 1e-6
    assert caps["cpu"].vram_bytes == 0 and caps["cpu"].vram_speed == 0.0
    # A device not measured yet is not planned on.
    assert caps["unmeasured"].vram_bytes == 0


def test_capacities_read_the_draft_models_compute_from_gossip():
    drafting = _Record()
    drafting.draft_gflops = (0.27, 1.6)
    caps = {c.peer_id: c for c in capacities({"d": _View(drafting), "n": _View(_Record())})}
    assert (caps["d"].draft_gflops, caps["d"].drafts_from_gflops) == (0.27, 1.6)
    assert (caps["n"].draft_gflops, caps["n"].drafts_from_gflops) == (0.0, 0.0)


def test_no_plan_says_when_the_layers_do_not_fall_into_the_offers():
    # Four layers of 0.3 GB on three peers of 0.5 GB: 1.5 GB in all is enough by the sum, and
    # a last stage of one layer fits any peer, but no peer holds two layers: no split fits.
    four = ModelCost("m", 4, (300_000_000,) * 4, 10_000_000, 10_000_000, 0, 1000)
    peers = [PeerCapacity(f"p{i}", 500_000_000, 100.0) for i in range(3)]
    try:
        plan(four, peers, context_tokens=100, headroom=0.0)
    except PlanError as e:
        assert "no split of m fits: over its 3 roomiest peers" in str(e), str(e)
        assert "last stage" not in str(e)
    else:
        raise AssertionError("planned four layers that do not fit")
