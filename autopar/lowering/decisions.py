"""What the search decided, read off a plan file: the axis each mesh bit splits, the degrees users speak in
(data x tensor, sequence where it applies, the experts' split), the operators that leave data parallel,
repeated blocks folded.

Pure functions of the typed plan file (`PlanFile`): the terminal table, the HTML report, `Plan.degrees` and
`Plan.decisions` all read them, so each face says the same thing.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from autopar.lowering.planfile import OpEntry, PlanFile

AXES = ("batch", "sequence", "channels/hidden", "heads", "contraction", "expert")
IMAGE_OPS = frozenset({"Conv", "ConvTranspose", "MaxPool", "AveragePool", "GlobalAveragePool"})
EXPERT_READERS = frozenset({"MatMul", "Einsum", "Gather", "GatherND"})


def expert_bits(data: PlanFile) -> dict[str, frozenset[int]]:
    """The mesh bits each operator splits an expert axis with (operators without one are absent).

    An expert axis is the leading dimension of a trainable parameter of three or more dimensions (a stack of
    per-expert matrices, ``[experts, rows, columns]``) read by a MatMul, an Einsum, a Gather or a GatherND, or
    transposed with the experts still leading (as exporters write a stack's layout): the bits splitting it in the
    layout such an operator reads it in are that operator's expert bits, wherever they land in its output (a
    batched MatMul's leading axis, the partial sum of a GatherND's masked lookups). A dense layer's weight is a
    matrix, and a convolution's 4-D weight leads with output channels (Conv reads none), so neither has one; a
    batch axis read from the data input is data. The split follows the tensors: where an operator's expert bit
    splits a dimension of a tensor it shares with another operator, and the other's layout of that tensor has the
    bit on the same dimension, the bit is the other's expert bit too (the token buffers dispatched to the experts,
    their reshapes, the experts' activations). A partial sum or a redistribution ends it.
    """
    parameters = {entry.parameter for entry in data.gradient_sync}
    holders: dict[str, list[tuple[str, list[list[int]]]]] = {}
    for op in data.ops:
        for tensor in [*op.inputs, *op.outputs]:
            holders.setdefault(tensor.tensor, []).append((op.name, tensor.layout.dims))
    by_name = {op.name: op for op in data.ops}
    found: dict[str, set[int]] = {}
    pending: list[tuple[str, int]] = []
    for op in data.ops:
        if op.op_type not in EXPERT_READERS and op.op_type != "Transpose":
            continue
        for slot, tensor in enumerate(op.inputs):
            if tensor.tensor in parameters and len(tensor.layout.dims) >= 3:
                bits = tensor.layout.dims[0]
                if op.op_type == "Transpose":  # a stack the exporter transposes, its experts still leading
                    bits = [bit for bit in bits if op.outputs and bit in op.outputs[0].layout.dims[0]]
                if op.op_type == "MatMul" and len(op.inputs) == 2:  # rows dispatched to each matrix of the stack
                    bits = [
                        bit for bit in bits if bit in _aligned(op.inputs[1 - slot].layout.dims, len(tensor.layout.dims))
                    ]
                pending += [(op.name, bit) for bit in bits]
    while pending:
        name, bit = pending.pop()
        if bit in found.setdefault(name, set()):
            continue
        found[name].add(bit)
        op = by_name[name]
        for tensor in [*op.inputs, *op.outputs]:
            dim = next((d for d, bits in enumerate(tensor.layout.dims) if bit in bits), None)
            if dim is None:
                continue
            for other, dims in holders[tensor.tensor]:
                if other != name and dim < len(dims) and bit in dims[dim]:
                    pending.append((other, bit))
    return {name: frozenset(bits) for name, bits in found.items() if bits}


def _aligned(dims: list[list[int]], stack_rank: int) -> list[int]:
    """The bits splitting the dimension of a MatMul's other operand that a stack's leading axis is aligned with
    (numpy's broadcasting aligns the last dimensions): the experts' rows, where the stack's matrices each take
    their own. An operand that broadcasts against the stack (its aligned size 1, or too few dimensions:
    ``x[3, 1, 5, 6] @ w[4, 6, 7]``) reads every matrix with the same rows, so the stack is no experts.

    >>> _aligned([[0], [1], [], []], 3), _aligned([[], []], 3)
    ([1], [])
    """
    at = len(dims) - stack_rank
    return dims[at] if at >= 0 else []


def is_image_model(data: PlanFile) -> bool:
    """A model with convolutions or pooling: its rank-4 tensors are (batch, channels, space, space)."""
    return any(op.op_type in IMAGE_OPS for op in data.ops)


def _kind_at(position: int, rank: int, image: bool) -> str:
    """The axis kind of dimension ``position`` of a tensor of ``rank`` dimensions."""
    if rank == 0 or position == 0:
        return "batch"
    if rank == 2:
        return "channels/hidden"
    if rank == 3:
        return "sequence" if position == 1 else "channels/hidden"
    if rank == 4 and image:
        return "channels/hidden" if position == 1 else "sequence"
    if rank == 4:
        return ("heads", "sequence", "channels/hidden")[position - 1]
    return "channels/hidden" if position == rank - 1 else "sequence"


def bit_kinds(op: OpEntry | Mapping[str, Any], image: bool, experts: Collection[int] = ()) -> dict[int, str]:
    """The axis kind each mesh bit of an operator's layouts splits (`AXES`), from its layouts and its
    ``experts`` bits (`expert_bits`), which are "expert" wherever they land.

    A bit is placed by where it lands in the first output: on its dimension e of rank r -> the kind of
    position e; in the output's partial bits -> contraction (a reduced axis), except for a full reduction
    to a scalar (a loss), whose bits keep the kind of the input dimension they split. Positions: rank <= 1
    and dimension 0 of every tensor are batch; rank 2 is (batch, hidden); rank 3 (batch, sequence,
    hidden); rank 4 (batch, channels, space, space) in a model with convolutions or pooling, otherwise
    (batch, heads, sequence, hidden — for attention scores the last is the key sequence); higher ranks
    put hidden last and sequence between. A bit no output holds keeps its input position's kind.
    """
    entry = op if isinstance(op, OpEntry) else OpEntry.model_validate(op)
    where: dict[int, str] = {}
    if entry.outputs:
        layout = entry.outputs[0].layout
        rank = len(layout.dims)
        for position, bits in enumerate(layout.dims):
            for bit in bits:
                where[bit] = _kind_at(position, rank, image)
        if rank:
            for bit in layout.partial or []:
                where[bit] = "contraction"
    for tensor in entry.inputs:
        dims = tensor.layout.dims
        for position, bits in enumerate(dims):
            for bit in bits:
                where.setdefault(bit, _kind_at(position, len(dims), image))
    for bit in experts:
        where[bit] = "expert"
    return where


def axis_splits(
    op: OpEntry | Mapping[str, Any], image: bool, experts: Collection[int] = ()
) -> tuple[dict[str, int], int]:
    """(split factor per axis kind, devices the operator divides its work over): every mesh bit the
    operator's layouts use is one factor of 2 on the axis `bit_kinds` places it on."""
    where = bit_kinds(op, image, experts)
    bits_of = Counter(where.values())
    return {kind: 1 << count for kind, count in bits_of.items()}, 1 << len(where)


def fold_groups(data: PlanFile) -> list[list[int]]:
    """Operator indices grouped by row: a repeated block's later copies join the first copy's operator.

    ``search.repeated_blocks`` gives (first_op, operators per copy, copies); an operator of a later
    copy folds into the first copy's operator at the same offset when type and strategy agree (a
    fixed operator inside the blocks is no longer a copy: it keeps its own row).
    """
    ops = data.ops
    index = {op.name: i for i, op in enumerate(ops)}
    representative: dict[int, int] = {}
    for block in data.search.repeated_blocks:
        start = index.get(block.first_op)
        if start is None:
            continue
        period = block.operators
        for copy in range(1, block.copies):
            for offset in range(period):
                i, first = start + copy * period + offset, start + offset
                if i < len(ops) and (ops[i].op_type, ops[i].strategy) == (ops[first].op_type, ops[first].strategy):
                    representative[i] = first
    groups: dict[int, list[int]] = {}
    for i in range(len(ops)):
        groups.setdefault(representative.get(i, i), []).append(i)
    return [groups[key] for key in sorted(groups)]


@dataclass(frozen=True)
class Degrees:
    """The parallel degrees users speak in: the devices that split the batch (data), the sequence, and
    anything else (tensor: hidden, heads, a contraction). Their product times ``replicated`` is the device
    count; ``replicated`` counts devices that repeat one another's work (mesh bits no operator uses).
    ``expert`` is the devices the experts of a mixture of experts are split over (`expert_bits`): not a
    factor of the count, as expert parallelism reuses devices another role counts (the data devices,
    as Megatron's expert-parallel size divides its data-parallel size).

    >>> str(Degrees(data=4, tensor=2))
    'data 4 x tensor 2'
    >>> str(Degrees(data=2, tensor=8, sequence=2, replicated=2))
    'data 2 x tensor 8 x sequence 2 (x 2 replicated)'
    >>> str(Degrees(data=16, tensor=8, pipeline=4))
    'data 16 x tensor 8 x pipeline 4'
    >>> str(Degrees(data=8, expert=8))
    'data 8 x tensor 1, expert 8'
    """

    data: int = 1
    tensor: int = 1
    sequence: int = 1
    replicated: int = 1
    pipeline: int = 1
    expert: int = 1

    def __str__(self) -> str:
        text = f"data {self.data} x tensor {self.tensor}"
        if self.sequence > 1:
            text += f" x sequence {self.sequence}"
        if self.pipeline > 1:
            text += f" x pipeline {self.pipeline}"
        if self.replicated > 1:
            text += f" (x {self.replicated} replicated)"
        if self.expert > 1:
            text += f", expert {self.expert}"
        return text

    def as_dict(self) -> dict[str, int]:
        return {
            "data": self.data,
            "tensor": self.tensor,
            "sequence": self.sequence,
            "pipeline": self.pipeline,
            "replicated": self.replicated,
            "expert": self.expert,
        }


# every other kind is tensor parallelism; an expert split counts where the experts' leading axis is: their batch
_DEGREE_OF = {"batch": "data", "sequence": "sequence", "expert": "data"}
_TIE_ORDER = ("data", "tensor", "sequence")


def bit_roles(data: PlanFile) -> dict[int, str]:
    """The role each mesh bit some operator uses plays: "data", "tensor" or "sequence" (`degrees` says how a
    bit is counted); bits no operator uses are absent (their devices repeat one another's work)."""
    image = is_image_model(data)
    experts = expert_bits(data)
    votes: dict[int, Counter[str]] = {}
    for op in data.ops:
        for bit, kind in bit_kinds(op, image, experts.get(op.name, ())).items():
            role = _DEGREE_OF.get(kind, "tensor")
            if image and role == "sequence":
                role = "tensor"  # an image's space: not what users call sequence parallelism
            votes.setdefault(bit, Counter())[role] += 1
    return {
        bit: max(_TIE_ORDER, key=lambda role, tally=tally: (tally[role], -_TIE_ORDER.index(role)))  # type: ignore[misc]
        for bit, tally in sorted(votes.items())
    }


def degrees(data: PlanFile) -> Degrees:
    """The plan's degrees: each mesh bit counts for the role it plays in the most operators (`bit_roles`).

    A bit that splits the batch dimension of most of the operators that use it is a data bit; one that
    mostly splits a sequence (in a model without convolutions: a rank-3 activation's second dimension,
    an attention tensor's query or key positions) is a sequence bit; any other split (hidden, heads, a
    contraction, an image's space) is a tensor bit; one splitting experts counts as data there. Ties go
    to data, then tensor. Bits no operator uses are replicated; the bits that spell a device's pipeline
    stage are the pipeline's. The expert degree counts the bits some operator splits experts with.
    """
    roles = bit_roles(data)
    counts = Counter(roles.values())
    stage_bits = len(data.pipeline.bits) if data.pipeline is not None else 0
    unused = data.mesh_bits - stage_bits - len(roles)
    return Degrees(
        data=1 << counts["data"],
        tensor=1 << counts["tensor"],
        sequence=1 << counts["sequence"],
        replicated=1 << max(0, unused),
        pipeline=1 << stage_bits,
        expert=1 << len(set().union(*expert_bits(data).values())),
    )


def decisions(data: PlanFile) -> list[dict[str, Any]]:
    """The operators off data parallel, in graph order, as plain data: those whose layouts split an axis
    besides the batch (`axis_splits`). Each: name, op_type, strategy (the in_strategy as tuples), splits
    (factor per axis kind), devices (over which it divides its work), block (the first copy's operator of
    the repeated block it belongs to, or None) and fixed (the user fixed it). Forks (`autopar.ops.fork`)
    are not the model's operators and are left out.
    """
    image = is_image_model(data)
    experts = expert_bits(data)
    first_of: dict[int, int] = {}
    for group in fold_groups(data):
        if len(group) > 1:
            for i in group:
                first_of[i] = group[0]
    found = []
    for i, op in enumerate(data.ops):
        splits, devices = axis_splits(op, image, experts.get(op.name, ()))
        if op.domain or all(kind == "batch" for kind in splits):  # a fork is autopar's, not a decision
            continue
        found.append(
            {
                "name": op.name,
                "op_type": op.op_type,
                "strategy": tuple(tuple(factors) for factors in op.strategy),
                "splits": {kind: splits[kind] for kind in AXES if kind in splits},
                "devices": devices,
                "block": data.ops[first_of[i]].name if i in first_of else None,
                "fixed": bool(op.fixed),
            }
        )
    return found
