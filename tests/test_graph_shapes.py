"""Shape chains folded at import (`autopar.graph.shapes`): exporters' size arithmetic, and sizes from data."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper, shape_inference

from autopar.context import opened
from autopar.errors import ComputedDimensionError, ModelImportError
from autopar.graph import bind, load_model
from autopar.graph.bind import bind_dimensions
from autopar.graph.shapes import resolve_shapes, split_computed


def _model(nodes, inputs, output="y", initializers=()):
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(name, elem, shape) for name, elem, shape in inputs],
        [helper.make_tensor_value_info(output, TensorProto.FLOAT, None)],
        initializer=list(initializers),
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _const(name, values):
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.asarray(values, np.int64)))


def _left_unknown(model, tensor):
    """Whether ONNX's own inference (with data propagation) leaves a size of ``tensor`` unknown."""
    inferred = shape_inference.infer_shapes(model, data_prop=True)
    for vi in list(inferred.graph.value_info) + list(inferred.graph.output):
        if vi.name == tensor:
            dims = vi.type.tensor_type.shape.dim
            return not vi.type.tensor_type.HasField("shape") or any(not d.HasField("dim_value") for d in dims)
    return True


def _expanded_by_where(batch="N"):
    """T5's pattern (legacy export): row ids expanded to a shape written as Where(Equal(shape, -1), 1, shape)."""
    nodes = [
        _const("two", [2]),
        helper.make_node("ConstantOfShape", ["two"], ["ones"], value=numpy_helper.from_array(np.ones(1, np.int64))),
        _const("minus", -1),
        helper.make_node("Mul", ["ones", "minus"], ["minus_ones"]),
        _const("wanted", [2, 8]),
        helper.make_node("Equal", ["wanted", "minus_ones"], ["is_minus"]),
        helper.make_node("Where", ["is_minus", "ones", "wanted"], ["target"]),
        _const("rows", [[0], [1]]),
        helper.make_node("Expand", ["rows", "target"], ["ids"], name="expand"),
        helper.make_node("Cast", ["ids"], ["bias"], to=TensorProto.FLOAT),
        helper.make_node("Add", ["x", "bias"], ["h"]),
        helper.make_node("MatMul", ["h", "w"], ["y"], name="mm"),
    ]
    init = [numpy_helper.from_array(np.ones((8, 4), np.float32), "w")]
    return _model(nodes, [("x", TensorProto.FLOAT, [batch, 2, 8])], initializers=init)


def _padded_to_windows(batch="N"):
    """Swin's pattern (legacy export): pad the height to a multiple of the window, sizes from Shape."""
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        _const("one", [1]),
        helper.make_node("Gather", ["shape", "one"], ["height"], axis=0),
        _const("window", [4]),
        helper.make_node("Mod", ["height", "window"], ["rest"]),
        helper.make_node("Sub", ["window", "rest"], ["short"]),
        helper.make_node("Mod", ["short", "window"], ["pad"]),
        _const("zeros", [0, 0, 0]),
        _const("zero", [0]),
        helper.make_node("Concat", ["zeros", "zero", "pad", "zero"], ["pads"], axis=0),
        helper.make_node("Pad", ["x", "pads"], ["padded"], name="pad", mode="constant"),
        helper.make_node("MatMul", ["padded", "w"], ["y"], name="mm"),
    ]
    init = [numpy_helper.from_array(np.ones((3, 5), np.float32), "w")]
    return _model(nodes, [("x", TensorProto.FLOAT, [batch, 6, 3])], initializers=init)


def test_an_expand_shaped_by_where_plans_without_a_flag():
    assert _left_unknown(_expanded_by_where(batch=2), "bias")  # what ONNX alone leaves, every input bound
    bound = load_model(_expanded_by_where(), batch=2)
    assert bound.tensor("bias").shape == (2, 8)
    assert bound.tensor("y").shape == (2, 2, 4)
    assert [op.op_type for op in bound.ops] == ["Add", "MatMul"]  # the chain is folded away


def test_pad_sizes_computed_from_the_shape_are_folded():
    assert _left_unknown(_padded_to_windows(batch=2), "padded")
    bound = load_model(_padded_to_windows(), batch=2)
    assert bound.tensor("padded").shape == (2, 8, 3)
    assert bound.tensor("y").shape == (2, 8, 5)
    assert [op.op_type for op in bound.ops] == ["Pad", "MatMul"]


