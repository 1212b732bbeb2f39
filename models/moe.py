"""Build an OLMoE-style mixture-of-experts decoder in opset-23 fused operators.

Usage: python models/moe.py --out moe.onnx [--layers 2 --hidden 64 --heads 4 --kv-heads 2 --experts 8
                                            --top-k 2 --ffn 128 --seq 16 --vocab 128 --batch 8
                                            --routing einsum|gather]

A second builder unlike ``models/transformer.py``: each layer is RMSNormalization, grouped-query
attention as one ``Attention`` operator (causal) on queries and keys rotated by ``RotaryEmbedding``
(position ids, cos/sin tables), then a mixture of experts with top-k routing, as GShard and OLMoE
train it. The experts are batched matrix products over the expert axis: gate, up and down weights
``[experts, hidden, ffn]`` / ``[experts, ffn, hidden]`` (SwiGLU). Tokens reach them through
dense dispatch and combine tensors ``[batch, seq, experts, capacity]``: the router's TopK picks
experts, OneHot and CumSum give each token its slot in an expert's buffer (tokens past the
capacity are dropped), ``Einsum("bsec,bsh->ebch")`` gathers each expert's tokens and
``Einsum("bsec,ebch->bsh")`` brings the weighted results back. Between a plan that splits the
batch and one that splits the experts, those two tensors are the tokens an AllToAll moves.
``routing="gather"`` moves them by index instead, as Hugging Face's experts do: each slot's token
position, ``GatherND`` into the expert buffers and ``ScatterND`` (add) back into the token rows.

The loss is the mean token cross-entropy of an untied LM head. Weights are stored (seeded normal
values, norms at one); the position ids, the rotary tables and the routing constants are constants.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET, IR_VERSION = 23, 10  # Attention, RMSNormalization and RotaryEmbedding are operators from opset 23 on
INIT_STD = 0.02
EPSILON = 1e-6
ROUTINGS = ("einsum", "gather")


class _Builder:
    """Nodes and initializers in topological order; each node's single output named after it."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []

    def node(self, op: str, name: str, inputs: Sequence[str], outputs: int = 1, **attrs: object) -> str:
        names = [name] if outputs == 1 else [f"{name}.{i}" for i in range(outputs)]
        self.nodes.append(helper.make_node(op, list(inputs), names, name=name, **attrs))
        return name if outputs == 1 else names[0]

    def constant(self, name: str, array: np.ndarray) -> str:
        if all(t.name != name for t in self.initializers):
            self.initializers.append(numpy_helper.from_array(np.asarray(array), name=name))
        return name

    def shape(self, dims: Sequence[int]) -> str:
        return self.constant("shape." + "x".join(str(d) for d in dims), np.array(dims, dtype=np.int64))

    def param(self, name: str, shape: Sequence[int], ones: bool = False) -> str:
        if ones:
            array = np.ones(shape, dtype=np.float32)
        else:
            array = self.rng.standard_normal(list(shape), dtype=np.float32) * np.float32(INIT_STD)
        self.initializers.append(numpy_helper.from_array(array, name=name))
        return name


def _attention(b: _Builder, p: str, x: str, cfg: dict) -> str:
    batch, seq, hidden, heads, kv_heads = cfg["batch"], cfg["seq"], cfg["hidden"], cfg["heads"], cfg["kv_heads"]
    size = hidden // heads

    def project(which: str, count: int, rotate: bool) -> str:
        y = b.node("MatMul", f"{p}.{which}_proj", [x, b.param(f"{p}.{which}_proj.weight", [hidden, count * size])])
        y = b.node("Reshape", f"{p}.{which}_heads", [y, b.shape([batch, seq, count, size])])
        y = b.node("Transpose", f"{p}.{which}_first", [y], perm=[0, 2, 1, 3])
        if rotate:
            y = b.node("RotaryEmbedding", f"{p}.{which}_rotary", [y, "rotary.cos", "rotary.sin", "position_ids"])
        return y

    q, k, v = project("q", heads, True), project("k", kv_heads, True), project("v", kv_heads, False)
    y = b.node("Attention", f"{p}.attention", [q, k, v], is_causal=1)
    y = b.node("Transpose", f"{p}.attention_last", [y], perm=[0, 2, 1, 3])
    y = b.node("Reshape", f"{p}.attention_merged", [y, b.shape([batch, seq, hidden])])
    return b.node("MatMul", f"{p}.o_proj", [y, b.param(f"{p}.o_proj.weight", [hidden, hidden])])


