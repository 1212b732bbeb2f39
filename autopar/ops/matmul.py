"""Gemm and MatMul: split rows (i), the contraction (k, partial output) and columns (j).

MatMul also splits its (broadcast) batch dimensions. Under a split contraction, Gemm's bias
is added by one rank of each partial group only, so the reduced sum counts it once.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from autopar.ops.base import OpSpec, broadcast_labels, shape
from autopar.ops.cases import F, named, one, ones, weight
from autopar.ops.registry import Keeps, MindSporePrimitive, register

if TYPE_CHECKING:
    from autopar.ops.views import GraphView, NodeView


def gemm_flops(
    in_shapes: Sequence[Sequence[int] | None], out_shapes: Sequence[Sequence[int]], attrs: Mapping[str, Any]
) -> float:
    """2 x M x N x K, plus one addition per output element for the bias C."""
    a = in_shapes[0] or ()
    k = a[0] if attrs.get("transA", 0) else a[1]
    out = math.prod(out_shapes[0])
    flops = 2.0 * out * k
    if len(in_shapes) > 2 and in_shapes[2] is not None:
        flops += out
    return flops


def matmul_flops(
    in_shapes: Sequence[Sequence[int] | None], out_shapes: Sequence[Sequence[int]], attrs: Mapping[str, Any]
) -> float:
    """2 x (output elements) x K: numpy matmul semantics, batch dimensions broadcast."""
    a = in_shapes[0] or ()
    k = a[-1] if len(a) >= 1 else 1
    return 2.0 * math.prod(out_shapes[0]) * k


def torch_gemm(t: Any, op: NodeView, inputs: list[Any]) -> list[Any]:
    """alpha A' B' + beta C, A' and B' transposed as the attributes say."""
    a, b = inputs[0], inputs[1]
    a = a.t() if int(op.attrs.get("transA", 0)) else a
    b = b.t() if int(op.attrs.get("transB", 0)) else b
    out = float(op.attrs.get("alpha", 1.0)) * (a @ b)
    if len(inputs) > 2 and inputs[2] is not None:
        out = out + float(op.attrs.get("beta", 1.0)) * inputs[2]
    return [out]


def torch_matmul(t: Any, op: NodeView, inputs: list[Any]) -> list[Any]:
    return [t.matmul(inputs[0], inputs[1])]


@register(
    "Gemm",
    mindspore=MindSporePrimitive(
        "ops.MatMul", 2, note="then ops.BiasAdd (ops.Add for a 2-D bias) on the output's layout"
    ),
    flops=gemm_flops,
    keeps=Keeps.OPERANDS,
    weight_inputs=True,
    torch_kernel=torch_gemm,
)
def gemm(op: NodeView, graph: GraphView) -> OpSpec:
    a = ("k", "i") if int(op.attrs.get("transA", 0)) else ("i", "k")
    b = ("j", "k") if int(op.attrs.get("transB", 0)) else ("k", "j")
    out_shape = shape(graph, op.outputs[0])
    inputs: list = [a, b]
    if len(op.inputs) > 2 and op.inputs[2]:
        c_labels = broadcast_labels(shape(graph, op.inputs[2]), out_shape, prefix="d")
        inputs.append(tuple({"d0": "i", "d1": "j"}.get(label) if label else None for label in c_labels))
    return OpSpec(
        inputs=tuple(inputs),
        outputs=(("i", "j"),),
        op_class="cube",
        local_once_inputs=(2,),
        label_order=("i", "k", "j"),
        matmul_labels=("i", "j", "k"),
    )


@register(
    "MatMul",
    mindspore=MindSporePrimitive("ops.MatMul", note="ops.BatchMatMul with batch dimensions"),
    flops=matmul_flops,
    keeps=Keeps.OPERANDS,
    weight_inputs=True,
    torch_kernel=torch_matmul,
)
def matmul(op: NodeView, graph: GraphView) -> OpSpec:
    a_shape = shape(graph, op.inputs[0])
    b_shape = shape(graph, op.inputs[1])
    out_shape = shape(graph, op.outputs[0])
    batch_rank = len(out_shape) - (2 if len(a_shape) > 1 and len(b_shape) > 1 else 1)
    batch_out = out_shape[:batch_rank]

    def batch_labels(operand_batch: tuple[int, ...]) -> tuple:
        labels = broadcast_labels(operand_batch, batch_out, prefix="b")
        return labels

    if len(a_shape) == 1:
        a: tuple = ("k",)
    else:
        a = batch_labels(a_shape[:-2]) + ("i", "k")
    if len(b_shape) == 1:
        b: tuple = ("k",)
    else:
        b = batch_labels(b_shape[:-2]) + ("k", "j")
    out = tuple(f"b{i}" for i in range(batch_rank))
    if len(a_shape) > 1:
        out += ("i",)
    if len(b_shape) > 1:
        out += ("j",)
    order = tuple(f"b{i}" for i in range(batch_rank)) + ("i", "k", "j")
    m, n = ("i" if len(a_shape) > 1 else None), ("j" if len(b_shape) > 1 else None)
    return OpSpec(inputs=(a, b), outputs=(out,), op_class="cube", label_order=order, matmul_labels=(m, n, "k"))


# --- the operator alone in tiny models, checked by the operator tests (`autopar.ops.cases`) -----

CASES = named(
    kernel={
        "gemm": one(
            "Gemm",
            ["A", "W", "C"],
            [("A", F, [4, 3])],
            [ones("W", [5, 3]), ones("C", [1, 5])],
            transB=1,
            alpha=0.5,
            beta=2.0,
        ),
        "gemm_trans_a": one("Gemm", ["A", "W"], [("A", F, [3, 4])], [ones("W", [3, 5])], transA=1),
        "matmul": one("MatMul", ["A", "W"], [("A", F, [2, 3, 4]), ("W", F, [4, 5])]),
        "matmul_vector": one("MatMul", ["v", "W"], [("v", F, [4]), ("W", F, [2, 4, 5])]),
    },
    strategies={
        "matmul_broadcast": one("MatMul", ["A", "Bm"], [("A", F, [2, 1, 4, 8]), ("Bm", F, [4, 8, 4])]),
        "matmul_vector": one("MatMul", ["A", "v"], [("A", F, [4, 8, 8]), ("v", F, [8])]),
        "gemm_trans": one(
            "Gemm",
            ["A", "W", "C"],
            [("A", F, [8, 4])],
            transA=1,
            transB=1,
            consts=[weight("W", [8, 8]), weight("C", [8])],
        ),
    },
)
