"""The mesh of the scale simulation (`scale_sim.py`): three models of 70B shape, and agents
drawn from laptops, desktops and GPU boxes, each holding some of the models' files."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from meshagent.placement.planner import ModelCost, PeerCapacity
from meshagent.testing.assignment_sim import GB, model_cost


def big_models() -> dict[str, ModelCost]:
    """Three models of 70B shape at Q4 (80 layers, width 8192, about 40 GB)."""
    shapes = (
        ("llama-3.1-70b", 70.6, 40.0, 128256),
        ("qwen2.5-72b", 72.7, 44.0, 152064),
        ("r1-distill-70b", 70.6, 40.0, 128256),
    )
    return {
        name: model_cost(
            name, params_b=p, file_gb=gb, n_layers=80, n_embd=8192, n_vocab=vocab, kv_heads=8
        )
        for name, p, gb, vocab in shapes
    }


@dataclass(frozen=True)
class AgentSpec:
    """An agent's offer (speeds in GFLOP/s, as gossiped), disk and network rates, and the
    model files it holds."""

    offer: PeerCapacity
    disk_bps: float
    net_bps: float
    holds: frozenset[str]


def draw_agent(peer_id: str, rng: random.Random, models: Sequence[str]) -> AgentSpec:
    """Laptops offering 4-12 GB (60% of agents), desktops 12-16 GB, and GPU boxes with 8-16
    GB of VRAM; each holds each model's file with probability one half."""
    kind = rng.random()
    if kind < 0.6:
        ram, cpu, vram, gpu = rng.choice([4, 6, 8, 12]), rng.uniform(60, 200), 0, 0.0
        disk, net = rng.uniform(0.5, 2.0), rng.uniform(0.03, 0.12)
    elif kind < 0.9:
        ram, cpu, vram, gpu = rng.choice([12, 16]), rng.uniform(150, 300), 0, 0.0
        disk, net = rng.uniform(1.0, 3.0), rng.uniform(0.1, 0.25)
    else:
        ram, cpu, vram, gpu = 16, 250, rng.choice([8, 12, 16]), rng.uniform(800, 2000)
        disk, net = rng.uniform(2.0, 3.0), rng.uniform(0.1, 1.1)
    offer = PeerCapacity(
        peer_id,
        int(ram * GB),
        cpu,
        vram_bytes=int(vram * GB),
        vram_speed=gpu,
        spare_bytes=2 * GB,
    )
    holds = frozenset(m for m in models if rng.random() < 0.5)
    return AgentSpec(offer, disk * GB, net * GB, holds)
