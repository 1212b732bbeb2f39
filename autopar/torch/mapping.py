"""Which part of the user's module each part of the plan is: its exported program's nodes against the plan.

The dynamo exporter translates each FX node of the decomposed program (`autopar.torch.capture`) into
zero or more ONNX operators and records the node in each one's metadata (``pkg.torch.onnx.fx_node``).
`map_module` reads that record back and sorts the FX nodes into units the trainer runs in order:

- `NodeUnit`: a node with operators in the plan. It runs as the module's own ATen call on the rank's
  shards, its tensor arguments read in the layouts the plan's operators read them in (`Read`), its
  outputs in the layouts they write.
- `ForkUnit`: a fork the importer inserted (`autopar.ops.fork`): a place where readers meet, no node.
- `WholeUnit`: a node the exporter folded into a constant (the causal mask, rotary tables): computed
  whole on every rank from buffers and constants, as the plan's constants are.
- `DerivedUnit`: a node computed from parameters that the exporter folded into a stored weight (BERT's token
  type embedding at constant indices, ViT's class token expanded to the batch): computed whole from those
  parameters, kept whole, its weight's gradient summed over the devices the plan splits it by.

A node with no operator that passes one value on unchanged (``alias``, ``clone``, a ``view`` to the same
shape, ``dropout`` of probability 0, arithmetic with a neutral literal: `_NEUTRAL`) is looked through, as are
an empty value and arguments read for their type or shape alone (`reads_metadata_only`); one the exporter
merged into its reader's operator (two Transposes become one) runs just before its reader on the shard the
reader reads (``inline``); a value one node's operators compute and another's read too (the exporter computed
it once) makes both run as their operators (``shared``); nodes read only, in the end, by nodes with operators
are merged into those (BLOOM's reshapes and bmm: one 4-D MatMul recorded under the last view), which then run as
their operators, reading what the merged nodes read (``merged``); any other is refused in one sentence. Where the
exporter merged the Transpose ending a node's operators into its reader's (Falcon's lookups by a list of
positions, read through ``transpose(1, 2)``), the node's value is its tensor in another order
(`NodeUnit.permutation`): the node's shard is permuted into the plan's order, and back for its readers.

Arguments pair with the operators' inputs by the value they carry: an activation by the node that
computes it (forks and `getitem` seen through), a data input by name, a parameter by its ``state_dict``
key, a folded constant by the node it came from. The rest pair by shape, one parameter of the node with
one stored weight of its operators: the exporter's optimiser stores ``linear``'s weight transposed
(``val_N``), and the importer gives each reader of a vector that several layers share a copy of its own
(``weight.1``, `autopar.graph.build`). What cannot be paired is refused, never replicated silently.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from autopar.errors import AutoparError
from autopar.graph.records import fx_node_name
from autopar.lowering.program import PlannedOp, PlanProgram
from autopar.ops.fork import FORK, FORK_DOMAIN
from autopar.torch.dropout import dropout_arguments

FX_NODE_KEY = "pkg.torch.onnx.fx_node"
aten = torch.ops.aten

# nodes that pass their one value on unchanged when shape and dtype stay (the exporter writes no operator)
_PASS_THROUGH = {
    aten.alias.default,
    aten.clone.default,
    aten.contiguous.default,
    aten.detach.default,
    aten.lift_fresh_copy.default,
    aten.view.default,
    aten.reshape.default,
    aten._unsafe_view.default,
    aten.expand.default,
    aten.slice.Tensor,
    aten.to.dtype,
    aten.to.dtype_layout,
    aten.to.device,
    aten._to_copy.default,
    aten.type_as.default,
    aten.copy.default,
    aten.cat.default,  # where every other value it joins is empty
    aten.dropout.default,
}

# nodes some of whose tensor arguments give a dtype, a device or a shape alone, never values: target -> the
# slots whose values it reads (``x.type_as(y)`` reads x; ``y.new_zeros(shape)`` nothing, a value the module makes
# whole; ``copy(dst, src)`` src, where dst is a slice its result is scattered back into; ``fill(x, v)`` v: as
# Whisper's and BART's ``shift_tokens_right`` and Gemma's norms write them)
_METADATA_ONLY: dict[Any, frozenset[int]] = {
    aten.type_as.default: frozenset({0}),
    aten.copy.default: frozenset({1}),
    aten.fill.Tensor: frozenset({1}),
    aten.fill.Scalar: frozenset(),
    **dict.fromkeys(
        (
            aten.new_zeros.default,
            aten.new_ones.default,
            aten.new_empty.default,
            aten.new_full.default,
            aten.zeros_like.default,
            aten.ones_like.default,
            aten.empty_like.default,
            aten.full_like.default,
        ),
        frozenset(),
    ),
}

# an argument the exporter's translation reads permuted, where its optimiser then stores the result
# (``linear``: ``MatMul(x, W^T)`` with ``W^T`` folded into ``val_N``): target -> {argument: permutation}
STORED_PERMUTED = {aten.linear.default: {1: (1, 0)}}

# calls that move a shard's elements alone (no size, no index written in them): one the exporter merged into its
# reader's operator (two Transposes become one) runs on the shard its reader reads, just before the reader
_INLINE = {
    aten.transpose.int,
    aten.permute.default,
    aten.t.default,
    aten.numpy_T.default,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
}

_MERGED = (
    "the exporter merged values of the module that were identical when it exported (a fresh model's zero-initialised"
    " tokens or tables): export it after setting its parameters apart."
)
"""What to do where the exporter's optimiser kept one of two values that were equal only by their initialisation."""

