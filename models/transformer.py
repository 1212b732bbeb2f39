"""Build BERT-style encoder and GPT-style decoder stacks, with loss, as ONNX models.

The graphs are meant for a sharding planner, so they spell out every operator a
transformer layer costs, in the plain ONNX opset-17 operators a planner must
shard, and give every node a readable, unique name (``layer3.attn.q``,
``layer3.mlp.fc1``, ``embed.tok``) because plans are keyed by node name.
Every node has a single output named after the node.

Graph layout
------------
Inputs ``input_ids`` int64 [batch, seq] and, with ``loss=True``, ``labels``
int64 [batch, seq] (already shifted for a GPT: ``labels[:, t]`` is the target
of position ``t``).

* Embeddings: ``embed.tok`` = Gather(``embed.tok.weight`` [vocab, hidden],
  input_ids) (GPT-2's ``wte``); ``embed.pos`` = Add of ``embed.pos.weight``
  [seq, hidden] (``wpe``), broadcast over the batch.  BERT then applies
  ``embed.ln``.  BERT's token-type embeddings are left out.
* Attention (``layer{i}.attn.*``): separate Q, K and V projections, each a
  MatMul by a [hidden, hidden] weight plus a bias Add, rather than one fused
  [hidden, 3*hidden] QKV matrix, so a Megatron-style column split is
  expressible per projection and the split never has to cut through the
  middle of a fused weight.  Q and V are reshaped to [b, s, heads, dh] and
  transposed to [b, heads, s, dh]; K goes straight to [b, heads, dh, s].
  ``scores`` = MatMul(q, kT), ``scale`` = Mul by the scalar 1/sqrt(dh),
  ``mask`` (GPT only) = Add of the causal mask, ``softmax`` on the last axis,
  ``context`` = MatMul(probs, v), transposed and reshaped back to [b, s, h],
  then the output projection ``out`` (+ bias) and the ``residual`` Add.
* MLP (``layer{i}.mlp.*``): ``fc1`` [hidden, ffn] + bias, GELU, ``fc2``
  [ffn, hidden] + bias, GELU, ``fc2``
  [ffn, hidden] + bias, ``residual`` Add.  With ``gelu="expanded"`` (the
  default) the GELU is written out in opset-17 operators: BERT's erf form
  x*0.5*(1+erf(x/sqrt 2)), GPT-2's tanh form
  0.5*x*(1+tanh(sqrt(2/pi)*(x+0.044715*x^3))).  ``gelu="fused"`` uses opset
  20's Gelu operator (``approximate="tanh"`` for a GPT), and the model
  imports opset 20 (IR version 9).
* LayerNorm: ``layernorm="fused"`` uses LayerNormalization (axis -1, epsilon
  1e-5); ``"decomposed"`` writes it as ReduceMean, Sub, Pow, ReduceMean, Add,
  Sqrt, Div, Mul, Add.  Either way the normalised tensor carries the LayerNorm's
  name (``layer{i}.ln1``), so the rest of the graph is identical.  BERT is
  post-LN (``ln1`` after the attention residual, ``ln2`` after the MLP
  residual, plus ``embed.ln``); GPT is pre-LN (``ln1`` before attention,
  ``ln2`` before the MLP, plus ``ln_f`` after the last layer).
* Dropout: with ``dropout`` above 0, a training Dropout (opset 12's form: the ratio and a training mode of
  true as constants) on the attention probabilities (``attn.dropout``, read by ``context``) and on the
  attention's and the MLP's outputs before each residual (``attn.out.dropout``, ``mlp.dropout``), where
  Megatron-LM places them; with 0 (the default) there is none.
* Head and loss: ``logits`` = MatMul by an untied ``logits.weight``
  [hidden, vocab] (no bias) -> [b, s, vocab].  With ``loss=True`` the logits
  and labels are reshaped to [b*s, vocab] and [b*s] and fed to
  SoftmaxCrossEntropyLoss(reduction="mean"), whose scalar output is ``loss``.

The GPT causal mask is built in-graph from int64 pieces:
``mask.positions`` = Range(0, seq), ``mask.rows`` = Reshape to [seq, 1],
``mask.future`` = Less(rows, positions) (true above the diagonal) and ``mask``
= Where(future, -10000.0, 0.0), a float [seq, seq] tensor added to the
scores of every layer.  A stored [seq, seq] float initializer would cost
seq*seq*4 bytes (16 MB at seq 2048), and a float ConstantOfShape fed to Trilu
would look exactly like a weight-elided parameter to an importer that
recognises those; here the only float constants are scalars.

Parameters and constants
------------------------
Every parameter is a float tensor of rank >= 1 named ``<node>.weight`` or
``<node>.bias`` after the node that uses it (``layer3.attn.q.weight`` is read
by ``layer3.attn.q``, ``layer3.attn.q.bias`` by ``layer3.attn.q.bias_add``).
Configuration constants (reshape targets, the attention scale, GELU and
LayerNorm constants) are initializers named ``const.*`` or ``mask.*``; float
ones are scalars of shape [].

``weights="elided"``: like ``models/resnet50.py``, each parameter ``P`` is the
output of a ``ConstantOfShape`` node ``P__init`` fed by the int64 initializer
``P__shape``; fill 0.0, except LayerNorm scales which get 1.0.  No weight
array is ever allocated, so even the GPT-3 preset builds in about a second.
``weights="random"``: float32 initializers, normal(0, 0.02) for matrices and
embeddings as in GPT-2, zero biases, unit LayerNorm scales, seeded by ``seed``;
refused (ValueError) when the weights would not fit in one 2 GiB protobuf.

Usage::

    python models/transformer.py --preset gpt2 --batch 8 --out /tmp/gpt2.onnx
    python models/transformer.py --preset bert-base --layernorm decomposed \\
        --no-loss --out /tmp/bert.onnx
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
IR_VERSION = 8  # matches opset 17, as in models/resnet50.py
FUSED_GELU_OPSET, FUSED_GELU_IR_VERSION = 20, 9  # Gelu is an operator from opset 20 on
LN_EPSILON = 1e-5
MASK_VALUE = -10000.0
INIT_STD = 0.02
PROTOBUF_LIMIT = 2**31  # a serialized ModelProto must stay under 2 GB

KINDS = ("gpt", "bert")
WEIGHTS = ("elided", "random")
LAYERNORMS = ("fused", "decomposed")
GELUS = ("expanded", "fused")

# GPT vocab 50257 and BERT vocab 30522 padded to a multiple of 128, as Megatron-LM does.
GPT_VOCAB = 50304
BERT_VOCAB = 30592

PRESETS: dict[str, dict] = {
    "bert-base": dict(kind="bert", layers=12, hidden=768, heads=12, seq=512, vocab=BERT_VOCAB),
    "bert-large": dict(kind="bert", layers=24, hidden=1024, heads=16, seq=512, vocab=BERT_VOCAB),
    "gpt2": dict(kind="gpt", layers=12, hidden=768, heads=12, seq=1024, vocab=GPT_VOCAB),
    "gpt2-medium": dict(kind="gpt", layers=24, hidden=1024, heads=16, seq=1024, vocab=GPT_VOCAB),
    "gpt3": dict(kind="gpt", layers=96, hidden=12288, heads=96, seq=2048, vocab=GPT_VOCAB),
}


class _Builder:
    """Accumulates nodes, parameters and shared constants in topological order."""

    def __init__(self, weights: str, seed: int) -> None:
        self.weights = weights
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._constants: dict[str, str] = {}

    def node(self, op: str, name: str, inputs: Sequence[str], **attrs) -> str:
        """Append one node whose single output is named after the node."""
        self.nodes.append(helper.make_node(op, list(inputs), [name], name=name, **attrs))
        return name

    def constant(self, name: str, array: np.ndarray) -> str:
        """Add a configuration constant once; later calls with the same name reuse it."""
        if name not in self._constants:
            self.initializers.append(numpy_helper.from_array(np.asarray(array), name=name))
            self._constants[name] = name
        return name

    def scalar(self, name: str, value: float) -> str:
        """A float32 scalar constant of shape [] named ``const.<name>``."""
        return self.constant(f"const.{name}", np.array(value, dtype=np.float32))

    def param(self, name: str, shape: Sequence[int], init: str) -> str:
        """Create parameter ``name``; ``init`` is "normal", "zeros" or "ones"."""
        shape = [int(d) for d in shape]
        if self.weights == "elided":
            fill = 1.0 if init == "ones" else 0.0
            shape_name = self.constant(f"{name}__shape", np.array(shape, dtype=np.int64))
            value = helper.make_tensor("value", TensorProto.FLOAT, [1], [fill])
            self.nodes.append(
                helper.make_node("ConstantOfShape", [shape_name], [name], name=f"{name}__init", value=value)
            )
            return name
        if init == "normal":
            array = self.rng.standard_normal(shape, dtype=np.float32) * np.float32(INIT_STD)
        elif init == "ones":
            array = np.ones(shape, dtype=np.float32)
        else:
            array = np.zeros(shape, dtype=np.float32)
        self.initializers.append(numpy_helper.from_array(array, name=name))
        return name


def _linear(b: _Builder, name: str, x: str, fan_in: int, fan_out: int, bias: bool = True) -> str:
    """``name`` = MatMul(x, name.weight), then ``name.bias_add`` = Add(., name.bias)."""
    weight = b.param(f"{name}.weight", [fan_in, fan_out], "normal")
    y = b.node("MatMul", name, [x, weight])
    if bias:
        y = b.node("Add", f"{name}.bias_add", [y, b.param(f"{name}.bias", [fan_out], "zeros")])
    return y


def _layernorm(b: _Builder, name: str, x: str, hidden: int, mode: str) -> str:
    """LayerNorm over the last axis; the normalised output is always the tensor ``name``."""
    scale = b.param(f"{name}.weight", [hidden], "ones")
    bias = b.param(f"{name}.bias", [hidden], "zeros")
    if mode == "fused":
        return b.node("LayerNormalization", name, [x, scale, bias], axis=-1, epsilon=LN_EPSILON)
    mean = b.node("ReduceMean", f"{name}.mean", [x], axes=[-1], keepdims=1)
    centered = b.node("Sub", f"{name}.sub", [x, mean])
    squared = b.node("Pow", f"{name}.pow", [centered, b.scalar("two", 2.0)])
    var = b.node("ReduceMean", f"{name}.var", [squared], axes=[-1], keepdims=1)
    var_eps = b.node("Add", f"{name}.add_eps", [var, b.scalar("ln_eps", LN_EPSILON)])
    std = b.node("Sqrt", f"{name}.sqrt", [var_eps])
    normed = b.node("Div", f"{name}.div", [centered, std])
    scaled = b.node("Mul", f"{name}.mul", [normed, scale])
    return b.node("Add", name, [scaled, bias])


def _gelu(b: _Builder, name: str, x: str, kind: str, mode: str = "expanded") -> str:
    """GELU: erf form for BERT, tanh approximation for GPT; fused or written out; output ``name``."""
    if mode == "fused":
        return b.node("Gelu", name, [x], approximate="none" if kind == "bert" else "tanh")
    if kind == "bert":
        scaled = b.node("Div", f"{name}.div", [x, b.scalar("sqrt2", math.sqrt(2.0))])
        inner = b.node("Erf", f"{name}.erf", [scaled])
    else:
        cube = b.node("Pow", f"{name}.pow", [x, b.scalar("three", 3.0)])
        cube = b.node("Mul", f"{name}.mul_coef", [cube, b.scalar("gelu_coef", 0.044715)])
        poly = b.node("Add", f"{name}.add_x", [x, cube])
        poly = b.node("Mul", f"{name}.mul_sqrt", [poly, b.scalar("sqrt_2_over_pi", math.sqrt(2.0 / math.pi))])
        inner = b.node("Tanh", f"{name}.tanh", [poly])
    one_plus = b.node("Add", f"{name}.add_one", [inner, b.scalar("one", 1.0)])
    y = b.node("Mul", f"{name}.mul_x", [x, one_plus])
    return b.node("Mul", name, [y, b.scalar("half", 0.5)])


def _causal_mask(b: _Builder, seq: int) -> str:
    """Float [seq, seq] tensor ``mask``: 0 on and below the diagonal, -10000 above."""
    positions = b.node(
        "Range",
        "mask.positions",
        [
            b.constant("mask.start", np.array(0, dtype=np.int64)),
            b.constant("mask.limit", np.array(seq, dtype=np.int64)),
            b.constant("mask.delta", np.array(1, dtype=np.int64)),
        ],
    )
    rows = b.node(
        "Reshape", "mask.rows", [positions, b.constant("mask.rows_shape", np.array([seq, 1], dtype=np.int64))]
    )
    future = b.node("Less", "mask.future", [rows, positions])
    return b.node(
        "Where",
        "mask",
        [future, b.constant("mask.value", np.array(MASK_VALUE, dtype=np.float32)), b.scalar("zero", 0.0)],
    )


def _attention(b: _Builder, prefix: str, x: str, cfg: dict, mask: str | None) -> str:
    """Multi-head self-attention including output projection (no residual)."""
    batch, seq, hidden, heads = cfg["batch"], cfg["seq"], cfg["hidden"], cfg["heads"]
    head_dim = hidden // heads
    split_shape = b.constant("const.heads_shape", np.array([batch, seq, heads, head_dim], dtype=np.int64))
    merge_shape = b.constant("const.hidden_shape", np.array([batch, seq, hidden], dtype=np.int64))

    def project(which: str, perm: list[int]) -> str:
        y = _linear(b, f"{prefix}.{which}", x, hidden, hidden)
        y = b.node("Reshape", f"{prefix}.{which}.reshape", [y, split_shape])
        return b.node("Transpose", f"{prefix}.{which}.transpose", [y], perm=perm)

    q = project("q", [0, 2, 1, 3])  # [b, heads, s, dh]
    k = project("k", [0, 2, 3, 1])  # [b, heads, dh, s]
    v = project("v", [0, 2, 1, 3])  # [b, heads, s, dh]
    scores = b.node("MatMul", f"{prefix}.scores", [q, k])
    scores = b.node("Mul", f"{prefix}.scale", [scores, b.scalar("attn_scale", 1.0 / math.sqrt(head_dim))])
    if mask is not None:
        scores = b.node("Add", f"{prefix}.mask", [scores, mask])
    probs = _dropout(b, f"{prefix}.dropout", b.node("Softmax", f"{prefix}.softmax", [scores], axis=-1), cfg)
    context = b.node("MatMul", f"{prefix}.context", [probs, v])
    context = b.node("Transpose", f"{prefix}.context.transpose", [context], perm=[0, 2, 1, 3])
    context = b.node("Reshape", f"{prefix}.context.reshape", [context, merge_shape])
    return _dropout(b, f"{prefix}.out.dropout", _linear(b, f"{prefix}.out", context, hidden, hidden), cfg)


def _dropout(b: _Builder, name: str, x: str, cfg: dict) -> str:
    """A training Dropout of ``x`` at ``cfg["dropout"]``; ``x`` itself at 0."""
    if not cfg["dropout"]:
        return x
    ratio = b.scalar("dropout_ratio", cfg["dropout"])
    return b.node("Dropout", name, [x, ratio, b.constant("const.training", np.array(True))])


def _mlp(b: _Builder, prefix: str, x: str, cfg: dict) -> str:
    """fc1 + bias, GELU, fc2 + bias (no residual)."""
    y = _linear(b, f"{prefix}.fc1", x, cfg["hidden"], cfg["ffn"])
    y = _gelu(b, f"{prefix}.gelu", y, cfg["kind"], cfg["gelu"])
    return _dropout(b, f"{prefix}.dropout", _linear(b, f"{prefix}.fc2", y, cfg["ffn"], cfg["hidden"]), cfg)


def _layer(b: _Builder, index: int, x: str, cfg: dict, mask: str | None) -> str:
    """One encoder (post-LN, BERT) or decoder (pre-LN, GPT) layer."""
    p, h, ln = f"layer{index}", cfg["hidden"], cfg["layernorm"]
    if cfg["kind"] == "bert":
        x = b.node("Add", f"{p}.attn.residual", [x, _attention(b, f"{p}.attn", x, cfg, mask)])
        x = _layernorm(b, f"{p}.ln1", x, h, ln)
        x = b.node("Add", f"{p}.mlp.residual", [x, _mlp(b, f"{p}.mlp", x, cfg)])
        return _layernorm(b, f"{p}.ln2", x, h, ln)
    y = _layernorm(b, f"{p}.ln1", x, h, ln)
    x = b.node("Add", f"{p}.attn.residual", [x, _attention(b, f"{p}.attn", y, cfg, mask)])
    y = _layernorm(b, f"{p}.ln2", x, h, ln)
    return b.node("Add", f"{p}.mlp.residual", [x, _mlp(b, f"{p}.mlp", y, cfg)])


def _check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _validate(cfg: dict) -> None:
    if cfg["kind"] not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {cfg['kind']!r}")
    if cfg["weights"] not in WEIGHTS:
        raise ValueError(f"weights must be one of {WEIGHTS}, got {cfg['weights']!r}")
    if cfg["layernorm"] not in LAYERNORMS:
        raise ValueError(f"layernorm must be one of {LAYERNORMS}, got {cfg['layernorm']!r}")
    if cfg["gelu"] not in GELUS:
        raise ValueError(f"gelu must be one of {GELUS}, got {cfg['gelu']!r}")
    for key in ("layers", "hidden", "heads", "seq", "vocab", "batch", "ffn"):
        _check_positive_int(key, cfg[key])
    if cfg["hidden"] % cfg["heads"]:
        raise ValueError(f"hidden ({cfg['hidden']}) must be divisible by heads ({cfg['heads']})")
    if isinstance(cfg["seed"], bool) or not isinstance(cfg["seed"], (int, np.integer)) or cfg["seed"] < 0:
        raise ValueError(f"seed must be a non-negative integer, got {cfg['seed']!r}")
    if cfg["loss"] not in (True, False):
        raise ValueError(f"loss must be True or False, got {cfg['loss']!r}")
    if isinstance(cfg["dropout"], bool) or not isinstance(cfg["dropout"], (int, float)) or not 0 <= cfg["dropout"] < 1:
        raise ValueError(f"dropout must be a probability in [0, 1), got {cfg['dropout']!r}")
    if cfg["weights"] == "random":
        count = expected_parameter_count(
            cfg["kind"], cfg["layers"], cfg["hidden"], cfg["seq"], cfg["vocab"], cfg["ffn"]
        )
        if 4 * count >= PROTOBUF_LIMIT:
            raise ValueError(
                f"random weights for {count:,} parameters need {4 * count / 2**30:.1f} GiB, "
                "over the 2 GiB protobuf limit of one ONNX file; use weights='elided'"
            )


def build_transformer(
    kind: str = "gpt",
    layers: int = 12,
    hidden: int = 768,
    heads: int = 12,
    seq: int = 1024,
    vocab: int = GPT_VOCAB,
    batch: int = 8,
    ffn: int | None = None,
    weights: str = "elided",
    seed: int = 0,
    layernorm: str = "fused",
    loss: bool = True,
    gelu: str = "expanded",
    dropout: float = 0.0,
) -> onnx.ModelProto:
    """Return a BERT-style encoder (``kind="bert"``) or GPT-style decoder as an ONNX model.

    ``ffn`` defaults to ``4 * hidden``.  Raises ValueError on a bad argument.
    The defaults are GPT-2 small (124M with a tied head; 163M here, untied).
    """
    if ffn is None and isinstance(hidden, (int, np.integer)) and not isinstance(hidden, bool):
        ffn = 4 * int(hidden)
    cfg = dict(
        kind=kind,
        layers=layers,
        hidden=hidden,
        heads=heads,
        seq=seq,
        vocab=vocab,
        batch=batch,
        ffn=ffn,
        weights=weights,
        seed=seed,
        layernorm=layernorm,
        loss=loss,
        gelu=gelu,
        dropout=dropout,
    )
    _validate(cfg)
    for key in ("layers", "hidden", "heads", "seq", "vocab", "batch", "ffn", "seed"):
        cfg[key] = int(cfg[key])
    cfg["loss"] = loss = bool(loss)
    cfg["dropout"] = float(dropout)
    layers, hidden, seq, vocab, batch = (cfg[k] for k in ("layers", "hidden", "seq", "vocab", "batch"))

    b = _Builder(weights, cfg["seed"])
    wte = b.param("embed.tok.weight", [vocab, hidden], "normal")
    x = b.node("Gather", "embed.tok", [wte, "input_ids"], axis=0)
    x = b.node("Add", "embed.pos", [x, b.param("embed.pos.weight", [seq, hidden], "normal")])
    mask = None
    if kind == "bert":
        x = _layernorm(b, "embed.ln", x, hidden, layernorm)
    else:
        mask = _causal_mask(b, seq)
    for index in range(layers):
        x = _layer(b, index, x, cfg, mask)
    if kind == "gpt":
        x = _layernorm(b, "ln_f", x, hidden, layernorm)
    logits = _linear(b, "logits", x, hidden, vocab, bias=False)

    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [batch, seq])]
    outputs = [helper.make_tensor_value_info(logits, TensorProto.FLOAT, [batch, seq, vocab])]
    if loss:
        inputs.append(helper.make_tensor_value_info("labels", TensorProto.INT64, [batch, seq]))
        flat_logits = b.node(
            "Reshape",
            "loss.logits_2d",
            [logits, b.constant("const.logits_2d_shape", np.array([batch * seq, vocab], dtype=np.int64))],
        )
        flat_labels = b.node(
            "Reshape",
            "loss.labels_1d",
            ["labels", b.constant("const.labels_1d_shape", np.array([batch * seq], dtype=np.int64))],
        )
        b.node("SoftmaxCrossEntropyLoss", "loss", [flat_logits, flat_labels], reduction="mean")
        outputs.insert(0, helper.make_tensor_value_info("loss", TensorProto.FLOAT, []))

    graph_name = f"{kind}_{'encoder' if kind == 'bert' else 'decoder'}_{'train' if loss else 'forward'}"
    graph = helper.make_graph(b.nodes, graph_name, inputs, outputs, initializer=b.initializers)
    opset, ir_version = (FUSED_GELU_OPSET, FUSED_GELU_IR_VERSION) if gelu == "fused" else (OPSET, IR_VERSION)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], producer_name="autopar.models")
    model.ir_version = ir_version
    settings = ", ".join(
        f"{key}={cfg[key]}"
        for key in ("layers", "hidden", "heads", "seq", "vocab", "batch", "ffn", "layernorm", "gelu", "weights", "loss")
    )
    model.doc_string = (
        f"{'BERT-style post-LN encoder' if kind == 'bert' else 'GPT-style pre-LN decoder'}"
        f" built by models/transformer.py: {settings}."
    )
    helper.set_model_props(model, {key: str(cfg[key]) for key in cfg})
    return model


def build_preset(name: str, **overrides) -> onnx.ModelProto:
    """Build preset ``name`` from PRESETS; keyword ``overrides`` replace its settings."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return build_transformer(**{**PRESETS[name], **overrides})


