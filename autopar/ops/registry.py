"""One registration per operator: everything autopar knows about an ONNX operator, in one place.

An `OpDef` is keyed by (domain, op type, opset range), as onnxscript keys its registries. It
holds the strategy rule (the einsum-like `OpSpec`), the forward FLOP count, the local kernel
the SPMD verifier runs on a rank's shards (None: the operator as ONNX defines it, run on the
local shapes), the valid range of integer inputs (for random test values), whether the
operator is differentiable, which of its tensors its backward keeps, the roles of its
inputs at import (configuration scalars, running statistics, layer weights), and what an
exporter needs per operator (the MindSpore primitive it corresponds to).

Operators without a strategy rule may still be declared (`declare`): the importer and the
search need to know that ``RandomNormal`` must never be folded or that ``ArgMax`` carries no
gradient, even though both run replicated.

>>> definition = lookup("Softmax", "", opset=17)
>>> (definition.op_type, definition.since, definition.keeps)
('Softmax', 13, <Keeps.OUTPUTS: 2>)
>>> lookup("Softmax", "", opset=11).until
12
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from autopar.ops.base import OpSpec
    from autopar.ops.views import GraphView, NodeView

Shape = Sequence[int]
RuleFn = Callable[["NodeView", "GraphView"], "OpSpec"]
FlopsFn = Callable[[Sequence["Shape | None"], Sequence[Shape], Mapping[str, Any]], float]
IndexBoundFn = Callable[["NodeView", "GraphView"], "int | None"]


class Keeps(enum.Flag):
    """Which of an operator's tensors its backward pass needs, so training keeps them until then.

    Read only when the backward runs (the operator is differentiable and some input needs a
    gradient): ``INPUTS`` every input (Gelu, LayerNorm); ``OUTPUTS`` every output (Relu,
    Softmax); ``OPERANDS`` each of the first two inputs when the other needs a gradient, as a
    product's backward multiplies by the other factor (MatMul, Conv, Mul by a constant keeps
    nothing); ``DIVISOR`` the second input, which a quotient's backward always needs (Div: with
    ``OPERANDS``, the numerator too when the divisor needs a gradient); ``SELECTORS`` the
    integer or boolean inputs (Where's condition, Gather's indices); ``STATISTICS`` an FP32
    mean and inverse deviation per normalised row; ``MASK`` a byte per element of its output, where it
    draws one (Dropout in training: `autopar.ops.elementwise.dropout_draws`).
    """

    NOTHING = 0
    INPUTS = enum.auto()
    OUTPUTS = enum.auto()
    OPERANDS = enum.auto()
    SELECTORS = enum.auto()
    STATISTICS = enum.auto()
    DIVISOR = enum.auto()
    MASK = enum.auto()


@dataclass(frozen=True)
class LocalCall:
    """One operator on one rank, as a local kernel sees it.

    ``bits`` maps each label of the operator's spec to the mesh bits splitting it under the
    chosen strategy; ``output_shapes`` are the rank's local output shapes; ``run`` executes
    the operator as ONNX defines it on local inputs (onnxruntime on the local shapes). Inputs
    and outputs are numpy arrays for a `local_kernel`, torch tensors for a `torch_local_kernel`.
    """

    op: "NodeView"
    graph: "GraphView"
    spec: "OpSpec"
    bits: Mapping[str, tuple[int, ...]]
    rank: int
    inputs: list[Any]
    output_shapes: list[tuple[int, ...] | None]
    run: Callable[[list[Any]], list[Any]]


LocalKernel = Callable[[LocalCall], list[Any]]

TorchKernel = Callable[[Any, "NodeView", list[Any]], list[Any]]
"""The operator as ONNX defines it, in torch: ``(torch module, op, inputs) -> outputs``.

