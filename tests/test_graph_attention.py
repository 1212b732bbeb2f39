"""Attention chains found in exports (`autopar.graph.attention`), and what a fused kernel changes in their cost."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import autopar
from autopar.cost import HardwareProfile
from autopar.graph import load_model
from autopar.graph.attention import find_attention
from tests.conftest import make_model, simple_profile_dict, weight

DATA = Path(__file__).parent / "data"


@pytest.mark.parametrize(
    "export",
    [
        "torch_llama_dynamo",
        "torch_llama_legacy",
        "torch_gpt_dynamo",
        "hf_qwen3_dynamo",
        "hf_bloom_dynamo",
        "hf_t5_legacy",
        "hf_clip_dynamo",
        "hf_swin_legacy",
        "hf_albert_dynamo",
        "hf_deepseek_v3_dynamo",
    ],
)
def test_every_softmax_of_an_exported_attention_is_a_chain(export):
    graph = load_model(DATA / f"{export}.onnx")
    softmaxes = {op.name for op in graph.ops if op.op_type == "Softmax"}
    regions = find_attention(graph)
    assert {name for region in regions for name in region.inner if name in softmaxes} == softmaxes
    for region in regions:
        scores, values = graph.op(region.scores), graph.op(region.values)
        assert (scores.op_type, values.op_type) == ("MatMul", "MatMul")
        assert graph.tensor(values.inputs[0]).name in region.hidden
        assert graph.tensor(scores.outputs[0]).name in region.hidden


def test_a_router_softmax_is_not_attention():
    graph = load_model(DATA / "hf_olmoe_dynamo.onnx")
    softmaxes = [op for op in graph.ops if op.op_type == "Softmax"]
    regions = find_attention(graph)
    assert len(softmaxes) == 2 and len(regions) == 1  # the router's softmax feeds TopK, not a product


@pytest.mark.parametrize("export", ["torch_llama_dynamo", "torch_gpt_dynamo"])
def test_a_known_causal_mask_halves_the_scores_computed(export):
    """The additive mask (-inf above the diagonal) and masked_fill's Where both mark 16 x 16 causal scores."""
    (region, *_) = find_attention(load_model(DATA / f"{export}.onnx"))
    assert region.kept_share == (16 * 17 / 2) / (16 * 16)


def _attention(mask: np.ndarray | None = None, read_twice: bool = False, key_weight: bool = False):
    """Z = softmax(Q K^T / 4 [+ mask]) V Wo with Q, K, V = X Wq, X Wk, X Wv; X [4, 8, 16], one head."""
    nodes = [helper.make_node("MatMul", ["X", w], [w.lower()[1]], name=w) for w in ("Wq", "Wk", "Wv")]
    key = "Wt" if key_weight else "kt"
    nodes += [
        helper.make_node("Transpose", ["k"], ["kt"], name="transpose", perm=[0, 2, 1]),
        helper.make_node("MatMul", ["q", key], ["s"], name="scores"),
        helper.make_node("Div", ["s", "four"], ["scaled"], name="scale"),
    ]
    last = "scaled"
    if mask is not None:
        nodes.append(helper.make_node("Add", ["scaled", "mask"], ["masked"], name="mask"))
        last = "masked"
    nodes += [
        helper.make_node("Softmax", [last], ["p"], name="softmax", axis=-1),
        helper.make_node("MatMul", ["p", "v"], ["o"], name="values"),
        helper.make_node("MatMul", ["o", "Wo"], ["Z"], name="out"),
    ]
    inits = [weight(w, [16, 16], i) for i, w in enumerate(("Wq", "Wk", "Wv", "Wo"))]
    inits.append(numpy_helper.from_array(np.array(4.0, dtype=np.float32), "four"))
    if mask is not None:
        inits.append(numpy_helper.from_array(mask.astype(np.float32), "mask"))
    if key_weight:
        inits.append(weight("Wt", [16, 8], 9))
    return make_model(nodes, [("X", TensorProto.FLOAT, [4, 8, 16])], ["Z", "p"] if read_twice else ["Z"], inits)


def test_probabilities_read_twice_or_a_weight_as_keys_are_no_chain():
    assert len(find_attention(load_model(_attention()))) == 1
    assert find_attention(load_model(_attention(read_twice=True))) == ()
    assert find_attention(load_model(_attention(key_weight=True))) == ()


def test_a_mask_that_is_not_causal_computes_every_score():
    padding = np.zeros((8, 8))
    padding[:, -2:] = -np.inf  # the last two keys hidden from every query
    assert find_attention(load_model(_attention(mask=padding)))[0].kept_share == 1.0
    causal = np.triu(np.full((8, 8), -1e9), 1)
    assert find_attention(load_model(_attention(mask=causal)))[0].kept_share == 36 / 64


