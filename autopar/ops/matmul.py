"""Gemm, MatMul and Einsum: split rows (i), the contraction (k, partial output) and columns (j).

MatMul also splits its (broadcast) batch dimensions. Under a split contraction, Gemm's bias
is added by one rank of each partial group only, so the reduced sum counts it once.

Einsum's equation is its own label spec: every letter (and every dimension an ellipsis stands
for) is a label, a label missing from the output is summed over, so splitting it leaves the
output a partial sum. A letter repeated within one operand (a diagonal) stays whole everywhere,
and a size-1 dimension that broadcasts against a larger one is not split.
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
    present = set(a) | set(b) | set(out)  # a vector operand has no i (or j): no label that no tensor carries
    order = tuple(label for label in (*(f"b{i}" for i in range(batch_rank)), "i", "k", "j") if label in present)
    m, n = ("i" if len(a_shape) > 1 else None), ("j" if len(b_shape) > 1 else None)
    # a weight-like second operand (no batch axes) makes the batch rows of one product; a batched one does not
    folded = (
        tuple(label for label in a if label is not None and label.startswith("b")) if m and len(b_shape) <= 2 else ()
    )
    return OpSpec(
        inputs=(a, b),
        outputs=(out,),
        op_class="cube",
        label_order=order,
        matmul_labels=(m, n, "k"),
        matmul_folded=folded,
    )


def einsum_terms(equation: str, ranks: Sequence[int]) -> tuple[list[list[str]], list[str]]:
    """Each operand's labels and the output's, from an equation and the operands' ranks.

    The dimensions an ellipsis stands for are labelled ``...0``, ``...1``, ... aligned from the
    right (they broadcast as numpy's do); without ``->`` the output is the ellipsis dimensions,
    then the letters that appear once, in alphabetical order.

    >>> einsum_terms("bij, bjk -> bik", [3, 3])
    ([['b', 'i', 'j'], ['b', 'j', 'k']], ['b', 'i', 'k'])
    >>> einsum_terms("...ij,jk", [4, 2])
    ([['...0', '...1', 'i', 'j'], ['j', 'k']], ['...0', '...1', 'i', 'k'])
    """
    lhs, arrow, rhs = equation.replace(" ", "").partition("->")
    terms = lhs.split(",")
    ellipsis = max((rank - len(term) + 3 for term, rank in zip(terms, ranks) if "..." in term), default=0)

    def expand(term: str, rank: int) -> list[str]:
        if "..." not in term:
            return list(term)
        head, tail = term.split("...")
        count = rank - len(head) - len(tail)
        return list(head) + [f"...{ellipsis - count + i}" for i in range(count)] + list(tail)

    inputs = [expand(term, rank) for term, rank in zip(terms, ranks)]
    if arrow:
        return inputs, expand(rhs, len(rhs.replace("...", "")) + ellipsis)
    letters = [label for labels in inputs for label in labels if not label.startswith("...")]
    once = sorted(label for label in set(letters) if letters.count(label) == 1)
    return inputs, [f"...{i}" for i in range(ellipsis)] + once


def _einsum_sizes(equation: str, in_shapes: Sequence[Sequence[int]]) -> dict[str, int]:
    terms, _ = einsum_terms(equation, [len(s) for s in in_shapes])
    sizes: dict[str, int] = {}
    for labels, dims in zip(terms, in_shapes):
        for label, size in zip(labels, dims):
            sizes[label] = max(sizes.get(label, 1), size)
    return sizes


def einsum_flops(
    in_shapes: Sequence[Sequence[int] | None], out_shapes: Sequence[Sequence[int]], attrs: Mapping[str, Any]
) -> float:
    """One multiply-add per operand pair for every point of the full index space (a sum alone for one operand)."""
    shapes = [s or () for s in in_shapes]
    points = math.prod(_einsum_sizes(str(attrs["equation"]), shapes).values())
    return float(points * max(1, 2 * (len(shapes) - 1)))


def torch_einsum(t: Any, op: NodeView, inputs: list[Any]) -> list[Any]:
    return [t.einsum(str(op.attrs["equation"]).replace(" ", ""), *inputs)]


@register(
    "Einsum",
    since=12,
    mindspore=MindSporePrimitive("ops.Einsum", needs_args=True, note="the equation is a constructor argument"),
    flops=einsum_flops,
    keeps=Keeps.OPERANDS,  # two operands: each for the other's gradient (a third is not counted)
    weight_inputs=True,
    torch_kernel=torch_einsum,
)
def einsum(op: NodeView, graph: GraphView) -> OpSpec:
    """Labels from the equation; contracted labels split into partial sums."""
    equation = str(op.attrs["equation"])
    shapes = [shape(graph, name) for name in op.inputs]
    terms, out = einsum_terms(equation, [len(s) for s in shapes])
    sizes = _einsum_sizes(equation, shapes)
    whole = {label for labels in terms for label in labels if labels.count(label) > 1}

    def keep(label: str, size: int) -> str | None:
        return None if label in whole or size != sizes[label] else label

    inputs = tuple(tuple(keep(label, size) for label, size in zip(labels, dims)) for labels, dims in zip(terms, shapes))
    outputs = (tuple(None if label in whole else label for label in out),)
    cube = len(shapes) > 1 and any(label not in out for labels in terms for label in labels)
    return OpSpec(inputs=inputs, outputs=outputs, op_class="cube" if cube else "vector")


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
        "einsum_batched": one(
            "Einsum", ["A", "B"], [("A", F, [2, 3, 4]), ("B", F, [2, 4, 5])], equation="bij,bjk->bik"
        ),
        "einsum_implicit": one("Einsum", ["A", "B"], [("A", F, [3, 4]), ("B", F, [4, 5])], equation="ij,jk"),
        "einsum_ellipsis": one(
            "Einsum", ["A", "B"], [("A", F, [2, 1, 3, 4]), ("B", F, [1, 3, 4, 5])], equation="...ij, ...jk -> ...ik"
        ),
        "einsum_diagonal": one("Einsum", ["A"], [("A", F, [2, 4, 4])], equation="bii->bi"),
        "einsum_three": one(
            "Einsum",
            ["A", "B", "C"],
            [("A", F, [2, 3]), ("B", F, [3, 4]), ("C", F, [4, 5])],
            equation="ij,jk,kl->il",
        ),
        "einsum_sum": one("Einsum", ["A"], [("A", F, [2, 3, 4])], equation="ijk->ki"),
    },
    strategies={
        "matmul_broadcast": one("MatMul", ["A", "Bm"], [("A", F, [2, 1, 4, 8]), ("Bm", F, [4, 8, 4])]),
        "matmul_vector": one("MatMul", ["A", "v"], [("A", F, [4, 8, 8]), ("v", F, [8])]),
        "einsum_experts": one(
            "Einsum",
            ["X", "W"],
            [("X", F, [4, 8, 8])],
            consts=[weight("W", [4, 8, 4])],
            equation="etd,edf->etf",
        ),
        "einsum_contract_two": one(
            "Einsum", ["A", "B"], [("A", F, [8, 4, 2]), ("B", F, [4, 2, 8])], equation="ikl,klj"
        ),
        "einsum_broadcast": one(
            "Einsum", ["A", "B"], [("A", F, [1, 8, 4]), ("B", F, [4, 4, 8])], equation="...ij,...jk->...ik"
        ),
        "einsum_diagonal": one("Einsum", ["A", "v"], [("A", F, [4, 8, 8]), ("v", F, [8])], equation="bii,i->b"),
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