def capacity(cfg: dict) -> int:
    """Slots per expert and sequence: an even share of the routed tokens times the capacity factor."""
    return math.ceil(cfg["seq"] * cfg["top_k"] * cfg["capacity_factor"] / cfg["experts"])


def _experts(b: _Builder, p: str, x: str, cfg: dict) -> str:
    batch, seq, hidden = cfg["batch"], cfg["seq"], cfg["hidden"]
    experts, top_k, slots = cfg["experts"], cfg["top_k"], capacity(cfg)
    logits = b.node("MatMul", f"{p}.router", [x, b.param(f"{p}.router.weight", [hidden, experts])])
    probabilities = b.node("Softmax", f"{p}.router_softmax", [logits], axis=-1)
    top = f"{p}.top_k"
    b.node("TopK", top, [probabilities, b.constant("moe.top_k", np.array([top_k], np.int64))], outputs=2, axis=-1)
    weights, chosen = f"{top}.0", f"{top}.1"
    off_on = b.constant("moe.off_on", np.array([0.0, 1.0], np.float32))
    picked = b.node("OneHot", f"{p}.picked", [chosen, b.constant("moe.experts", np.array(experts)), off_on], axis=-1)
    routed = b.node("Reshape", f"{p}.routed", [picked, b.shape([batch, seq * top_k, experts])])
    count = b.node("CumSum", f"{p}.count", [routed, b.constant("moe.token_axis", np.array(1, np.int64))])
    one = b.constant("moe.one", np.array(1.0, np.float32))
    position = b.node("Cast", f"{p}.position", [b.node("Sub", f"{p}.slot_index", [count, one])], to=TensorProto.INT64)
    slot = b.node("OneHot", f"{p}.slot", [position, b.constant("moe.capacity", np.array(slots)), off_on], axis=-1)
    unsqueeze = b.constant("moe.last_axis", np.array([-1], np.int64))
    taken = b.node("Mul", f"{p}.taken", [slot, b.node("Unsqueeze", f"{p}.routed_slots", [routed, unsqueeze])])
    taken = b.node("Reshape", f"{p}.taken_per_choice", [taken, b.shape([batch, seq, top_k, experts, slots])])
    choice_axis = b.constant("moe.choice_axis", np.array([2], np.int64))
    dispatch = b.node("ReduceSum", f"{p}.dispatch", [taken, choice_axis], keepdims=0)
    gate = b.node("Reshape", f"{p}.gate", [weights, b.shape([batch, seq, top_k, 1, 1])])
    weighted = b.node("Mul", f"{p}.weighted", [taken, gate])
    combine = b.node("ReduceSum", f"{p}.combine", [weighted, choice_axis], keepdims=0)
    if cfg["routing"] == "gather":
        return _gathered_experts(b, p, x, dispatch, combine, cfg)
    tokens = b.node("Einsum", f"{p}.expert_inputs", [dispatch, x], equation="bsec,bsh->ebch")
    tokens = b.node("Reshape", f"{p}.expert_rows", [tokens, b.shape([experts, batch * slots, hidden])])
    out = _swiglu_experts(b, p, tokens, cfg)
    out = b.node("Reshape", f"{p}.expert_outputs", [out, b.shape([experts, batch, slots, hidden])])
    return b.node("Einsum", f"{p}.combined", [combine, out], equation="bsec,ebch->bsh")


