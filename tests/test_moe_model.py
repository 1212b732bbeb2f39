"""The OLMoE-style builder: opset-23 fused operators, and experts the plan splits over devices.

At 8 devices the search gives each device one expert of a model whose expert compute dominates:
the batched expert MatMuls split their expert axis, their weights need no gradient
synchronisation, and the tokens reach the experts by AllToAll. A small copy trains correctly
with the experts split that way (every gradient equal to one device's). The same model with its
tokens moved by index (GatherND into the expert buffers, ScatterND adding the results back) computes
the same loss, and its plan splits the experts too.
"""

from __future__ import annotations

import numpy as np
import pytest

import autopar
from autopar.graph import load_model
from models.moe import build_moe, capacity
from tests.conftest import profile

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


def test_the_plan_at_8_devices_splits_the_experts():
    model = build_moe(layers=1, hidden=512, ffn=1024, heads=8, kv_heads=4, batch=16, seq=128, vocab=512)
    plan = autopar.plan(model, devices=8)
    # one expert a device: the tokens, split by batch, reach the experts by an AllToAll and come back by
    # another (0.649 ms a step; the router's products run their 4 x 128 rows a device as one product of 512
    # rows, so keeping the batch split 4 ways there and moving the last bit by a Slice and an AllGather
    # beats an AllToAll over all three bits, 0.657 ms)
    for name in EXPERT_MATMULS:
        assert plan.strategies[f"layers.0.mlp.{name}"] == ((8, 1, 1), (8, 1, 1)), name
    assert plan.degrees.expert == 8
    moved = {
        (entry["tensor"], step["collective"]) for entry in plan.to_dict()["redistributions"] for step in entry["steps"]
    }
    assert {("layers.0.mlp.expert_rows", "AllToAll"), ("layers.0.mlp.experts.down", "AllToAll")} <= moved


def test_expert_parallelism_moves_tokens_by_all_to_all():
    """GShard's layout under the test profile where splitting pays: the router and the dispatch and
    combine Einsums split by batch, the experts by expert, and the dispatched tokens [e, b, c, h] =
    [8, 8, 8, 64] in fp16 (65,536 bytes) go from one to the other by one AllToAll over the 8 devices
    (8,192 bytes a rank), and come back by another; the backward runs both the other way."""
    model = build_moe(layers=1)
    plan = autopar.plan(model, devices=8, cost_model=profile(peak=1e9))
    for name in EXPERT_MATMULS:
        assert plan.strategies[f"layers.0.mlp.{name}"][0] == (8, 1, 1), name
    for name in ("expert_inputs", "combined"):
        assert plan.strategies[f"layers.0.mlp.{name}"][0] == (8, 1, 1, 1), name
    exchanges = [
        (entry["tensor"], step["collective"], tuple(step["bits"]), step["bytes"])
        for entry in plan.to_dict()["redistributions"]
        for step in entry["steps"]
        if entry["tensor"] in ("layers.0.mlp.expert_inputs", "layers.0.mlp.expert_outputs")
    ]
    assert exchanges == [
        ("layers.0.mlp.expert_inputs", "AllToAll", (2, 1, 0), 8192),
        ("layers.0.mlp.expert_outputs", "AllToAll", (2, 1, 0), 8192),
    ]


def test_the_model_plans_at_64_devices():
    """Two layers at 64 devices: the router's two outputs meet again at the combine Einsum, so a cycle
    runs through the dispatch Einsum, the experts and the combine Einsum (393 candidates each). The
    local elimination orders joined the two Einsums over the experts and then closed the cycle with a
    table of 462 million entries; weighted min-fill closes it over the experts' Reshape (64 layouts)."""
    model = build_moe()
    plan = autopar.plan(model, devices=64)
    assert plan.devices == 64 and not plan.fallback_ops
    assert set(plan.strategies) == {op.name for op in load_model(model).ops}