def test_a_model_whose_sizes_inference_knows_is_left_as_it_was():
    nodes = [  # a flatten whose target ONNX's data propagation follows
        helper.make_node("Shape", ["x"], ["shape"]),
        _const("first", [0]),
        helper.make_node("Gather", ["shape", "first"], ["batch"], axis=0),
        _const("rest", [-1]),
        helper.make_node("Concat", ["batch", "rest"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["y"]),
    ]
    model = _model(nodes, [("x", TensorProto.FLOAT, [2, 3, 4])])
    resolved = resolve_shapes(onnx.ModelProto.FromString(model.SerializeToString()), {})
    assert [n.SerializeToString() for n in resolved.graph.node] == [n.SerializeToString() for n in model.graph.node]


def _nonzero():
    nodes = [
        helper.make_node("NonZero", ["x"], ["nz"], name="nonzero"),
        helper.make_node("Cast", ["nz"], ["f"], to=TensorProto.FLOAT),
        helper.make_node("Relu", ["f"], ["y"], name="relu"),
    ]
    return _model(nodes, [("x", TensorProto.FLOAT, [4, 8])])


def test_a_size_from_data_is_named_by_a_key_the_user_can_bind():
    with pytest.raises(ComputedDimensionError) as info:
        load_model(_nonzero())
    message = str(info.value)
    assert "dims={'nz:1': value}" in message and "NonZero" in message and "unk__" not in message
    assert message.count(". ") == 0 and message.endswith(".")
    assert load_model(_nonzero(), dims={"nz:1": 5}).tensor("y").shape == (2, 5)


@pytest.mark.parametrize(
    "key, words", [("nz:0", "not computed at run time"), ("nz:7", "has 2 axes"), ("other:1", "no such symbolic")]
)
def test_a_computed_binding_that_names_no_unknown_size_is_refused(key, words):
    with pytest.raises(ModelImportError, match=words):
        load_model(_nonzero(), dims={"nz:1": 5, key: 3})


def test_an_input_symbol_is_never_taken_for_a_computed_size():
    model = _model([helper.make_node("Relu", ["x"], ["y"])], [("x", TensorProto.FLOAT, ["a:1", 4])])
    assert split_computed({"a:1": 2}, model) == ({"a:1": 2}, {})
    assert load_model(model, dims={"a:1": 2}).tensor("y").shape == (2, 4)


def test_an_unbound_input_symbol_is_asked_for_before_any_computed_size():
    model = _expanded_by_where()
    with pytest.raises(ModelImportError, match="'N'"):
        load_model(model)


# --- exports the project did not write (tests/data/make_exports.py) -------------------------------

DATA = Path(__file__).resolve().parent / "data"


@pytest.mark.parametrize("name", ["hf_t5_legacy", "hf_swin_legacy"])
def test_hugging_face_exports_with_computed_shapes_plan_and_verify_with_no_flag(name):
    """T5's Expand shaped by Where, Swin's window pads from Shape -> Mod -> Pad: static once folded."""
    import autopar

    pytest.importorskip("torch")
    graph = load_model(DATA / f"{name}.onnx")
    assert all(isinstance(d, int) for t in graph.tensors.values() for d in t.shape)
    plan = autopar.plan(DATA / f"{name}.onnx", devices=4)
    report = autopar.verify(DATA / f"{name}.onnx", plan, gradients=True)
    assert report.ok, report.problems


@pytest.fixture
def propagating(monkeypatch):
    """Whether each ONNX shape inference call from here on propagates data (a list), and the real inference."""
    asked = []
    infer = shape_inference.infer_shapes

    def recorded(model, *args, **kwargs):
        asked.append(kwargs.get("data_prop", False))
        return infer(model, *args, **kwargs)

    monkeypatch.setattr(shape_inference, "infer_shapes", recorded)
    return asked, infer


@pytest.mark.parametrize("path", sorted(Path("tests/data").glob("*.onnx")), ids=lambda path: path.stem)
def test_inference_skips_data_propagation_only_where_it_would_find_nothing_more(path, propagating):
    """A file inferred with data propagation once is inferred at its next batch without it, where its graph
    (its declared shapes cleared, as `bind_dimensions` leaves it) has no Shape or Size operator and every size
    comes out known: the result is what inference with propagation gives. The files with shape arithmetic
    (legacy Swin, T5 and Llama exports) still get it, and so does every file the first time, but where
    propagation follows nothing (`bind._no_stored_start`, `bind._vector_start`: ALBERT's export and our dynamo
    GPT's)."""
    proto = bind_dimensions(onnx.load(path, load_external_data=False), None, {})
    asked, infer = propagating
    full = infer(proto, strict_mode=True, data_prop=True)
    follows = path.stem not in ("hf_albert_dynamo", "torch_gpt_dynamo")
    assert bind._strict_inference(proto) == full and asked == [follows]
    assert bind._strict_inference(proto, checked=True) == full
    assert asked[-1] == any(node.op_type in ("Shape", "Size") for node in proto.graph.node)


def test_a_file_is_inferred_with_data_propagation_at_its_first_batch_only(propagating, monkeypatch):
    asked, _ = propagating
    path = Path("tests/data/torch_llama_dynamo.onnx")  # declared at a batch of 4
    with opened():  # one plan (`autopar.context`)
        first = load_model(path, batch=4)
        assert asked == [True]
        # the file's own sizes (to rebatch; every one known without propagation), then its strict inference
        second = load_model(path, batch=2)
        assert asked == [True, False, False]
    assert second.tensor("ids").shape == (2, 16) and first.tensor("ids").shape == (4, 16)


def test_a_small_file_imported_at_its_own_batch_spares_its_next_import_the_propagation(propagating):
    """The plan's first import is at the file's own batch: a file small enough to hash (`bind.import_key`)
    notes there that data propagation inferred it, so its import at another batch infers without it."""
    asked, _ = propagating
    path = Path("tests/data/torch_llama_dynamo.onnx")
    with opened():
        load_model(path)
        assert asked == [True]
        load_model(path, batch=2)  # the file's own sizes (to rebatch), then its strict inference, both without it
        assert asked == [True, False, False]
    with opened(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(bind, "KEYED_BYTES", 0)  # too large to hash: the next import propagates again
        load_model(path)
        load_model(path, batch=2)
        assert asked[3:] == [True, False, True]


def test_the_operators_that_propagate_are_the_ones_onnx_gives_a_propagation_function():
    defined = onnx.defs.get_all_schemas_with_history()
    assert {s.name for s in defined if s.domain == "" and s.has_data_propagation_function} == bind.PROPAGATING


def _x_and(nodes, initializers=(), functions=(), opset=17, output="y"):
    """A model of ``nodes`` reading a float input x[2, 4], declared as `bind_dimensions` leaves it."""
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info(output, TensorProto.FLOAT, None)],
        initializer=list(initializers),
    )
    imports = [helper.make_opsetid("", opset), *(helper.make_opsetid(f.domain, 1) for f in functions)]
    return helper.make_model(graph, opset_imports=imports, functions=list(functions))


