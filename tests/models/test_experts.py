"""A mixture-of-experts model in placement's eyes: its memory is every expert, its compute
only the experts a token is routed to; and a slice of a model whose first layers are dense
(DeepSeek-V2/V3) counts its own."""

from __future__ import annotations

import pytest

from meshagent.errors import ModelError
from meshagent.models.layout import inspect_model
from meshagent.models.slicer import _leading_dense
from meshagent.placement.planner import ModelCost
from meshagent.testing.tiny_gguf import N_EXPERTS, N_EXPERTS_USED, write_tiny_model


def test_an_moe_layer_weighs_all_its_experts_and_computes_with_those_routed(tmp_path):
    moe = inspect_model(write_tiny_model(tmp_path / "moe.gguf", "qwen3moe", n_layers=2))
    dense = inspect_model(write_tiny_model(tmp_path / "dense.gguf", "qwen3", n_layers=2))
    assert (moe.n_experts, moe.n_experts_used) == (N_EXPERTS, N_EXPERTS_USED)
    assert (dense.n_experts, dense.n_experts_used) == (0, 0)
    # Per layer: 3 stacked expert matrices of 4 x (64 x 64) f32 elements (n_ff 128 halved).
    experts = 3 * N_EXPERTS * 64 * 64
    attention = 64 * 64 * 2 + 32 * 64 * 2  # q and o, k and v (2 of 4 heads)
    norms = 64 + 16 + 16 + 64
    router = N_EXPERTS * 64
    assert moe.layer_bytes[0] == 4 * (experts + attention + norms + router)
    routed = experts * N_EXPERTS_USED // N_EXPERTS
    assert moe.layer_params[0] == routed + attention + norms + router
    # Placement prices the memory of all experts and the compute of the routed ones.
    cost = ModelCost.from_layout("moe", moe)
    assert cost.weight_bytes(0, 1) - cost.weight_bytes(0, 0) == moe.layer_bytes[0]
    assert cost.flops_per_layer == 2.0 * moe.layer_params[0]
    assert cost.flops_per_layer < 2.0 * moe.layer_bytes[0] / 4  # less than all its weights
    assert dense.layer_params[0] == dense.layer_bytes[0] // 4


def test_a_slice_counts_its_own_leading_dense_layers():
    assert _leading_dense(3, [0, 1]) == 2
    assert _leading_dense(3, [2, 3, 4]) == 1
    assert _leading_dense(3, [3, 4, 5]) == 0
    with pytest.raises(ModelError, match="do not lead"):
        _leading_dense(3, [5, 0, 1])  # a padding layer copied from past the dense ones
