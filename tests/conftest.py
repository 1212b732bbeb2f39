"""Shared fixtures and helpers: a round-number hardware profile and tiny ONNX graphs built in code.

Test files import the helpers from here (``from tests.conftest import ...``), never from one
another or from ``bench/``.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from autopar.cost import CostModel, HardwareProfile
from autopar.graph import load_model
from autopar.search.memory import MemoryChoices
from autopar.strategy import OpRule


def sourced(value: float) -> dict:
    return {"value": value, "source": "test value"}


def simple_profile_dict(capacity: float = 1e12) -> dict:
    """Round numbers so costs can be worked out by hand: compute-bound, 1 GB/s links, 1 us latency."""
    return {
        "name": "simple",
        "compute": {
            "peak_flops_fp16": sourced(1e12),
            "peak_flops_fp32": sourced(5e11),
            "hbm_bandwidth": sourced(1e18),
            "hbm_capacity": sourced(capacity),
            "memory_reserve": sourced(0.0),
            "cube_efficiency": sourced(1.0),
            "matmul_efficiency": sourced(1.0),
            "matmul_falloff": {"smallest_dim": [1], "factor": [1.0], "source": "test value"},
            "memory_efficiency": sourced(1.0),
            "vector_flops_fraction": sourced(1.0),
        },
        "training": {
            "backward_compute_factor": sourced(1.0),
            "optimizer": {"value": "sgd", "source": "test value"},
            "gradient_fusion_bytes": sourced(1e6),
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
        list(nodes),
        name,
        [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
        [],
        initializer=list(initializers),
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8 if opset <= 17 else 9)
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
    nodes = [
        helper.make_node("MatMul", ["X", "W1"], ["Y"], name="mm1"),
        helper.make_node("MatMul", ["Y", "W2"], ["Z"], name="mm2"),
    ]
    return make_model(
        nodes,
        [("X", TensorProto.FLOAT, [batch, d_in])],
        ["Z"],
        [weight("W1", [d_in, d_hidden], 1), weight("W2", [d_hidden, d_out], 2)],
    )


def profile(capacity: float = 1e12, peak: float = 1e9) -> HardwareProfile:
    """The simple profile with a chosen device memory and fp16 peak (a low peak makes splitting pay)."""
    data = simple_profile_dict(capacity)
    data["compute"]["peak_flops_fp16"] = {"value": peak, "source": "test value"}
    return HardwareProfile.model_validate(data)


def rule_for(model, op_name: str, devices: int = 8) -> OpRule:
    """The strategy rule of operator ``op_name`` in ``model`` on ``devices`` devices."""
    graph = load_model(model)
    return OpRule.build(graph.op(op_name), graph, devices.bit_length() - 1)


def conv_model(group: int = 1) -> onnx.ModelProto:
    """One 3x3 Conv with bias on an [8, 8, 6, 6] input, 16 output channels."""
    nodes = [helper.make_node("Conv", ["X", "W", "B"], ["Y"], name="conv", pads=[1, 1, 1, 1], group=group)]
    return make_model(
        nodes, [("X", TensorProto.FLOAT, [8, 8, 6, 6])], ["Y"], [weight("W", [16, 8 // group, 3, 3]), weight("B", [16])]
    )


def random_model(seed: int) -> onnx.ModelProto:
    """A random DAG of MatMul/Gemm/Add/Mul/Relu/Exp/ReduceSum/Sub with shared weights and fan-out."""
    rng = np.random.default_rng(seed)
    sizes = [2, 4, 8]
    batch = int(rng.choice([2, 4, 8]))
    tensors = [("X", (batch, int(rng.choice(sizes))))]
    nodes, inits = [], []
    weights: dict[tuple[int, int], str] = {}
    count = int(rng.integers(2, 7))
    for k in range(count):
        name = f"t{k}"
        src, shape = tensors[int(rng.integers(len(tensors)))]
        kind = rng.choice(["matmul", "gemm", "add", "mul", "relu", "exp", "reduce_sub", "matmul_act"])
        if kind in ("matmul", "gemm"):
            out_dim = int(rng.choice(sizes))
            key = (shape[1], out_dim)
            if key not in weights or rng.random() < 0.5:  # sometimes reuse (a shared parameter)
                weights[key] = f"w{len(inits)}"
                inits.append(weight(weights[key], [shape[1], out_dim], seed + len(inits)))
            if kind == "matmul":
                nodes.append(helper.make_node("MatMul", [src, weights[key]], [name], name=f"op{k}"))
            else:
                nodes.append(helper.make_node("Gemm", [src, weights[key]], [name], name=f"op{k}"))
            tensors.append((name, (shape[0], out_dim)))
        elif kind in ("add", "mul"):
            same = [t for t, s in tensors if s == shape]
            other = same[int(rng.integers(len(same)))]
            nodes.append(helper.make_node(kind.capitalize(), [src, other], [name], name=f"op{k}"))
            tensors.append((name, shape))
        elif kind in ("relu", "exp"):
            nodes.append(helper.make_node(kind.capitalize(), [src], [name], name=f"op{k}"))
            tensors.append((name, shape))
        elif kind == "reduce_sub":
            axes = f"axes{k}"
            inits.append(helper.make_tensor(axes, TensorProto.INT64, [1], [1]))
            nodes.append(helper.make_node("ReduceSum", [src, axes], [f"r{k}"], name=f"op{k}_sum", keepdims=1))
            nodes.append(helper.make_node("Sub", [src, f"r{k}"], [name], name=f"op{k}_sub"))
            tensors.append((name, shape))
        else:  # activation x activation^T-shaped MatMul: both operands carry gradients
            partner, partner_shape = next(((t, s) for t, s in tensors if s[0] == shape[1]), (None, None))
            if partner is None:
                nodes.append(helper.make_node("Relu", [src], [name], name=f"op{k}"))
                tensors.append((name, shape))
            else:
                nodes.append(helper.make_node("MatMul", [src, partner], [name], name=f"op{k}"))
                tensors.append((name, (shape[0], partner_shape[1])))
    outputs = [tensors[-1][0]]
    if len(tensors) > 2 and rng.random() < 0.5:
        outputs.append(tensors[int(rng.integers(1, len(tensors) - 1))][0])
    outputs = list(dict.fromkeys(outputs))
    return make_model(nodes, [("X", TensorProto.FLOAT, list(tensors[0][1]))], outputs, inits)


def light_models() -> list[Path]:
    """The onnx wheel's model-zoo test files (weights elided): onnx/backend/test/data/light/light_*.onnx."""
    return sorted((Path(onnx.__file__).parent / "backend" / "test" / "data" / "light").glob("light_*.onnx"))