def expected_parameter_count(kind: str, layers: int, hidden: int, seq: int, vocab: int, ffn: int | None = None) -> int:
    """Analytic parameter count of ``build_transformer`` with these settings.

    Per layer: Q, K, V, O weights and biases 4h^2 + 4h; MLP 2*h*f + f + h; two
    LayerNorms 4h.  Plus token embedding V*h, position embedding S*h, untied
    head V*h and one extra LayerNorm 2h (BERT's embedding LN, GPT's ln_f):

        L * (4h^2 + 2hf + f + 9h) + 2Vh + Sh + 2h

    With f = 4h the layers give the familiar 12 L h^2 (+ 13 L h).
    """
    f = 4 * hidden if ffn is None else ffn
    del kind  # both kinds have the same parameter set
    return (
        layers * (4 * hidden * hidden + 2 * hidden * f + f + 9 * hidden)
        + 2 * vocab * hidden
        + seq * hidden
        + 2 * hidden
    )


def parameter_shapes(model: onnx.ModelProto) -> dict[str, tuple]:
    """Name -> shape of every parameter, in either weight representation.

    A parameter is a float tensor of rank >= 1 that is either an initializer
    or the output of a ConstantOfShape node fed by an initializer (elided).
    """
    shapes: dict[str, tuple] = {}
    inits = {init.name: init for init in model.graph.initializer}
    float_types = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.BFLOAT16)
    for init in inits.values():
        if init.data_type in float_types and len(init.dims) > 0:
            shapes[init.name] = tuple(int(d) for d in init.dims)
    for node in model.graph.node:
        if node.op_type != "ConstantOfShape" or node.input[0] not in inits:
            continue
        fill = next((a.t for a in node.attribute if a.name == "value"), None)
        if fill is not None and fill.data_type not in float_types:
            continue
        shape = tuple(int(d) for d in numpy_helper.to_array(inits[node.input[0]]).reshape(-1))
        if shape:
            shapes[node.output[0]] = shape
    return shapes


