"""ONNX import (autopar.graph.load_model): shapes, roles of tensors, FLOPs and import errors."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from autopar.errors import AutoparError, ModelImportError, UnknownDimensionError
from autopar.graph import Graph, load_model
from models.resnet50 import build_resnet50
from tests.conftest import make_model, weight

REPO = Path(__file__).resolve().parents[1]
RESNET50 = REPO / "models" / "resnet50.onnx"
TINY = dict(batch=4, num_classes=10, image_size=32, width=8, blocks=(1, 1, 1, 1))


# --- helpers ------------------------------------------------------------------------------------


def _model(nodes, inputs, outputs, initializers=(), name="handmade") -> onnx.ModelProto:
    """An opset-17 model; ``inputs``/``outputs`` are (name, elem_type, shape or None)."""
    graph = helper.make_graph(
        list(nodes),
        name,
        [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
        [helper.make_tensor_value_info(n, t, s) for n, t, s in outputs],
        initializer=list(initializers),
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _symbolic_model() -> onnx.ModelProto:
    """x[N, S, 16] @ w[16, 32] -> Relu -> y: two symbolic input dimensions."""
    w = numpy_helper.from_array(np.ones((16, 32), np.float32), "w")
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
        helper.make_node("Relu", ["h"], ["y"], name="relu"),
    ]
    return _model(
        nodes, [("x", TensorProto.FLOAT, ["N", "S", 16])], [("y", TensorProto.FLOAT, None)], [w], name="symbolic"
    )


def _roles_model() -> onnx.ModelProto:
    """Weights next to configuration constants: which initializers are parameters?"""
    inits = [
        numpy_helper.from_array(np.ones(16, np.float32), "scale"),  # learned: Mul by a vector
        numpy_helper.from_array(np.ones((16, 16), np.float32), "w"),  # learned: MatMul weight
        numpy_helper.from_array(np.array(-1.0, np.float32), "neg_one"),  # scalar: a constant
        numpy_helper.from_array(np.array([0.0, 1.0], np.float32), "on_off"),  # OneHot values: config
        numpy_helper.from_array(np.array(16, np.int64), "depth"),  # int: a constant
    ]
    nodes = [
        helper.make_node("Mul", ["x", "scale"], ["a"], name="scale_mul"),
        helper.make_node("Mul", ["a", "neg_one"], ["b"], name="negate"),
        helper.make_node("MatMul", ["b", "w"], ["c"], name="mm"),
        helper.make_node("OneHot", ["idx", "depth", "on_off"], ["oh"], name="onehot", axis=-1),
        helper.make_node("Mul", ["c", "oh"], ["y"], name="pick"),
    ]
    return _model(
        nodes,
        [("x", TensorProto.FLOAT, [8, 16]), ("idx", TensorProto.INT64, [8])],
        [("y", TensorProto.FLOAT, None)],
        inits,
    )


def _assert_one_sentence(message: str) -> None:
    assert message, "empty error message"
    assert "\n" not in message
    assert "Traceback" not in message
    assert message.endswith(".")


# --- fixtures -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def resnet() -> Graph:
    return load_model(RESNET50)


@pytest.fixture(scope="module")
def tiny_proto() -> onnx.ModelProto:
    return build_resnet50(**TINY)


# --- the bundled ResNet-50 ----------------------------------------------------------------------


def test_resnet50_operator_count_after_folding(resnet):
    assert len(resnet.ops) == 186
    types = {op.op_type for op in resnet.ops}
    assert "ConstantOfShape" not in types and "Constant" not in types
    # 53 convolutions and their batch norms are all there
    assert sum(op.op_type == "Conv" for op in resnet.ops) == 53
    assert sum(op.op_type == "BatchNormalization" for op in resnet.ops) == 53
    # the shape initializers of folded weights are not tensors of the graph
    assert not [name for name in resnet.tensors if name.endswith("__shape")]


def test_resnet50_op_indices_are_topological(resnet):
    assert [op.index for op in resnet.ops] == list(range(len(resnet.ops)))
    position = {op.name: op.index for op in resnet.ops}
    assert len(position) == len(resnet.ops)
    for op in resnet.ops:
        for inp in op.inputs:
            producer = resnet.producer.get(inp)
            if producer is not None:
                assert position[producer] < op.index, (producer, op.name)


def test_resnet50_trainable_parameters(resnet):
    trainable = [p for p in resnet.parameters if p.trainable]
    assert sum(p.numel for p in trainable) == 25_557_032
    assert all(p.kind == "parameter" and p.is_float for p in resnet.parameters)
    assert resnet.tensor("conv1.weight").shape == (64, 3, 7, 7)
    assert resnet.tensor("fc.weight").shape == (1000, 2048)
    assert resnet.tensor("fc.bias").trainable


def test_resnet50_batchnorm_statistics_are_frozen_parameters(resnet):
    stats = [t for name, t in resnet.tensors.items() if name.endswith((".mean", ".var"))]
    assert len(stats) == 2 * 53
    for tensor in stats:
        assert tensor.kind == "parameter", tensor.name
        assert tensor.trainable is False, tensor.name
    for name in ("bn1.scale", "bn1.bias", "layer4.2.bn3.scale"):
        assert resnet.tensor(name).kind == "parameter" and resnet.tensor(name).trainable
    # running statistics are the only non-trainable parameters: 2 x 26,560 BN channels
    frozen = sum(p.numel for p in resnet.parameters if not p.trainable)
    assert frozen == 2 * 26_560


def test_resnet50_forward_flops_per_image(resnet):
    batch = resnet.tensor("images").shape[0]
    assert batch == 256
    assert resnet.total_flops == pytest.approx(8.24e9 * batch, rel=0.01)
    conv_flops = sum(op.flops for op in resnet.ops if op.op_type == "Conv")
    assert conv_flops / resnet.total_flops > 0.95  # convolutions dominate


def test_resnet50_every_used_tensor_has_a_known_shape(resnet):
    for op in resnet.ops:
        for name in op.inputs + op.outputs:
            if not name:
                continue
            assert name in resnet.tensors, (op.name, name)
            shape = resnet.tensor(name).shape
            assert isinstance(shape, tuple)
            assert all(isinstance(d, int) and d >= 1 for d in shape), (name, shape)


def test_resnet50_inputs_and_outputs(resnet):
    assert resnet.inputs == ("images", "labels")
    assert resnet.outputs == ("loss", "logits")
    assert resnet.tensor("images").shape == (256, 3, 224, 224)
    assert resnet.tensor("labels").shape == (256,)
    assert resnet.tensor("labels").dtype == "int64"
    assert resnet.tensor("logits").shape == (256, 1000)
    assert resnet.tensor("loss").shape == ()
    assert resnet.tensor("images").kind == "input"
    assert resnet.tensor("logits").kind == "activation"


def test_resnet50_loss_constants_are_not_parameters(resnet):
    onehot_values = resnet.tensor("loss.onehot_values")
    assert onehot_values.kind == "constant" and not onehot_values.trainable
    assert onehot_values.dtype == "float32"
    np.testing.assert_array_equal(onehot_values.value, [0.0, 1.0])
    neg_one = resnet.tensor("loss.neg_one")
    assert neg_one.kind == "constant" and neg_one.shape == () and float(neg_one.value) == -1.0
    assert resnet.tensor("loss.depth").kind == "constant"
    names = {p.name for p in resnet.parameters}
    assert not names & {"loss.onehot_values", "loss.neg_one", "loss.depth", "loss.axes_classes"}


# --- batch and symbolic dimensions --------------------------------------------------------------


def test_batch_override_propagates(tiny_proto):
    base = load_model(tiny_proto)
    graph = load_model(tiny_proto, batch=16)
    assert base.tensor("images").shape == (4, 3, 32, 32)
    assert graph.tensor("images").shape == (16, 3, 32, 32)
    assert graph.tensor("labels").shape == (16,)
    assert graph.tensor("logits").shape == (16, 10)
    assert graph.tensor("loss.onehot").shape == (16, 10)
    # weights do not depend on the batch; FLOPs scale with it
    assert graph.tensor("conv1.weight").shape == base.tensor("conv1.weight").shape
    assert graph.total_flops == pytest.approx(4 * base.total_flops, rel=1e-9)


def test_batch_override_on_the_bundled_file():
    graph = load_model(RESNET50, batch=2)
    assert graph.tensor("images").shape == (2, 3, 224, 224)
    assert graph.tensor("logits").shape == (2, 1000)
    assert graph.total_flops == pytest.approx(8.24e9 * 2, rel=0.01)


def test_non_positive_batch_is_an_import_error(tiny_proto):
    with pytest.raises(ModelImportError, match="batch"):
        load_model(tiny_proto, batch=0)


def test_symbolic_dims_are_bound():
    graph = load_model(_symbolic_model(), dims={"N": 2, "S": 8})
    assert graph.tensor("x").shape == (2, 8, 16)
    assert graph.tensor("h").shape == (2, 8, 32)
    assert graph.tensor("y").shape == (2, 8, 32)
    assert graph.tensor("w").kind == "parameter"
    assert graph.op("mm").flops == pytest.approx(2 * 2 * 8 * 16 * 32)


def test_batch_binds_the_leading_symbolic_dim():
    graph = load_model(_symbolic_model(), batch=3, dims={"S": 5})
    assert graph.tensor("y").shape == (3, 5, 32)


@pytest.mark.parametrize("dims, missing", [({}, "N"), ({"N": 2}, "S")])
def test_unbound_symbolic_dim_names_tensor_and_suggests_dim(dims, missing):
    # the core names the tensor and the dimension, in a Python caller's words; the CLI words it with --dim
    with pytest.raises(UnknownDimensionError) as info:
        load_model(_symbolic_model(), dims=dims)
    assert (info.value.tensor, info.value.dimension) == ("x", missing)
    message = str(info.value)
    assert "'x'" in message
    assert f"dims={{{missing!r}: value}}" in message and "--dim" not in message
    _assert_one_sentence(message)


def test_dims_naming_a_nonexistent_symbol_is_an_error():
    with pytest.raises(ModelImportError) as info:
        load_model(_symbolic_model(), dims={"N": 2, "S": 8, "Q": 3})
    message = str(info.value)
    assert "Q" in message
    assert "N" in message and "S" in message  # lists the symbols the model does have
    _assert_one_sentence(message)


def test_dims_on_a_model_without_symbols_is_an_error(tiny_proto):
    with pytest.raises(ModelImportError, match="B"):
        load_model(tiny_proto, dims={"B": 4})


# --- unreadable files ---------------------------------------------------------------------------


def test_missing_file(tmp_path):
    path = tmp_path / "nope.onnx"
    with pytest.raises(ModelImportError) as info:
        load_model(path)
    assert "nope.onnx" in str(info.value) and "does not exist" in str(info.value)
    _assert_one_sentence(str(info.value))


def test_truncated_file(tmp_path):
    path = tmp_path / "truncated.onnx"
    path.write_bytes(RESNET50.read_bytes()[:100])
    with pytest.raises(ModelImportError) as info:
        load_model(path)
    message = str(info.value)
    assert "truncated.onnx" in message
    assert "not a readable ONNX model" in message
    _assert_one_sentence(message)
    assert info.value.__cause__ is None  # raised "from None": no chained protobuf traceback


@pytest.mark.parametrize("filename", ["notes.txt", "notes.onnx"])
def test_foreign_text_file(tmp_path, filename):
    path = tmp_path / filename
    path.write_text("this is a text file, not a model\nsecond line\n", encoding="utf-8")
    with pytest.raises(ModelImportError) as info:
        load_model(path)
    assert filename in str(info.value)
    _assert_one_sentence(str(info.value))


def test_empty_file_has_no_operators(tmp_path):
    path = tmp_path / "empty.onnx"
    path.write_bytes(b"")
    with pytest.raises(ModelImportError) as info:
        load_model(path)
    _assert_one_sentence(str(info.value))


def test_import_errors_are_autopar_errors():
    assert issubclass(ModelImportError, AutoparError)


# --- constants vs parameters --------------------------------------------------------------------


def test_roles_of_initializers():
    graph = load_model(_roles_model())
    assert graph.tensor("on_off").kind == "constant"  # OneHot's float `values` configure the op
    assert graph.tensor("neg_one").kind == "constant"  # a float scalar is a constant
    assert graph.tensor("depth").kind == "constant"
    assert graph.tensor("idx").kind == "input"
    for name in ("scale", "w"):
        assert graph.tensor(name).kind == "parameter" and graph.tensor(name).trainable, name
    assert {p.name for p in graph.parameters} == {"scale", "w"}
    assert graph.tensor("x").kind == "input"
    assert graph.inputs == ("x", "idx")
    np.testing.assert_array_equal(graph.tensor("on_off").value, [0.0, 1.0])


def test_constant_node_is_folded():
    nodes = [
        helper.make_node("Constant", [], ["two"], name="c", value_float=2.0),
        helper.make_node("Mul", ["x", "two"], ["y"], name="double"),
    ]
    graph = load_model(_model(nodes, [("x", TensorProto.FLOAT, [4, 4])], [("y", TensorProto.FLOAT, None)]))
    assert [op.name for op in graph.ops] == ["double"]
    assert graph.tensor("two").kind == "constant"
    assert float(graph.tensor("two").value) == 2.0


# --- ModelProto input ---------------------------------------------------------------------------


def test_model_proto_is_accepted_and_not_mutated(tiny_proto):
    before = tiny_proto.SerializeToString()
    graph = load_model(tiny_proto, batch=8)
    assert tiny_proto.SerializeToString() == before
    assert graph.tensor("logits").shape == (8, 10)
    assert graph.name == "resnet50_v1_5_train"
    assert graph.model is not tiny_proto
    # the caller's proto still has its own batch
    assert tiny_proto.graph.input[0].type.tensor_type.shape.dim[0].dim_value == 4


def test_symbolic_model_proto_is_not_mutated():
    proto = _symbolic_model()
    before = proto.SerializeToString()
    load_model(proto, dims={"N": 2, "S": 8})
    assert proto.SerializeToString() == before
    assert proto.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "N"


def test_proto_and_file_give_the_same_graph(tiny_proto, tmp_path):
    path = tmp_path / "tiny.onnx"
    onnx.save(tiny_proto, str(path))
    from_file, from_proto = load_model(path), load_model(tiny_proto)
    assert from_file.name == "tiny"
    assert [(op.name, op.op_type, op.flops) for op in from_file.ops] == [
        (op.name, op.op_type, op.flops) for op in from_proto.ops
    ]
    assert {k: (t.shape, t.kind, t.trainable) for k, t in from_file.tensors.items()} == {
        k: (t.shape, t.kind, t.trainable) for k, t in from_proto.tensors.items()
    }


def test_tiny_parameter_count_matches_the_onnx_file(tiny_proto):
    """Independent count: every ConstantOfShape-elided weight except BN running statistics."""
    shapes = {init.name: numpy_helper.to_array(init) for init in tiny_proto.graph.initializer}
    expected = 0
    for node in tiny_proto.graph.node:
        if node.op_type == "ConstantOfShape" and not node.output[0].endswith((".mean", ".var")):
            expected += math.prod(int(d) for d in shapes[node.input[0]])
    graph = load_model(tiny_proto)
    assert expected > 0
    assert sum(p.numel for p in graph.parameters if p.trainable) == expected


# --- operator names -----------------------------------------------------------------------------


def test_operator_names_are_unique_after_renaming():
    nodes = [
        helper.make_node("Relu", ["x"], ["a"], name="r"),
        helper.make_node("Relu", ["a"], ["b"], name="r"),
        helper.make_node("Relu", ["b"], ["y"], name="r_1"),
    ]
    graph = load_model(_model(nodes, [("x", TensorProto.FLOAT, [8, 16])], [("y", TensorProto.FLOAT, None)]))
    names = [op.name for op in graph.ops]
    assert len(set(names)) == 3, names


def test_duplicate_and_missing_names_are_made_unique():
    nodes = [
        helper.make_node("Relu", ["x"], ["a"], name="r"),
        helper.make_node("Relu", ["a"], ["b"], name="r"),
        helper.make_node("Relu", ["b"], ["y"]),
    ]
    graph = load_model(_model(nodes, [("x", TensorProto.FLOAT, [8, 16])], [("y", TensorProto.FLOAT, None)]))
    names = [op.name for op in graph.ops]
    assert len(set(names)) == 3, names
    assert names[0] == "r"
    assert graph.op(names[1]).inputs == ("a",)


# --- shape computations and hard-coded batch sizes -------------------------------------------------


def _shape_subgraph_model(batch: int = 4) -> onnx.ModelProto:
    """x: [B, 6, 8] reshaped to [B, 48] through Shape -> Gather -> Unsqueeze -> Concat; a Range adds 0..47."""
    inits = [
        numpy_helper.from_array(np.array(0, np.int64), "zero"),
        numpy_helper.from_array(np.array([48], np.int64), "rest"),
        numpy_helper.from_array(np.array([0], np.int64), "axes0"),
        numpy_helper.from_array(np.array(1, np.int64), "one"),
        numpy_helper.from_array(np.array(48, np.int64), "limit"),
    ]
    nodes = [
        helper.make_node("Shape", ["x"], ["s"], name="shape"),
        helper.make_node("Gather", ["s", "zero"], ["b"], name="batch_of", axis=0),
        helper.make_node("Unsqueeze", ["b", "axes0"], ["b1"], name="as_list"),
        helper.make_node("Concat", ["b1", "rest"], ["target"], name="target", axis=0),
        helper.make_node("Reshape", ["x", "target"], ["flat"], name="flatten"),
        helper.make_node("Range", ["zero", "limit", "one"], ["positions"], name="positions"),
        helper.make_node("Cast", ["positions"], ["pos_f"], name="pos_float", to=TensorProto.FLOAT),
        helper.make_node("ReduceSum", ["flat", "axes0"], ["y"], name="total", keepdims=0),
        helper.make_node("Add", ["y", "pos_f"], ["z"], name="shift"),
    ]
    return _model(nodes, [("x", TensorProto.FLOAT, [batch, 6, 8])], [("z", TensorProto.FLOAT, None)], inits)


def test_shape_subgraphs_are_folded_to_constants():
    model = _shape_subgraph_model()
    graph = load_model(model)
    assert [op.op_type for op in graph.ops] == ["Reshape", "ReduceSum", "Add"]
    np.testing.assert_array_equal(graph.tensor("pos_f").value, np.arange(48, dtype=np.float32))
    np.testing.assert_array_equal(graph.tensor("target").value, [4, 48])
    assert graph.tensor("target").kind == "constant"
    rebound = load_model(model, batch=16)
    np.testing.assert_array_equal(rebound.tensor("target").value, [16, 48])
    assert rebound.tensor("flat").shape == (16, 48)


def _hard_coded_reshape(batch: int = 1, target=(1, 48)) -> onnx.ModelProto:
    inits = [numpy_helper.from_array(np.array(target, np.int64), "target")]
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("Reshape", ["r", "target"], ["y"], name="flatten"),
    ]
    return _model(nodes, [("x", TensorProto.FLOAT, [batch, 6, 8])], [("y", TensorProto.FLOAT, [batch, 48])], inits)


def test_batch_override_rewrites_a_hard_coded_reshape_batch():
    graph = load_model(_hard_coded_reshape(), batch=32)
    assert graph.tensor("y").shape == (32, 48)
    assert graph.tensor("r").shape == (32, 6, 8)


def test_a_file_imported_at_one_batch_after_another_is_rebatched_as_if_imported_alone():
    """The sizes a file infers at its own batch are inferred once per file content in a plan
    (`bind._file_shapes`, `autopar.context`): the second and third batches take them from there, and a file
    of other content is inferred anew."""
    from autopar.context import opened

    with opened() as plan:
        model = _hard_coded_reshape(batch=2, target=(2, 48))
        shapes = {batch: load_model(model, batch=batch).tensor("y").shape for batch in (32, 4, 32)}
        assert shapes == {32: (32, 48), 4: (4, 48)} and len(plan.file_shapes) == 1
        wider = _hard_coded_reshape(batch=2, target=(2, 48))
        wider.graph.input[0].type.tensor_type.shape.dim[2].dim_value = 16  # (2, 6, 16): 96 features a sample
        wider.graph.output[0].type.tensor_type.shape.dim[1].dim_value = 96
        wider.graph.initializer[0].CopyFrom(numpy_helper.from_array(np.array([2, 96], np.int64), "target"))
        assert load_model(wider, batch=4).tensor("y").shape == (4, 96) and len(plan.file_shapes) == 2
    assert not plan.file_shapes  # closed with the plan


def _sizes(proto: onnx.ModelProto) -> dict[str, tuple[int, ...]]:
    from autopar.graph.proto import value_infos

    return {
        name: tuple(dim.dim_value for dim in info.type.tensor_type.shape.dim)
        for name, info in value_infos(proto).items()
        if info.type.HasField("tensor_type")
    }


def test_a_file_sized_without_data_propagation_has_the_sizes_propagation_infers():
    """`bind._file_shapes` skips data propagation where inference without it sizes every output
    (`_sized_without_propagation`): the sizes are those propagation infers, and a size that only a shape chain
    gives (a Reshape's target read from ``Shape``) sends it to propagation."""
    from autopar.graph.bind import _sized_without_propagation
    from models.transformer import build_transformer

    gpt = build_transformer(layers=2, hidden=64, heads=4, seq=16, vocab=128, batch=2)
    for model in (build_resnet50(batch=2), gpt, _hard_coded_reshape(batch=2, target=(2, 48))):
        quick = _sized_without_propagation(model)
        assert quick is not None
        assert _sizes(quick) == _sizes(onnx.shape_inference.infer_shapes(model, data_prop=True))
    assert _sized_without_propagation(_shape_subgraph_model()) is None
    declared = _hard_coded_reshape(batch=2, target=(2, 48))
    declared.graph.output[0].type.tensor_type.shape.dim[1].dim_value = 47  # contradicts the inferred 48
    assert _sized_without_propagation(declared) is None


def test_reshape_that_changes_the_element_count_is_an_import_error():
    # a target that names a feature size, not the batch, cannot be rewritten: say so
    model = _hard_coded_reshape(batch=2, target=(4, 48))
    with pytest.raises(ModelImportError, match="turns 96 elements into 192") as info:
        load_model(model)
    _assert_one_sentence(str(info.value))


def test_a_mask_built_in_the_graph_is_a_constant_but_a_folded_weight_is_a_parameter():
    seq = 4
    nodes = [
        helper.make_node("Range", ["zero", "seq", "one"], ["positions"], name="range"),
        helper.make_node("Reshape", ["positions", "column"], ["rows"], name="rows"),
        helper.make_node("Less", ["rows", "positions"], ["future"], name="less"),
        helper.make_node("Where", ["future", "minus", "nought"], ["mask"], name="where"),
        helper.make_node("Add", ["X", "mask"], ["masked"], name="add_mask"),
        helper.make_node("Transpose", ["W"], ["WT"], name="transpose_weight", perm=[1, 0]),
        helper.make_node("MatMul", ["masked", "WT"], ["Y"], name="mm"),
    ]
    inits = [
        numpy_helper.from_array(np.array(0, dtype=np.int64), "zero"),
        numpy_helper.from_array(np.array(seq, dtype=np.int64), "seq"),
        numpy_helper.from_array(np.array(1, dtype=np.int64), "one"),
        numpy_helper.from_array(np.array([seq, 1], dtype=np.int64), "column"),
        numpy_helper.from_array(np.array(-1e4, dtype=np.float32), "minus"),
        numpy_helper.from_array(np.array(0.0, dtype=np.float32), "nought"),
        weight("W", [seq, seq]),
    ]
    graph = load_model(make_model(nodes, [("X", TensorProto.FLOAT, [2, seq, seq])], ["Y"], inits))
    assert graph.tensor("mask").kind == "constant"
    assert graph.tensor("WT").kind == "parameter" and graph.tensor("WT").trainable


def test_a_reshape_target_merging_the_batch_with_the_sequence_is_rebatched():
    from models.transformer import build_preset

    graph = load_model(build_preset("gpt2", layers=1, hidden=64, heads=2, seq=16, vocab=128, batch=8), batch=2)
    assert graph.tensor("loss.logits_2d").shape == (2 * 16, 128)
    assert graph.tensor("layer0.attn.q.reshape").shape == (2, 16, 2, 32)


def _routed(batch: int = 8, seq: int = 4, experts: int = 2) -> onnx.ModelProto:
    """A router as the dynamo exporter writes DeepSeek-V3's: each token's top expert marked with a scatter of ones
    into ``zeros_like`` of its scores (both folded: a stored table of zeros, a ConstantOfShape of the tokens' count),
    the scores gathered per token and split back into the batch's sequences, and a key-state buffer the model
    fills at its batch (``new_empty``) that a scatter writes into."""
    tokens = batch * seq
    nodes = [
        helper.make_node("Reshape", ["x", "per_token"], ["flat"], name="flatten"),
        helper.make_node("MatMul", ["flat", "gate"], ["scores"], name="gate"),
        helper.make_node("TopK", ["scores", "one"], ["top", "chosen"], name="topk"),
        helper.make_node(
            "ConstantOfShape",
            ["ones_shape"],
            ["ones"],
            name="ones",
            value=numpy_helper.from_array(np.ones(1, np.float32)),
        ),
        helper.make_node("ScatterElements", ["zeros_like", "chosen", "ones"], ["marked"], name="mark", axis=1),
        helper.make_node("Mul", ["scores", "marked"], ["routed"], name="route"),
        helper.make_node("Reshape", ["routed", "per_sequence"], ["back"], name="unflatten"),
        helper.make_node("ConstantOfShape", ["buffer_shape"], ["buffer"], name="new_empty"),
        helper.make_node("ScatterND", ["buffer", "where", "back"], ["states"], name="write_states"),
    ]
    inits = [
        numpy_helper.from_array(np.array([tokens, 4], np.int64), "per_token"),
        weight("gate", [4, experts]),
        numpy_helper.from_array(np.array([1], np.int64), "one"),
        numpy_helper.from_array(np.array([tokens, 1], np.int64), "ones_shape"),
        numpy_helper.from_array(np.zeros((tokens, experts), np.float32), "zeros_like"),
        numpy_helper.from_array(np.array([batch, seq, experts], np.int64), "per_sequence"),
        numpy_helper.from_array(np.array([batch, seq, experts], np.int64), "buffer_shape"),
        numpy_helper.from_array(np.zeros((1, 1), np.int64), "where"),
    ]
    outputs = [("states", TensorProto.FLOAT, [batch, seq, experts])]
    return _model(nodes, [("x", TensorProto.FLOAT, [batch, seq, 4])], outputs, inits)


def test_a_routers_buffers_and_its_tokens_reshapes_follow_the_batch():
    """At another batch (a micro-batch's), the buffers a model fills at its batch or its tokens' count and the
    reshapes that gather the batch's tokens and split them back take the new batch (DeepSeek-V3 refused every
    micro-batch count but one: 'Incompatible dimensions'); ``zeros_like`` folded into a stored table, which only a
    scatter writes into, is a constant, not a trained parameter."""
    whole, micro = load_model(_routed()), load_model(_routed(), batch=2)
    assert micro.tensor("states").shape == (2, 4, 2) and micro.tensor("back").shape == (2, 4, 2)
    assert micro.tensor("marked").shape == (8, 2) and micro.tensor("zeros_like").shape == (8, 2)
    assert whole.tensor("zeros_like").kind == micro.tensor("zeros_like").kind == "constant"
    assert whole.tensor("gate").kind == "parameter"


def _gathered_mask(batch: int = 4, seq: int = 3, index_reader: str = "Unsqueeze") -> onnx.ModelProto:
    """A padding mask as transformers 5 exports it: gathered from the attention mask by index grids stored at the
    file's batch, one holding each sample's index and one the positions (each sample's the same), each unsqueezed
    and concatenated into GatherND's indices. ``index_reader``: what reads the sample-index grid."""
    index_node = (
        helper.make_node("Unsqueeze", ["sample", "last"], ["sample_1"], name="index_sample")
        if index_reader == "Unsqueeze"
        else helper.make_node("Reshape", ["sample", "grid_shape"], ["sample_1"], name="index_sample")
    )
    nodes = [
        index_node,
        helper.make_node("Unsqueeze", ["position", "last"], ["position_1"], name="index_position"),
        helper.make_node("Concat", ["sample_1", "position_1"], ["indices"], name="indices", axis=-1),
        helper.make_node("GatherND", ["attention_mask", "indices"], ["kept"], name="gather_mask"),
        helper.make_node("Cast", ["kept"], ["kept_f"], name="to_float", to=TensorProto.FLOAT),
        helper.make_node("Mul", ["x", "kept_f"], ["padded"], name="mask"),
        helper.make_node("LessOrEqual", ["position", "limit"], ["early"], name="compare"),  # (as Qwen3's mask does)
        helper.make_node("Cast", ["early"], ["early_f"], name="early_to_float", to=TensorProto.FLOAT),
        helper.make_node("Mul", ["padded", "early_f"], ["y"], name="limit_mask"),
    ]
    samples = np.broadcast_to(np.arange(batch).reshape(batch, 1, 1), (batch, 1, seq))
    inits = [
        numpy_helper.from_array(samples.copy(), "sample"),
        numpy_helper.from_array(np.broadcast_to(np.arange(seq), (batch, 1, seq)).copy(), "position"),
        numpy_helper.from_array(np.full((batch, 1, seq), seq - 2, np.int64), "limit"),
        numpy_helper.from_array(np.array([-1], np.int64), "last"),
        numpy_helper.from_array(np.array([batch, 1, seq, 1], np.int64), "grid_shape"),
    ]
    inputs = [("x", TensorProto.FLOAT, [batch, 1, seq]), ("attention_mask", TensorProto.INT64, [batch, seq])]
    return _model(nodes, inputs, [("y", TensorProto.FLOAT, [batch, 1, seq])], inits)


def test_a_mask_gathered_by_stored_index_grids_follows_the_batch():
    """At a micro-batch's size, the index grids a transformers 5 mask gathers by are stored again: each sample's
    index for the first samples, the positions each sample's (a GPT-NeoX export refused every micro-batch count
    but one: 'Incompatible dimensions' at its mask)."""
    micro = load_model(_gathered_mask(), batch=2)  # (the grids are folded into GatherND's indices)
    assert micro.tensor("y").shape == (2, 1, 3)
    indices = micro.tensor("indices").value
    assert indices[..., 0].tolist() == [[[0, 0, 0]], [[1, 1, 1]]] and indices[..., 1].tolist() == [[[0, 1, 2]]] * 2
    assert micro.tensor("early_f").value.tolist() == [[[1.0, 1.0, 0.0]]] * 2  # (folded: positions <= 1)
    assert load_model(_gathered_mask(), batch=6).tensor("indices").value[:, 0, 0, 0].tolist() == list(range(6))


def test_an_index_grid_read_otherwise_than_sample_by_sample_is_not_rebatched():
    """A sample-index grid that a Reshape reads (which may move its samples) keeps its size: the import at
    another batch is refused, not rewritten."""
    with pytest.raises(ModelImportError):
        load_model(_gathered_mask(index_reader="Reshape"), batch=2)


def test_a_reshape_naming_a_size_the_batch_does_not_hold_is_not_rebatched():
    """A tensor of weights leading with a size equal to the batch's tokens is not reshaped as if it held them."""
    nodes = [
        helper.make_node("Reshape", ["table", "split"], ["rows"], name="split_table"),
        helper.make_node("MatMul", ["x", "rows"], ["y"], name="mm"),
    ]
    inits = [weight("table", [8, 4]), numpy_helper.from_array(np.array([8, 4], np.int64), "split")]
    model = _model(nodes, [("x", TensorProto.FLOAT, [2, 4, 8])], [("y", TensorProto.FLOAT, [2, 4, 4])], inits)
    assert load_model(model, batch=1).tensor("rows").shape == (8, 4)


@pytest.mark.parametrize(
    "path, node, source",
    [
        ("tests/data/torch_gpt_dynamo.onnx", "node_MatMul_6", "blocks.0.qkv"),
        ("tests/data/torch_gpt_legacy.onnx", "/blocks.0/qkv/MatMul", "blocks.0.qkv"),
    ],
)
def test_pytorch_module_paths_are_kept_as_the_layer_name(path, node, source):
    assert load_model(path).op(node).source == source


def test_stored_masks_and_shared_tables_are_constants_but_scales_and_shared_weights_are_trained():
    """An additive mask, a multiplicative 0/1 mask and a table several products read (rotary cos) are
    buffers no framework trains; a norm's scale (one product) and a weight two matrix products share
    (ALBERT) are trained."""
    seq = 4
    nodes = [
        helper.make_node("Add", ["X", "causal"], ["a"], name="add_mask"),
        helper.make_node("Mul", ["a", "keep"], ["b"], name="mul_mask"),
        helper.make_node("Mul", ["b", "cos"], ["c"], name="rotate_q"),
        helper.make_node("Mul", ["X", "cos"], ["d"], name="rotate_k"),
        helper.make_node("Mul", ["c", "scale"], ["e"], name="norm_scale"),
        helper.make_node("MatMul", ["e", "W"], ["f"], name="layer1"),
        helper.make_node("MatMul", ["d", "W"], ["g"], name="layer2"),
        helper.make_node("Add", ["f", "g"], ["Y"], name="sum"),
    ]
    inits = [
        numpy_helper.from_array(np.triu(np.full((seq, seq), -1e9, dtype=np.float32), 1), "causal"),
        numpy_helper.from_array(np.tril(np.ones((seq, seq), dtype=np.float32)), "keep"),
        numpy_helper.from_array(np.cos(np.arange(seq * seq, dtype=np.float32)).reshape(seq, seq), "cos"),
        weight("scale", [seq], 1),
        weight("W", [seq, seq], 2),
    ]
    graph = load_model(make_model(nodes, [("X", TensorProto.FLOAT, [2, seq, seq])], ["Y"], inits))
    assert [graph.tensor(name).kind for name in ("causal", "keep", "cos")] == ["constant"] * 3
    assert graph.tensor("scale").trainable and graph.tensor("W").trainable


def _masked_scores(reader: str):
    """Scores x @ w masked by a stored causal mask that ``reader`` (Add or Where) applies."""
    mask = np.triu(np.full((4, 4), -np.inf, dtype=np.float32), 1)
    inits = [numpy_helper.from_array(mask, "mask"), numpy_helper.from_array(np.ones((4, 4), np.float32), "w")]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["s"], name="mm")]
    if reader == "Add":
        nodes.append(helper.make_node("Add", ["s", "mask"], ["y"], name="mask_add"))
    else:
        inits.append(numpy_helper.from_array(np.tril(np.ones((4, 4), bool)), "keep"))
        nodes.append(helper.make_node("Where", ["keep", "s", "mask"], ["y"], name="mask_where"))
    graph = helper.make_graph(
        nodes,
        "masked",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        initializer=inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("reader", ["Add", "Where"])
def test_a_stored_mask_is_not_trained_unless_asked(reader):
    graph = load_model(_masked_scores(reader))
    assert graph.tensor("mask").kind == "constant" and graph.tensor("w").trainable
    forced = load_model(_masked_scores(reader), trainable=["ma*"])
    assert forced.tensor("mask").kind == "parameter" and forced.tensor("mask").trainable


def test_training_a_name_that_is_no_constant_is_an_error():
    with pytest.raises(ModelImportError, match="'nothing'") as info:
        load_model(_masked_scores("Add"), trainable=["nothing"])
    _assert_one_sentence(str(info.value))


def _elided(name: str, shape: list[int]) -> onnx.TensorProto:
    """A float initializer whose values live in a file not kept (as the exports in tests/data store them)."""
    from onnx.external_data_helper import set_external_data

    tensor = numpy_helper.from_array(np.ones(shape, np.float32), name)
    set_external_data(tensor, "absent.weights")
    tensor.ClearField("raw_data")
    return tensor


def test_scales_an_exporter_merged_under_identities_get_their_own_names_back():
    """PyTorch's TorchScript exporter keeps one of several identical norm scales and names the others
    as Identities of it (T5); each becomes its own trained parameter under its name. An Identity whose
    output a matrix product reads is a weight shared on purpose and stays."""
    nodes = [
        helper.make_node("Mul", ["X", "norm0.weight"], ["a"], name="norm0"),
        helper.make_node("Identity", ["norm0.weight"], ["norm1.weight"], name="alias1"),
        helper.make_node("Mul", ["a", "norm1.weight"], ["b"], name="norm1"),
        helper.make_node("Identity", ["norm0.weight"], ["norm2.weight"], name="alias2"),
        helper.make_node("Mul", ["b", "norm2.weight"], ["Y"], name="norm2"),
    ]
    io = ([("X", TensorProto.FLOAT, [2, 4])], [("Y", TensorProto.FLOAT, None)])
    graph = load_model(_model(nodes, *io, [_elided("norm0.weight", [4])]))
    assert [op.op_type for op in graph.ops] == ["Mul"] * 3
    assert [graph.op(f"norm{i}").inputs[1] for i in range(3)] == [f"norm{i}.weight" for i in range(3)]
    assert all(graph.tensor(f"norm{i}.weight").trainable for i in range(3))

    shared = [
        helper.make_node("Identity", ["W"], ["W_alias"], name="alias"),
        helper.make_node("Mul", ["X", "W"], ["a"], name="scale"),
        helper.make_node("MatMul", ["a", "W_alias"], ["Y"], name="project"),
    ]
    graph = load_model(_model(shared, *io, [_elided("W", [4])]))
    assert [op.op_type for op in graph.ops] == ["Identity", "Mul", "MatMul"]
    assert graph.op("alias").inputs == ("W",) and graph.op("scale").inputs == ("X", "W")


def test_the_t5_export_trains_each_norm_scale_torch_trains():
    graph = load_model(REPO / "tests" / "data" / "hf_t5_legacy.onnx")
    scales = sorted(p.name for p in graph.parameters if p.trainable and p.name.endswith("layer_norm.weight"))
    encoder = [f"model.encoder.block.{b}.layer.{i}.layer_norm.weight" for b in range(2) for i in range(2)]
    decoder = [f"model.decoder.block.{b}.layer.{i}.layer_norm.weight" for b in range(2) for i in range(3)]
    finals = ["model.decoder.final_layer_norm.weight", "model.encoder.final_layer_norm.weight"]
    assert scales == sorted(encoder + decoder + finals)
    assert not [op for op in graph.ops if op.op_type == "Identity"]


def test_a_buffer_only_the_routing_reads_gets_no_gradient_in_the_plan_the_runtime_or_the_report():
    """DeepSeek-V3's router adds a buffer (``e_score_correction_bias``) to its scores only to choose the top-k
    experts: its indices, not its values, go on, so autograd gives the buffer no gradient. It is not trained:
    no gradient sync in the plan, none run by the runtime (the data-parallel plan verifies with gradients,
    every collective as listed), and the report counts its elements as frozen. The rest of the router trains."""
    import autopar
    from autopar.graph import gradient_reaches
    from autopar.report import inspect_summary

    path = REPO / "tests" / "data" / "hf_deepseek_v3_dynamo.onnx"
    graph = load_model(path)
    bias = [name for name in graph.tensors if name.endswith("e_score_correction_bias")]
    gate = [name for name in graph.tensors if name.endswith("mlp.gate.weight")]
    assert len(bias) == 1 and len(gate) == 1
    assert not graph.tensor(bias[0]).trainable and graph.tensor(gate[0]).trainable
    assert gradient_reaches(graph)[gate[0]] and not gradient_reaches(graph)[bias[0]]
    plan = autopar.plan(path, devices=8, mode="data_parallel")
    synced = {entry["parameter"] for entry in plan.gradient_sync()}
    assert gate[0] in synced and bias[0] not in synced
    assert autopar.verify(path, plan, gradients=True).ok
    counted = inspect_summary(graph)["parameters"]
    trained = sum(p.numel for p in graph.parameters if p.name in synced)
    assert counted["trainable_elements"] == trained < counted["elements"]


def test_a_broadcast_too_large_to_fold_is_not_evaluated_to_find_out():
    """A comparison of position ramps, 8,192 x 8,192 (a causal mask's, 67 million entries): refused from its
    inputs' shapes before the reference evaluator builds it; a small one, or an operator whose size its inputs
    do not bound, still goes to the evaluator."""
    from autopar.graph.fold import _surely_too_large

    ramp = np.arange(8192, dtype=np.int64)
    known = {"kv": ramp.reshape(1, 1, 8192), "q": ramp.reshape(1, 8192, 1), "small": ramp[:8].reshape(1, 8, 1)}
    known["shape"], known["one"] = np.array([1, 8192, 8192], dtype=np.int64), np.zeros((1, 1, 1), dtype=bool)
    assert _surely_too_large(helper.make_node("LessOrEqual", ["kv", "q"], ["le"]), known)
    assert _surely_too_large(helper.make_node("Expand", ["one", "shape"], ["big"]), known)
    assert not _surely_too_large(helper.make_node("LessOrEqual", ["kv", "small"], ["le"]), known)
    assert not _surely_too_large(helper.make_node("Range", ["small", "small", "small"], ["r"]), known)
    grid = np.zeros((8, 1, 4096, 4096, 2), dtype=np.int64)  # a mask's index grid: 134 million index pairs
    known["grid"], known["pairs"] = grid, np.zeros((8, 4096), dtype=np.int64)
    assert _surely_too_large(helper.make_node("GatherND", ["pairs", "grid"], ["mask"]), known)
    known["grid"] = grid[:, :, :8]
    assert not _surely_too_large(helper.make_node("GatherND", ["pairs", "grid"], ["mask"]), known)


@pytest.mark.parametrize("seed", range(5))
def test_gather_nd_folds_as_onnx_defines_it(seed):
    """Folding's numpy GatherND against onnx's reference evaluator: batch dimensions, partial index tuples,
    negative indices, extra index axes."""
    from onnx.reference import ReferenceEvaluator

    from autopar.graph.fold import gather_nd

    rng = np.random.default_rng(seed)
    for _ in range(60):
        batch_dims = int(rng.integers(0, 3))
        shape = tuple(int(size) for size in rng.integers(1, 4, size=batch_dims + int(rng.integers(1, 4))))
        depth = int(rng.integers(1, len(shape) - batch_dims + 1))
        extra = tuple(int(size) for size in rng.integers(1, 3, size=int(rng.integers(0, 3))))
        per_axis = [
            rng.integers(-shape[a], shape[a], size=shape[:batch_dims] + extra)
            for a in range(batch_dims, batch_dims + depth)
        ]
        indices = np.stack(per_axis, axis=-1).astype(np.int64)
        data = rng.standard_normal(shape)
        node = helper.make_node("GatherND", ["data", "indices"], ["out"], batch_dims=batch_dims)
        (expected,) = ReferenceEvaluator(node).run(None, {"data": data, "indices": indices})
        got = gather_nd(data, indices, batch_dims)
        assert got.shape == expected.shape and np.array_equal(got, expected)


def test_a_buffer_built_to_scatter_into_is_a_constant_but_an_elided_weight_is_a_parameter():
    """DeepSeek-V3's key states: ``new_empty`` (a ConstantOfShape of the file's shape) transposed and scattered
    into, then read by the model. The buffer holds its one value at every place, as a constant the trainer and the
    reference read (a broadcast view, one element held); the Transpose stays an operator (the order it is
    scattered in is the trainer's to read). A weight elided as ConstantOfShape and read by a MatMul stays a
    trained parameter."""
    fill = numpy_helper.from_array(np.array([0.0], dtype=np.float32))
    nodes = [
        helper.make_node("ConstantOfShape", ["shape"], ["buffer"], name="new_empty", value=fill),
        helper.make_node("Transpose", ["buffer"], ["turned"], name="turn", perm=[1, 0]),
        helper.make_node("Transpose", ["X"], ["x_turned"], name="turn_x", perm=[1, 0]),
        helper.make_node("ScatterND", ["turned", "rows", "x_turned"], ["written"], name="scatter"),
        helper.make_node("Transpose", ["written"], ["keys"], name="turn_back", perm=[1, 0]),
        helper.make_node("ConstantOfShape", ["w_shape"], ["W"], name="W__init", value=fill),
        helper.make_node("MatMul", ["keys", "W"], ["Y"], name="mm"),
    ]
    inits = [
        numpy_helper.from_array(np.array([4, 6], dtype=np.int64), "shape"),
        numpy_helper.from_array(np.array([[0], [1], [2], [3], [4], [5]], dtype=np.int64), "rows"),
        numpy_helper.from_array(np.array([6, 3], dtype=np.int64), "w_shape"),
    ]
    graph = load_model(make_model(nodes, [("X", TensorProto.FLOAT, [4, 6])], ["Y"], inits))
    buffer = graph.tensor("buffer")
    assert buffer.kind == "constant" and buffer.value is not None
    assert buffer.value.shape == (4, 6) and not buffer.value.any() and not any(buffer.value.strides)
    assert "turn" in {op.name for op in graph.ops}
    assert graph.tensor("W").kind == "parameter" and graph.tensor("W").trainable