def _swiglu_experts(b: _Builder, p: str, tokens: str, cfg: dict) -> str:
    """SwiGLU experts as MatMuls over the expert axis: [experts, rows, hidden] -> [experts, rows, hidden]."""
    experts, hidden, ffn = cfg["experts"], cfg["hidden"], cfg["ffn"]
    up = b.node("MatMul", f"{p}.experts.up", [tokens, b.param(f"{p}.experts.up_proj", [experts, hidden, ffn])])
    gated = b.node("MatMul", f"{p}.experts.gate", [tokens, b.param(f"{p}.experts.gate_proj", [experts, hidden, ffn])])
    silu = b.node("Mul", f"{p}.experts.silu", [gated, b.node("Sigmoid", f"{p}.experts.sigmoid", [gated])])
    hidden_states = b.node("Mul", f"{p}.experts.swiglu", [silu, up])
    down = b.param(f"{p}.experts.down_proj", [experts, ffn, hidden])
    return b.node("MatMul", f"{p}.experts.down", [hidden_states, down])


def _gathered_experts(b: _Builder, p: str, x: str, dispatch: str, combine: str, cfg: dict) -> str:
    """The experts reached by indices, as Hugging Face's eager experts index tokens
    (``hidden_states[token_idx]``) and return them (``index_add_``), with static capacity buffers:
    each slot's token position read off the dispatch tensor, ``GatherND`` (batch_dims 1) fills
    ``[batch, experts, capacity, hidden]``, and ``ScatterND`` (add) sums the weighted results into the
    token rows. An empty slot points at its sequence's first token with weight zero."""
    batch, seq, hidden = cfg["batch"], cfg["seq"], cfg["hidden"]
    experts, slots = cfg["experts"], capacity(cfg)
    scalars = [
        b.constant(f"moe.{name}", np.array(v, np.float32)) for name, v in (("zero", 0), ("seq", seq), ("one", 1))
    ]
    positions = b.node("Range", f"{p}.positions", scalars)  # built in the graph: a table, not a weight
    where = b.node("Einsum", f"{p}.slot_position", [dispatch, positions], equation="bsec,s->bec")
    token = b.node("Cast", f"{p}.slot_token", [where], to=TensorProto.INT64)
    last = b.constant("moe.last_axis", np.array([-1], np.int64))
    index = b.node("Unsqueeze", f"{p}.slot_index_tuple", [token, last])
    tokens = b.node("GatherND", f"{p}.expert_inputs", [x, index], batch_dims=1)
    tokens = b.node("Transpose", f"{p}.expert_first", [tokens], perm=[1, 0, 2, 3])
    tokens = b.node("Reshape", f"{p}.expert_rows", [tokens, b.shape([experts, batch * slots, hidden])])
    out = _swiglu_experts(b, p, tokens, cfg)
    choice_axis = b.constant("moe.sequence_axis", np.array([1], np.int64))
    weight = b.node("ReduceSum", f"{p}.slot_weight", [combine, choice_axis], keepdims=0)
    weight = b.node("Transpose", f"{p}.slot_weight_expert_first", [weight], perm=[1, 0, 2])
    weight = b.node("Reshape", f"{p}.slot_weight_rows", [weight, b.shape([experts, batch * slots, 1])])
    weighted = b.node("Mul", f"{p}.expert_weighted", [out, weight])
    offsets = b.constant("moe.row_offsets", (np.arange(batch, dtype=np.int64) * seq).reshape(batch, 1, 1))
    row = b.node("Add", f"{p}.slot_row", [token, offsets])
    row = b.node("Transpose", f"{p}.slot_row_expert_first", [row], perm=[1, 0, 2])
    row = b.node("Reshape", f"{p}.slot_rows", [row, b.shape([experts, batch * slots, 1])])
    zero = b.constant("moe.zero", np.array(0.0, np.float32))
    zeros = b.node("Expand", f"{p}.token_rows", [zero, b.shape([batch * seq, hidden])])
    summed = b.node("ScatterND", f"{p}.combined_rows", [zeros, row, weighted], reduction="add")
    return b.node("Reshape", f"{p}.combined", [summed, b.shape([batch, seq, hidden])])


def _rms_norm(b: _Builder, name: str, x: str, hidden: int) -> str:
    return b.node("RMSNormalization", name, [x, b.param(f"{name}.weight", [hidden], ones=True)], epsilon=EPSILON)


