"""Gathered experts written as GShard's dispatch (`autopar.graph.experts`), on Hugging Face exports.

The exports are transformers' own ``batched_mm`` experts: OLMoE and DeepSeek-V3 as the dynamo exporter
optimises them, Mixtral unoptimised (identity Transposes, indices built by Concat, ``torch.split``), as
``bench/large_exports.py`` writes the full-size models.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import autopar
from autopar.cli import main
from autopar.errors import InfeasibleError, ModelImportError
from autopar.graph import load_model
from autopar.graph.experts import route_experts
from tests.conftest import profile
from tests.test_families import DATA, SPLITTING_PAYS, _trains_on_8_processes

ROUTED = ["hf_olmoe_dynamo", "hf_deepseek_v3_dynamo", "hf_mixtral_dynamo"]
EXPERTS_OVER_TOP_K = 4.0  # 8 experts, top 2: an expert's slots hold every row a group could send it


def _with_weights(path) -> onnx.ModelProto:
    """The export with random weights in place of the file it points its parameters at."""
    model = onnx.load(str(path), load_external_data=False)
    rng = np.random.default_rng(0)
    for position, tensor in enumerate(model.graph.initializer):
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            values = (rng.standard_normal(tuple(tensor.dims)) * 0.2).astype(np.float32)
            model.graph.initializer[position].CopyFrom(numpy_helper.from_array(values, tensor.name))
    return model


def _loss(model: onnx.ModelProto) -> float:
    onnxruntime = pytest.importorskip("onnxruntime")
    ids = np.random.default_rng(1).integers(0, 100, size=(4, 16)).astype(np.int64)
    session = onnxruntime.InferenceSession(model.SerializeToString())
    return float(session.run(None, {"ids": ids, "labels": ids})[0])


@pytest.mark.parametrize("name", ROUTED)
def test_routing_that_drops_no_row_computes_what_the_export_computes(name):
    model = _with_weights(DATA / f"{name}.onnx")
    kept = route_experts(model, EXPERTS_OVER_TOP_K)
    dropping = route_experts(model, 1.0)
    # a token sends an expert at most one of its two rows: the slots hold every token of the group
    assert kept.blocks and all(block.capacity == block.group_rows // 2 for block in kept.blocks)
    assert _loss(kept.model) == pytest.approx(_loss(model), rel=1e-5)
    assert _loss(dropping.model) != pytest.approx(_loss(model), rel=1e-5)  # rows past capacity are lost


@pytest.mark.parametrize("name", ROUTED)
def test_each_layer_dispatches_its_rows_once_for_both_products(name):
    routed = route_experts(DATA / f"{name}.onnx", 1.25)
    layers = 2 if name == "hf_mixtral_dynamo" else 1
    assert len(routed.blocks) == layers
    for block in routed.blocks:
        assert len(block.products) == 2  # gate-and-up, then down, the SwiGLU between on the experts' rows
        assert (block.experts, block.rows, block.group_rows) == (8, 128, 32)
        assert block.capacity == 5  # ceil(1.25 * 32 / 8)
    ops = [node.op_type for node in routed.model.graph.node]
    exported = [node.op_type for node in onnx.load(str(DATA / f"{name}.onnx"), load_external_data=False).graph.node]
    assert ops.count("Einsum") == 2 * layers  # one dispatch and one combine a layer
    assert exported.count("GatherND") - ops.count("GatherND") == 2 * layers  # the weights gathered per row
    assert "SplitToSequence" not in ops  # read back as Slices, which run on the experts' rows


def test_routing_is_the_same_bytes_every_time():
    first = route_experts(DATA / "hf_mixtral_dynamo.onnx", 1.25).model.SerializeToString()
    assert route_experts(DATA / "hf_mixtral_dynamo.onnx", 1.25).model.SerializeToString() == first


def test_a_model_without_gathered_experts_routes_nothing():
    assert route_experts(DATA / "hf_qwen3_dynamo.onnx", 1.25).blocks == ()


@pytest.mark.parametrize("factor", [0.0, -1.0, float("nan"), float("inf")])
def test_a_capacity_factor_that_is_not_a_positive_number_is_one_sentence(factor):
    with pytest.raises(ModelImportError, match="positive number"):
        route_experts(DATA / "hf_olmoe_dynamo.onnx", factor)


def test_the_routed_experts_split_by_expert_and_train_on_8_processes():
    pytest.importorskip("torch")
    routed = route_experts(DATA / "hf_mixtral_dynamo.onnx", 1.25).model
    plan = autopar.plan(routed, devices=8, cost_model=SPLITTING_PAYS)
    assert plan.degrees.expert == 8  # one expert a device, the tokens moved to them and back
    _trains_on_8_processes(routed, plan, sum(p.trainable for p in load_model(routed).parameters))


def test_the_route_command_writes_the_routed_model_and_says_what(tmp_path, capsys):
    out = tmp_path / "mixtral_routed.onnx"
    assert main(["route", str(DATA / "hf_mixtral_dynamo.onnx"), "-o", str(out), "--capacity-factor", "2"]) == 0
    said = capsys.readouterr().err
    assert "2 expert layers dispatched" in said and "8 slots an expert" in said
    assert onnx.load(str(out), load_external_data=False).SerializeToString() == (
        route_experts(DATA / "hf_mixtral_dynamo.onnx", 2.0).model.SerializeToString()
    )


def test_the_route_command_refuses_what_it_cannot_route(tmp_path, capsys):
    assert main(["route", str(DATA / "hf_qwen3_dynamo.onnx"), "-o", str(tmp_path / "q.onnx")]) == 1
    assert "no gathered experts" in capsys.readouterr().err and not (tmp_path / "q.onnx").exists()
    with pytest.raises(SystemExit) as flag:
        main(["route", str(DATA / "hf_olmoe_dynamo.onnx"), "--capacity-factor", "none"])
    assert flag.value.code == 2 and "positive number" in capsys.readouterr().err
    model = DATA / "hf_olmoe_dynamo.onnx"
    assert main(["route", str(model), "-o", str(model)]) == 2
    assert "the model itself" in capsys.readouterr().err


def test_a_model_whose_gathered_experts_do_not_fit_is_pointed_at_route():
    with pytest.raises(InfeasibleError, match="autopar route MODEL"):
        autopar.plan(DATA / "hf_mixtral_dynamo.onnx", devices=8, cost_model=profile(capacity=2e5))


def _tiny_experts(batch: int | str) -> onnx.ModelProto:
    """Two rows a sample routed to 4 experts of [3, 5] weights, the batch ``batch`` (a symbol: dynamic)."""
    from onnx import TensorProto, helper

    stack = numpy_helper.from_array(np.random.default_rng(2).standard_normal((4, 3, 5)).astype(np.float32), "stack")
    targets = [numpy_helper.from_array(np.array(t, np.int64), n) for n, t in (("pairs", [-1, 1]), ("cols", [-1, 5, 1]))]
    nodes = [
        helper.make_node("Reshape", ["route", "pairs"], ["index"]),
        helper.make_node("GatherND", ["stack", "index"], ["gathered"]),
        helper.make_node("Reshape", ["tokens", "cols"], ["column"]),
        helper.make_node("MatMul", ["gathered", "column"], ["y"]),
    ]
    inputs = [
        helper.make_tensor_value_info("route", TensorProto.INT64, [batch, 2]),
        helper.make_tensor_value_info("tokens", TensorProto.FLOAT, [batch, 2, 5]),
    ]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    return helper.make_model(helper.make_graph(nodes, "experts", inputs, outputs, [stack, *targets]))


def test_an_export_with_a_dynamic_batch_routes_for_every_batch():
    onnxruntime = pytest.importorskip("onnxruntime")
    exported = _tiny_experts("N")
    routed = route_experts(exported, capacity_factor=2.0)  # 2 rows a sample, 4 experts: a slot each holds all
    assert [(b.rows, b.group_rows, b.capacity) for b in routed.blocks] == [(2, 2, 1)]
    rng = np.random.default_rng(3)
    for batch in (1, 3, 8):
        feeds = {
            "route": rng.integers(0, 4, (batch, 2)),
            "tokens": rng.standard_normal((batch, 2, 5)).astype(np.float32),
        }
        feeds["route"][:, 1] = (feeds["route"][:, 0] + 1) % 4  # top 2: a sample's rows go to two experts
        run = [
            onnxruntime.InferenceSession(m.SerializeToString()).run(None, feeds)[0] for m in (exported, routed.model)
        ]
        np.testing.assert_allclose(run[1], run[0], rtol=1e-6)
        assert load_model(routed.model, batch=batch).tensor("y").shape == (2 * batch, 3, 1)


def _routed_by_top_k(tokens: int, top_k: int, experts: int, join: str = "", opset: int = 18) -> onnx.ModelProto:
    """Scores -> TopK -> each token's rows through [experts, 3, 5] weights, gate-and-up style when ``join``
    names a row-wise operator between two products (``cast``: to float16 and back), the result returned."""
    from onnx import TensorProto, helper

    rng = np.random.default_rng(4)
    arrays = {
        "stack": rng.standard_normal((experts, 3, 5)),
        "down": rng.standard_normal((experts, 5, 3)),
        "k": np.array([top_k]),
        "pairs": np.array([-1, 1]),
        "rows": np.array([1, top_k, 1]),
        "cols": np.array([-1, 5, 1]),
        "back": np.array([-1, 3, 1]),
        "middle": np.array([1]),
    }
    stored = [
        numpy_helper.from_array(a.astype(np.float32 if a.dtype.kind == "f" else np.int64), n) for n, a in arrays.items()
    ]
    nodes = [
        helper.make_node("TopK", ["scores", "k"], ["weights", "chosen"], name="route"),
        helper.make_node("Reshape", ["chosen", "pairs"], ["index"], name="index"),
        helper.make_node("Unsqueeze", ["tokens", "middle"], ["tokens_3d"], name="unsqueeze_tokens")
        if opset >= 13
        else helper.make_node("Unsqueeze", ["tokens"], ["tokens_3d"], name="unsqueeze_tokens", axes=[1]),
        helper.make_node("Expand", ["tokens_3d", "rows"], ["repeated"], name="repeat"),
        helper.make_node("Reshape", ["repeated", "cols"], ["column"], name="column"),
        helper.make_node("GatherND", ["stack", "index"], ["gathered"], name="gather"),
        helper.make_node("MatMul", ["gathered", "column"], ["y"], name="product"),
    ]
    out = "y"
    if join:
        nodes += [helper.make_node("Sigmoid", ["y"], ["act"], name="act")]
        act = "act"
        if join == "cast":
            nodes += [
                helper.make_node("Cast", ["act"], ["half"], name="half", to=TensorProto.FLOAT16),
                helper.make_node("Cast", ["half"], ["act_back"], name="full", to=TensorProto.FLOAT),
            ]
            act = "act_back"
        nodes += [
            helper.make_node("GatherND", ["down", "index"], ["gathered_down"], name="gather_down"),
            helper.make_node("MatMul", ["gathered_down", act], ["z"], name="product_down"),
        ]
        out = "z"
    inputs = [
        helper.make_tensor_value_info("scores", TensorProto.FLOAT, [tokens, experts]),
        helper.make_tensor_value_info("tokens", TensorProto.FLOAT, [tokens, 5]),
    ]
    width = 5 if join else 3
    outputs = [helper.make_tensor_value_info(out, TensorProto.FLOAT, [tokens * top_k, width, 1])]
    graph = helper.make_graph(nodes, "experts", inputs, outputs, stored)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _run(model: onnx.ModelProto, tokens: int, experts: int) -> np.ndarray:
    onnxruntime = pytest.importorskip("onnxruntime")
    rng = np.random.default_rng(5)
    feeds = {
        "scores": rng.standard_normal((tokens, experts)).astype(np.float32),
        "tokens": rng.standard_normal((tokens, 5)).astype(np.float32),
    }
    return onnxruntime.InferenceSession(model.SerializeToString()).run(None, feeds)[0]


@pytest.mark.parametrize(("tokens", "top_k", "experts", "group_rows"), [(6, 3, 4, 7), (10, 3, 8, 8), (12, 6, 8, 20)])
def test_groups_hold_whole_tokens_so_experts_over_top_k_drops_nothing(tokens, top_k, experts, group_rows):
    exported = _routed_by_top_k(tokens, top_k, experts)
    routed = route_experts(exported, experts / top_k, group_rows)
    (block,) = routed.blocks
    assert block.group_rows % top_k == 0 and block.group_rows <= max(group_rows, top_k)
    np.testing.assert_allclose(_run(routed.model, tokens, experts), _run(exported, tokens, experts), atol=1e-6)


def test_an_experts_slots_are_at_most_its_groups_tokens():
    (block,) = route_experts(_routed_by_top_k(8, 2, 4), 1e30).blocks
    assert block.capacity == block.group_rows // 2


@pytest.mark.parametrize("join", ["sigmoid", "cast"])
def test_the_rows_between_two_products_run_on_the_experts_rows(join):
    exported = _routed_by_top_k(8, 2, 4, join=join)
    routed = route_experts(exported, 2.0)
    assert [block.products for block in routed.blocks] == [("product", "product_down")]
    onnx.checker.check_model(routed.model)
    np.testing.assert_allclose(_run(routed.model, 8, 4), _run(exported, 8, 4), rtol=1e-3)


def test_rows_the_graph_returns_stay_where_they_are():
    exported = _routed_by_top_k(8, 2, 4, join="sigmoid")
    exported.graph.output.append(onnx.helper.make_tensor_value_info("act", onnx.TensorProto.FLOAT, [16, 3, 1]))
    routed = route_experts(exported, 2.0)
    assert [block.products for block in routed.blocks] == [("product",), ("product_down",)]  # dispatched twice
    onnx.checker.check_model(routed.model)
    np.testing.assert_allclose(_run(routed.model, 8, 4), _run(exported, 8, 4), rtol=1e-5)


def test_unnamed_operators_route_in_every_layer_under_names_of_their_own():
    first, second = _routed_by_top_k(8, 2, 4, join="sigmoid"), _routed_by_top_k(8, 2, 4, join="sigmoid")
    for node in second.graph.node:
        node.input[:] = [f"L2.{name}" if name not in ("scores", "tokens") else name for name in node.input]
        node.output[:] = [f"L2.{name}" for name in node.output]
    for tensor in second.graph.initializer:
        tensor.name = f"L2.{tensor.name}"
    first.graph.node.extend(second.graph.node)
    first.graph.initializer.extend(second.graph.initializer)
    first.graph.output.append(onnx.helper.make_tensor_value_info("L2.z", onnx.TensorProto.FLOAT, [16, 5, 1]))
    for node in first.graph.node:
        node.name = ""
    routed = route_experts(first, 2.0)
    assert len(routed.blocks) == 2 and all(len(block.products) == 2 for block in routed.blocks)
    names = [node.name for node in routed.model.graph.node if node.name]
    assert len(names) == len(set(names))
    onnx.checker.check_model(routed.model)


def test_a_model_below_opset_13_is_refused_in_one_sentence():
    with pytest.raises(ModelImportError, match="opset 13 or later; the model's is 12"):
        route_experts(_routed_by_top_k(8, 2, 4, opset=12), 2.0)


def test_the_route_command_never_writes_over_the_weights(tmp_path):
    model = _routed_by_top_k(8, 2, 4)
    onnx.save(model, str(tmp_path / "m.onnx"), save_as_external_data=True, location="m.weights", size_threshold=0)
    code = main(["route", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "m.weights")])
    assert code == 2 and (tmp_path / "m.weights").stat().st_size > 0
