"""Operators with no strategy rule (they run replicated, inputs gathered) whose facts still matter.

The importer must never fold a random operator, must not train Resize's scales, and the search
must not send gradients through NonZero; the registry says so here, one line each.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from autopar.ops.cases import (
    X4,
    F,
    OpCase,
    const,
    named,
    one,
)
from autopar.ops.registry import Keeps, MindSporePrimitive, declare
from autopar.ops.resize import resize_kernel

if TYPE_CHECKING:
    from autopar.ops.views import NodeView


def torch_shape_query(t: Any, op: NodeView, inputs: list[Any]) -> list[Any]:
    """Shape (with opset 15's start/end), Size, NonZero: integer results, no gradient."""
    x, kind = inputs[0], op.op_type
    if kind == "Shape":
        dims = list(x.shape)[slice(op.attrs.get("start", 0), op.attrs.get("end"))]
        return [t.tensor(dims, dtype=t.int64)]
    if kind == "Size":
        return [t.tensor(x.numel(), dtype=t.int64)]
    return [t.stack(t.nonzero(x, as_tuple=True)) if x.dim() else t.nonzero(x.reshape(1)).t()]  # NonZero


declare(
    "Shape",
    "Size",
    "NonZero",
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


# --- the operator alone in tiny models, checked by the operator tests (`autopar.ops.cases`) -----

LEGACY = [("X", F, [1, 2, 4, 5])]


def resize_case(opset: int = 19, roi: Any = None, scales: Any = None, sizes: Any = None, **attrs: Any) -> OpCase:
    """Resize of a [1, 2, 4, 5] input, from whichever of roi, scales and sizes are given."""
    inputs, consts = ["X", "", "", ""], []
    for slot, name, value, dtype in (
        (1, "roi", roi, np.float32),
        (2, "scales", scales, np.float32),
        (3, "sizes", sizes, np.int64),
    ):
        if value is not None:
            inputs[slot] = name
            consts.append(const(name, value, dtype))
    while not inputs[-1]:
        inputs.pop()
    return one("Resize", inputs, [("X", F, [1, 2, 4, 5])], consts, opset=opset, **attrs)


CASES = named(
    kernel={
        "shape": one("Shape", ["X"], X4),
        "shape_start_end": one("Shape", ["X"], X4, start=1, end=-1, opset=15),
        "size": one("Size", ["X"], X4),
        "resize_nearest_up": resize_case(scales=[1, 1, 2, 1.5]),
        "resize_nearest_down": resize_case(scales=[1, 1, 0.5, 0.6]),
        "resize_nearest_ceil_align_corners": resize_case(
            sizes=[1, 2, 7, 3], nearest_mode="ceil", coordinate_transformation_mode="align_corners"
        ),
        "resize_nearest_floor_asymmetric": resize_case(
            scales=[1, 1, 1.7, 0.8], nearest_mode="floor", coordinate_transformation_mode="asymmetric"
        ),
        "resize_nearest_prefer_ceil": resize_case(scales=[1, 1, 3, 2], nearest_mode="round_prefer_ceil"),
        "resize_linear_up": resize_case(scales=[1, 1, 2, 1.5], mode="linear"),
        "resize_linear_down": resize_case(sizes=[1, 2, 3, 2], mode="linear"),
        "resize_linear_align_corners": resize_case(
            sizes=[1, 2, 7, 9], mode="linear", coordinate_transformation_mode="align_corners"
        ),
        "resize_linear_pytorch": resize_case(
            sizes=[1, 2, 1, 9], mode="linear", coordinate_transformation_mode="pytorch_half_pixel"
        ),
        "resize_linear_symmetric": resize_case(
            scales=[1, 1, 1.5, 0.7], mode="linear", coordinate_transformation_mode="half_pixel_symmetric"
        ),
        "resize_linear_crop": resize_case(
            sizes=[1, 2, 6, 4],
            roi=[0, 0, -0.2, 0.1, 1, 1, 0.9, 1.3],
            mode="linear",
            coordinate_transformation_mode="tf_crop_and_resize",
            extrapolation_value=3.0,
        ),
        "resize_cubic": resize_case(scales=[1, 1, 2, 1.5], mode="cubic"),
        "resize_cubic_exclude_outside": resize_case(
            scales=[1, 1, 0.6, 1.5], mode="cubic", exclude_outside=1, cubic_coeff_a=-0.5
        ),
        "resize_cubic_align_corners": resize_case(
            sizes=[1, 2, 6, 7], mode="cubic", coordinate_transformation_mode="align_corners"
        ),
        "resize_axes": resize_case(scales=[2.0, 0.6], axes=[2, 3], mode="linear"),
        "resize_not_larger": resize_case(sizes=[7, 7], axes=[2, 3], keep_aspect_ratio_policy="not_larger"),
        "resize_not_smaller": resize_case(
            sizes=[7, 7], axes=[2, 3], keep_aspect_ratio_policy="not_smaller", mode="linear"
        ),
        "resize_opset11": resize_case(opset=11, roi=[], scales=[1, 1, 2, 1.5], mode="linear"),
        "resize_opset10": one("Resize", ["X", "s"], LEGACY, [const("s", [1, 1, 2, 1.5], np.float32)], opset=10),
        "resize_opset10_down": one("Resize", ["X", "s"], LEGACY, [const("s", [1, 1, 0.5, 0.6], np.float32)], opset=10),
        "resize_opset10_linear": one(
            "Resize", ["X", "s"], LEGACY, [const("s", [1, 1, 2, 1.5], np.float32)], opset=10, mode="linear"
        ),
        "upsample_opset7": one("Upsample", ["X"], LEGACY, opset=7, scales=[1.0, 1.0, 2.0, 3.0]),
        "upsample_linear": one(
            "Upsample", ["X", "s"], LEGACY, [const("s", [1, 1, 2, 1.5], np.float32)], opset=9, mode="linear"
        ),
    },
)
