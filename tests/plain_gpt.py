"""A second GPT builder, written unlike `models/transformer.py`, for tests and benchmarks of the search.

What differs, on purpose (these are what real exports do and our own builder does not):
separate Q/K/V projections, each with its own bias; K transposed by two Transposes; the score
scale as a Div; GELU written out as Div/Erf/Add/Mul/Mul on shared scalar initializers; every
layer reading one causal-mask *initializer* (float [1, 1, seq, seq], so the importer takes it for
a weight); optionally a tied embedding read at both ends (Gather at the bottom, MatMul with its
Transpose at the top); weights as external-data initializers pointing at a file never written
(autopar reads only their shapes), so a 175B model is a few hundred kilobytes.

    >>> model = build_plain_gpt(layers=2, hidden=64, heads=4, seq=16, vocab=128, batch=2)
    >>> sorted({n.op_type for n in model.graph.node})[:4]
    ['Add', 'Div', 'Erf', 'Gather']
"""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
EXTERNAL = "plain_gpt.weights-never-written"


class _Graph:
    def __init__(self, stored: bool, seed: int) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.stored = stored
        self.rng = np.random.default_rng(seed)
        self.offset = 0
        self.count = 0

    def op(self, op_type: str, inputs: list[str], **attrs: object) -> str:
        self.count += 1
        out = f"t{self.count}"
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=f"n{self.count}_{op_type}", **attrs))
        return out

    def value(self, name: str, array: np.ndarray) -> str:
        self.initializers.append(numpy_helper.from_array(array, name=name))
        return name

    def weight(self, name: str, shape: list[int], fill: float | None = None) -> str:
        if self.stored:
            if fill is None:
                array = (self.rng.standard_normal(shape) * 0.02).astype(np.float32)
            else:
                array = np.full(shape, fill, dtype=np.float32)
            return self.value(name, array)
        tensor = onnx.TensorProto(name=name, data_type=TensorProto.FLOAT, dims=shape)
        nbytes = 4 * math.prod(shape)
        tensor.data_location = TensorProto.EXTERNAL
        for key, val in (("location", EXTERNAL), ("offset", str(self.offset)), ("length", str(nbytes))):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, val
        self.offset += nbytes
        self.initializers.append(tensor)
        return name


def build_plain_gpt(
    layers: int = 4,
    hidden: int = 256,
    heads: int = 4,
    seq: int = 128,
    vocab: int = 1024,
    batch: int = 8,
    tied: bool = False,
    shared_weight: bool = False,
    shared_layers: bool = False,
    stored: bool = True,
    seed: int = 0,
) -> onnx.ModelProto:
    """A pre-LN GPT with its loss; ``stored=False`` writes weights as external data that is never read.

    ``shared_weight`` applies one trained projection, shared by every layer, to each attention output
    (ALBERT shares its layers' weights): a parameter every copy of the block reads from outside it.
    ``shared_layers`` is ALBERT itself: every layer's projections use one set of weights, each stored
    as torch stores a Linear's (out, in) and transposed once before the layers, so every copy reads
    six Transposes of parameters from outside it.
    """
    g = _Graph(stored, seed)
    head_dim = hidden // heads
    sqrt2 = g.value("c_sqrt2", np.array(math.sqrt(2.0), dtype=np.float32))
    one = g.value("c_one", np.array(1.0, dtype=np.float32))
    half = g.value("c_half", np.array(0.5, dtype=np.float32))
    scale = g.value("c_scale", np.array(math.sqrt(head_dim), dtype=np.float32))
    mask = g.value("causal_mask", np.triu(np.full((1, 1, seq, seq), -1e4, dtype=np.float32), k=1))
    split = g.value("c_split", np.array([batch, seq, heads, head_dim], dtype=np.int64))
    merge = g.value("c_merge", np.array([batch, seq, hidden], dtype=np.int64))

    shared = g.weight("shared_weight", [hidden, hidden]) if shared_weight else None
    wte = g.weight("wte", [vocab, hidden])
    x = g.op("Gather", [wte, "ids"], axis=0)
    sizes = {"q": (hidden, hidden), "k": (hidden, hidden), "v": (hidden, hidden), "o": (hidden, hidden)}
    sizes |= {"fc": (hidden, 4 * hidden), "proj": (4 * hidden, hidden)}
    transposed = {
        name: g.op("Transpose", [g.weight(f"shared.{name}.w", [fan_out, fan_in])], perm=[1, 0])
        for name, (fan_in, fan_out) in sizes.items()
        if shared_layers
    }
    x = g.op("Add", [x, g.weight("wpe", [seq, hidden])])
    for layer in range(layers):
        p = f"h{layer}."

        def norm(name: str, t: str, p: str = p) -> str:
            return g.op(
                "LayerNormalization",
                [t, g.weight(p + name + ".g", [hidden], 1.0), g.weight(p + name + ".b", [hidden], 0.0)],
                axis=-1,
                epsilon=1e-5,
            )

        def dense(name: str, t: str, fan_in: int, fan_out: int, p: str = p) -> str:
            w = transposed[name] if transposed else g.weight(p + name + ".w", [fan_in, fan_out])
            y = g.op("MatMul", [t, w])
            return g.op("Add", [g.weight(p + name + ".b", [fan_out], 0.0), y])

        y = norm("ln1", x)
        q = g.op("Transpose", [g.op("Reshape", [dense("q", y, hidden, hidden), split])], perm=[0, 2, 1, 3])
        k = g.op("Transpose", [g.op("Reshape", [dense("k", y, hidden, hidden), split])], perm=[0, 2, 1, 3])
        v = g.op("Transpose", [g.op("Reshape", [dense("v", y, hidden, hidden), split])], perm=[0, 2, 1, 3])
        scores = g.op("Div", [g.op("MatMul", [q, g.op("Transpose", [k], perm=[0, 1, 3, 2])]), scale])
        probs = g.op("Softmax", [g.op("Add", [scores, mask])], axis=-1)
        context = g.op("Reshape", [g.op("Transpose", [g.op("MatMul", [probs, v])], perm=[0, 2, 1, 3]), merge])
        attended = dense("o", context, hidden, hidden)
        if shared is not None:
            attended = g.op("MatMul", [attended, shared])
        x = g.op("Add", [x, attended])
        h = dense("fc", norm("ln2", x), hidden, 4 * hidden)
        h = g.op("Mul", [g.op("Mul", [h, g.op("Add", [g.op("Erf", [g.op("Div", [h, sqrt2])]), one])]), half])
        x = g.op("Add", [x, dense("proj", h, 4 * hidden, hidden)])
    x = g.op("LayerNormalization", [x, g.weight("lnf.g", [hidden], 1.0), g.weight("lnf.b", [hidden], 0.0)], axis=-1)
    head = g.op("Transpose", [wte], perm=[1, 0]) if tied else g.weight("head", [hidden, vocab])
    logits = g.op("MatMul", [x, head])
    flat = g.op("Reshape", [logits, g.value("c_flat", np.array([batch * seq, vocab], dtype=np.int64))])
    labels = g.op("Reshape", ["labels", g.value("c_flat_labels", np.array([batch * seq], dtype=np.int64))])
    g.nodes.append(helper.make_node("SoftmaxCrossEntropyLoss", [flat, labels], ["loss"], name="loss"))
    graph = helper.make_graph(
        g.nodes,
        "plain_gpt",
        [
            helper.make_tensor_value_info("ids", TensorProto.INT64, [batch, seq]),
            helper.make_tensor_value_info("labels", TensorProto.INT64, [batch, seq]),
        ],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        initializer=g.initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="plain_gpt")
    model.ir_version = 8
    return model
