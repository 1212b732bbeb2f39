"""One module node on one rank's shards: the node's own ATen call, with what a shard changes about it.

Run on its shards, an ATen call computes the rank's part of the result exactly where autopar's operator
for it runs as ONNX defines it on local inputs (`autopar.runtime.local`): element-wise arithmetic, matrix
products (a split contraction leaves the partial sums the plan reduces), normalisations over whole axes.
What differs is what autopar's operators adjust, and this module adjusts the same way:

- a shape written into the call (``view``, ``reshape``, ``expand``, ``new_zeros``) becomes the rank's local
  output shape, as Reshape's and Expand's local kernels make their targets local;
- under a split contraction, a bias is added by the first rank of each partial group only
  (`autopar.ops.base.OpSpec.local_once_inputs`), and a mean divides by the global count (``local_mean``);
- an ``embedding`` whose table is split by rows looks up the rows the rank holds and writes zeros for
  the others: a partial sum, one rank contributing each row (Gather's local kernel).

Anything else an operator's own local kernel would do (a split class axis of OneHot, split indexed axes
of GatherND) is refused by name (`unsupported`), never run as if it were the default.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from autopar.layout import shard_index
from autopar.lowering.program import PlannedOp

aten = torch.ops.aten

# the argument holding the output's shape, per call that writes one (a view, an expand, a new tensor)
SHAPE_ARGUMENT = {
    aten.view.default: 1,
    aten._unsafe_view.default: 1,
    aten.reshape.default: 1,
    aten.expand.default: 1,
    aten.new_zeros.default: 1,
    aten.new_ones.default: 1,
    aten.new_empty.default: 1,
    aten.new_full.default: 1,
    aten.zeros.default: 0,
    aten.ones.default: 0,
    aten.empty.memory_format: 0,
    aten.full.default: 0,
}

# operators whose own local kernel autopar runs where a shard changes the call, and that this module mirrors (a
# Dropout's, inference's identity for verification: the trainer draws each shard's mask, `autopar.torch.dropout`)
_MIRRORED = {"Reshape", "Expand", "Gather", "Dropout"}


def unsupported(planned: PlannedOp) -> str | None:
    """Why a node with this planned operator cannot run on its shards as its ATen call (None: it can)."""
    definition = planned.rule.definition
    if definition is None or definition.torch_local_kernel is None or planned.rule.op.op_type in _MIRRORED:
        return None
    if planned.rule.op.domain:  # autopar's own fork: no node runs it
        return None
    split = any(planned.rule.label_bits(planned.exponents)[label] for label in planned.rule.spec.label_order)
    if not split:
        return None
    return (
        f"operator {planned.name!r} ({planned.rule.op.op_type}) is split in a way its ATen call cannot run on"
        " shards yet"
    )


# a view of a whole tensor may not be one of its shard (a shard a collective assembled is laid out anew)
_RESHAPING = {aten.view.default: aten.reshape.default, aten._unsafe_view.default: aten.reshape.default}


def local_call(
    target: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    out_shape: Sequence[int] | None,
) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    """The call and its arguments on a shard: a written output shape made the rank's local one."""
    position = SHAPE_ARGUMENT.get(target)
    if position is None or out_shape is None:
        return target, args, kwargs
    if position < len(args):
        args = args[:position] + (list(out_shape),) + args[position + 1 :]
    else:
        kwargs = {**kwargs, "size": list(out_shape)}
    return _RESHAPING.get(target, target), args, kwargs


def first_of_partial_group(planned: PlannedOp, rank: int) -> bool:
    """Whether ``rank`` holds the first shard of every split reduced label (adds the operator's bias)."""
    bits = planned.rule.label_bits(planned.exponents)
    return all(shard_index(rank, bits[label]) == 0 for label in planned.rule.spec.reduced_labels if bits[label])


def mean_divisor(planned: PlannedOp) -> int:
    """What a mean over split labels divides a rank's local mean by (1: none)."""
    if not planned.rule.spec.local_mean:
        return 1
    bits = planned.rule.label_bits(planned.exponents)
    return 1 << sum(len(bits[label]) for label in planned.rule.spec.reduced_labels)


def gathered_rows(planned: PlannedOp) -> tuple[int, ...]:
    """The mesh bits splitting the rows a Gather looks up (empty: it holds every row)."""
    if planned.rule.op.op_type != "Gather":
        return ()
    return planned.rule.label_bits(planned.exponents).get("g", ())


def _masked_take(
    table: torch.Tensor, axis: int, indices: torch.Tensor, full: int, rank: int, bits: Sequence[int]
) -> torch.Tensor:
    """``table``'s entries along ``axis`` at ``indices`` (any shape, in the whole axis of size ``full``) on a rank
    holding one block of that axis: zeros where the block lacks the entry (a partial sum over ``bits``)."""
    local = table.shape[axis]
    indices = torch.where(indices < 0, indices + full, indices) - shard_index(rank, bits) * local
    held = (indices >= 0) & (indices < local)
    safe = torch.where(held, indices, torch.zeros_like(indices))
    picked = table.index_select(axis, safe.reshape(-1))
    picked = picked.reshape(tuple(table.shape[:axis]) + tuple(indices.shape) + tuple(table.shape[axis + 1 :]))
    mask = held.reshape((1,) * axis + tuple(held.shape) + (1,) * (table.dim() - axis - 1))
    return picked * mask.to(picked.dtype)


def masked_lookup(
    target: Any, args: tuple[Any, ...], kwargs: dict[str, Any], full: int, rank: int, bits: Sequence[int]
) -> torch.Tensor | None:
    """A lookup (``embedding``, ``select``, ``index_select``) on a rank holding one block of the looked-up axis, as
    Gather's local kernel does it (None: not a lookup this module knows)."""
    if kwargs:
        return None
    if target == aten.embedding.default:
        return _masked_take(args[0], 0, args[1], full, rank, bits)
    if target == aten.select.int:
        table, axis = args[0], int(args[1]) % args[0].dim()
        index = torch.tensor(int(args[2]), device=table.device)
        return _masked_take(table, axis, index, full, rank, bits)
    if target == aten.index_select.default:
        table, axis = args[0], int(args[1]) % args[0].dim()
        return _masked_take(table, axis, args[2], full, rank, bits)
    return None
