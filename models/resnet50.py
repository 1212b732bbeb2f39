"""Build ResNet-50 v1.5 with an expanded softmax cross-entropy loss as ONNX.

The graph follows the torchvision layout (stride on the 3x3 conv of each
bottleneck, the "v1.5" variant) and ends in the loss written out in small
operators (ReduceMax, Sub, Exp, ReduceSum, Div, Log, OneHot, Mul, ReduceSum,
Mul, ReduceMean), as MindSpore's distributed-training tutorial does, so a
sharding planner sees every operator the loss really costs.

Weight representation
---------------------
``weights="elided"`` (the committed ``resnet50.onnx``): each parameter ``P`` is
the output of a ``ConstantOfShape`` node named ``P__init`` whose input
``P__shape`` is an int64 initializer holding P's shape.  This is the pattern
the onnx package uses for its weight-elided model-zoo test files
(``onnx/backend/test/data/light/*.onnx``): shapes, dtypes and the graph stay
exact while the file is a few tens of KB instead of ~100 MB.  The fill value
is 0.0, except BatchNormalization scale and variance which get 1.0 so the
network still computes finite numbers.

``weights="random"``: ordinary float32 initializers with seeded random values
(He-normal convolutions), for numerical tests on small instances.

Usage::

    python models/resnet50.py --batch 256 --classes 1000 --image-size 224 \\
        --weights elided --out models/resnet50.onnx
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
IR_VERSION = 8  # onnxruntime 1.31 accepts ir_version <= 10; 8 matches opset 17.
EXPANSION = 4
BN_EPSILON = 1e-5
BN_MOMENTUM = 0.9


class _GraphBuilder:
    """Accumulates nodes and parameters in topological order."""

    def __init__(self, weights: str, seed: int) -> None:
        if weights not in ("elided", "random"):
            raise ValueError(f"weights must be 'elided' or 'random', got {weights!r}")
        self.weights = weights
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []

    def node(self, op: str, name: str, inputs: Sequence[str], output: str | None = None, **attrs) -> str:
        """Append one node; its single output is named after the node by default."""
        output = output or name
        self.nodes.append(helper.make_node(op, list(inputs), [output], name=name, **attrs))
        return output

    def constant(self, name: str, array: np.ndarray) -> str:
        """Add a non-parameter constant (loss axes, depth, ...) as an initializer."""
        self.initializers.append(numpy_helper.from_array(array, name=name))
        return name

    def param(self, name: str, shape: Sequence[int], kind: str, fan_in: int = 0) -> str:
        """Create parameter ``name`` in the representation chosen by ``weights``.

        ``kind`` is one of "he" (conv/gemm weight), "small" (biases, BN mean),
        "scale" (BN scale) or "var" (BN variance).
        """
        shape = [int(d) for d in shape]
        if self.weights == "elided":
            fill = 1.0 if kind in ("scale", "var") else 0.0
            shape_name = self.constant(f"{name}__shape", np.array(shape, dtype=np.int64))
            value = helper.make_tensor("value", TensorProto.FLOAT, [1], [fill])
            self.node("ConstantOfShape", f"{name}__init", [shape_name], output=name, value=value)
        else:
            self.constant(name, self._random(shape, kind, fan_in))
        return name

    def _random(self, shape: list[int], kind: str, fan_in: int) -> np.ndarray:
        if kind == "he":
            values = self.rng.normal(0.0, np.sqrt(2.0 / fan_in), size=shape)
        elif kind == "small":
            values = self.rng.normal(0.0, 0.1, size=shape)
        elif kind in ("scale", "var"):
            values = self.rng.uniform(0.5, 1.5, size=shape)
        else:
            raise ValueError(f"unknown parameter kind {kind!r}")
        return values.astype(np.float32)


def _conv(b: _GraphBuilder, name: str, x: str, cin: int, cout: int, kernel: int, stride: int = 1) -> str:
    """Bias-free convolution with 'same'-style padding kernel // 2."""
    weight = b.param(f"{name}.weight", [cout, cin, kernel, kernel], "he", fan_in=cin * kernel * kernel)
    pad = kernel // 2
    return b.node(
        "Conv", name, [x, weight], kernel_shape=[kernel, kernel], strides=[stride, stride], pads=[pad, pad, pad, pad]
    )


def _bn(b: _GraphBuilder, name: str, x: str, channels: int) -> str:
    """Inference-form BatchNormalization; scale/bias trainable, mean/var running stats."""
    scale = b.param(f"{name}.scale", [channels], "scale")
    bias = b.param(f"{name}.bias", [channels], "small")
    mean = b.param(f"{name}.mean", [channels], "small")
    var = b.param(f"{name}.var", [channels], "var")
    return b.node("BatchNormalization", name, [x, scale, bias, mean, var], epsilon=BN_EPSILON, momentum=BN_MOMENTUM)


