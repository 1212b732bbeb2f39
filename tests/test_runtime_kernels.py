"""Every operator's torch kernel: registered, equal to onnxruntime on one device, right in the backward.

The forward of every bundled and test model in torch must equal onnxruntime's (it stays the
reference for the forward), and so must each operator alone under its attributes and opset
variants (`KERNELS`), with constant inputs given as tensors or as numpy arrays alike. Every
trainable parameter of a model with a loss gets a finite, non-zero gradient. Each one-operator
model of the coverage suite, with its float inputs made trainable weights, trains on 4 virtual
devices under several candidate strategies: every weight's gradient, reassembled from its
shards, equals torch autograd's on one device.
"""

from __future__ import annotations

import random

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import autopar
from autopar.errors import AutoparError
from autopar.graph import load_model
from autopar.ops import FAMILIES, registered_op_types
from autopar.ops.cases import KERNEL, all_cases
from autopar.ops.registry import _REGISTRY
from autopar.spmd.compare import compare_output
from autopar.spmd.reference import reference_outputs
from autopar.spmd.values import materialise
from models.resnet50 import build_resnet50
from models.transformer import build_transformer
from tests.conftest import light_models, make_model
from tests.test_ops_coverage import CASES

torch = pytest.importorskip("torch")
pytest.importorskip("onnxruntime")

from autopar.runtime.single import run_graph, run_op, tensor  # noqa: E402  (needs torch)

MODELS = {
    "resnet50": lambda: ("models/resnet50.onnx", 2),
    "tiny_resnet": lambda: (build_resnet50(batch=4, num_classes=16, image_size=32, width=8, blocks=(1, 1, 1, 1)), None),
    "gpt": lambda: (
        build_transformer(kind="gpt", layers=2, hidden=64, heads=8, seq=16, vocab=64, batch=2, weights="random"),
        None,
    ),
    "bert_decomposed_layernorm": lambda: (
        build_transformer(kind="bert", layers=1, hidden=64, heads=8, seq=16, vocab=64, batch=2, layernorm="decomposed"),
        None,
    ),
    "gpt_fused_gelu": lambda: (
        build_transformer(kind="gpt", layers=1, hidden=64, heads=8, seq=16, vocab=64, batch=2, gelu="fused"),
        None,
    ),
    "torch_gpt_dynamo": lambda: ("tests/data/torch_gpt_dynamo.onnx", None),
    "torch_gpt_legacy": lambda: ("tests/data/torch_gpt_legacy.onnx", None),
    **{path.stem: (lambda path=path: (str(path), 1)) for path in light_models()},
}


def test_every_operator_with_a_rule_has_a_torch_kernel():
    missing = sorted(
        f"{op_type} (opset {d.since}+)"
        for (_, op_type), definitions in _REGISTRY.items()
        for d in definitions
        if d.rule is not None and d.torch_kernel is None
    )
    assert not missing
    local = [
        op_type
        for (_, op_type), definitions in _REGISTRY.items()
        for d in definitions
        if d.local_kernel is not None and d.torch_local_kernel is None
    ]
    assert not local, "an operator adjusted on its shards needs the torch twin of that adjustment"


@pytest.mark.parametrize("name", sorted(MODELS))
def test_torch_forward_equals_onnxruntime(name):
    model, batch = MODELS[name]()
    graph = autopar.build(model, 1, batch=batch).graph
    values = materialise(graph, seed=0)
    expected = reference_outputs(graph, values)
    outputs, _ = run_graph(graph, values)
    for output, value in expected.items():
        check = compare_output(output, outputs[output].detach().numpy(), value)
        assert check.ok, check.problem


def trainable_inputs(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with every float graph input turned into a weight: its gradient is then checked."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    rng = np.random.default_rng(0)
    for value in list(out.graph.input):
        if value.type.tensor_type.elem_type != onnx.TensorProto.FLOAT:
            continue
        shape = [d.dim_value for d in value.type.tensor_type.shape.dim]
        out.graph.initializer.append(numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), value.name))
        out.graph.input.remove(value)
    return out


# Non-differentiable operators and those whose float inputs are configuration only
NO_GRADIENT = {"equal_and_not", "range", "arg_max_kept", "arg_min_dropped"}


@pytest.mark.parametrize("case", sorted(set(CASES) - NO_GRADIENT))
def test_operator_gradients_under_candidate_strategies(case):
    model = trainable_inputs(CASES[case]())
    candidates = autopar.candidates(model, devices=4)
    rng = random.Random(case)
    options = candidates["op"]
    draws = options if len(options) <= 6 else [options[0]] + rng.sample(options[1:], 5)
    for draw, strategy in enumerate(draws):
        strategies = {op: (strategy if op == "op" else rng.choice(cands)) for op, cands in candidates.items()}
        report = autopar.verify(model, strategies, devices=4, seed=draw, gradients=True)
        assert report.ok, (strategy, report.problems)
        assert report.gradients is not None and report.gradients.checked >= 1


