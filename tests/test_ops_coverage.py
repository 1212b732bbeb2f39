"""Every supported operator, alone in a tiny model, verifies under its candidate strategies.

Each case checks what the rule lets split, then runs candidates on 4 virtual devices against
onnxruntime on one: the op's local execution, partial outputs and their reductions must agree.
The cases come from the operator modules (`autopar.ops.cases`): adding an operator adds its case there.
"""

from __future__ import annotations

import random

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import autopar
from autopar.errors import FallbackWarning
from autopar.graph import load_model
from autopar.ops import FAMILIES, registered_op_types
from autopar.ops.cases import STRATEGIES, all_cases
from autopar.strategy import OpRule
from tests.conftest import make_model

pytest.importorskip("onnxruntime")

F, I64, B = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL

ISSUE_OPS = [
    "MatMul",
    "Gemm",
    "Transpose",
    "Reshape",
    "Flatten",
    "Unsqueeze",
    "Squeeze",
    "Concat",
    "Split",
    "Slice",
    "Gather",
    "GatherElements",
    "LayerNormalization",
    "ReduceMean",
    "Sub",
    "Pow",
    "Sqrt",
    "Div",
    "Add",
    "Softmax",
    "LogSoftmax",
    "Erf",
    "Tanh",
    "Sigmoid",
    "Gelu",
    "Where",
    "Expand",
    "Equal",
    "And",
    "Not",
    "Dropout",
    "Cast",
    "SoftmaxCrossEntropyLoss",
    "NegativeLogLikelihoodLoss",
    "LRN",
    "Clip",
    "Max",
    "Min",
]


def ints(name, values):
    return numpy_helper.from_array(np.asarray(values, dtype=np.int64), name)


# Each operator module lists its cases next to its registration (`autopar.ops.cases`); the ones
# that split are checked here, as "op" in a tiny model, under its candidate strategies.
CASES = {name: case.model for name, case in all_cases(FAMILIES, STRATEGIES).items()}


@pytest.mark.parametrize("case", sorted(CASES))
def test_candidates_verify(case):
    model = CASES[case]()
    candidates = autopar.candidates(model, devices=4)
    assert not autopar.plan(model, devices=4).fallback_ops
    options = candidates["op"]
    rng = random.Random(case)
    draws = options if len(options) <= 10 else [options[0]] + rng.sample(options[1:], 9)
    for draw, strategy in enumerate(draws):
        strategies = {op: (strategy if op == "op" else rng.choice(cands)) for op, cands in candidates.items()}
        report = autopar.verify(model, strategies, devices=4, seed=draw)
        assert report.ok, (strategy, report.problems)


def rule(model, devices=8) -> OpRule:
    graph = load_model(model)
    return OpRule.build(graph.op("op"), graph, devices.bit_length() - 1)


def split_axes(model, devices=8) -> list[tuple[int, ...]]:
    """For each input, the dims some candidate splits."""
    r = rule(model, devices)
    split = [set() for _ in r.op.inputs]
    for exponents in r.candidates:
        for position, entry in enumerate(r.in_strategy(exponents)):
            split[position] |= {d for d, f in enumerate(entry) if f > 1}
    return [tuple(sorted(s)) for s in split]


def test_every_issue_op_has_a_rule():
    assert set(ISSUE_OPS) <= set(registered_op_types())


def test_embedding_vocab_split_gives_a_partial_sum():
    r = rule(CASES["gather_embedding"]())
    vocab_split = next(e for e in r.candidates if r.in_strategy(e)[0] == (8, 1))
    out = r.output_layouts(vocab_split)[0]
    assert out.partial and out.partial_op == "sum"
    assert split_axes(CASES["gather_embedding"]())[0] == (0, 1)


@pytest.mark.parametrize(
    "case, strategy",
    [
        ("gather_embedding", ((4, 1), (1, 1))),  # vocabulary rows split: masked lookups, summed
        ("gather_embedding", ((2, 1), (2, 1))),
        ("gather_token", ((1, 4, 1), ())),  # the gathered sequence axis split: one rank holds the token
    ],
)
def test_split_gather_axis_verifies(case, strategy):
    model = CASES[case]()
    report = autopar.verify(model, {"op": strategy}, devices=4)
    assert report.ok, report.problems
    assert report.executed.get("AllReduce", {}).get("count") == 1  # the partial output is summed once


