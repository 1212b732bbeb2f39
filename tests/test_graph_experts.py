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
