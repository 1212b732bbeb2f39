"""A weight the exporter stored twice, once transposed (`autopar.graph.tied`): planned, stored and trained once."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import autopar
from autopar.graph import load_model
from tests.conftest import make_model, profile, weight

VOCAB, HIDDEN, BATCH, SEQ = 32, 16, 8, 4


def _language_model(tied: bool, table: np.ndarray | None = None) -> onnx.ModelProto:
    """Tokens looked up in an embedding, one hidden layer, logits by the output matrix: the output matrix the
    embedding's transpose, stored apart as PyTorch's exporter stores a tied one (``tied``), or a weight of its own."""
    rng = np.random.default_rng(0)
    embedding = rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32) if table is None else table
    output = embedding.T.copy() if tied else rng.standard_normal((HIDDEN, VOCAB)).astype(np.float32)
    nodes = [
        helper.make_node("Gather", ["embedding", "ids"], ["h"], name="lookup"),
        helper.make_node("MatMul", ["h", "hidden"], ["g"], name="layer"),
        helper.make_node("MatMul", ["g", "output"], ["logits"], name="head"),
    ]
    stored = [
        numpy_helper.from_array(embedding, "embedding"),
        weight("hidden", (HIDDEN, HIDDEN), seed=1),
        numpy_helper.from_array(output, "output"),
    ]
    return make_model(nodes, [("ids", TensorProto.INT64, [BATCH, SEQ])], ["logits"], stored)


def test_the_transposed_copy_is_read_as_a_transpose_of_the_one_weight():
    graph = load_model(_language_model(tied=True))
    assert [p.name for p in graph.parameters] == ["embedding", "hidden"]
    transpose = graph.op("output")
    assert (transpose.op_type, transpose.inputs, transpose.outputs) == ("Transpose", ("embedding",), ("output",))
    assert graph.tensor("output").kind == "activation" and graph.tensor("output").shape == (HIDDEN, VOCAB)
    assert sorted(graph.consumers["embedding"]) == ["lookup", "output"]


def test_a_copy_stored_in_the_typed_fields_is_tied_too():
    """Values in ``float_data`` rather than raw bytes (a smaller exporter's way)."""
    model = _language_model(tied=True)
    for index, tensor in enumerate(model.graph.initializer):
        value = numpy_helper.to_array(tensor)
        typed = helper.make_tensor(tensor.name, TensorProto.FLOAT, value.shape, value.flatten().tolist())
        model.graph.initializer[index].CopyFrom(typed)
    assert [p.name for p in load_model(model).parameters] == ["embedding", "hidden"]


def test_two_matrices_only_products_read_stay_apart_though_one_is_the_others_transpose():
    """Two layers' weights may hold equal values when fresh (an identity-like start): only a lookup's table is
    tied to a product's matrix."""
    first, second = np.eye(4, 6, dtype=np.float32) * 2.0, np.eye(6, 4, dtype=np.float32) * 2.0
    first[0, 1] = second[1, 0] = 0.5  # (not its own transpose, nor of one value)
    nodes = [
        helper.make_node("MatMul", ["x", "first"], ["h"], name="up"),
        helper.make_node("MatMul", ["h", "second"], ["y"], name="down"),
    ]
    stored = [numpy_helper.from_array(first, "first"), numpy_helper.from_array(second, "second")]
    model = make_model(nodes, [("x", TensorProto.FLOAT, [BATCH, 4])], ["y"], stored)
    assert [p.name for p in load_model(model).parameters] == ["first", "second"]


def test_untied_and_fresh_zero_matrices_stay_weights_of_their_own():
    untied = load_model(_language_model(tied=False))
    assert [p.name for p in untied.parameters] == ["embedding", "hidden", "output"]
    zeros = load_model(_language_model(tied=True, table=np.zeros((VOCAB, HIDDEN), np.float32)))
    assert "output" in {p.name for p in zeros.parameters}  # equal for being fresh, not tied


def test_the_plan_holds_and_synchronises_the_tied_weight_once():
    tied = autopar.plan(_language_model(tied=True), devices=8, cost_model=profile(peak=1e9), optimizer="adam")
    assert sorted(entry.parameter for entry in tied.file.gradient_sync) == ["embedding", "hidden"]
    assert {op.name: op.op_type for op in tied.file.ops}["output"] == "Transpose"
    untied = autopar.plan(_language_model(tied=False), devices=8, cost_model=profile(peak=1e9), optimizer="adam")
    assert sorted(entry.parameter for entry in untied.file.gradient_sync) == ["embedding", "hidden", "output"]


def test_the_two_reads_in_two_layouts_verify_forward_backward_and_gradients():
    """The lookup stores the embedding split by its features, the output product reads it split by the
    vocabulary: the plan moves it between the two, and its gradient back, summed with the lookup's."""
    fixed = {"lookup": ((1, 8), (1, 1)), "output": ((8, 1),)}
    model = _language_model(tied=True)
    plan = autopar.plan(model, devices=8, fixed=fixed, optimizer="adam")
    moved = [entry for entry in plan.file.redistributions if entry.tensor == "embedding"]
    assert moved and moved[0].steps, "the plan moves the embedding to the output product's layout"
    report = autopar.verify(model, plan, gradients=True)
    assert report.ok, report.problems
    assert report.gradients is not None and report.gradients.ok and report.gradients.checked == 2


def test_the_annotated_export_of_a_tied_plan_verifies(tmp_path):
    """The plan names the copy's Transpose: the ONNX export annotates the model as imported, not as stored, and the
    annotated file verifies as the plan it carries."""
    stored = tmp_path / "tied.onnx"
    onnx.save(_language_model(tied=True), stored)
    plan = autopar.plan(stored, devices=8, fixed={"lookup": ((1, 8), (1, 1)), "output": ((8, 1),)})
    [written] = autopar.export_plan(plan.file, "onnx", tmp_path / "annotated.onnx", model=onnx.load(stored))
    report = autopar.verify(written, devices=8)
    assert report.ok, report.problems
    assert report.planned == autopar.verify(stored, plan).planned