def _bottleneck(b: _GraphBuilder, prefix: str, x: str, cin: int, mid: int, stride: int, downsample: bool) -> str:
    """One v1.5 bottleneck: the stride sits on the 3x3 conv, not the first 1x1."""
    cout = mid * EXPANSION
    y = _conv(b, f"{prefix}.conv1", x, cin, mid, 1)
    y = _bn(b, f"{prefix}.bn1", y, mid)
    y = b.node("Relu", f"{prefix}.relu1", [y])
    y = _conv(b, f"{prefix}.conv2", y, mid, mid, 3, stride)
    y = _bn(b, f"{prefix}.bn2", y, mid)
    y = b.node("Relu", f"{prefix}.relu2", [y])
    y = _conv(b, f"{prefix}.conv3", y, mid, cout, 1)
    y = _bn(b, f"{prefix}.bn3", y, cout)
    shortcut = x
    if downsample:
        shortcut = _conv(b, f"{prefix}.downsample.conv", x, cin, cout, 1, stride)
        shortcut = _bn(b, f"{prefix}.downsample.bn", shortcut, cout)
    y = b.node("Add", f"{prefix}.add", [y, shortcut])
    return b.node("Relu", f"{prefix}.relu_out", [y])


def _backbone(b: _GraphBuilder, images: str, num_classes: int, width: int, blocks: Sequence[int]) -> str:
    """Stem, four bottleneck stages and the classifier; returns the logits tensor."""
    y = _conv(b, "conv1", images, 3, width, 7, 2)
    y = _bn(b, "bn1", y, width)
    y = b.node("Relu", "relu1", [y])
    y = b.node("MaxPool", "maxpool", [y], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    channels = width
    for stage, count in enumerate(blocks):
        mid = width * 2**stage
        for index in range(count):
            first = index == 0
            stride = 2 if first and stage > 0 else 1
            y = _bottleneck(b, f"layer{stage + 1}.{index}", y, channels, mid, stride, downsample=first)
            channels = mid * EXPANSION
    y = b.node("GlobalAveragePool", "avgpool", [y])
    y = b.node("Flatten", "flatten", [y], axis=1)
    weight = b.param("fc.weight", [num_classes, channels], "he", fan_in=channels)
    bias = b.param("fc.bias", [num_classes], "small")
    return b.node("Gemm", "fc", [y, weight, bias], output="logits", transB=1)


def _softmax_cross_entropy(b: _GraphBuilder, logits: str, labels: str, num_classes: int) -> str:
    """Mean softmax cross-entropy, expanded into the small ops a planner must shard."""
    axes1 = b.constant("loss.axes_classes", np.array([1], dtype=np.int64))
    depth = b.constant("loss.depth", np.array(num_classes, dtype=np.int64))
    on_off = b.constant("loss.onehot_values", np.array([0.0, 1.0], dtype=np.float32))
    neg_one = b.constant("loss.neg_one", np.array(-1.0, dtype=np.float32))

    row_max = b.node("ReduceMax", "loss.reduce_max", [logits], axes=[1], keepdims=1)
    shifted = b.node("Sub", "loss.sub", [logits, row_max])
    exp = b.node("Exp", "loss.exp", [shifted])
    total = b.node("ReduceSum", "loss.reduce_sum", [exp, axes1], keepdims=1)
    softmax = b.node("Div", "loss.div", [exp, total])
    log_softmax = b.node("Log", "loss.log", [softmax])

    onehot = b.node("OneHot", "loss.onehot", [labels, depth, on_off], axis=-1)
    picked = b.node("Mul", "loss.mul", [onehot, log_softmax])
    per_sample = b.node("ReduceSum", "loss.sum_classes", [picked, axes1], keepdims=0)
    negated = b.node("Mul", "loss.neg", [per_sample, neg_one])
    return b.node("ReduceMean", "loss.mean", [negated], output="loss", axes=[0], keepdims=0)


def build_resnet50(
    batch: int = 256,
    num_classes: int = 1000,
    image_size: int = 224,
    weights: str = "elided",
    seed: int = 0,
    width: int = 64,
    blocks=(3, 4, 6, 3),
) -> onnx.ModelProto:
    """Return ResNet-50 v1.5 plus expanded cross-entropy loss as an ONNX model.

    ``width`` and ``blocks`` shrink the network for tests; the defaults give the
    standard 25,557,032-parameter ResNet-50.
    """
    b = _GraphBuilder(weights, seed)
    logits = _backbone(b, "images", num_classes, width, blocks)
    loss = _softmax_cross_entropy(b, logits, "labels", num_classes)

    inputs = [
        helper.make_tensor_value_info("images", TensorProto.FLOAT, [batch, 3, image_size, image_size]),
        helper.make_tensor_value_info("labels", TensorProto.INT64, [batch]),
    ]
    outputs = [
        helper.make_tensor_value_info(loss, TensorProto.FLOAT, []),
        helper.make_tensor_value_info(logits, TensorProto.FLOAT, [batch, num_classes]),
    ]
    graph = helper.make_graph(b.nodes, "resnet50_v1_5_train", inputs, outputs, initializer=b.initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="autopar.models")
    model.ir_version = IR_VERSION
    model.doc_string = (
        f"ResNet-50 v1.5 (torchvision layout, width={width}, blocks={tuple(blocks)}) with "
        f"expanded softmax cross-entropy loss; batch={batch}, classes={num_classes}, "
        f"image_size={image_size}, weights={weights}."
    )
    return model


def main(argv=None) -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--weights", choices=("elided", "random"), default="elided")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=os.path.join(here, "resnet50.onnx"))
    args = parser.parse_args(argv)

    model = build_resnet50(
        batch=args.batch, num_classes=args.classes, image_size=args.image_size, weights=args.weights, seed=args.seed
    )
    onnx.save(model, args.out)
    print(f"wrote {args.out} ({os.path.getsize(args.out)} bytes)")


if __name__ == "__main__":
    main()