Inputs are tensors (None for an absent optional input); constant inputs (shapes, axes) may also
arrive as numpy arrays. The kernel is differentiable wherever the operator is. The torch module
is passed in so that `autopar.ops` never imports torch, an optional dependency.
"""


def output_elements(in_shapes: Sequence[Shape | None], out_shapes: Sequence[Shape], attrs: Mapping[str, Any]) -> float:
    """The default FLOP count: one per output element (element-wise work)."""
    return float(sum(math.prod(shape) for shape in out_shapes))


def input_elements(in_shapes: Sequence[Shape | None], out_shapes: Sequence[Shape], attrs: Mapping[str, Any]) -> float:
    """One operation per element of the first input (reductions, global pools)."""
    return float(math.prod(in_shapes[0] or ()))


def no_flops(in_shapes: Sequence[Shape | None], out_shapes: Sequence[Shape], attrs: Mapping[str, Any]) -> float:
    """Metadata-only operators (views, reshapes) do no arithmetic."""
    return 0.0


@dataclass(frozen=True)
class MindSporePrimitive:
    """The MindSpore primitive (``mindspore.ops``) an ONNX operator corresponds to.

    ``inputs``: how many leading ONNX inputs are the primitive's tensor inputs (the shard strategy
    covers only those; ONNX passes shapes, axes and pads as inputs where MindSpore takes them as
    constructor arguments), None for all. ``needs_args``: the constructor has required arguments
    the plan does not hold, so the exported snippet writes the call as a comment.
    """

    name: str
    inputs: int | None = None
    needs_args: bool = False
    note: str = ""


MindSporeField = MindSporePrimitive | str | None | Mapping[str, "MindSporePrimitive | str | None"]
"""How a registration names its MindSpore primitive: a primitive, its name alone (all inputs are
tensors, no required arguments), None (no primitive does the same), or, for a registration of
several op types, one of those per op type."""


@dataclass(frozen=True)
class OpDef:
    """Everything about one ONNX operator over a range of opset versions."""

    op_type: str
    domain: str = ""
    since: int = 1
    until: int | None = None
    rule: RuleFn | None = None
    flops: FlopsFn = output_elements
    local_kernel: LocalKernel | None = None
    torch_kernel: TorchKernel | None = None
    torch_local_kernel: LocalKernel | None = None
    index_bounds: Mapping[int, IndexBoundFn] = field(default_factory=dict)
    differentiable: bool = True
    keeps: Keeps = Keeps.INPUTS
    config_inputs: frozenset[int] = frozenset()
    statistics_inputs: frozenset[int] = frozenset()
    positive_inputs: frozenset[int] = frozenset()
    weight_inputs: bool = False
    foldable: bool = True
    mindspore: MindSporePrimitive | None = None

    def covers(self, opset: int) -> bool:
        return self.since <= opset and (self.until is None or opset <= self.until)


_REGISTRY: dict[tuple[str, str], list[OpDef]] = {}

INTERNAL_DOMAIN = "autopar"  # operators the importer inserts (`autopar.ops.fork`), never read from a file


def _domain(domain: str) -> str:
    return "" if domain in ("", "ai.onnx") else domain


def _add(definition: OpDef) -> None:
    versions = _REGISTRY.setdefault((definition.domain, definition.op_type), [])
    for other in versions:
        last = other.until if other.until is not None else math.inf
        mine = definition.until if definition.until is not None else math.inf
        if definition.since <= last and other.since <= mine:
            raise ValueError(f"{definition.op_type} is registered twice for overlapping opsets")
    versions.append(definition)
    versions.sort(key=lambda d: d.since)


def register(
    *op_types: str, domain: str = "", since: int = 1, until: int | None = None, **fields: Any
) -> Callable[[RuleFn], RuleFn]:
    """Register a strategy rule, with the operator's other facts, for one or more op types.

    ``fields`` are `OpDef`'s: ``flops``, ``local_kernel``, ``torch_kernel``, ``torch_local_kernel``,
    ``index_bounds``, ``differentiable``, ``keeps``, ``config_inputs``, ``statistics_inputs``,
    ``positive_inputs``, ``weight_inputs``, ``foldable``, ``mindspore`` (a `MindSporeField`).
    """

    def decorate(rule: RuleFn) -> RuleFn:
        for op_type in op_types:
            _add(OpDef(op_type, _domain(domain), since, until, rule, **_fields_for(op_type, fields)))
        return rule

    return decorate


def declare(*op_types: str, domain: str = "", since: int = 1, until: int | None = None, **fields: Any) -> None:
    """Declare operators that have no strategy rule (they run replicated) but known facts."""
    for op_type in op_types:
        _add(OpDef(op_type, _domain(domain), since, until, None, **_fields_for(op_type, fields)))


def _fields_for(op_type: str, fields: Mapping[str, Any]) -> dict[str, Any]:
    """One op type's fields of a registration: its own MindSpore primitive picked out of a mapping."""
    named: MindSporeField = fields.get("mindspore")
    if isinstance(named, Mapping):
        named = named.get(op_type)
    if isinstance(named, str):
        named = MindSporePrimitive(named)
    return {**fields, "mindspore": named} if "mindspore" in fields else dict(fields)


def lookup(op_type: str, domain: str, opset: int) -> OpDef | None:
    """The registration covering ``opset``, or None for an operator autopar does not know."""
    for definition in _REGISTRY.get((_domain(domain), op_type), ()):
        if definition.covers(opset):
            return definition
    return None


def mindspore_primitives() -> dict[str, MindSporePrimitive | None]:
    """Op type (default domain) -> the MindSpore primitive of its newest registration, for every
    operator autopar knows (None: no primitive does the same).

    >>> primitives = mindspore_primitives()
    >>> primitives["MatMul"].name, primitives["InstanceNormalization"]
    ('ops.MatMul', None)
    """
    return {op_type: versions[-1].mindspore for (domain, op_type), versions in sorted(_REGISTRY.items()) if not domain}


def registered_op_types() -> list[str]:
    """ONNX operator types with a strategy rule (in some opset); autopar's own (`INTERNAL_DOMAIN`) do not count."""
    ruled = {(domain, op_type) for (domain, op_type), defs in _REGISTRY.items() if any(d.rule for d in defs)}
    return sorted({op_type for domain, op_type in ruled if domain != INTERNAL_DOMAIN})