def every_plan(problem):
    """Every (choice, memory choices): each candidate assignment with each set of parallel optimizers."""
    optional = sorted(problem.sharded)
    for choice in itertools.product(*(range(len(problem.candidates(i))) for i in range(problem.size))):
        for size in range(len(optional) + 1):
            for sharded in itertools.combinations(optional, size):
                yield choice, MemoryChoices(frozenset(sharded))


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``autopar ARGV``; argparse exits count as exit codes."""
    from autopar.cli import main

    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


# --- the export tests' plans: ResNet-50 and a small GPT-2 on 8 devices, planned once per session
# (a test module may define its own resnet_plan / gpt_plan fixture instead)

RESNET50 = Path(__file__).resolve().parents[1] / "models" / "resnet50.onnx"


def export_gpt() -> onnx.ModelProto:
    """A 2-layer GPT-2 (hidden 128, sequence 64, batch 8): small, yet its plan splits several ways."""
    from models.transformer import build_preset

    return build_preset("gpt2", layers=2, hidden=128, heads=4, seq=64, batch=8)


@pytest.fixture(scope="session")
def resnet_plan():
    import autopar

    return autopar.plan(RESNET50, devices=8)


@pytest.fixture(scope="session")
def gpt_plan():
    import autopar

    return autopar.plan(export_gpt(), devices=8)


def reordered(plan):
    """A plan file with layouts autopar's strategies do not make: bits not highest first, a partial max."""
    from autopar.lowering import read_plan_file

    data = plan.to_dict()
    odd = {"dims": [[0, 2], [1]]}
    for op in data["ops"]:
        if op["name"] == "embed.pos":
            op["inputs"][1]["layout"] = odd  # embed.pos.weight [64, 128]
            op["strategy"][1] = [4, 2]  # as the layout splits it
            op["outputs"][0]["layout"] = {"dims": [[], [0, 2], [1]]}
        if op["name"] == "layer0.ln1":
            op["outputs"][0]["layout"] = {"dims": [[0], [], []], "partial": [2], "partial_op": "max"}
    for sync in data["gradient_sync"]:
        if sync["parameter"] == "embed.pos.weight":
            sync["layout"] = odd
    return read_plan_file(data)
