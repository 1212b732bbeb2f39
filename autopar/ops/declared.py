"""Operators with no strategy rule (they run replicated, inputs gathered) whose facts still matter.

The importer must never fold a random operator, must not train Resize's scales, and the search
must not send gradients through ArgMax; the registry says so here, one line each.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from autopar.ops.base import normalize_axis
from autopar.ops.registry import Keeps, MindSporePrimitive, declare
from autopar.ops.resize import resize_kernel

if TYPE_CHECKING:
    from autopar.ops.views import NodeView


def torch_shape_query(t: Any, op: NodeView, inputs: list[Any]) -> list[Any]:
    """Shape (with opset 15's start/end), Size, ArgMax/ArgMin, NonZero: integer results, no gradient."""
    x, kind = inputs[0], op.op_type
    if kind == "Shape":
        dims = list(x.shape)[slice(op.attrs.get("start", 0), op.attrs.get("end"))]
        return [t.tensor(dims, dtype=t.int64)]
    if kind == "Size":
        return [t.tensor(x.numel(), dtype=t.int64)]
    if kind == "NonZero":
        return [t.stack(t.nonzero(x, as_tuple=True)) if x.dim() else t.nonzero(x.reshape(1)).t()]
    axis = normalize_axis(int(op.attrs.get("axis", 0)), x.dim())
    keep = bool(int(op.attrs.get("keepdims", 1)))
    values = x.flip(axis) if int(op.attrs.get("select_last_index", 0)) else x
    found = values.argmax(dim=axis, keepdim=keep) if kind == "ArgMax" else values.argmin(dim=axis, keepdim=keep)
    return [x.shape[axis] - 1 - found if int(op.attrs.get("select_last_index", 0)) else found]


declare(
    "Shape",
    "Size",
    "ArgMax",
    "ArgMin",
    "NonZero",
    mindspore={"ArgMax": "ops.Argmax", "ArgMin": "ops.Argmin"},
    differentiable=False,
    keeps=Keeps.NOTHING,
    torch_kernel=torch_shape_query,
)
_RESIZE = MindSporePrimitive("ops.ResizeNearestNeighbor", 1, needs_args=True)
# Resize's roi, scales and sizes (Upsample's and opset 10's scales) configure it
declare("Resize", until=10, mindspore=_RESIZE, config_inputs=frozenset({1}), torch_kernel=resize_kernel(legacy=True))
declare(
    "Resize", since=11, mindspore=_RESIZE, config_inputs=frozenset({1, 2, 3}), torch_kernel=resize_kernel(legacy=False)
)
declare("Upsample", mindspore=_RESIZE, config_inputs=frozenset({1}), torch_kernel=resize_kernel(legacy=True))
# no torch kernel: a random draw matches neither onnxruntime's nor, without a shared seed, the other ranks'
declare(
    "RandomNormal",
    "RandomUniform",
    "RandomNormalLike",
    "RandomUniformLike",
    "Multinomial",
    "Bernoulli",
    differentiable=False,
    keeps=Keeps.NOTHING,
    foldable=False,
)
