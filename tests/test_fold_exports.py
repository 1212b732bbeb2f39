"""Repeated blocks in graphs this project did not build: torch's exports of a Llama-style module and a
second hand builder, with tensors every layer reads from outside its block.

Folded == unfolded == ILP on each; the blocks are found from structure alone (scrambled names give the
same runs); buffers (rotary tables, masks) are constants, not trained weights.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest

import autopar
from autopar.cost import CostModel
from autopar.graph import load_model
from autopar.search import repeats
from autopar.search.costing import build_problem
from autopar.search.driver import SearchOptions, run_search
from tests.conftest import profile
from tests.plain_gpt import build_plain_gpt
from tests.torch_llama import CONFIG, DATA

pytest.importorskip("highspy")

LLAMA_EXPORTS = ("torch_llama_dynamo", "torch_llama_legacy", "torch_llama_interleaved_dynamo")


def _objectives(graph, devices: int, ilp: bool = True) -> tuple[float, ...]:
    """The folded DP's plan, the unfolded DP's (twin branches untied) and the ILP's, each scored by the
    unfolded problem."""
    cost = CostModel(profile())
    folded, unfolded = build_problem(graph, cost, devices), build_problem(graph, cost, devices, fold=False, twins=False)
    assert folded.folds, "nothing folded"
    found = [unfolded.objective(run_search(folded).choice), unfolded.objective(run_search(unfolded).choice)]
    if ilp:
        found.append(unfolded.objective(run_search(unfolded, SearchOptions(algorithm="ilp")).choice))
    return tuple(found)


@pytest.mark.parametrize("name", LLAMA_EXPORTS)
def test_torch_exports_fold_every_layer(name):
    """The first layer folds too, though it reads the embedding where the others read a residual sum."""
    plan = autopar.plan(DATA / f"{name}.onnx", devices=8)
    blocks = plan.to_dict()["search"]["repeated_blocks"]
    assert [(b["copies"]) for b in blocks] == [CONFIG["layers"]]


@pytest.mark.parametrize("name", LLAMA_EXPORTS)
def test_torch_exports_buffers_are_constants_and_parameters_match_torch(name):
    graph = load_model(DATA / f"{name}.onnx")
    hidden, ffn, vocab, layers = CONFIG["hidden"], CONFIG["ffn"], CONFIG["vocab"], CONFIG["layers"]
    kv = hidden * CONFIG["kv_heads"] // CONFIG["heads"]
    per_layer = 2 * hidden + 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * ffn
    expected = 2 * vocab * hidden + layers * per_layer + hidden
    assert sum(p.numel for p in graph.parameters if p.trainable) == expected
    assert all(p.shape[-1] != hidden // CONFIG["heads"] for p in graph.parameters), "a rotary table is trained"


@pytest.mark.parametrize("name", ["torch_llama_dynamo", "torch_llama_legacy"])
def test_torch_exports_folded_equals_unfolded_and_ilp(name):
    folded, unfolded, ilp = _objectives(load_model(DATA / f"{name}.onnx"), devices=4)
    assert folded == pytest.approx(unfolded, rel=1e-12)
    assert unfolded == pytest.approx(ilp, rel=1e-9)


def test_torch_export_folds_the_same_with_scrambled_names():
    model = onnx.load(str(DATA / "torch_llama_dynamo.onnx"), load_external_data=False)
    plain = autopar.plan(model, devices=8).to_dict()["search"]["repeated_blocks"]
    order = np.random.default_rng(0).permutation(len(model.graph.node))
    for node, index in zip(model.graph.node, order):
        node.name = f"op{index}"
    scrambled = autopar.plan(model, devices=8).to_dict()["search"]["repeated_blocks"]
    assert [(b["operators"], b["copies"]) for b in scrambled] == [(b["operators"], b["copies"]) for b in plain]


@pytest.fixture
def fold_short_runs(monkeypatch):
    monkeypatch.setattr(repeats, "MIN_FOLDED_COPIES", 2)


@pytest.mark.usefixtures("fold_short_runs")
@pytest.mark.parametrize("devices", [4, 8])
def test_a_weight_every_layer_shares_folds_exactly(devices):
    """Every copy reads one projection weight owned before the run, and a tied embedding is read at both ends."""
    model = build_plain_gpt(layers=4, hidden=64, heads=4, seq=16, vocab=128, batch=8, tied=True, shared_weight=True)
    graph = load_model(model)
    problem = build_problem(graph, CostModel(profile()), devices)
    (repeat, _), *_ = problem.folds
    assert repeat.shared, "the shared weight's owner is not read as a shared operator"
    folded, unfolded, ilp = _objectives(graph, devices)
    assert folded == pytest.approx(unfolded, rel=1e-12)
    assert unfolded == pytest.approx(ilp, rel=1e-9)


def test_the_second_builders_mask_initializer_is_a_constant():
    graph = load_model(build_plain_gpt(layers=6, hidden=64, heads=4, seq=16, vocab=128, batch=8))
    assert graph.tensor("causal_mask").kind == "constant"
    plan = autopar.plan(graph, devices=8)
    assert [b["copies"] for b in plan.to_dict()["search"]["repeated_blocks"]] == [6]


def test_a_torch_export_plan_verifies():
    path = DATA / "torch_llama_dynamo.onnx"
    plan = autopar.plan(path, devices=8)
    report = autopar.verify(path, plan)
    assert report.ok, report.problems


def _skip_chain(blocks: int):
    """y_k = Relu(MatMul(y_{k-1}, W_k) + y_{k-2}): every block also reads the block before the previous one."""
    from onnx import TensorProto, helper

    from tests.conftest import make_model, weight

    nodes, inits, before, x = [], [], "X", "X"
    for k in range(blocks):
        nodes += [
            helper.make_node("MatMul", [x, f"W{k}"], [f"m{k}"], name=f"mm{k}"),
            helper.make_node("Add", [f"m{k}", before], [f"a{k}"], name=f"add{k}"),
            helper.make_node("Relu", [f"a{k}"], [f"y{k}"], name=f"relu{k}"),
        ]
        inits.append(weight(f"W{k}", [16, 16], k))
        before, x = x, f"y{k}"
    nodes.append(helper.make_node("ReduceSum", [x], ["loss"], name="loss", keepdims=0))
    return make_model(nodes, [("X", TensorProto.FLOAT, [8, 16])], ["loss"], inits)


def test_a_plan_says_why_identical_blocks_were_not_folded():
    search = autopar.plan(_skip_chain(8), devices=4).to_dict()["search"]
    assert search["repeated_blocks"] == []
    (run,) = search["unfolded_runs"]
    assert run["operators"] == 3 and run["copies"] >= 4
    assert "outside" in run["reason"] and "'" in run["reason"], run["reason"]


def test_a_plan_says_when_too_few_blocks_repeat_to_fold():
    from models.transformer import build_transformer

    search = autopar.plan(build_transformer(layers=4, hidden=64, heads=4, seq=16, vocab=128), devices=8)
    (run,) = search.to_dict()["search"]["unfolded_runs"]
    assert run["reason"] == "fewer than 4 copies line up with a clean boundary"
    assert (
        "unfolded_runs"
        not in autopar.plan(build_transformer(layers=6, hidden=64, heads=4, seq=16, vocab=128), devices=8).to_dict()[
            "search"
        ]
    )


HF_EXPORTS = ("hf_qwen3_dynamo", "hf_bloom_dynamo", "hf_gpt_neox_dynamo")
# torch's own count for each module: sum(p.numel() for p in model.parameters()) and how many tensors
TORCH_PARAMETERS = {
    "hf_qwen3_dynamo": (254336, 25),
    "hf_bloom_dynamo": (165760, 29),
    "hf_gpt_neox_dynamo": (231168, 28),
}


@pytest.mark.parametrize("name", HF_EXPORTS)
def test_hugging_face_exports_plan_at_64_devices_with_their_tables_constant(name):
    """Modules this project did not write (transformers' Qwen3 with rotary and GQA, BLOOM with ALiBi,
    GPT-NeoX with partial rotary and attention beside the MLP), exported by dynamo from random
    configurations (bench/hf_exports.py). The exporter merged Qwen3's and BLOOM's fresh norms'
    identical scales and biases; the import gives each layer its own again."""
    graph = load_model(DATA / f"{name}.onnx")
    trained = [p for p in graph.parameters if p.trainable]
    assert (sum(p.numel for p in trained), len(trained)) == TORCH_PARAMETERS[name]
    # a transformer's trained weights are matrices and vectors; rotary tables ([1, 1, seq, head]) and
    # ALiBi biases ([batch x heads, 1, seq]) are the higher-rank initializers
    tables = [p.name for p in graph.parameters if len(p.shape) > 2 and p.trainable]
    assert tables == [], f"position tables taken for trained weights: {tables}"
    assert {len(p.shape) for p in graph.parameters} == {1, 2}
    plan = autopar.plan(graph, devices=64)
    assert not plan.fallback_ops


@pytest.mark.parametrize("name", HF_EXPORTS)
def test_hugging_face_export_plans_verify_with_gradients(name):
    path = DATA / f"{name}.onnx"
    report = autopar.verify(path, autopar.plan(path, devices=8), gradients=True)
    assert report.ok, report.problems
    assert report.gradients is not None and report.gradients.checked > 0


def _weight_transposes(graph):
    return [op for op in graph.ops if op.op_type == "Transpose" and graph.tensor(op.inputs[0]).kind == "parameter"]


@pytest.mark.usefixtures("fold_short_runs")
@pytest.mark.parametrize("stored", [True, False])
@pytest.mark.parametrize("devices", [4, 8])
def test_layers_sharing_transposed_weights_fold_exactly(devices, stored):
    """ALBERT: six weights every layer shares, each transposed once before the layers, stored or elided."""
    model = build_plain_gpt(layers=4, hidden=64, heads=4, seq=16, vocab=128, batch=8, shared_layers=True, stored=stored)
    graph = load_model(model)
    transposes = _weight_transposes(graph)
    assert len(transposes) == 6, "a shared weight's Transpose was folded into a new weight"
    problem = build_problem(graph, CostModel(profile()), devices)
    (repeat, _), *_ = problem.folds
    index = {op.name: op.index for op in graph.ops}
    assert {index[op.name] for op in transposes} <= set(repeat.shared)
    assert all(len(problem.node_time[index[op.name]]) == 1 for op in transposes)  # held whole
    folded, unfolded, ilp = _objectives(graph, devices)
    assert folded == pytest.approx(unfolded, rel=1e-12)
    assert unfolded == pytest.approx(ilp, rel=1e-9)


@pytest.mark.parametrize("devices", [2, 8, 64])
def test_a_hugging_face_albert_export_plans_at_every_size(devices):
    path = DATA / "hf_albert_dynamo.onnx"
    plan = autopar.plan(path, devices=devices)
    assert [b["copies"] for b in plan.to_dict()["search"]["repeated_blocks"]] == [6]  # every layer, the first too
    if devices == 8:
        pytest.importorskip("torch")
        assert autopar.verify(path, plan, gradients=True).ok


def test_a_search_past_its_table_limits_answers_with_a_plan_and_its_gap(monkeypatch):
    """With the shared Transposes free to split, ALBERT's exact search passes the table limits (it was refused
    there once): it answers all the same, with what it relaxed (its layers each read the shared Transposes in
    their own best layout) or split, a lower bound no plan beats and the gap, in the plan file and in the text."""
    from autopar.search import costing

    monkeypatch.setattr(costing, "_weight_only", lambda graph, rules, shared: [])
    model = build_plain_gpt(layers=6, hidden=64, heads=4, seq=16, vocab=128, batch=8, shared_layers=True)
    plan = autopar.plan(model, devices=8)
    search = plan.to_dict()["search"]
    assert search["exact"] is False and search.get("runs_relaxed") == 1
    assert 0 < search["lower_bound_s"] <= plan.objective
    assert search["gap"] == pytest.approx(plan.objective / search["lower_bound_s"] - 1, rel=1e-9)
    said = f"of the fastest plan that fits: none is faster than {1e3 * search['lower_bound_s']:.3f} ms"
    assert said in plan.summary() and "1 repeated run bounded with each copy reading" in plan.summary()
    if "steps_split" in search:
        assert f"{search['steps_split']} elimination steps split" in plan.summary()