def build_moe(
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    experts: int = 8,
    top_k: int = 2,
    ffn: int = 128,
    seq: int = 16,
    vocab: int = 128,
    batch: int = 8,
    capacity_factor: float = 2.0,
    seed: int = 0,
    routing: str = "einsum",
) -> onnx.ModelProto:
    """The model as an `onnx.ModelProto` (inputs ``ids`` and ``labels`` [batch, seq]; output ``loss``).

    ``routing``: ``"einsum"`` moves tokens with dense dispatch and combine Einsums, ``"gather"`` with
    GatherND and ScatterND on slot indices.
    """
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, got {routing!r}")
    cfg = dict(
        batch=batch,
        seq=seq,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        experts=experts,
        top_k=top_k,
        ffn=ffn,
        capacity_factor=capacity_factor,
    )
    for key, value in {**cfg, "layers": layers, "vocab": vocab}.items():
        if value <= 0:
            raise ValueError(f"{key} must be positive, got {value}")
    if hidden % heads or heads % kv_heads or (hidden // heads) % 2:
        raise ValueError(
            f"heads ({heads}) must divide hidden ({hidden}) into even head sizes, and kv_heads must divide heads"
        )
    if top_k > experts:
        raise ValueError(f"top_k ({top_k}) must not exceed experts ({experts})")
    cfg["routing"] = routing
    b = _Builder(seed)
    half = hidden // heads // 2
    angles = np.outer(np.arange(seq), 1.0 / 10000.0 ** (np.arange(half) / half))
    b.constant("rotary.cos", np.cos(angles).astype(np.float32))
    b.constant("rotary.sin", np.sin(angles).astype(np.float32))
    b.constant("position_ids", np.tile(np.arange(seq, dtype=np.int64), (batch, 1)))
    x = b.node("Gather", "embed", [b.param("embed.weight", [vocab, hidden]), "ids"])
    for index in range(layers):
        p = f"layers.{index}"
        attended = _attention(b, f"{p}.self_attn", _rms_norm(b, f"{p}.input_norm", x, hidden), cfg)
        x = b.node("Add", f"{p}.attention_residual", [x, attended])
        mixed = _experts(b, f"{p}.mlp", _rms_norm(b, f"{p}.post_attention_norm", x, hidden), cfg)
        x = b.node("Add", f"{p}.mlp_residual", [x, mixed])
    x = _rms_norm(b, "norm", x, hidden)
    logits = b.node("MatMul", "lm_head", [x, b.param("lm_head.weight", [hidden, vocab])])
    classes_second = b.node("Transpose", "logits_classes", [logits], perm=[0, 2, 1])
    b.node("SoftmaxCrossEntropyLoss", "loss", [classes_second, "labels"], reduction="mean")
    graph = helper.make_graph(
        b.nodes,
        "moe",
        [
            helper.make_tensor_value_info("ids", TensorProto.INT64, [batch, seq]),
            helper.make_tensor_value_info("labels", TensorProto.INT64, [batch, seq]),
        ],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        initializer=b.initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="autopar.models")
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model)
    return model


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag in ("layers", "hidden", "heads", "kv-heads", "experts", "top-k", "ffn", "seq", "vocab", "batch", "seed"):
        parser.add_argument(f"--{flag}", type=int, default=None)
    parser.add_argument("--capacity-factor", type=float, default=None)
    parser.add_argument(
        "--routing", choices=ROUTINGS, default=None, help="tokens moved by dispatch Einsums or by GatherND/ScatterND"
    )
    parser.add_argument("--out", required=True, help="path of the .onnx file to write")
    args = parser.parse_args(argv)
    overrides = {key: value for key, value in vars(args).items() if key != "out" and value is not None}
    try:
        model = build_moe(**overrides)
    except ValueError as exc:
        parser.error(str(exc))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    onnx.save(model, args.out)
    print(f"wrote {args.out} ({os.path.getsize(args.out)} bytes, {len(model.graph.node)} nodes)")


if __name__ == "__main__":
    main()