def test_axes_an_operator_works_along_stay_whole():
    assert split_axes(CASES["concat"]()) == [(0, 2), (0, 2)]
    assert split_axes(CASES["split"]())[0] == (0, 1)
    assert split_axes(CASES["slice"]())[0] == (0, 2)
    assert split_axes(CASES["slice_whole_axis"]())[0] == (0, 1)  # axis 1 is sliced whole
    assert split_axes(CASES["layer_norm"]())[0] == (0, 1)
    assert split_axes(CASES["softmax"]())[0] == (0, 2)
    assert split_axes(CASES["softmax_opset11"]())[0] == (0,)  # opset < 13 flattens from the axis on
    assert split_axes(CASES["lrn"]())[0] == (0,)
    assert split_axes(CASES["sce_ignore_index"]()) == [(0,), ()]  # the labels whole: the mean counts them all
    assert split_axes(CASES["top_k"]()) == [(0, 2), ()]  # TopK selects along axis 1


def test_transpose_moves_splits_with_their_dims():
    r = rule(CASES["transpose"]())
    exponents = next(e for e in r.candidates if r.in_strategy(e)[0] == (2, 4, 1, 1))
    in_dims = r.input_layouts(exponents)[0].dims
    assert r.output_layouts(exponents)[0].dims == in_dims[:1] + ((), in_dims[1], ())


def test_mean_loss_split_over_samples_is_a_partial_sum():
    r = rule(CASES["sce_mean"]())
    exponents = next(e for e in r.candidates if r.in_strategy(e)[0] == (8, 1))
    out = r.output_layouts(exponents)[0]
    assert out.partial and out.partial_op == "sum" and r.spec.local_mean


def test_unknown_operator_runs_replicated_and_is_reported(tmp_path, capsys):
    from autopar.cli import main

    nodes = [
        helper.make_node("Relu", ["X"], ["r"], name="relu"),
        helper.make_node("Det", ["r"], ["Y"], name="det"),
    ]
    model = make_model(nodes, [("X", F, [4, 8, 8])], ["Y"])
    with pytest.warns(FallbackWarning, match=r"det \(Det\)") as warned:
        plan = autopar.plan(model, devices=8)
    assert warned[0].filename == __file__  # the warning names the line that asked for the plan
    assert plan.fallback_ops == ["det"]
    assert autopar.verify(model, plan).ok
    path = tmp_path / "det.onnx"
    onnx.save(model, path)
    assert main(["plan", str(path), "--devices", "8"]) == 0
    assert "det" in capsys.readouterr().err


@pytest.mark.parametrize(
    "case, axes",
    [
        ("reduce_prod", (0, 2)),  # the reduced axis 1 stays whole: partial products have no reduction
        ("reduce_l2", (0,)),
        ("reduce_log_sum_exp", (1,)),
        ("reduce_l1", (0, 1)),  # a partial sum of |x| sums
        ("reduce_sum_square", (0, 1, 2)),
        ("cumsum", (0, 2)),  # the scanned axis stays whole
        ("trilu", (0, 1)),  # the triangle's axes stay whole
        ("depth_to_space", (0, 2, 3)),  # DCR: channels interleave the blocks
        ("depth_to_space_crd", (0, 1, 2, 3)),  # CRD: an output channel reads a contiguous run of input channels
        ("space_to_depth", (0, 2, 3)),
        ("group_norm", (0, 1)),  # one channel a group: channels split by whole groups
        ("group_norm_even_groups", (0,)),  # two channels a group: a split by 8 would cut groups
        ("rms_norm", (0, 1)),
        ("gather_nd", (0, 1, 2)),  # the indexed axes (0, 1) split too: masked lookups, a partial sum
        ("gather_nd_batch", (0, 1, 2)),
        ("scatter_nd", (0, 1, 2)),  # a rank writes the updates that land in its rows
        ("scatter_elements", (0,)),
        ("attention", (0, 1)),  # batch and heads; both sequences stay whole
        ("attention_3d", (0,)),  # heads folded into the hidden axis: the batch only
        ("rotary", (0, 1, 2)),  # batch, heads, sequence; the rotated axis stays whole
        ("rotary_caches_per_position", (0, 1)),
    ],
)
def test_what_each_new_operator_splits(case, axes):
    assert split_axes(CASES[case]())[0] == axes


def test_einsum_splits_every_label_and_a_contracted_one_leaves_a_partial_sum():
    r = rule(CASES["einsum_experts"]())  # etd,edf->etf
    assert r.spec.inputs == (("e", "t", "d"), ("e", "d", "f")) and r.spec.reduced_labels == ("d",)
    assert r.spec.op_class == "cube"
    assert split_axes(CASES["einsum_experts"]()) == [(0, 1, 2), (0, 1, 2)]  # experts split too
    contracted = next(e for e in r.candidates if r.in_strategy(e) == ((1, 1, 4), (1, 4, 1)))
    out = r.output_layouts(contracted)[0]
    assert out.partial and out.partial_op == "sum"
    diagonal = rule(CASES["einsum_diagonal"]())  # bii,i->b: the diagonal's label stays whole
    assert diagonal.spec.inputs == (("b", None, None), (None,)) and split_axes(CASES["einsum_diagonal"]())[1] == ()
    broadcast = rule(CASES["einsum_broadcast"]())  # a size-1 ellipsis dimension is not split
    assert broadcast.spec.inputs[0][0] is None and broadcast.spec.inputs[1][0] == "...0"