# reshapes: one whose every reader is a reshape with operators of its own is looked through, as the exporter merged
# it into them (a reshape of a reshape is one reshape to the last shape: GPT-2's and BLOOM's heads joined, then
# flattened for their projection)
_RESHAPES = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}
# what the exporter's optimiser merges into a later node's operators (`_Mapper._merges`): reshapes, copies and a
# batched product (BLOOM's heads folded into the batch for a bmm and back: one 4-D MatMul)
_MERGED_INTO_READERS = {
    *_RESHAPES,
    aten.transpose.int,
    aten.permute.default,
    aten.expand.default,
    aten.clone.default,
    aten.bmm.default,
    aten.baddbmm.default,
    aten.matmul.default,
}

# nodes returning values their operator does not write: target -> the operator's output slot of each value (None:
# one it does not write; a training BatchNorm's saved mean and deviation are for its backward, which autograd keeps)
_RETURNS: dict[str, tuple[int | None, ...]] = {
    "aten._native_batch_norm_legit_functional.default": (0, None, None, 1, 2),
    "aten.native_dropout.default": (0, None),  # its mask: no tensor of the plan (`autopar.torch.dropout`)
}
# a parameter viewed before use, which the exporter folds into the stored weight: target -> permutation
_PARAMETER_VIEWS = {aten.t.default, aten.transpose.int, aten.permute.default, aten.numpy_T.default}


class MappingError(AutoparError):
    """The module and the plan's model do not match, or the model file lacks what pairs them."""


@dataclass(frozen=True)
class Read:
    """One tensor argument of a node, as the plan reads it: the operator, its input slot and the tensor there.

    ``permutation``: the argument holds the plan's tensor with its dimensions taken in this order (a
    weight the exporter stored transposed); None when they are the same.
    """

    arg: str  # the FX value (node name) the argument carries
    tensor: str  # what the plan's operator reads (its model's name: a fork's output, a weight's copy)
    consumer: int  # the planned operator (an index into `PlanProgram.ops`)
    slot: int
    permutation: tuple[int, ...] | None = None


@dataclass(frozen=True)
class NodeUnit:
    """An FX node the plan has operators for (see the module docstring)."""

    node: str
    ops: tuple[int, ...]  # its planned operators, in graph order
    reads: tuple[Read, ...]  # one per distinct tensor argument that carries data
    outputs: tuple[tuple[str, int], ...]  # per value it returns, in order: (tensor, the planned op writing it)
    # its one value is the plan's tensor with its dimensions in another order: the tensor is the value permuted
    # so (the exporter merged the Transpose that ends the node's operators into its reader's: `_Mapper._permuted`)
    permutation: tuple[int, ...] | None = None
    # module nodes before it that have no operators of their own were merged into its operators (`_Mapper.merged`):
    # it runs as its operators, which read what those nodes read
    merged: bool = False


@dataclass(frozen=True)
class ForkUnit:
    op: int  # the fork's planned operator


@dataclass(frozen=True)
class WholeUnit:
    node: str


@dataclass(frozen=True)
class DerivedUnit:
    """A node computed from parameters (and constants) that the exporter folded into a stored weight (a token
    type embedding looked up at constant indices, a class token expanded to the batch)."""

    node: str


Unit = NodeUnit | ForkUnit | WholeUnit | DerivedUnit


@dataclass(frozen=True)
class ParameterUse:
    """A stored weight of the plan that is (a view of) one of the module's parameters."""

    tensor: str  # the plan's name
    parameter: str  # the module's state_dict key
    permutation: tuple[int, ...] | None  # the plan's tensor is the parameter permuted so (None: as it is)


@dataclass(frozen=True)
class ModuleMap:
    """The plan's operators and tensors against the module's FX nodes, parameters and inputs."""

    units: tuple[Unit, ...]
    parameters: Mapping[str, ParameterUse]  # plan tensor -> the parameter it is
    inputs: Mapping[str, str]  # plan data input -> FX placeholder
    node_of: Mapping[str, str]  # FX node -> the node whose value it passes on (itself for the rest)
    outputs: tuple[str, ...]  # the FX values the module returns (looked through)
    placeholders: Mapping[str, str] = field(default_factory=dict)  # FX placeholder -> state_dict key or input
    buffers: Mapping[str, str] = field(default_factory=dict)  # FX placeholder -> buffer / constant key
    # stored tables the plan trains as weights where the module computes them from buffers and constants (rotary
    # frequencies the exporter folded), and running statistics the module holds as buffers: read as the constants
    # they are, their planned moves and synchronisation left out
    untrained: frozenset[str] = frozenset()
    # stored weights the exporter folded from parameters: plan tensor -> the FX node computing it (a `DerivedUnit`)
    derived: Mapping[str, str] = field(default_factory=dict)
    # nodes the exporter merged into their readers' operators (`_INLINE`): node -> the node whose value it moves
    inline: Mapping[str, str] = field(default_factory=dict)
    # values one node's operators compute and another's read too (the exporter computed them once for both): the
    # nodes run as their operators (`Read.arg` "" marks such a read)
    shared: frozenset[str] = frozenset()
    # buffers the module's forward writes (a training BatchNorm's running statistics, its step count): buffer key ->
    # (the plan tensor that is its new value, or "" where the FX node of that name computes it whole)
    mutated: Mapping[str, tuple[str, str]] = field(default_factory=dict)

    def parameter_names(self) -> list[str]:
        """The module's parameters the plan trains or reads, in a fixed order."""
        return sorted({use.parameter for use in self.parameters.values()})


def fx_node_target(metadata: str) -> str | None:
    """The operator an ``fx_node`` record names.

    >>> fx_node_target("%linear : [num_users=1] = call_function[target=torch.ops.aten.linear.default](...)")
    'torch.ops.aten.linear.default'
    """
    found = re.search(r"target=([^\]]+)\]", metadata)
    return found.group(1) if found else None