@pytest.mark.parametrize(
    "case, strategy",
    [
        ("gather_nd_experts", ((4, 1, 1), (1, 1))),  # experts split: masked lookups, a partial sum
        ("gather_nd_experts", ((2, 1, 1), (2, 1))),  # with the routed rows split too
        ("gather_nd_batch", ((2, 2, 1), (2, 1, 1))),  # batch and the indexed axis
        ("scatter_nd_add_experts", ((1, 1), (4, 1, 1), (4, 1, 1))),  # each rank adds its experts' updates
        ("scatter_nd_add_experts", ((2, 1), (2, 1, 1), (2, 1, 1))),  # and writes only its rows
        ("scatter_nd", ((4, 1, 1), (1, 1), (1, 1, 1))),  # no reduction: each rank writes its rows
        ("scatter_nd_max", ((2, 1), (1, 1), (1, 1))),
    ],
)
def test_split_indexed_axes_train(case, strategy):
    """The strategies that split what GatherND and ScatterND index: every gradient equals one device's."""
    model = trainable_inputs(CASES[case]() if case in CASES else KERNELS[case]())
    report = autopar.verify(model, {"op": strategy}, devices=4, gradients=True)
    assert report.ok, report.problems
    assert report.gradients is not None and report.gradients.checked >= 1


# --- each operator alone, under its attributes and opset variants ---------------------------------

F = TensorProto.FLOAT
# Each operator module lists its cases next to its registration (`autopar.ops.cases`), under its
# attributes and opset variants; the ones checked as kernels are run here.
KERNELS = {name: case.model for name, case in all_cases(FAMILIES, KERNEL).items()}


def const(name, values, dtype=np.int64):
    return numpy_helper.from_array(np.asarray(values, dtype=dtype), name)


def kernel_case(name):
    """(graph, values) of a one-operator case; unsigned inputs get small values a shift keeps in range."""
    graph = load_model(KERNELS[name]())
    values = materialise(graph, seed=0)
    for key, value in values.items():
        if value.dtype == np.uint8 and graph.tensor(key).kind == "input":
            values[key] = (np.arange(value.size).reshape(value.shape) % 7 * 9).astype(np.uint8)
    return graph, values


def test_every_operator_with_a_rule_is_checked_alone():
    checked = {KERNELS[name]().graph.node[0].op_type for name in KERNELS}
    assert set(registered_op_types()) <= checked


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_operator_alone_equals_onnxruntime(name):
    graph, values = kernel_case(name)
    expected = reference_outputs(graph, values)
    outputs, _ = run_graph(graph, values)
    for output, value in expected.items():
        got = outputs[output].detach().numpy()
        assert (got.shape, got.dtype) == (value.shape, value.dtype), output
        nan = np.isnan(value) if value.dtype.kind == "f" else np.zeros(value.shape, bool)
        assert np.array_equal(np.isnan(got) if got.dtype.kind == "f" else nan, nan), output
        check = compare_output(output, np.where(nan, 0, got), np.where(nan, 0, value))
        assert check.ok, check.problem


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_constant_inputs_may_be_numpy_arrays(name):
    """The runtime may hand a kernel a constant (Reshape's local target shape) as a numpy array."""
    graph, values = kernel_case(name)
    expected, _ = run_graph(graph, values)
    (op,) = graph.ops
    inputs = [
        None if not n else values[n] if graph.tensor(n).kind == "constant" else tensor(values[n]) for n in op.inputs
    ]
    for output, got in zip([n for n in op.outputs if n], run_op(op, graph, inputs)):
        assert torch.equal(got, expected[output]) or torch.allclose(got, expected[output], equal_nan=True), output


# --- gradients ----------------------------------------------------------------------------------

WITH_LOSS = ["tiny_resnet", "gpt", "bert_decomposed_layernorm", "torch_gpt_dynamo"]


@pytest.mark.parametrize("name", WITH_LOSS)
def test_every_trainable_parameter_gets_a_finite_nonzero_gradient(name):
    model, batch = MODELS[name]()
    graph = load_model(model, batch=batch)
    trainable = [n for n, info in graph.tensors.items() if info.kind == "parameter" and info.trainable]
    outputs, leaves = run_graph(graph, materialise(graph, seed=0), requires_grad=trainable)
    loss = outputs["loss"]
    assert loss.dim() == 0
    loss.backward()
    for name_, leaf in leaves.items():
        assert leaf.grad is not None, name_
        assert torch.isfinite(leaf.grad).all(), name_
        assert leaf.grad.abs().max() > 0, name_


def test_an_operator_without_a_torch_kernel_is_named():
    model = make_model(
        [
            helper.make_node("Relu", ["X"], ["r"], name="relu"),
            helper.make_node("Det", ["r"], ["Y"], name="det"),
        ],
        [("X", F, [2, 3, 3])],
        ["Y"],
    )
    graph = load_model(model)
    with pytest.raises(AutoparError, match=r"'det' \(Det\)"):
        run_graph(graph, materialise(graph))


def test_a_cast_between_floats_keeps_verification_in_float64():
    """Verification runs every float in float64 (`runtime.verify.in_float64`): a Cast to float32 or float16
    there keeps float64, so its result meets the float64 values it is combined with (a router casting its
    input to float32 before a MatMul with a weight the import folded to float64); casts to integers and
    from float32 are as the model writes them."""
    import torch

    def cast_to(kind: int):
        return load_model(
            make_model([helper.make_node("Cast", ["x"], ["y"], to=kind)], [("x", TensorProto.FLOAT, [2, 3])], ["y"])
        )

    graph = cast_to(TensorProto.FLOAT16)
    cast = graph.ops[0]
    wide = torch.ones(2, 3, dtype=torch.float64)
    assert run_op(cast, graph, [wide])[0].dtype == torch.float64
    assert run_op(cast, graph, [wide.float()])[0].dtype == torch.float16
    to_int = cast_to(TensorProto.INT64)
    assert run_op(to_int.ops[0], to_int, [wide])[0].dtype == torch.int64
