"""Operator strategy rules, written as einsum-like index specs.

Each rule names the *labels* (loop indices) of an operator: which tensor dimensions carry
which label. A strategy assigns a power-of-two split factor to every label; that one choice
fixes the split of every input and output dimension. A label present in the inputs but not
in the outputs is reduced over, so splitting it leaves the outputs *partial*. Dimensions
labelled ``None`` cannot be split by this rule (for instance convolution windows).

The device matrix follows MindSpore: the repeated-calculation factor first, then the labels
in order of first appearance, the last label on the lowest (fastest) rank bits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from autopar.layout import ReduceOp

if TYPE_CHECKING:
    from autopar.ops.views import GraphView, NodeView

Labels = tuple[str | None, ...]
OpClass = Literal["cube", "vector", "free"]


@dataclass(frozen=True)
class OpSpec:
    """How an operator's tensors are indexed, and how its work is classed for costing.

    ``inputs``/``outputs`` hold a label tuple per tensor (None for an absent optional input).
    ``strategy_labels`` is what the in_strategy tuple spells for each input; it defaults to
    the input labels (OneHot overrides it, as MindSpore's OneHot strategy describes the output).
    ``local_once_inputs`` are inputs a rank adds only when it holds the first shard of every
    reduced label (a bias under a split contraction must be added exactly once).
    ``local_mean`` marks an average over the reduced labels (ReduceMean, a mean loss): each rank
    divides its local mean by the number of shards, so the partial results sum to the global mean.
    ``matmul_labels`` marks a matrix product (MatMul, Gemm) by the labels of its M, N and K (None for
    an M or N the operands lack, a matrix-vector product's): its efficiency depends on their sizes on
    one device (`autopar.cost.CostModel.matmul_rate`), where other "cube" work (convolutions) runs
    at one fitted efficiency. ``matmul_folded`` are the batch labels of the first operand where the second
    has no batch axes (a [b, s, h] activation times a [h, f] weight): the library runs them as one product
    whose M is their sizes times M's, so they count in M's size.
    """

    inputs: tuple[Labels | None, ...]
    outputs: tuple[Labels, ...]
    reduce_op: ReduceOp = ReduceOp.SUM
    op_class: OpClass = "vector"  # "cube" (matrix unit), "vector" or "free" (metadata only)
    strategy_labels: tuple[Labels | None, ...] = ()
    local_once_inputs: tuple[int, ...] = ()
    fallback: bool = False
    local_mean: bool = False
    label_order: tuple[str, ...] = field(default=(), compare=False)
    matmul_labels: tuple[str | None, str | None, str] | None = None
    matmul_folded: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.label_order:
            order: list[str] = []
            for labels in list(self.inputs) + list(self.outputs):
                for label in labels or ():
                    if label is not None and label not in order:
                        order.append(label)
            object.__setattr__(self, "label_order", tuple(order))
        if not self.strategy_labels:
            object.__setattr__(self, "strategy_labels", self.inputs)

    @property
    def reduced_labels(self) -> tuple[str, ...]:
        """Labels some input has and no output: splitting one leaves the outputs partial."""
        out = {label for labels in self.outputs for label in labels if label is not None}
        read = {label for labels in self.inputs for label in labels or () if label is not None}
        return tuple(label for label in self.label_order if label not in out and label in read)

    @property
    def gradient_labels(self) -> tuple[str, ...]:
        """Labels no tensor has (a fork's, `autopar.ops.fork`): splitting one leaves the outputs whole,
        and lets their gradients arrive partial over its bits."""
        named = {label for labels in (*self.inputs, *self.outputs) for label in labels or () if label is not None}
        return tuple(label for label in self.label_order if label not in named)


def fallback_spec(op: "NodeView", graph: "GraphView") -> OpSpec:
    """Keep an unknown operator whole on every device: inputs gathered, outputs replicated."""
    inputs = tuple(tuple(None for _ in graph.tensor(name).shape) if name else None for name in op.inputs)
    outputs = tuple(tuple(None for _ in graph.tensor(name).shape) if name else () for name in op.outputs)
    return OpSpec(inputs=inputs, outputs=outputs, fallback=True)


# --- helpers shared by the rule modules -----------------------------------------------------


def shape(graph: "GraphView", name: str) -> tuple[int, ...]:
    return graph.tensor(name).shape


def dim_labels(rank: int, prefix: str = "d") -> Labels:
    return tuple(f"{prefix}{i}" for i in range(rank))


def broadcast_labels(input_shape: Sequence[int], output_shape: Sequence[int], prefix: str = "d") -> Labels:
    """Numpy broadcasting: align from the right; a size-1 dimension that broadcasts gets no label."""
    offset = len(output_shape) - len(input_shape)
    labels = []
    for i, size in enumerate(input_shape):
        out_size = output_shape[offset + i]
        labels.append(None if size == 1 and out_size != 1 else f"{prefix}{offset + i}")
    return tuple(labels)


def no_split(rank: int) -> Labels:
    return tuple(None for _ in range(rank))


def normalize_axis(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis


def constant_ints(graph: "GraphView", op: "NodeView", slot: int, attr: str) -> list[int] | None:
    """Integers given as an attribute (older opsets) or a constant input (newer ones).

    None when the input is present but computed at run time; [] when neither is given.
    """
    if attr in op.attrs:
        return [int(v) for v in op.attrs[attr]]
    if slot < len(op.inputs) and op.inputs[slot]:
        value = constant_value(graph, op.inputs[slot])
        if value is None:
            return None
        return [int(v) for v in np.asarray(value).reshape(-1)]
    return []


def constant_value(graph: "GraphView", name: str) -> Any:
    """The value of a constant input (axes, shapes), or None when it is computed at run time."""
    if not name or name not in graph.tensors:
        return None
    return graph.tensor(name).value


# --- helpers shared by the torch kernels (`OpDef.torch_kernel`) --------------------------------


def named_outputs(op: NodeView, values: Sequence[Any]) -> list[Any]:
    """A kernel's values of every output the operator declares, in order, kept for those it names: the values
    the runtime gives the named outputs in order (LayerNormalization's ``["y", "", "rstd"]`` takes the third).

    >>> from types import SimpleNamespace
    >>> named_outputs(SimpleNamespace(outputs=("y", "", "rstd")), ["Y", "MEAN", "RSTD"])
    ['Y', 'RSTD']
    """
    return [value for value, name in zip(values, op.outputs) if name]


def as_ints(value: Any) -> list[int]:
    """Integers from a constant input (shapes, axes, pads), a numpy array or a torch tensor alike."""
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    return [int(v) for v in np.asarray(value).reshape(-1)]


def as_float(value: Any) -> float:
    """A scalar from a configuration input, a numpy array or a torch tensor alike."""
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    return float(np.asarray(value).reshape(-1)[0])


def ints_from(op: "NodeView", inputs: Sequence[Any], slot: int, attr: str) -> list[int] | None:
    """Integers given as an attribute (older opsets) or an input (newer ones); None when neither is."""
    if attr in op.attrs:
        return [int(v) for v in op.attrs[attr]]
    if slot < len(inputs) and inputs[slot] is not None:
        return as_ints(inputs[slot])
    return None


def tensors(t: Any, inputs: Sequence[Any]) -> list[Any]:
    """The inputs as tensors: a numpy constant (a divisor, an index) moved where the first tensor is; None kept."""
    device = next((x.device for x in inputs if isinstance(x, t.Tensor)), None)
    return [x if x is None or isinstance(x, t.Tensor) else t.tensor(x, device=device) for x in inputs]