def _fused(efficiency: float | None) -> HardwareProfile:
    data = simple_profile_dict()
    if efficiency is not None:
        data["compute"]["attention_efficiency"] = {"value": efficiency, "source": "test value"}
    return HardwareProfile.model_validate(data)


def _operators(plan) -> dict[str, dict]:
    return {op["name"]: op for op in plan.to_dict()["ops"]}


def test_a_fused_kernel_costs_its_products_by_hand():
    """On 1 device at 1e12 FLOP/s (`conftest.simple_profile_dict`) with a kernel at half of it, 5e11.

    Both products do 2 x 4 x 8 x 8 x 16 = 8,192 FLOPs; the scores' backward takes two products and runs the
    forward again (x4), the values' takes two (x3); the scale and the softmax run inside the kernel (0).
    Unfused they run at the matmul rate, x3 each.
    """
    fused = _operators(autopar.plan(_attention(), devices=1, cost_model=_fused(0.5)))
    assert fused["scores"]["cost"]["compute_s"] == pytest.approx(8192 / 5e11 * 4)
    assert fused["values"]["cost"]["compute_s"] == pytest.approx(8192 / 5e11 * 3)
    assert fused["softmax"]["cost"].get("compute_s", 0.0) == 0.0
    assert fused["scale"]["cost"].get("compute_s", 0.0) == 0.0
    plain = _operators(autopar.plan(_attention(), devices=1, cost_model=_fused(None)))
    assert plain["scores"]["cost"]["compute_s"] == pytest.approx(8192 / 1e12 * 3)
    assert plain["softmax"]["cost"]["compute_s"] > 0.0


def test_a_fused_kernel_keeps_no_scores_but_the_output_and_a_log_sum_exp_per_row():
    """Unfused the backward keeps the probabilities (4 x 8 x 8 FP16 = 512 B); fused, the output
    (4 x 8 x 16 FP16 = 1,024 B, the projection keeps it anyway) and 32 FP32 log-sum-exps (128 B)."""

    def activations(efficiency: float | None) -> int:
        plan = autopar.plan(_attention(), devices=1, cost_model=_fused(efficiency))
        return plan.to_dict()["totals"]["memory_breakdown"]["activations"]

    assert activations(None) - activations(0.5) == 512 - 128


def test_a_dropout_inside_the_chain_keeps_no_mask_where_the_kernel_runs():
    """Dropout(P) keeps its s x s mask for the backward as an operator (4 x 8 x 8 booleans, 256 B); a flash
    kernel draws it again from the seed."""
    nodes = [
        helper.make_node("MatMul", ["X", "Wq"], ["q"], name="Wq"),
        helper.make_node("MatMul", ["X", "Wk"], ["k"], name="Wk"),
        helper.make_node("MatMul", ["X", "Wv"], ["v"], name="Wv"),
        helper.make_node("Transpose", ["k"], ["kt"], name="transpose", perm=[0, 2, 1]),
        helper.make_node("MatMul", ["q", "kt"], ["s"], name="scores"),
        helper.make_node("Softmax", ["s"], ["p"], name="softmax", axis=-1),
        helper.make_node("Dropout", ["p", "ratio", "training"], ["pd", "mask"], name="drop"),
        helper.make_node("MatMul", ["pd", "v"], ["o"], name="values"),
        helper.make_node("MatMul", ["o", "Wo"], ["Z"], name="out"),
    ]
    inits = [weight(w, [16, 16], i) for i, w in enumerate(("Wq", "Wk", "Wv", "Wo"))]
    inits += [
        numpy_helper.from_array(np.array(0.1, dtype=np.float32), "ratio"),
        numpy_helper.from_array(np.array(True), "training"),
    ]
    model = make_model(nodes, [("X", TensorProto.FLOAT, [4, 8, 16])], ["Z"], inits)
    (region,) = find_attention(load_model(model))
    assert "mask" in region.hidden and region.inner == ("softmax", "drop")
    plain = autopar.plan(model, devices=1, cost_model=_fused(None)).to_dict()["totals"]["memory_breakdown"]
    fused = autopar.plan(model, devices=1, cost_model=_fused(0.5)).to_dict()["totals"]["memory_breakdown"]
    # unfused: the softmax keeps P, the dropout its output and its mask (512 + 512 + 256 B); fused: none of
    # them, the output o (1,024 B, which the projection keeps anyway) and 32 log-sum-exps (128 B)
    assert plain["activations"] - fused["activations"] == 512 + 512 + 256 - 128


def test_a_softmax_of_opset_11_without_an_axis_normalises_more_than_the_keys():
    model = _attention()
    model.opset_import[0].version = 11
    for node in model.graph.node:
        if node.op_type == "Softmax":
            del node.attribute[:]  # axis 1 before opset 13: over the queries and keys together
    assert find_attention(load_model(model)) == ()


