"""Fused attention operators of opsets 23 and 24: Attention and RotaryEmbedding.

Attention (scaled dot product, MHA, GQA and MQA) splits the batch and the heads. Each query
head attends its own keys and values, so a split of the heads by f gives every rank f-th of the
query heads and the same f-th of the key/value heads: query head i reads key head i // (q_heads /
kv_heads), and the contiguous chunks line up whenever f divides both head counts, which the one
label ``h`` on both asks. The key sequence stays whole (a softmax over it), and so does the query
sequence (a causal mask aligns a query with its offset among the keys). The mask, the past and
present caches, the debug scores and ``nonpad_kv_seqlen`` follow the batch and heads where they
have those axes; a mask axis of size 1 broadcasts and stays whole. In the 3-D form (heads folded
into the hidden axis, counted by attributes) only the batch splits: a local kernel would need
local head counts, and exporters write the 4-D form.

RotaryEmbedding rotates each (batch, head, position) row of X by its own angle: the batch, heads
and sequence split, the rotated axis stays whole. With ``position_ids`` the cos/sin caches are
tables indexed by them (whole on every rank; the ids split with the batch and sequence); without,
the caches are per (batch, position) and split as X's batch and sequence do.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from autopar.ops.base import OpSpec, shape, tensors
from autopar.ops.cases import I64, B, F, const, named, one, weight
from autopar.ops.registry import Keeps, MindSporePrimitive, register

if TYPE_CHECKING:
    from autopar.ops.views import GraphView, NodeView

Q, K, V, MASK, PAST_KEY, PAST_VALUE, NONPAD = range(7)


def _slot(inputs: Sequence[Any], slot: int) -> Any:
    return inputs[slot] if slot < len(inputs) else None


def attention_flops(
    in_shapes: Sequence[Sequence[int] | None], out_shapes: Sequence[Sequence[int]], attrs: Mapping[str, Any]
) -> float:
    """Two products (scores, then the weighted values) and about five operations a score for the softmax."""
    q, v, y = in_shapes[Q] or (), in_shapes[V] or (), out_shapes[0]
    past = in_shapes[PAST_KEY] if len(in_shapes) > PAST_KEY and in_shapes[PAST_KEY] else None
    if len(q) == 4:
        batch, heads, queries, head_size = q
        keys, value_size = v[2] + (past[2] if past else 0), y[3]
    else:
        heads = int(attrs["q_num_heads"])
        batch, queries, head_size = q[0], q[1], q[2] // heads
        keys, value_size = v[1] + (past[2] if past else 0), y[2] // heads
    scores = float(batch * heads * queries * keys)
    return scores * (2.0 * head_size + 2.0 * value_size + 5.0)


def _heads_first(t: Any, x: Any, heads: int) -> Any:
    """[batch, sequence, heads x size] -> [batch, heads, sequence, size]."""
    return x.reshape(x.shape[0], x.shape[1], heads, -1).transpose(1, 2)


def torch_attention(t: Any, op: NodeView, inputs: list[Any]) -> list[Any]:
    """Attention as opset 24 defines it: scores scaled, soft-capped, masked (mask, causal, padding), softmaxed.

    A row whose every key is masked gives zeros, not NaN, as the operator's errata say.
    """
    inputs = tensors(t, inputs)
    q, k, v = inputs[Q], inputs[K], inputs[V]
    mask, past_key, past_value, nonpad = (_slot(inputs, s) for s in (MASK, PAST_KEY, PAST_VALUE, NONPAD))
    three_d = q.dim() == 3
    if three_d:
        q = _heads_first(t, q, int(op.attrs["q_num_heads"]))
        k = _heads_first(t, k, int(op.attrs["kv_num_heads"]))
        v = _heads_first(t, v, int(op.attrs["kv_num_heads"]))
    past = 0
    if past_key is not None:
        past = past_key.shape[2]
        k, v = t.cat([past_key, k], dim=2), t.cat([past_value, v], dim=2)
    present_key, present_value = k, v
    queries, keys = q.shape[2], k.shape[2]
    scale = float(op.attrs.get("scale", 1.0 / math.sqrt(q.shape[-1])))
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = t.matmul(q * math.sqrt(scale), (k * math.sqrt(scale)).transpose(-1, -2))
    stages = [scores]
    softcap = float(op.attrs.get("softcap", 0.0))
    if softcap > 0:
        scores = softcap * t.tanh(scores / softcap)
    stages.append(scores)
    neg_inf = t.tensor(float("-inf"), dtype=scores.dtype)
    if mask is not None:
        bias = t.where(mask, t.zeros((), dtype=scores.dtype), neg_inf) if mask.dtype == t.bool else mask
        if bias.shape[-1] < keys:  # opset 24: a shorter mask is padded with -inf
            pad = t.full((*bias.shape[:-1], keys - bias.shape[-1]), float("-inf"), dtype=scores.dtype)
            bias = t.cat([bias, pad], dim=-1)
        scores = scores + bias
    rows = t.arange(queries).reshape(-1, 1)
    cols = t.arange(keys).reshape(1, -1)
    if nonpad is not None:
        valid = nonpad.reshape(-1, 1, 1, 1)
        scores = scores.masked_fill(cols >= valid, float("-inf"))
    if int(op.attrs.get("is_causal", 0)):
        offset = past if nonpad is None else nonpad.reshape(-1, 1, 1, 1) - queries
        scores = scores.masked_fill(cols > rows + offset, float("-inf"))
    stages.append(scores)
    masked = t.isneginf(scores.amax(dim=-1, keepdim=True))
    probabilities = t.softmax(scores.masked_fill(masked, 0.0), dim=-1).masked_fill(masked, 0.0)
    stages.append(probabilities)
    y = t.matmul(probabilities, v)
    if three_d:
        y = y.transpose(1, 2).reshape(y.shape[0], queries, -1)
    outputs = [y, present_key, present_value, stages[int(op.attrs.get("qk_matmul_output_mode", 0))]]
    return [value for value, name in zip(outputs, op.outputs) if name]


def _mask_labels(mask_shape: Sequence[int], full: Sequence[int], labels: Sequence[str | None]) -> tuple:
    """A mask broadcast to [batch, heads, queries, keys]: the batch and heads where it has them in full."""
    offset = len(full) - len(mask_shape)
    return tuple(
        labels[offset + d] if size == full[offset + d] and size > 1 else None for d, size in enumerate(mask_shape)
    )


def _valid_keys(op: NodeView, graph: GraphView) -> int:
    """``nonpad_kv_seqlen`` counts valid keys: from 0 to the key sequence's length."""
    return shape(graph, op.inputs[K])[-2] + 1


