"""Shared fixtures: a round-number hardware profile and tiny ONNX graphs built in code."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from autopar.cost import CostModel, HardwareProfile


def sourced(value: float) -> dict:
    return {"value": value, "source": "test value"}


def simple_profile_dict(capacity: float = 1e12) -> dict:
    """Round numbers so costs can be worked out by hand: compute-bound, 1 GB/s links, 1 us latency."""
    return {
        "name": "simple",
        "compute": {
            "peak_flops_fp16": sourced(1e12), "peak_flops_fp32": sourced(5e11), "hbm_bandwidth": sourced(1e18),
            "hbm_capacity": sourced(capacity), "cube_efficiency": sourced(1.0), "memory_efficiency": sourced(1.0),
            "vector_flops_fraction": sourced(1.0),
        },
        "training": {
            "backward_compute_factor": sourced(1.0), "optimizer_state_bytes_per_param": sourced(4.0),
            "master_weight_bytes_per_param": sourced(4.0), "gradient_fusion_bytes": sourced(1e6),
        },
        "links": [
            {"name": "fast", "bits": 1, "bandwidth": sourced(1e9), "latency": sourced(1e-6)},
            {"name": "slow", "bits": 40, "bandwidth": sourced(1e8), "latency": sourced(1e-5)},
        ],
    }


@pytest.fixture
def simple_profile() -> HardwareProfile:
    return HardwareProfile.model_validate(simple_profile_dict())


@pytest.fixture
def simple_cost(simple_profile) -> CostModel:
    return CostModel(simple_profile, "mixed")


def make_model(nodes, inputs, outputs, initializers=(), name="tiny", opset: int = 17) -> onnx.ModelProto:
    """A checked (by default opset-17) model from helper nodes, (name, elem_type, shape) inputs and output names.

    Output types and shapes are filled in by ONNX shape inference.
    """
    graph = helper.make_graph(
        list(nodes), name, [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs], [],
        initializer=list(initializers),
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)],
                              ir_version=8 if opset <= 17 else 9)
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    known = {vi.name: vi for vi in inferred.graph.value_info}
    model.graph.output.extend(known[n] for n in outputs)
    onnx.checker.check_model(model)
    return model


def weight(name: str, shape, seed: int = 0) -> onnx.TensorProto:
    rng = np.random.default_rng(seed)
    return numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)


def two_matmul_chain(batch: int = 4, d_in: int = 8, d_hidden: int = 16, d_out: int = 4) -> onnx.ModelProto:
    """Z = (X @ W1) @ W2: the hand-worked golden model."""
    nodes = [helper.make_node("MatMul", ["X", "W1"], ["Y"], name="mm1"),
             helper.make_node("MatMul", ["Y", "W2"], ["Z"], name="mm2")]
    return make_model(nodes, [("X", TensorProto.FLOAT, [batch, d_in])], ["Z"],
                      [weight("W1", [d_in, d_hidden], 1), weight("W2", [d_hidden, d_out], 2)])
