"""The OLMoE-style builder: opset-23 fused operators, and experts the plan splits over devices.

At 8 devices the search gives each device one expert of a model whose expert compute dominates:
the batched expert MatMuls split their expert axis, their weights need no gradient
synchronisation, and the tokens reach the experts by AllToAll. A small copy trains correctly
with the experts split that way (every gradient equal to one device's).
"""

from __future__ import annotations

import pytest

import autopar
from autopar.graph import load_model
from models.moe import build_moe, capacity

pytest.importorskip("onnxruntime")

EXPERT_MATMULS = ("experts.up", "experts.gate", "experts.down")


def test_the_model_uses_the_fused_operators_and_batched_experts():
    model = build_moe(layers=1)
    types = {node.op_type for node in model.graph.node}
    assert {"Attention", "RMSNormalization", "RotaryEmbedding", "Einsum", "TopK", "CumSum"} <= types
    graph = load_model(model)
    assert graph.opset == 23
    assert graph.tensor("layers.0.mlp.experts.up_proj").shape == (8, 64, 128)
    assert graph.tensor("layers.0.mlp.experts.up_proj").trainable
    assert not graph.tensor("rotary.cos").trainable  # a table no framework trains
    assert capacity(dict(seq=16, top_k=2, capacity_factor=2.0, experts=8)) == 8


def test_bad_sizes_are_one_sentence():
    with pytest.raises(ValueError, match="must not exceed experts"):
        build_moe(experts=2, top_k=3)
    with pytest.raises(ValueError, match="kv_heads must divide heads"):
        build_moe(heads=4, kv_heads=3)


def test_the_plan_at_8_devices_holds_one_expert_per_device():
    model = build_moe(layers=1, hidden=512, ffn=1024, heads=8, kv_heads=4, batch=16, seq=128, vocab=512)
    plan = autopar.plan(model, devices=8)
    for name in EXPERT_MATMULS:
        assert plan.strategies[f"layers.0.mlp.{name}"] == ((8, 1, 1), (8, 1, 1)), name
    synchronised = {entry["parameter"] for entry in plan.to_dict()["gradient_sync"] if entry["collective"]}
    experts = {f"layers.0.mlp.experts.{w}_proj" for w in ("up", "gate", "down")}
    assert synchronised and not synchronised & experts  # each device owns its expert's weights
    moved = {step["collective"] for entry in plan.to_dict()["redistributions"] for step in entry["steps"]}
    assert "AllToAll" in moved


def test_expert_parallel_training_step_verifies_on_8_devices():
    model = build_moe(layers=1)
    fixed = {f"layers.0.mlp.{name}": ((8, 1, 1), (8, 1, 1)) for name in EXPERT_MATMULS}
    plan = autopar.plan(model, devices=8, fixed=fixed)
    report = autopar.verify(model, plan, gradients=True)
    assert report.ok, report.problems