@register(
    "Attention",
    since=23,
    mindspore=MindSporePrimitive(
        "ops.operations.nn_ops.FlashAttentionScore", 3, needs_args=True, note="head_num is an argument"
    ),
    flops=attention_flops,
    keeps=Keeps.INPUTS | Keeps.OUTPUTS,  # Q, K, V and Y, as a fused kernel's backward reads them
    index_bounds={NONPAD: _valid_keys},
    config_inputs=frozenset({MASK}),  # a stored mask is never trained
    torch_kernel=torch_attention,
)
def attention(op: NodeView, graph: GraphView) -> OpSpec:
    """The batch and (in the 4-D form) the heads split; sequences and head sizes stay whole."""
    q_shape = shape(graph, op.inputs[Q])
    h = "h" if len(q_shape) == 4 else None
    x = ("b", h, None, None) if h else ("b", None, None)
    cache = ("b", h, None, None)
    full = (q_shape[0], q_shape[1], q_shape[2], 0) if h else (q_shape[0], int(op.attrs["q_num_heads"]), 0, 0)
    labels: list[tuple | None] = [x, x, x]
    for slot in range(MASK, len(op.inputs)):
        name = op.inputs[slot]
        if not name:
            labels.append(None)
        elif slot == MASK:
            labels.append(_mask_labels(shape(graph, name), full, ("b", h, None, None)))
        elif slot == NONPAD:
            labels.append(("b",))
        else:
            labels.append(cache)
    outputs = tuple(() if not name else x if position == 0 else cache for position, name in enumerate(op.outputs))
    return OpSpec(inputs=tuple(labels), outputs=outputs, op_class="cube")