def parameter_count(model: onnx.ModelProto) -> int:
    """Total number of parameter elements (see ``parameter_shapes``)."""
    return sum(math.prod(shape) for shape in parameter_shapes(model).values())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        help="start from a preset (default: build_transformer's GPT-2-sized defaults)",
    )
    for flag in ("layers", "hidden", "heads", "seq", "vocab", "batch", "ffn", "seed"):
        parser.add_argument(f"--{flag}", type=int, default=None)
    parser.add_argument("--kind", choices=KINDS, default=None)
    parser.add_argument("--weights", choices=WEIGHTS, default=None)
    parser.add_argument("--layernorm", choices=LAYERNORMS, default=None)
    parser.add_argument("--gelu", choices=GELUS, default=None)
    parser.add_argument(
        "--dropout", type=float, default=None, help="a training Dropout's ratio, where Megatron-LM drops"
    )
    parser.add_argument(
        "--no-loss", dest="loss", action="store_false", help="end at the logits; no labels input and no loss output"
    )
    parser.add_argument("--out", required=True, help="path of the .onnx file to write")
    args = parser.parse_args(argv)

    overrides = {key: value for key, value in vars(args).items() if key not in ("preset", "out") and value is not None}
    try:
        if args.preset:
            model = build_preset(args.preset, **overrides)
        else:
            model = build_transformer(**overrides)
    except ValueError as exc:
        parser.error(str(exc))
    directory = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(directory, exist_ok=True)
    onnx.save(model, args.out)
    print(
        f"wrote {args.out} ({os.path.getsize(args.out)} bytes, "
        f"{len(model.graph.node)} nodes, {parameter_count(model):,} parameters)"
    )


if __name__ == "__main__":
    main()
