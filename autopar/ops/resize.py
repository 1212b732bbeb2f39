"""Resize and Upsample in torch: one axis at a time, each output position read from its source coordinate.

ONNX maps output index ``i`` of a resized axis to a coordinate of the input (``coordinate_transformation_mode``),
then reads the nearest element, interpolates the two around it (linear) or the four (cubic). All three are
separable, so resizing the axes one after another is the operator; gathers and weighted sums keep the result
differentiable in the input. Upsample and opset 10's Resize are the old form: asymmetric coordinates, the
nearest element found as onnxruntime does (rounding down when enlarging, up when shrinking).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from autopar.errors import AutoparError
from autopar.ops.base import normalize_axis
from autopar.ops.registry import TorchKernel

if TYPE_CHECKING:
    from autopar.ops.views import NodeView


def _floats(value: Any) -> list[float]:
    """Floats from an optional input (a tensor or numpy array); [] when absent or empty."""
    if value is None:
        return []
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    return [float(v) for v in np.asarray(value).reshape(-1)]


def _coordinates(mode: str, out: int, size: int, scale: float, roi: tuple[float, float]) -> np.ndarray:
    """The input coordinate each output index of one axis reads."""
    i = np.arange(out, dtype=np.float64)
    if mode == "half_pixel":
        return (i + 0.5) / scale - 0.5
    if mode == "half_pixel_symmetric":
        offset = size / 2 * (1 - out / (scale * size))
        return offset + (i + 0.5) / scale - 0.5
    if mode == "pytorch_half_pixel":
        return (i + 0.5) / scale - 0.5 if out > 1 else np.zeros(out)
    if mode == "align_corners":
        return i * (size - 1) / (out - 1) if out > 1 else np.zeros(out)
    if mode == "asymmetric":
        return i / scale
    if mode == "tf_half_pixel_for_nn":
        return (i + 0.5) / scale
    if mode == "tf_crop_and_resize":
        start, end = roi
        if out == 1:
            return np.full(out, 0.5 * (start + end) * (size - 1))
        return start * (size - 1) + i * (end - start) * (size - 1) / (out - 1)
    raise AutoparError(f"Resize's coordinate_transformation_mode {mode!r} is not one ONNX defines.")


def _nearest(x: np.ndarray, rounding: str, shrinking: bool) -> np.ndarray:
    if rounding == "round_prefer_floor":
        return np.where(x == np.floor(x) + 0.5, np.floor(x), np.round(x))
    if rounding == "round_prefer_ceil":
        return np.where(x == np.floor(x) + 0.5, np.ceil(x), np.round(x))
    if rounding == "floor":
        return np.floor(x)
    if rounding == "ceil":
        return np.ceil(x)
    return np.ceil(x) if shrinking else np.trunc(x)  # "simple": Upsample and Resize-10 in onnxruntime


def _cubic_weights(frac: np.ndarray, a: float) -> list[np.ndarray]:
    """Keys' cubic convolution weights of the taps at floor(x) - 1 ... floor(x) + 2."""
    distances = [frac + 1, frac, 1 - frac, 2 - frac]
    near = [((a + 2) * d - (a + 3)) * d * d + 1 for d in distances[1:3]]
    far = [((a * d - 5 * a) * d + 8 * a) * d - 4 * a for d in (distances[0], distances[3])]
    return [far[0], near[0], near[1], far[1]]


def _resize_axis(
    t: Any, op: NodeView, x: Any, axis: int, out: int, scale: float, roi: tuple[float, float], legacy: bool
) -> Any:
    """x resized along ``axis`` to ``out`` elements."""
    a, size = op.attrs, x.shape[axis]
    mode = a.get("mode", "nearest")
    transform = "asymmetric" if legacy else a.get("coordinate_transformation_mode", "half_pixel")
    coords = _coordinates(transform, out, size, scale, roi)
    if mode == "nearest":
        rounding = "simple" if legacy else a.get("nearest_mode", "round_prefer_floor")
        taps = [_nearest(coords, rounding, scale < 1)]
        weights = [np.ones(out)]
    elif mode in ("linear", "bilinear"):
        if transform != "tf_crop_and_resize":
            coords = np.clip(coords, 0, size - 1)
        first = np.floor(coords)
        taps, weights = [first, first + 1], [1 - (coords - first), coords - first]
    elif mode == "cubic":
        first = np.floor(coords)
        taps = [first + k for k in (-1, 0, 1, 2)]
        weights = _cubic_weights(coords - first, float(a.get("cubic_coeff_a", -0.75)))
        if int(a.get("exclude_outside", 0)):
            weights = [np.where((tap < 0) | (tap > size - 1), 0.0, w) for tap, w in zip(taps, weights)]
            total = sum(weights)
            weights = [w / total for w in weights]
    else:
        raise AutoparError(f"Resize's mode {mode!r} is not one ONNX defines.")
    view = [1] * x.dim()
    view[axis] = out
    result = None
    for tap, weight in zip(taps, weights):
        index = t.as_tensor(np.clip(tap, 0, size - 1).astype(np.int64), device=x.device)
        picked = x.index_select(axis, index)
        if mode != "nearest":
            picked = picked * t.as_tensor(weight.reshape(view), dtype=x.dtype, device=x.device)
        result = picked if result is None else result + picked
    if transform == "tf_crop_and_resize":
        outside = t.as_tensor(((coords < 0) | (coords > size - 1)).reshape(view), device=x.device)
        result = t.where(outside, t.full((), float(a.get("extrapolation_value", 0.0)), dtype=x.dtype), result)
    return result


def resize_kernel(legacy: bool) -> TorchKernel:
    """Resize (``legacy``: Upsample, Resize before opset 11, scales as attribute or second input)."""

    def torch_resize(t: Any, op: NodeView, inputs: list[Any]) -> list[Any]:
        x, rank = inputs[0], inputs[0].dim()
        a = op.attrs
        if int(a.get("antialias", 0)):
            raise AutoparError(f"Resize {op.name!r} uses antialias, which the torch runtime does not implement.")
        axes = [normalize_axis(int(d), rank) for d in a.get("axes", range(rank))]
        roi_values = [] if legacy else _floats(inputs[1] if len(inputs) > 1 else None)
        scales = [float(s) for s in a["scales"]] if "scales" in a else _floats(inputs[1 if legacy else 2])
        sizes = [] if legacy or len(inputs) < 4 else [int(s) for s in _floats(inputs[3])]
        if sizes:
            ratios = [sizes[k] / x.shape[d] for k, d in enumerate(axes)]
            policy = a.get("keep_aspect_ratio_policy", "stretch")
            if policy != "stretch":
                ratio = min(ratios) if policy == "not_larger" else max(ratios)
                ratios = [ratio] * len(axes)
                sizes = [math.floor(ratio * x.shape[d] + 0.5) for d in axes]
            scales = ratios
        else:
            sizes = [math.floor(x.shape[d] * scales[k]) for k, d in enumerate(axes)]
        roi = roi_values or [0.0] * len(axes) + [1.0] * len(axes)
        count = len(roi) // 2
        for k, d in enumerate(axes):
            bounds = (roi[d if count == rank else k], roi[count + (d if count == rank else k)])
            if (
                sizes[k] != x.shape[d]
                or scales[k] != 1
                or a.get("coordinate_transformation_mode") == "tf_crop_and_resize"
            ):
                x = _resize_axis(t, op, x, d, sizes[k], scales[k], bounds, legacy)
        return [x]

    return torch_resize