def torch_rotary_embedding(t: Any, op: NodeView, inputs: list[Any]) -> list[Any]:
    """RotaryEmbedding as opset 23 defines it: halves (or even/odd pairs) rotated by each position's angle."""
    x, cos, sin, positions = (tensors(t, inputs) + [None])[:4]
    four_d = x.dim() == 4
    rows = x.transpose(1, 2) if four_d else x.reshape(x.shape[0], x.shape[1], int(op.attrs["num_heads"]), -1)
    if positions is not None:
        cos, sin = cos[positions], sin[positions]
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    dim = int(op.attrs.get("rotary_embedding_dim", 0)) or rows.shape[-1]
    rotate, keep = rows[..., :dim], rows[..., dim:]
    if int(op.attrs.get("interleaved", 0)):
        x1, x2 = rotate[..., 0::2], rotate[..., 1::2]
    else:
        x1, x2 = rotate[..., : dim // 2], rotate[..., dim // 2 :]
    real, imaginary = cos * x1 - sin * x2, sin * x1 + cos * x2
    if int(op.attrs.get("interleaved", 0)):
        rotated = t.stack([real, imaginary], dim=-1).reshape(rotate.shape)
    else:
        rotated = t.cat([real, imaginary], dim=-1)
    out = t.cat([rotated, keep], dim=-1)
    return [out.transpose(1, 2) if four_d else out.reshape(x.shape)]


def _cache_rows(op: NodeView, graph: GraphView) -> int:
    """Position ids index the caches' rows."""
    return shape(graph, op.inputs[1])[0]


@register(
    "RotaryEmbedding",
    since=23,
    mindspore=None,
    flops=lambda in_shapes, out_shapes, attrs: 3.0 * math.prod(out_shapes[0]),
    keeps=Keeps.INPUTS,  # X's gradient reads the caches, theirs reads X
    index_bounds={3: _cache_rows},
    config_inputs=frozenset({1, 2}),  # the cos/sin tables: stored constants no framework trains
    torch_kernel=torch_rotary_embedding,
)
def rotary_embedding(op: NodeView, graph: GraphView) -> OpSpec:
    """Batch, heads (4-D form) and sequence split; the rotated axis, and caches indexed by position ids, stay whole."""
    x_shape = shape(graph, op.inputs[0])
    x = ("b", "h", "s", None) if len(x_shape) == 4 else ("b", "s", None)
    positions = len(op.inputs) > 3 and bool(op.inputs[3])
    caches = (None, None) if positions else ("b", "s", None)
    inputs: tuple = (x, caches, caches) + ((("b", "s"),) if positions else ())
    return OpSpec(inputs=inputs, outputs=(x,))


# --- the operator alone in tiny models, checked by the operator tests (`autopar.ops.cases`) -----


def _qkv(batch: int, heads: int, kv_heads: int, queries: int, keys: int, size: int) -> list:
    return [
        ("Q", F, [batch, heads, queries, size]),
        ("K", F, [batch, kv_heads, keys, size]),
        ("V", F, [batch, kv_heads, keys, size]),
    ]


def _angles(rows: int, half: int) -> list[tuple[str, np.ndarray]]:
    angles = np.outer(np.arange(rows), 1.0 / 10000 ** (np.arange(half) / half))
    return [const("cos", np.cos(angles), np.float32), const("sin", np.sin(angles), np.float32)]


CASES = named(
    kernel={
        "attention": one("Attention", ["Q", "K", "V"], _qkv(2, 3, 3, 5, 5, 4), opset=23),
        "attention_causal_gqa": one(
            "Attention", ["Q", "K", "V"], _qkv(2, 4, 2, 5, 7, 4), opset=23, is_causal=1, scale=0.3
        ),
        "attention_bool_mask_softcap": one(
            "Attention",
            ["Q", "K", "V", "M"],
            _qkv(2, 2, 2, 3, 5, 4) + [("M", B, [3, 5])],
            opset=23,
            softcap=2.0,
        ),
        "attention_float_mask_scores": one(
            "Attention",
            ["Q", "K", "V", "M"],
            _qkv(2, 2, 1, 3, 5, 4) + [("M", F, [2, 1, 3, 5])],
            outputs=("Y", "", "", "S"),
            opset=23,
            qk_matmul_output_mode=3,
        ),
        "attention_past": one(
            "Attention",
            ["Q", "K", "V", "", "PK", "PV"],
            _qkv(2, 2, 2, 3, 3, 4) + [("PK", F, [2, 2, 4, 4]), ("PV", F, [2, 2, 4, 4])],
            outputs=("Y", "KP", "VP", "S"),
            opset=23,
            is_causal=1,
            qk_matmul_output_mode=1,
        ),
        "attention_3d": one(
            "Attention",
            ["Q", "K", "V"],
            [("Q", F, [2, 5, 12]), ("K", F, [2, 6, 6]), ("V", F, [2, 6, 6])],
            opset=23,
            q_num_heads=4,
            kv_num_heads=2,
        ),
        "attention_opset24_nonpad": one(
            "Attention",
            ["Q", "K", "V", "M", "", "", "N"],
            _qkv(2, 2, 2, 3, 5, 4) + [("M", F, [3, 5]), ("N", I64, [2])],
            opset=24,
            is_causal=1,
            qk_matmul_output_mode=3,
            outputs=("Y", "", "", "S"),
        ),
        "rotary": one(
            "RotaryEmbedding",
            ["X", "c", "s"],
            [("X", F, [2, 3, 5, 8]), ("c", F, [2, 5, 4]), ("s", F, [2, 5, 4])],
            opset=23,
        ),
        "rotary_positions_interleaved": one(
            "RotaryEmbedding",
            ["X", "cos", "sin", "P"],
            [("X", F, [2, 3, 5, 8]), ("P", I64, [2, 5])],
            _angles(7, 4),
            opset=23,
            interleaved=1,
        ),
        "rotary_3d_partial": one(
            "RotaryEmbedding",
            ["X", "cos", "sin", "P"],
            [("X", F, [2, 5, 12]), ("P", I64, [2, 5])],
            _angles(6, 2),
            opset=23,
            num_heads=2,
            rotary_embedding_dim=4,
        ),
    },
    strategies={
        "attention": one("Attention", ["Q", "K", "V"], _qkv(4, 4, 4, 8, 8, 4), opset=23, is_causal=1),
        "attention_gqa_mask_past": one(
            "Attention",
            ["Q", "K", "V", "M", "PK", "PV"],
            _qkv(4, 8, 4, 4, 4, 2) + [("M", F, [4, 1, 4, 8]), ("PK", F, [4, 4, 4, 2]), ("PV", F, [4, 4, 4, 2])],
            outputs=("Y", "KP", "VP"),
            opset=23,
        ),
        "attention_3d": one(
            "Attention",
            ["Q", "K", "V"],
            [("Q", F, [4, 8, 16]), ("K", F, [4, 8, 8]), ("V", F, [4, 8, 8])],
            opset=23,
            q_num_heads=4,
            kv_num_heads=2,
        ),
        "rotary": one(
            "RotaryEmbedding",
            ["X", "cos", "sin", "P"],
            [("X", F, [4, 4, 8, 4]), ("P", I64, [4, 8])],
            _angles(8, 2),
            opset=23,
        ),
        "rotary_caches_per_position": one(
            "RotaryEmbedding",
            ["X", "c", "s"],
            [("X", F, [4, 8, 8])],
            [weight("c", [4, 8, 2]), weight("s", [4, 8, 2], 1)],
            opset=23,
            num_heads=2,
        ),
    },
)