_TARGET = numpy_helper.from_array(np.asarray([4, 2], np.int64), "target")
_HALF = numpy_helper.from_array(np.asarray([4], np.int64), "half")
_BODY = helper.make_graph(
    [helper.make_node("Relu", ["x"], ["z"])], "body", [], [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)]
)
_DOUBLED = helper.make_function(
    "local", "Doubled", ["a"], ["b"], [helper.make_node("Add", ["a", "a"], ["b"])], [helper.make_opsetid("", 17)]
)


_NONE, _STORED, _VECTOR = [False], [True], [False, True]  # the inferences run: without propagation, with it


@pytest.mark.parametrize(
    ("model", "asked"),
    [
        # float values only, a float vector stored, an index table of two axes: nothing to follow
        (_x_and([helper.make_node("Add", ["x", "x"], ["y"])]), _NONE),
        (
            _x_and(
                [helper.make_node("Add", ["x", "b"], ["y"])], [numpy_helper.from_array(np.ones(4, np.float32), "b")]
            ),
            _NONE,
        ),
        (_x_and([helper.make_node("Reshape", ["x", "target"], ["y"])], [_TARGET]), _NONE),
        (
            _x_and(
                [helper.make_node("Gather", ["x", "rows"], ["y"])],
                [numpy_helper.from_array(np.zeros((2, 2), np.int64), "rows")],
            ),
            _NONE,
        ),
        # an index vector or a Constant read by an operator that propagates, a size read, a subgraph, a function
        (
            _x_and(
                [
                    helper.make_node("Concat", ["half", "half"], ["t"], axis=0),
                    helper.make_node("Reshape", ["x", "t"], ["y"]),
                ],
                [_HALF],
            ),
            _STORED,
        ),
        (
            _x_and(
                [
                    _const("t", [4, 2]),
                    helper.make_node("Cast", ["t"], ["u"], to=TensorProto.INT64),
                    helper.make_node("Reshape", ["x", "u"], ["y"]),
                ]
            ),
            _STORED,
        ),
        (_x_and([helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Reshape", ["x", "s"], ["y"])]), _STORED),
        (
            _x_and(
                [
                    helper.make_node("Less", ["x", "x"], ["c"]),
                    helper.make_node("If", ["c"], ["y"], then_branch=_BODY, else_branch=_BODY),
                ]
            ),
            _STORED,
        ),
        (_x_and([helper.make_node("Doubled", ["x"], ["y"], domain="local")], functions=[_DOUBLED]), _STORED),
        # ONNX infers GroupNormalization by its function body, node by node
        (
            _x_and(
                [helper.make_node("GroupNormalization", ["x", "s", "b"], ["y"], num_groups=2)],
                [numpy_helper.from_array(np.ones(2, np.float32), n) for n in "sb"],
                opset=18,
            ),
            _STORED,
        ),
        # a vector of known length read by an operator that propagates: as many unknown entries, which a Reshape
        # takes for its output's rank (and a rank past 1,024, which the inference without them refuses to write)
        (
            _model(
                [helper.make_node("Squeeze", ["v", "axes"], ["s"]), helper.make_node("Reshape", ["d", "s"], ["y"])],
                [("v", TensorProto.INT64, [3]), ("axes", TensorProto.INT64, [0]), ("d", TensorProto.FLOAT, [3])],
            ),
            _VECTOR,
        ),
        (
            _model(
                [
                    helper.make_node("Cast", ["v"], ["s"], to=TensorProto.INT64),
                    helper.make_node("Reshape", ["d", "s"], ["y"]),
                ],
                [("v", TensorProto.INT64, [1025]), ("d", TensorProto.FLOAT, [1])],
            ),
            _VECTOR,
        ),
        # a vector an operator that propagates reads past its first input: none acts, unless another reads it too
        (
            _model(
                [helper.make_node("Gather", ["table", "v"], ["y"])],
                [("v", TensorProto.INT64, [3])],
                initializers=[numpy_helper.from_array(np.ones((4, 2), np.float32), "table")],
            ),
            _NONE,
        ),
        (
            _model(
                [helper.make_node("Gather", ["table", "v"], ["g"]), helper.make_node("Reshape", ["d", "v"], ["y"])],
                [("v", TensorProto.INT64, [2]), ("d", TensorProto.FLOAT, [6])],
                initializers=[numpy_helper.from_array(np.ones((4, 2), np.float32), "table")],
            ),
            _VECTOR,
        ),
    ],
    ids=[
        "floats",
        "float-vector",
        "reshape-by-initializer",
        "index-table",
        "concat-of-initializers",
        "cast-of-constant",
        "shape",
        "subgraph",
        "function",
        "function-body",
        "squeezed-vector",
        "long-vector",
        "vector-past-the-first-input",
        "vector-read-elsewhere",
    ],
)
def test_data_propagation_is_left_out_only_where_it_follows_nothing(model, asked, propagating):
    """Where propagation follows nothing, inference without it is inference with it; elsewhere it runs: at once
    where it starts from something stored, after the inference without it where from a vector that one types."""
    said, infer = propagating
    assert bind._strict_inference(model) == infer(model, strict_mode=True, data_prop=True)
    assert said == asked


def test_data_written_twice_counts_as_a_start():
    """ONNX's propagation refuses data written twice to one name, which the inference without it lets pass."""
    nodes = [helper.make_node("Relu", ["x"], ["y"]), helper.make_node("Relu", ["x"], ["y"])]
    assert not bind._no_stored_start(_x_and(nodes))
    assert bind._no_stored_start(_x_and(nodes[:1]))


def test_a_first_import_where_propagation_follows_nothing_is_the_import_with_it(monkeypatch):
    """Our dynamo GPT's first import infers without data propagation, and comes out as it did with it."""
    path = Path("tests/data/torch_gpt_dynamo.onnx")
    quick = load_model(path)
    monkeypatch.setattr(bind, "_no_stored_start", lambda proto: False)
    full = load_model(path)
    assert quick.model.SerializeToString(deterministic=True) == full.model.SerializeToString(deterministic=True)
    assert [(t.name, t.shape, t.dtype, t.kind) for t in quick.tensors.values()] == [
        (t.name, t.shape, t.dtype, t.kind) for t in full.tensors.values()
    ]
    assert quick.ops == full.ops