def test_expert_parallel_training_step_verifies_on_8_devices():
    model = build_moe(layers=1)
    fixed = {f"layers.0.mlp.{name}": ((8, 1, 1), (8, 1, 1)) for name in EXPERT_MATMULS}
    plan = autopar.plan(model, devices=8, fixed=fixed)
    report = autopar.verify(model, plan, gradients=True)
    assert report.ok, report.problems


def test_routing_by_index_computes_what_the_einsums_compute():
    import onnxruntime as ort

    ids = np.random.default_rng(0).integers(0, 128, (8, 16)).astype(np.int64)
    losses = []
    for routing in ("einsum", "gather"):
        session = ort.InferenceSession(build_moe(layers=1, routing=routing).SerializeToString())
        losses.append(session.run(None, {"ids": ids, "labels": np.roll(ids, 1, axis=1)})[0])
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    types = {node.op_type for node in build_moe(layers=1, routing="gather").graph.node}
    assert {"GatherND", "ScatterND"} <= types and "Einsum" in types  # one Einsum reads each slot's position
    with pytest.raises(ValueError, match="routing must be one of"):
        build_moe(routing="loop")


def test_routing_by_index_splits_the_experts_at_8_devices():
    model = build_moe(
        layers=1, hidden=512, ffn=1024, heads=8, kv_heads=4, batch=16, seq=128, vocab=512, routing="gather"
    )
    plan = autopar.plan(model, devices=8)
    for name in EXPERT_MATMULS:
        assert plan.strategies[f"layers.0.mlp.{name}"] == ((8, 1, 1), (8, 1, 1)), name
    # GatherND fills the experts' buffers split over the experts (with its forks, 2 ways there, the tokens
    # 2 ways: cheaper than 8 ways, and the plan without forks costs the same with them)
    assert plan.strategies["layers.0.mlp.expert_inputs"][1][0] > 1
    assert plan.strategies["layers.0.mlp.combined_rows"][2][0] == 8  # ScatterND adds each device's experts
    assert plan.degrees.expert == 8 and str(plan.degrees) == "data 8 x tensor 1, expert 8"
    synchronised = {entry["parameter"] for entry in plan.to_dict()["gradient_sync"] if entry["collective"]}
    assert synchronised and not any(".experts." in name for name in synchronised)


def test_routing_by_index_with_split_experts_trains_on_8_devices():
    model = build_moe(layers=1, routing="gather")
    fixed = {f"layers.0.mlp.{name}": ((8, 1, 1), (8, 1, 1)) for name in EXPERT_MATMULS}
    fixed["layers.0.mlp.combined_rows"] = ((1, 1), (8, 1, 1), (8, 1, 1))
    plan = autopar.plan(model, devices=8, fixed=fixed)
    report = autopar.verify(model, plan, gradients=True)
    assert report.ok, report.problems
    assert report.gradients is not None and report.gradients.checked == 13


def test_a_hugging_face_moe_export_trains_with_its_experts_split():
    """transformers' OLMoE with its batched_mm experts (tests/data/make_exports.py): every routed token's
    expert weights are taken from the [experts, ...] stacks by GatherND, which may split the experts
    (masked lookups, a partial sum); fixed that way, the training step equals one device's."""
    path = "tests/data/hf_olmoe_dynamo.onnx"
    graph = load_model(path)
    lookups = [op.name for op in graph.ops if op.op_type == "GatherND"]
    assert [graph.tensor(graph.op(name).inputs[0]).shape[0] for name in lookups] == [8, 8]
    candidates = autopar.candidates(path, devices=8)
    assert all(((8, 1, 1), (1, 1)) in candidates[name] for name in lookups)
    plan = autopar.plan(path, devices=8, fixed={name: ((8, 1, 1), (1, 1)) for name in lookups})
    assert plan.degrees.expert == 8
    report = autopar.verify(path, plan, gradients=True)
    assert report.ok, report.problems
    assert report.gradients is not None and report.gradients.checked == 15