def test_two_chains_sharing_a_product_are_not_attention_twice():
    """softmax(q k) v, then softmax of that times w: the first product of values is no product of keys."""
    nodes = [
        helper.make_node("MatMul", ["q", "k"], ["s1"], name="scores"),
        helper.make_node("Softmax", ["s1"], ["p1"], name="softmax1", axis=-1),
        helper.make_node("MatMul", ["p1", "v"], ["o1"], name="values"),
        helper.make_node("Softmax", ["o1"], ["p2"], name="softmax2", axis=-1),
        helper.make_node("MatMul", ["p2", "w"], ["o2"], name="again"),
    ]
    shapes = [("q", [2, 8, 8]), ("k", [2, 8, 8]), ("v", [2, 8, 8]), ("w", [2, 8, 8])]
    model = make_model(nodes, [(n, TensorProto.FLOAT, s) for n, s in shapes], ["o2"])
    regions = find_attention(load_model(model))
    assert [(r.scores, r.values) for r in regions] == [("scores", "values")]


def test_fp8_runs_a_weight_s_products_in_fp8_and_attention_s_in_bf16():
    """Unfused attention (its probabilities are a graph output): the four projections multiply a weight and
    run in FP8; Q K^T and P V multiply activations and stay in BF16, their operands kept in two bytes. The
    attention's output is kept by the output projection alone: in one byte."""
    from autopar.cost import CostModel
    from autopar.search.dataflow import Dataflow
    from autopar.strategy import OpRule

    data = simple_profile_dict()
    data["compute"]["peak_flops_fp8"] = {"value": 4e12, "source": "test value"}
    cost = CostModel(HardwareProfile.model_validate(data), "fp8")
    graph = load_model(_attention(read_twice=True))
    rules = [OpRule.build(op, graph, 0) for op in graph.ops]
    flow = Dataflow.of(graph, rules, cost, 1, frozenset())
    assert flow.fp8_products == {"Wq", "Wk", "Wv", "out"}
    assert flow.kept_low == {"o"}


def _computed_mask(positions: int, offset: int = 0):
    """softmax(q k^T + mask) v, the mask computed as transformers writes it: Where(And(key <= query, keep), 0,
    -inf), the key and query positions ramps along the last axis and the one before, ``keep`` a data input."""
    nodes = [
        helper.make_node("LessOrEqual", ["kv", "q_idx"], ["le"], name="le"),
        helper.make_node("And", ["le", "keep"], ["visible"], name="and"),
        helper.make_node("Where", ["visible", "zero", "fill"], ["mask"], name="where"),
        helper.make_node("MatMul", ["q", "k"], ["s"], name="scores"),
        helper.make_node("Add", ["s", "mask"], ["masked"], name="mask"),
        helper.make_node("Softmax", ["masked"], ["p"], name="softmax", axis=-1),
        helper.make_node("MatMul", ["p", "v"], ["o"], name="values"),
    ]
    ramp = np.arange(positions, dtype=np.int64)
    inits = [
        numpy_helper.from_array(ramp.reshape(1, 1, positions), "kv"),
        numpy_helper.from_array((ramp + offset).reshape(1, positions, 1), "q_idx"),
        numpy_helper.from_array(np.array(0.0, dtype=np.float32), "zero"),
        numpy_helper.from_array(np.array(-np.inf, dtype=np.float32), "fill"),
    ]
    inputs = [
        ("q", TensorProto.FLOAT, [1, positions, 8]),
        ("k", TensorProto.FLOAT, [1, 8, positions]),
        ("v", TensorProto.FLOAT, [1, positions, 8]),
        ("keep", TensorProto.BOOL, [1, 1, positions]),
    ]
    return make_model(nodes, inputs, ["o"], inits)


def test_a_causal_mask_computed_at_run_time_is_read_through_what_computes_it():
    """Folded (8 positions: the comparison of two constants is a constant) or computed (4,096: 16 million
    elements, too many to fold), key <= query marks the causal scores; an And with anything only hides more.
    Queries ahead by one see one key more each; behind by one, one less."""
    for positions in (8, 4096):
        (region,) = find_attention(load_model(_computed_mask(positions)))
        assert region.kept_share == pytest.approx((positions + 1) / (2 * positions))
    ahead = find_attention(load_model(_computed_mask(4096, offset=1)))[0].kept_share
    behind = find_attention(load_model(_computed_mask(4096, offset=-1)))[0].kept_share
    assert ahead == pytest.approx((4096 * 4097 / 2 + 4095) / 4096**2)
    assert behind == pytest.approx((4096 * 4095 / 2) / 4096**2)