def test_gather_nd_splits_index_rows_and_batch():
    assert split_axes(CASES["gather_nd"]())[1] == (0,)
    assert split_axes(CASES["gather_nd_batch"]())[1] == (0, 1)
    assert split_axes(CASES["scatter_nd"]())[1:] == [(), (1, 2)]  # indices whole; updates' slice axes
    assert split_axes(CASES["scatter_nd_add_experts"]())[1:] == [(0, 1), (0, 1, 2)]  # summed: rows split too


def test_gather_nd_split_by_experts_gives_a_partial_sum():
    r = rule(CASES["gather_nd_experts"]())  # W [8 experts, 4, 8], one expert per routed row
    experts = next(e for e in r.candidates if r.in_strategy(e) == ((8, 1, 1), (1, 1)))
    out = r.output_layouts(experts)[0]
    assert out.dims == ((), (), ()) and out.partial == (2, 1, 0) and out.partial_op == "sum"


def test_scatter_nd_add_split_by_experts_gives_a_partial_sum_that_adds_the_data_once():
    r = rule(CASES["scatter_nd_add_experts"]())  # X [8, 8] += U [4 experts, 4 slots, 8] at i
    assert r.spec.local_once_inputs == (0,)
    experts = next(e for e in r.candidates if r.in_strategy(e) == ((1, 1), (4, 1, 1), (4, 1, 1)))
    assert r.output_layouts(experts)[0].partial == (1, 0)
    plain = rule(CASES["scatter_nd"]())  # reduction none: updates for one row may come from any rank
    assert not plain.spec.local_once_inputs and plain.spec.inputs[2][0] is None


@pytest.mark.parametrize(
    "case, strategy, collective",
    [
        ("gather_nd_experts", ((4, 1, 1), (1, 1)), "AllReduce"),  # 2 experts a rank: masked lookups, summed
        ("gather_nd", ((2, 2, 1), (1, 1)), "AllReduce"),  # both indexed axes split
        ("scatter_nd_add_experts", ((1, 1), (4, 1, 1), (4, 1, 1)), "AllReduce"),  # each rank adds its experts'
        ("scatter_nd_add_experts", ((4, 1), (1, 1, 1), (1, 1, 1)), None),  # each rank writes its rows
        ("scatter_nd", ((4, 1, 1), (1, 1), (1, 1, 1)), None),
    ],
)
def test_split_indexed_axes_verify(case, strategy, collective):
    model = CASES[case]()
    report = autopar.verify(model, {"op": strategy}, devices=4)
    assert report.ok, report.problems
    if collective is None:  # the output keeps the rows each rank wrote
        assert report.executed == {}
    else:  # the partial output is summed once
        assert report.executed[collective]["count"] == 1


def test_attention_splits_query_and_key_heads_alike_and_its_caches_follow():
    axes = split_axes(CASES["attention_gqa_mask_past"]())  # 8 query heads, 4 key/value heads
    assert axes[:3] == [(0, 1), (0, 1), (0, 1)]
    assert axes[3] == (0,)  # the mask's head axis (size 1) broadcasts
    assert axes[4:] == [(0, 1), (0, 1)]  # past key and value
    r = rule(CASES["attention_gqa_mask_past"]())
    assert r.max_exponent("h") == 2  # 4 key/value heads bound the head split
    assert r.spec.outputs[1] == ("b", "h", None, None)  # the present key follows
    positions = rule(CASES["rotary"]())
    assert positions.spec.inputs[1:] == ((None, None), (None, None), ("b", "s"))  # the ids split, the tables not


@pytest.mark.parametrize("seed", range(3))
def test_a_mean_that_skips_ignored_labels_sums_each_shards_losses_over_the_whole_count(seed):
    """Hugging Face's loss (`ignore_index`, mean): the shards hold different numbers of ignored labels, so a
    mean of shard means would be wrong; each rank's sum over the whole batch's count adds up to the loss,
    forward and backward."""
    model = CASES["sce_ignore_index"]()
    r = rule(model, devices=4)
    exponents = next(e for e in r.candidates if r.in_strategy(e) == ((4, 1), (1,)))
    out = r.output_layouts(exponents)[0]
    assert out.partial and out.partial_op == "sum" and not r.spec.local_mean
    report = autopar.verify(model, {"op": ((4, 1), (1,))}, devices=4, seed=seed, gradients=True)
    assert report.ok, report.problems