def _record(planned: PlannedOp) -> str:
    """An operator's ``fx_node`` record ("" where the file has none)."""
    proto = planned.rule.op.proto
    return next((p.value for p in proto.metadata_props if p.key == FX_NODE_KEY), "") if proto is not None else ""


def _nodes_of(program: PlanProgram) -> tuple[dict[str, list[int]], list[int]]:
    """FX node -> its planned operators, and the operators without a record (the exporter's optimiser wrote
    some anew: three Slices of one tensor become a Split); MappingError if no operator has one."""
    found: dict[str, list[int]] = {}
    missing: list[int] = []
    for index, planned in enumerate(program.ops):
        op = planned.rule.op
        if op.domain == FORK_DOMAIN and op.op_type == FORK:
            continue
        record = _record(planned)
        name = fx_node_name(record) if record else None
        if name is None:
            missing.append(index)
            continue
        found.setdefault(name, []).append(index)
    if missing and not found:
        raise MappingError(
            f"The plan's model does not say which module node its operators come from (no operator has the dynamo"
            f" exporter's '{FX_NODE_KEY}' record, e.g. {program.ops[missing[0]].name!r}): export the module with"
            " torch.onnx.export(..., dynamo=True), keep the node metadata, and plan that file."
        )
    return found, missing


def _tensor_args(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The node's arguments that are values of the graph, each once, in order."""
    seen: list[torch.fx.Node] = []
    for arg in node.all_input_nodes:
        if arg not in seen:
            seen.append(arg)
    return seen


def reads_metadata_only(node: torch.fx.Node, arg: torch.fx.Node) -> bool:
    """Whether ``node`` reads ``arg`` for its dtype, device or shape alone (`_METADATA_ONLY`): the trainer gives it
    a stand-in of that type and shape, the value not computed."""
    slots = _METADATA_ONLY.get(node.target)
    args: Any = node.args
    return slots is not None and not any(value is arg for slot, value in enumerate(args) if slot in slots)


def _shape(node: torch.fx.Node) -> tuple[int, ...] | None:
    value = node.meta.get("val")
    return tuple(int(s) for s in value.shape) if isinstance(value, torch.Tensor) else None


def _dtype(node: torch.fx.Node) -> torch.dtype | None:
    value = node.meta.get("val")
    return value.dtype if isinstance(value, torch.Tensor) else None


def _passes_on(node: torch.fx.Node, source: torch.fx.Node) -> bool:
    """Whether ``node`` (no operator of its own) gives back ``source``'s value unchanged: a copy, a view or cast to
    the same shape and type, or arithmetic with its neutral element (`_NEUTRAL`)."""
    if _shape(node) != _shape(source) or _dtype(node) != _dtype(source):
        return False
    args: Any = node.args
    if node.target in _NEUTRAL and node.kwargs.get("alpha", 1) == 1:
        element, commutes = _NEUTRAL[node.target]
        if len(args) != 2 or (args[0] is not source and not commutes):
            return False
        other = args[1] if args[0] is source else args[0]
        return other is not source and _is_literal(other, element, tolerance=_NEGLIGIBLE if element == 0.0 else 0.0)
    if node.target not in _PASS_THROUGH:
        return False
    if node.target == aten.dropout.default:  # the same shape for a slice: the whole dimension
        probability, training = dropout_arguments(node)
        return probability == 0 or not training
    return True


_NEUTRAL: dict[Any, tuple[float, bool]] = {
    aten.add.Tensor: (0.0, True),
    aten.add.Scalar: (0.0, True),
    aten.sub.Tensor: (0.0, False),
    aten.sub.Scalar: (0.0, False),
    aten.mul.Tensor: (1.0, True),
    aten.mul.Scalar: (1.0, True),
    aten.div.Tensor: (1.0, False),
    aten.div.Scalar: (1.0, False),
}
"""Arithmetic that leaves a value as it is when its other operand is this literal (the element, and whether it may
come first), which the exporter's optimiser folds away: RoBERTa's positions plus a cache length of 0, Whisper's
attention scores times a scaling of 1."""

_NEGLIGIBLE = 1e-15
"""A literal this small added to a value the exporter's optimiser may fold away too: DeepSeek-V3's router divides by
a sum of routing weights plus 1e-20, and its file divides by the sum. Looked through where the file has no operator
for it, as the plan's model computes (in float32 it changes no value above 2e-8)."""


def _is_literal(value: Any, element: float, tolerance: float = 0.0) -> bool:
    """``value`` is the number ``element`` (within ``tolerance``), as a literal or a scalar tensor the module makes
    of one."""
    if isinstance(value, torch.fx.Node):
        args: Any = value.args
        made = value.target == aten.scalar_tensor.default and len(args) == 1
        return made and _is_literal(args[0], element, tolerance)
    return isinstance(value, int | float) and not isinstance(value, bool) and abs(value - element) <= tolerance


def _permutation_of(node: torch.fx.Node) -> tuple[int, ...] | None:
    """The dimension order a view of a parameter gives (``t``, ``transpose``, ``permute``), None for others."""
    args: Any = node.args
    value = args[0]
    shape = _shape(value) if isinstance(value, torch.fx.Node) else None
    if shape is None:
        return None
    rank = len(shape)
    if node.target in (aten.t.default, aten.numpy_T.default):
        return tuple(reversed(range(rank)))
    if node.target == aten.transpose.int:
        a, b = (int(d) % rank for d in args[1:3])
        order = list(range(rank))
        order[a], order[b] = order[b], order[a]
        return tuple(order)
    if node.target == aten.permute.default:
        return tuple(int(d) % rank for d in args[1])
    return None


def _compose(first: tuple[int, ...] | None, then: tuple[int, ...] | None) -> tuple[int, ...] | None:
    """The order of ``x.permute(first).permute(then)`` as one permutation (None is the identity)."""
    if first is None:
        return then
    if then is None:
        return first
    combined = tuple(first[d] for d in then)
    return None if combined == tuple(range(len(combined))) else combined


def inverse(permutation: tuple[int, ...]) -> tuple[int, ...]:
    """The permutation undoing ``permutation``.

    >>> inverse((2, 0, 1))
    (1, 2, 0)
    """
    out = [0] * len(permutation)
    for position, dim in enumerate(permutation):
        out[dim] = position
    return tuple(out)


def _permuted(shape: Sequence[int], permutation: tuple[int, ...] | None) -> tuple[int, ...]:
    return tuple(shape) if permutation is None else tuple(shape[d] for d in permutation)


class _Mapper:
    def __init__(self, program: PlanProgram, exported: torch.export.ExportedProgram) -> None:
        self.program, self.graph = program, program.graph
        self.exported = exported
        self.nodes = {node.name: node for node in exported.graph.nodes}
        signature = exported.graph_signature
        self.parameter_key = dict(signature.inputs_to_parameters)
        self.buffer_key = {**signature.inputs_to_buffers, **signature.inputs_to_lifted_tensor_constants}
        self.user_inputs = list(signature.user_inputs)
        self.ops_of, self.unattributed = _nodes_of(program)
        unknown = sorted(set(self.ops_of) - set(self.nodes))
        if unknown:
            raise MappingError(
                f"The plan's model has operators from node {unknown[0]!r}, which this module's exported program"
                " does not have: the plan was made for another module, or for other input shapes."
            )
        for name, indices in sorted(self.ops_of.items()):
            target = fx_node_target(_record(program.ops[indices[0]]))
            if target is not None and not target.endswith(str(self.nodes[name].target)):
                raise MappingError(
                    f"The plan's model computes node {name!r} with {target}, where this module computes it with"
                    f" {self.nodes[name].target}: the plan was made for another module."
                )
        self.op_index = {planned.name: index for index, planned in enumerate(program.ops)}
        self.fork_input = {
            planned.rule.op.outputs[0]: planned.rule.op.inputs[0]
            for planned in program.ops
            if planned.rule.op.domain == FORK_DOMAIN and planned.rule.op.op_type == FORK
        }
        # FX node -> "data" (computed from the inputs), "parameter" (a parameter or a view of one), "whole" (from
        # buffers and constants alone) or "derived" (from parameters, not a view: a `DerivedUnit`)
        self.kind: dict[str, str] = {}
        self.node_of: dict[str, str] = {}  # FX node -> the node whose value it carries
        self.view_of: dict[str, tuple[str, tuple[int, ...] | None]] = {}  # -> (parameter placeholder, order)
        self.value_of: dict[str, str] = {}  # plan tensor -> FX value
        self.units: list[Unit] = []
        self.parameters: dict[str, ParameterUse] = {}
        self.untrained: set[str] = set()
        self.derived: dict[str, str] = {}
        self.inline: dict[str, str] = {}
        self.merged: dict[str, list[torch.fx.Node]] = {}  # node merged into its readers' operators -> its data args
        self.shared: set[str] = set()
        self.order_of: dict[str, tuple[int, ...]] = {}  # FX value -> its plan tensor is it permuted so (`_permuted`)
        self.constants_trained: dict[str, str] = {}  # constant of the plan -> the node computing it from parameters
        self.computed: dict[str, str] = {}  # `_call_key` -> the first node making that call

    # --- what each node is ------------------------------------------------------------------

    def run(self) -> ModuleMap:
        for node in self.exported.graph.nodes:
            if node.target == aten._native_batch_norm_legit_functional.default and not any(
                self.program.ops[index].rule.op.op_type == "BatchNormalization"
                for index in self.ops_of.get(node.name, ())
            ):
                raise MappingError(
                    f"Module node {node.name!r} is a BatchNorm in training, which the plan's model does not have: the"
                    " dynamo exporter's optimiser folded it into its Conv as if it normalised with running statistics;"
                    " export the module with torch.onnx.export(..., dynamo=True, optimize=False) and plan that file."
                )
        for node in self.exported.graph.nodes:
            if node.op == "placeholder":
                self._placeholder(node)
            elif node.op == "call_function":
                self._call(node)
            elif node.op == "output":
                pass
            else:
                raise MappingError(
                    f"The exported program has a {node.op} node ({node.name!r}), which autopar cannot run."
                )
        self._check_every_op_placed()
        self._check_trained()
        returned = [self.node_of.get(arg.name, arg.name) for arg in self._returned()]
        inputs = {name: name for name in self.user_inputs if name in self.graph.tensors}
        missing = sorted(name for name in self.graph.inputs if name not in inputs)
        if missing:
            raise MappingError(
                f"The plan's model reads input {missing[0]!r}, which the module's forward does not take."
            )
        placeholders = {**self.parameter_key, **{name: name for name in self.user_inputs}}
        return ModuleMap(
            tuple(self.units),
            dict(self.parameters),
            inputs,
            dict(self.node_of),
            tuple(returned),
            placeholders,
            dict(self.buffer_key),
            frozenset(self.untrained),
            dict(self.derived),
            dict(self.inline),
            frozenset(self.shared),
            self._mutated(),
        )

    def _mutated(self) -> dict[str, tuple[str, str]]:
        """The buffers the forward writes and where their new values are (`ModuleMap.mutated`)."""
        tensor_of = {value: tensor for tensor, value in self.value_of.items()}
        found = {}
        for name, key in sorted(self.exported.graph_signature.buffers_to_mutate.items()):
            source = self.node_of.get(name, name)
            if source in tensor_of:
                found[key] = (tensor_of[source], "")
            elif self.kind.get(source) == "whole":
                found[key] = ("", source)
            else:
                raise MappingError(
                    f"The module's forward writes buffer {key!r} from node {name!r}, which the plan does not compute."
                )
        return found

    def _returned(self) -> list[torch.fx.Node]:
        output = next(node for node in self.exported.graph.nodes if node.op == "output")
        return list(output.all_input_nodes)

    def _placeholder(self, node: torch.fx.Node) -> None:
        self.node_of[node.name] = node.name
        if node.name in self.parameter_key:
            self.kind[node.name] = "parameter"
            self.view_of[node.name] = (node.name, None)
        elif node.name in self.buffer_key:
            self.kind[node.name] = "whole"
        else:
            self.kind[node.name] = "data"
            if node.name in self.graph.tensors:
                self.value_of[node.name] = node.name

    def _call(self, node: torch.fx.Node) -> None:
        # an empty value (a slice past the end: Phi-3's rotary part at its whole head size) holds nothing to
        # read, and the exporter drops it with what it adds nothing to (a Concat of one other value); one read
        # for its type or shape alone (`reads_metadata_only`) is not computed either
        given = [arg for arg in _tensor_args(node) if self.kind[self.node_of[arg.name]] != "unread"]
        self.node_of[node.name] = node.name
        twin = self.computed.setdefault(self._call_key(node), node.name)
        if node.name in self.ops_of:  # (its operators may read what it reads for a shape: an unoptimised export's)
            self.kind[node.name] = "data"
            self._node_unit(node, given)
            return
        args = [arg for arg in given if not reads_metadata_only(node, arg)]
        kinds = {self.kind[self.node_of[arg.name]] for arg in args}
        if 0 in (_shape(node) or ()) or (node.users and all(reads_metadata_only(user, node) for user in node.users)):
            self.kind[node.name] = "unread"
            return
        if node.target == operator.getitem:
            source = self.node_of[args[0].name]
            self.kind[node.name] = self.kind[source]
            if self.kind[source] == "whole":
                self.units.append(WholeUnit(node.name))
            return  # a NodeUnit's outputs name their getitem nodes (`_outputs`)
        if node.target == aten._assert_tensor_metadata.default or not node.users:
            self.kind[node.name] = "whole"
            return  # a check, or a value nothing reads
        if kinds <= {"whole"}:
            self.kind[node.name] = "whole"
            self.units.append(WholeUnit(node.name))
            return
        if kinds == {"parameter"} and len(args) == 1 and node.target in _PARAMETER_VIEWS:
            placeholder, order = self.view_of[self.node_of[args[0].name]]
            self.kind[node.name] = "parameter"
            self.view_of[node.name] = (placeholder, _compose(order, _permutation_of(node)))
            return
        data = [arg for arg in args if self.kind[self.node_of[arg.name]] != "whole"]
        claimed = self._claim(node, data)
        if claimed:
            self.ops_of[node.name] = claimed
            self.kind[node.name] = "data"
            self._node_unit(node, args)
            return
        if len(data) == 1 and _passes_on(node, data[0]):
            source = self.node_of[data[0].name]
            self.node_of[node.name] = source
            self.kind[node.name] = self.kind[source]
            if source in self.view_of:
                self.view_of[node.name] = self.view_of[source]
            return
        if len(data) == 1 and self._reshaped_again(node):
            self.node_of[node.name] = self.node_of[data[0].name]
            self.kind[node.name] = self.kind[self.node_of[data[0].name]]
            return
        if len(data) == 1 and node.target in _INLINE and self.kind[self.node_of[data[0].name]] == "data":
            self.kind[node.name] = "data"
            self.inline[node.name] = self.node_of[data[0].name]
            return
        if kinds <= {"parameter", "whole", "derived"}:
            for arg in args:
                value = self.node_of[arg.name]
                if self.kind[value] == "parameter" and self.view_of[value] != (value, None):
                    raise MappingError(
                        f"Module node {node.name!r} computes from a view of parameter {arg.name!r}, which the exporter"
                        " folded into a stored weight: autopar's trainer cannot follow that fold."
                    )
            self.kind[node.name] = "derived"
            self.units.append(DerivedUnit(node.name))
            return
        if twin != node.name:  # the same call on the same values as an earlier node: the exporter computed it once
            self.node_of[node.name] = self.node_of[twin]
            self.kind[node.name] = self.kind[self.node_of[twin]]
            return
        if data and self._merges(node, data):
            return
        raise MappingError(
            f"Module node {node.name!r} ({node.target}) computes from the model's data, but the plan has no operator"
            " for it: the plan was made from another export of this module, or the exporter merged it with a node"
            " that computed the same value when it exported (a fresh model's identical norms: export it after"
            " setting its parameters apart)."
        )

    def _call_key(self, node: torch.fx.Node) -> str:
        """What a call computes: its target and its arguments, each value by the node that carries it, so that two
        calls of one key compute one value (Cohere's norm writes ``x - mean`` twice; the exporter keeps one)."""
        carried: Any = torch.fx.node.map_arg((node.args, node.kwargs), lambda arg: self.node_of.get(arg.name, arg.name))
        return f"{node.target}{carried!r}"

    def _reshaped_again(self, node: torch.fx.Node) -> bool:
        """Whether ``node`` (no operators of its own) is a reshape that only reshapes read, each with operators:
        the exporter wrote the two as one, which each reader's own call makes of the node's input alone."""
        return (
            node.target in _RESHAPES
            and bool(node.users)
            and all(user.target in _RESHAPES and user.name in self.ops_of for user in node.users)
        )

    def _merges(self, node: torch.fx.Node, data: list[torch.fx.Node]) -> bool:
        """Whether ``node`` (no operators of its own: a reshape, a copy, a batched product) is merged into its
        readers' operators, which then read what it reads (``data``); kept so where it is. It is where every
        reader has operators, or is such a node read so in turn (BLOOM's reshapes to heads times batch around a
        bmm and back: one 4-D MatMul, recorded under the last view). Any other node without operators is not
        the plan's module (an activation more) and stays refused."""
        stack, seen = list(node.users), set()
        while stack:
            user = stack.pop()
            if user.name in seen or user.name in self.ops_of:
                continue
            seen.add(user.name)
            if user.target not in _MERGED_INTO_READERS or not user.users:
                return False
            stack.extend(user.users)
        if node.target not in _MERGED_INTO_READERS or not node.users:
            return False
        self.kind[node.name] = "data"
        self.merged[node.name] = data
        return True

    def _carried(self, arg: torch.fx.Node) -> list[tuple[str, torch.fx.Node]]:
        """The values a node's argument brings its operators, each with the argument that carries it: its own
        (seen through a node run just before its reader: ``inline``), or those of the nodes merged into the
        operators (``merged``), which read what those read."""
        value = self.node_of[arg.name]
        while value in self.inline:  # the operators read what the inlined node moves
            value = self.inline[value]
        if value not in self.merged:
            return [(value, arg)]
        return [carried for source in self.merged[value] for carried in self._carried(source)]

    def _claim(self, node: torch.fx.Node, data: list[torch.fx.Node]) -> list[int]:
        """The operators without a record that compute this node: an operator reading exactly the node's data
        arguments and writing as many values as it returns."""
        wanted = {self.node_of[arg.name] for arg in data}
        value = node.meta.get("val")
        count = len(value) if isinstance(value, (tuple, list)) else 1
        for index in self.unattributed:
            op = self.program.ops[index].rule.op
            reads = {
                self._value_of_tensor(name)
                for name in op.inputs
                if name and self.graph.tensor(name).kind not in ("constant", "parameter")
            }
            if reads == wanted and len([out for out in op.outputs if out]) == count:
                self.unattributed.remove(index)
                return [index]
        return []

    # --- a node with operators ----------------------------------------------------------------

    def _node_unit(self, node: torch.fx.Node, args: list[torch.fx.Node]) -> None:
        ops = sorted(self.ops_of[node.name])
        produced = {out for index in ops for out in self.program.ops[index].rule.op.outputs if out}
        outputs = self._outputs(node, ops)
        by_value: dict[str, torch.fx.Node] = {}
        for arg in args:
            for value, carrier in self._carried(arg):
                by_value.setdefault(value, carrier)
        merged = any(carrier is not arg for arg in args for _, carrier in self._carried(arg))
        reads: list[Read] = []
        left: list[tuple[int, int, str]] = []
        for index in ops:
            for slot, name in enumerate(self.program.ops[index].rule.op.inputs):
                if not name or name in produced or self.fork_input.get(name) in produced:
                    continue  # (a fork of its own operators' output: Falcon's shared Transpose, run within the node)
                carried = self._value_of_tensor(name)
                if name in self.shared or self.fork_input.get(name) in self.shared:  # another node's operators wrote it
                    reads.append(Read("", name, index, slot))
                elif carried is not None and carried in by_value:
                    reads.append(self._read(node, by_value[carried], carried, name, index, slot, stored=False))
                elif self.graph.tensor(name).kind in ("parameter", "constant"):
                    left.append((index, slot, name))
                else:
                    raise MappingError(
                        f"Operator {self.program.ops[index].name!r} of the plan reads {name!r}, which module node"
                        f" {node.name!r} does not read: the plan was made for another module."
                    )
        paired = {read.arg for read in reads}
        for value, arg in by_value.items():
            if value in paired:
                continue
            match = self._pair_stored(node, arg, left)
            if match is None:
                if self.kind[value] == "whole" or any(not read.arg for read in reads) or reads_metadata_only(node, arg):
                    continue  # a constant folded in (a shape, a scale), a shared value, or read for its type
                raise MappingError(
                    f"Module node {node.name!r} reads {arg.name!r}, which none of the plan's operators for it reads:"
                    f" the plan was made for another module, or {_MERGED}"
                )
            left.remove(match)
            reads.append(self._read(node, arg, value, match[2], match[0], match[1], stored=True))
        for index, _, name in left:
            if self.graph.tensor(name).kind == "parameter":
                raise MappingError(
                    f"The plan's weight {name!r} (read by {self.program.ops[index].name!r}) is none of module node"
                    f" {node.name!r}'s parameters: the plan was made for another module."
                )
        for tensor, _ in outputs:
            self.value_of.setdefault(tensor, node.name)
        order = self.order_of.get(node.name)
        self.units.append(NodeUnit(node.name, tuple(ops), tuple(reads), tuple(outputs), order, merged))
        for index in ops:  # each fork right after the value it forks
            for out in self.program.ops[index].rule.op.outputs:
                self.units += [ForkUnit(fork) for fork in self._forks_of(out)]

    def _read(
        self, node: torch.fx.Node, arg: torch.fx.Node, value: str, tensor: str, index: int, slot: int, stored: bool
    ) -> Read:
        """The argument ``arg`` (carrying ``value``) as operator ``index`` reads ``tensor`` in ``slot``; ``stored``:
        the tensor is a weight the exporter stored for it (`STORED_PERMUTED`), not the value itself."""
        order = self._stored_permutation(node, arg) if stored else self.order_of.get(value)
        if self.kind[value] == "derived":
            if self.graph.tensor(tensor).kind != "parameter":
                self.constants_trained.setdefault(tensor, value)  # (said once, all of them: `_check_trained`)
            if self.derived.setdefault(tensor, value) != value:
                raise MappingError(
                    f"The plan's {tensor!r} is what module nodes {self.derived[tensor]!r} and {value!r} compute from"
                    f" their parameters: {_MERGED}"
                )
        elif self.graph.tensor(tensor).kind == "parameter" and self.kind[value] == "whole":
            self.untrained.add(tensor)  # a table the importer took for a weight (see `ModuleMap.untrained`)
        elif self.graph.tensor(tensor).kind == "parameter":
            if self.kind[value] != "parameter":
                raise MappingError(
                    f"The plan trains {tensor!r} (read by {self.program.ops[index].name!r}), which the module computes"
                    f" from its data: the plan was made for another module."
                )
            placeholder, viewed = self.view_of[value]
            use = ParameterUse(tensor, self.parameter_key[placeholder], _identity_none(_compose(viewed, order)))
            held = self.parameters.setdefault(tensor, use)
            if held != use:
                raise MappingError(
                    f"The plan's weight {tensor!r} is read as module parameter {held.parameter!r} and as"
                    f" {use.parameter!r} (by node {node.name!r}): the plan was made for another module."
                )
        return Read(value, tensor, index, slot, _identity_none(order))

    def _forks_of(self, tensor: str) -> list[int]:
        return [
            self.op_index[consumer]
            for consumer in self.graph.consumers.get(tensor, ())
            if self.graph.op(consumer).domain == FORK_DOMAIN and self.graph.op(consumer).op_type == FORK
        ]

    def _value_of_tensor(self, tensor: str) -> str | None:
        """The FX value a plan tensor carries: forks seen through, parameters by key, constants by name."""
        tensor = self.fork_input.get(tensor, tensor)
        if tensor in self.value_of:
            return self.value_of[tensor]
        for placeholder, key in self.parameter_key.items():
            if key == tensor:
                return placeholder
        for placeholder, key in self.buffer_key.items():
            if key == tensor:
                return placeholder
        node = self.nodes.get(tensor)
        if (
            node is not None
            and node.op == "call_function"
            and self.kind.get(self.node_of.get(tensor, ""))
            in (
                "whole",
                "derived",
            )
        ):
            return self.node_of[tensor]
        return None

    def _outputs(self, node: torch.fx.Node, ops: list[int]) -> list[tuple[str, int]]:
        """The plan tensors the node's values are, in the order it returns them, each with its writer."""
        writer = {out: index for index in ops for out in self.program.ops[index].rule.op.outputs if out}
        mine = {self.program.ops[index].name for index in ops}
        read_outside = [
            out
            for out in writer
            if out in self.graph.outputs or any(consumer not in mine for consumer in self.graph.consumers.get(out, ()))
        ]
        value = node.meta.get("val")
        if isinstance(value, (tuple, list)):
            last = self.program.ops[ops[-1]].rule.op
            slots = _RETURNS.get(str(node.target), tuple(range(len(value))))
            if (
                len(ops) != 1
                or len(slots) != len(value)
                or sorted(slot for slot in slots if slot is not None) != list(range(len(last.outputs)))
            ):
                raise MappingError(
                    f"Module node {node.name!r} returns {len(value)} values, which autopar cannot pair with its"
                    f" {len(ops)} operator(s) in the plan."
                )
            for user in node.users:
                position: Any = user.args[1]
                slot = slots[int(position)] if user.target == operator.getitem else None
                if slot is not None and last.outputs[slot]:
                    self.value_of[last.outputs[slot]] = user.name
            return [(last.outputs[slot] if slot is not None else "", ops[0]) for slot in slots]
        shape = _shape(node)
        own = [
            t for t in read_outside if shape is None or _same_but_batch(tuple(self.graph.tensor(t).shape), shape)
        ] or read_outside
        if not own:
            raise MappingError(f"Module node {node.name!r} becomes operators none of whose outputs is read.")
        tensor = max(own, key=lambda t: writer[t])  # the last one written; others are shared (`ModuleMap.shared`)
        self.shared.update(t for t in read_outside if t != tensor)
        planned = tuple(self.graph.tensor(tensor).shape)
        order = self._permuted(node, tensor) or self._scattered_transposed(node, tensor, ops)
        if shape is not None and order is not None and _same_but_batch(_permuted(planned, inverse(order)), shape):
            self.order_of[node.name] = order
        elif shape is not None and not _same_but_batch(planned, shape):
            raise MappingError(
                f"Module node {node.name!r} has shape {list(_shape(node) or ())} where the plan's {tensor!r} has"
                f" {list(self.graph.tensor(tensor).shape)}: the plan was made for another module, or for other input"
                " shapes."
            )
        return [(tensor, writer[tensor])]

    def _permuted(self, node: torch.fx.Node, tensor: str) -> tuple[int, ...] | None:
        """How the plan's ``tensor`` orders the dimensions of ``node``'s value, where the exporter merged the Transpose
        ending the node's operators into its reader's (None: where it did not, or in the same order).

        Falcon's ``k[:, :, [i]]`` is a Transpose, a GatherND and a Transpose back; its reader's ``transpose(1, 2)``
        made the last two one. The node's one reader is then a transpose or permute by r whose operator is a
        Transpose by q of ``tensor``: r of the value is q of the tensor, so the tensor is the value permuted by
        r then the inverse of q."""
        if len(node.users) != 1:
            return None
        (user,) = node.users
        r = _permutation_of(user)
        if r is None or user.target not in _PARAMETER_VIEWS:
            return None
        for index in self.ops_of.get(user.name, ()):
            op = self.program.ops[index].rule.op
            if op.op_type == "Transpose" and self.fork_input.get(op.inputs[0], op.inputs[0]) == tensor:
                q = op.attrs.get("perm")
                if q is None or len(q) != len(r):
                    return None
                return _identity_none(_compose(r, inverse(tuple(int(d) for d in q))))
        return None

    def _scattered_transposed(self, node: torch.fx.Node, tensor: str, ops: Sequence[int]) -> tuple[int, ...] | None:
        """How the plan's ``tensor`` orders the dimensions of ``node``'s value where the exporter scattered into a
        transposed copy of the value the node writes into and left the Transpose back to the node's reader (None:
        where it did not). DeepSeek-V3's key states, ``k[..., :8].copy_(k_nope)``, are a ``slice_scatter`` along
        the last dimension: a Transpose bringing that dimension first, a ScatterND into it, and the Transpose back
        only after the next ``slice_scatter``. The ScatterND keeps the order of what it scatters into, so the
        tensor is the value permuted as that Transpose permutes (after any order its input has already; a table
        the exporter folded, as DeepSeek-V3's ``new_empty``, has the value's own). Only a Transpose the exporter
        wrote for a node of the same kind counts (the next layer's scatter reads the one this layer's wrote): a
        module's own transpose before its scatter gives the value its order too. Asked whatever the shapes, which
        the order is then checked against: the dimensions it swaps may have one size."""
        written = {out: index for index in ops for out in self.program.ops[index].rule.op.outputs if out}
        writer = self.program.ops[written[tensor]].rule.op
        data = writer.inputs[0]
        if writer.op_type not in ("ScatterND", "ScatterElements") or data not in self.graph.producer:
            return None
        turned = self.graph.op(self.graph.producer[data])
        into = turned.inputs[0] if turned.op_type == "Transpose" else None
        perm = turned.attrs.get("perm")
        if into is None or into in written or perm is None or not self._written_for(turned.name, node):
            return None
        value = self._value_of_tensor(into)  # (None: a table the exporter folded, in the value's own order)
        if value is None and self.graph.tensor(into).kind not in ("constant", "parameter"):
            return None
        return _identity_none(_compose(self.order_of.get(value or ""), tuple(int(d) for d in perm)))

    def _written_for(self, op: str, node: torch.fx.Node) -> bool:
        """Whether the exporter wrote operator ``op`` for ``node`` or for a node of the same kind."""
        index = self.op_index.get(op)
        owner = next((name for name, indices in self.ops_of.items() if index in indices), None)
        return owner is not None and (owner == node.name or self.nodes[owner].target == node.target)

    def _pair_stored(
        self, node: torch.fx.Node, arg: torch.fx.Node, left: list[tuple[int, int, str]]
    ) -> tuple[int, int, str] | None:
        """The first stored weight or constant of the node's operators that ``arg`` is, by shape."""
        shape = _shape(arg)
        if shape is None:
            return None
        order = self._stored_permutation(node, arg)
        want = _permuted(shape, order)

        def fits(name: str) -> bool:  # a weight exactly; a constant table perhaps at the plan's micro-batch
            info = self.graph.tensor(name)
            return tuple(info.shape) == want or (info.kind == "constant" and _same_but_batch(tuple(info.shape), want))

        return next((c for c in left if fits(c[2])), None)

    def _stored_permutation(self, node: torch.fx.Node, arg: torch.fx.Node) -> tuple[int, ...] | None:
        """How the exporter orders an argument's dimensions where it stores it (`STORED_PERMUTED`)."""
        position = next((i for i, a in enumerate(node.args) if a is arg), None)
        permuted = STORED_PERMUTED.get(node.target)  # type: ignore[call-overload]
        return permuted.get(position) if permuted and position is not None else None

    def _check_trained(self) -> None:
        """Every constant of the plan that the module computes from its parameters, in one sentence: its gradient
        is not planned (T5's position biases, looked up at positions the exporter folded in)."""
        if not self.constants_trained:
            return
        (tensor, node), *more = self.constants_trained.items()
        flags = " ".join(f"--trainable {name}" for name in self.constants_trained)
        what = f"{tensor!r} and {len(more)} more as constants" if more else f"{tensor!r} as a constant"
        whose = "their gradients are" if more else "its gradient is"
        raise MappingError(
            f"The plan's model stores {what}, which the module computes from its parameters (module node {node!r}):"
            f" plan with {flags} so that {whose} planned."
        )

    def _check_every_op_placed(self) -> None:
        placed = {index for unit in self.units if isinstance(unit, NodeUnit) for index in unit.ops}
        placed |= {unit.op for unit in self.units if isinstance(unit, ForkUnit)}
        missing = [planned.name for index, planned in enumerate(self.program.ops) if index not in placed]
        if missing:
            raise MappingError(f"The plan's operator {missing[0]!r} belongs to no node of the module's program.")


def _same_but_batch(planned: tuple[int, ...], captured: tuple[int, ...]) -> bool:
    """Whether a plan tensor's shape is a captured value's, but for a smaller leading batch (the plan's micro-batch
    of the batch the module was exported at).

    >>> _same_but_batch((4, 16, 64), (8, 16, 64)), _same_but_batch((64, 64), (128, 64)), _same_but_batch((3,), (8,))
    (True, True, False)
    """
    if planned == captured:
        return True
    return (
        len(planned) == len(captured)
        and len(planned) > 0
        and planned[1:] == captured[1:]
        and 0 < planned[0] < captured[0]
        and captured[0] % planned[0] == 0
    )


def _identity_none(permutation: tuple[int, ...] | None) -> tuple[int, ...] | None:
    return None if permutation is None or permutation == tuple(range(len(permutation))) else permutation


def map_module(program: PlanProgram, exported: torch.export.ExportedProgram) -> ModuleMap:
    """Pair the plan's operators and tensors with the module's nodes and parameters (see the module docstring)."""
    return _Mapper(program, exported).run()
