"""Forward FLOP counts per ONNX operator (a multiply-add counts as 2 FLOPs).

The counts feed the roofline compute model; they follow the usual conventions
(e.g. ResNet-50 v1.5 at 224x224 comes to about 8.2 GFLOPs per image forward).
Unknown operators count one FLOP per output element.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

Shape = Sequence[int]


def _numel(shape: Shape) -> int:
    return math.prod(shape) if shape else 1


def _conv(in_shapes: list[Shape], out_shapes: list[Shape], attrs: dict) -> float:
    weight = in_shapes[1]
    out = out_shapes[0]
    macs_per_output = _numel(weight[1:])  # (C/groups) * kh * kw
    flops = 2.0 * _numel(out) * macs_per_output
    if len(in_shapes) > 2 and in_shapes[2]:
        flops += _numel(out)
    return flops


def _gemm(in_shapes: list[Shape], out_shapes: list[Shape], attrs: dict) -> float:
    a = in_shapes[0]
    k = a[0] if attrs.get("transA", 0) else a[1]
    out = out_shapes[0]
    flops = 2.0 * _numel(out) * k
    if len(in_shapes) > 2 and in_shapes[2] is not None:
        flops += _numel(out)
    return flops


def _matmul(in_shapes: list[Shape], out_shapes: list[Shape], attrs: dict) -> float:
    a = in_shapes[0]
    k = a[-1] if len(a) >= 1 else 1
    return 2.0 * _numel(out_shapes[0]) * k


def _pool(in_shapes: list[Shape], out_shapes: list[Shape], attrs: dict) -> float:
    kernel = attrs.get("kernel_shape", [1])
    return float(_numel(out_shapes[0]) * _numel(kernel))


def _input_elements(in_shapes: list[Shape], out_shapes: list[Shape], attrs: dict) -> float:
    return float(_numel(in_shapes[0]))


def _batchnorm(in_shapes: list[Shape], out_shapes: list[Shape], attrs: dict) -> float:
    # normalise then scale and shift: about four element-wise operations
    return 4.0 * _numel(out_shapes[0])


def _output_elements(in_shapes: list[Shape], out_shapes: list[Shape], attrs: dict) -> float:
    return float(sum(_numel(s) for s in out_shapes))


def _zero(in_shapes: list[Shape], out_shapes: list[Shape], attrs: dict) -> float:
    return 0.0


_RULES: dict[str, Callable[[list[Shape], list[Shape], dict], float]] = {
    "Conv": _conv,
    "Gemm": _gemm,
    "MatMul": _matmul,
    "MaxPool": _pool,
    "AveragePool": _pool,
    "GlobalAveragePool": _input_elements,
    "GlobalMaxPool": _input_elements,
    "ReduceMax": _input_elements,
    "ReduceMin": _input_elements,
    "ReduceSum": _input_elements,
    "ReduceMean": _input_elements,
    "BatchNormalization": _batchnorm,
    "Flatten": _zero,
    "Reshape": _zero,
    "Identity": _zero,
    "Squeeze": _zero,
    "Unsqueeze": _zero,
}


def forward_flops(op_type: str, in_shapes: list[Shape], out_shapes: list[Shape], attrs: dict) -> float:
    """Forward FLOPs of one operator given its input and output shapes."""
    rule = _RULES.get(op_type, _output_elements)
    return rule(in_shapes, out_shapes, attrs)
