"""The model as the search sees it before any cost: who reads what from where, what needs a gradient,
what the backward keeps.

Parameters and data inputs are owned by their first consumer, which stores or loads them in the
layout it wants; every later consumer redistributes from there (a `TensorUse`, as an activation
read from its producer is). Constants are held whole by every rank and sliced locally: no use.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from types import MappingProxyType
from typing import Literal

from autopar.cost import CostModel
from autopar.graph import Graph, OpNode, TensorInfo, gradient_reaches
from autopar.graph.attention import causal_share, find_attention
from autopar.layout import Layout
from autopar.ops import Keeps
from autopar.redistribute import Step, redistribute
from autopar.strategy import OpRule


@dataclass(frozen=True)
class TensorUse:
    """A consumer reading a tensor from a source layout: a producer's output or an owner's input."""

    tensor: str
    src_node: int
    src_slot: int
    src_is_output: bool
    dst_node: int
    dst_slot: int


@dataclass(frozen=True)
class FusedPart:
    """An operator of an attention chain the profile's fused kernel runs (`autopar.graph.attention`).

    ``role``: "scores" (the product of queries and keys, whose forward the backward runs again), "inner"
    (scale, mask, softmax: inside the kernel, no time of their own), "values" (the product with the
    values, whose output and log-sum-exp rows the backward keeps) or "kernel" (an ``Attention`` operator,
    the whole chain in one). ``share`` is the share of the scores a causal kernel computes; ``hidden``
    the s x s tensors it never writes.
    """

    role: Literal["scores", "inner", "values", "kernel"]
    share: float = 1.0
    hidden: frozenset[str] = frozenset()


@dataclass(frozen=True, eq=False)
class Dataflow:
    """Operators bound to the mesh (candidates fixed), the uses between them, and the cost model
    and device count they are planned for: what costing reads, and what lowering explains with.

    ``fixed`` names the operators whose strategy the user fixed (semi-auto); ``kept`` the activations some
    backward needs (``kept_low`` those held in FP8); ``fused`` the operators of attention chains (by name)
    that the profile's fused kernel runs (empty where the profile has none); ``fp8_products`` the products
    of a weight that ``--precision fp8`` runs in FP8.
    """

    graph: Graph
    rules: tuple[OpRule, ...]
    cost: CostModel
    num_devices: int
    mesh_bits: int
    uses: tuple[TensorUse, ...]
    owner: Mapping[str, tuple[int, int]]  # a parameter or data input -> the (operator, slot) that holds it
    requires_grad: Mapping[str, bool]
    kept: frozenset[str]
    fixed: frozenset[int]
    fused: Mapping[str, FusedPart]
    kept_low: frozenset[str]  # kept activations held in FP8 (`CostModel.kept_product_itemsize`)
    fp8_products: frozenset[str]  # the products of a weight run in FP8 (`--precision fp8`; else empty)

    @classmethod
    def of(
        cls, graph: Graph, rules: Sequence[OpRule], cost: CostModel, num_devices: int, fixed: frozenset[int]
    ) -> Dataflow:
        """Trace the uses, the gradients and what the backward keeps."""
        grad = gradient_reaches(graph)
        uses, owner = _uses(graph, rules)
        fused = fused_parts(graph, cost)
        kept = _kept_for_backward(graph, rules, grad, fused)
        fp8 = weight_products(graph, rules) if cost.fp8_matmul_flops is not None else frozenset()
        low = _kept_only_by(graph, rules, grad, fused, fp8) if cost.kept_product_itemsize else frozenset()
        mesh_bits = num_devices.bit_length() - 1
        frozen_grad, frozen_owner = MappingProxyType(grad), MappingProxyType(owner)
        return cls(
            graph,
            tuple(rules),
            cost,
            num_devices,
            mesh_bits,
            uses,
            frozen_owner,
            frozen_grad,
            kept,
            fixed,
            fused,
            low,
            fp8,
        )

    @property
    def size(self) -> int:
        return len(self.rules)

    def candidates(self, node: int) -> list[tuple[int, ...]]:
        return self.rules[node].candidates

    def source_layout(self, use: TensorUse, choice_of_src: int) -> Layout:
        rule = self.rules[use.src_node]
        if use.src_is_output:
            return rule.output_layout(choice_of_src, use.src_slot)
        return rule.input_layout(choice_of_src, use.src_slot)

    def itemsize(self, tensor: TensorInfo) -> int:
        return self.cost.activation_itemsize(tensor.dtype)

    def kept_itemsize(self, tensor: TensorInfo) -> int:
        """Bytes an element of a kept activation takes: FP8's 1 where only matrix products keep it in FP8."""
        low = self.cost.kept_product_itemsize
        return low if low is not None and tensor.name in self.kept_low else self.itemsize(tensor)

    def redistribution(self, tensor: str, src: Layout, dst: Layout) -> tuple[tuple[Step, ...], float]:
        """Steps and their seconds (a gradient's way back is a redistribution of its own)."""
        info = self.graph.tensor(tensor)
        steps = redistribute(src, dst, info.shape, self.itemsize(info))
        return steps, sum(self.cost.collective_time(s.kind, s.bits, s.nbytes) for s in steps)

    def gradient_sync_bits(self, node: int, exponents: Sequence[int], slot: int) -> tuple[int, ...]:
        """Bits over which an input's gradient comes out partial: split labels the input lacks.

        For a parameter this is the gradient AllReduce (MindSpore's mirror operator); for an
        activation read whole by an operator that splits another axis (a column-split MatMul's
        input, say) the gradient's way back to its producer reduces over them (`costing._edge_costs`).
        """
        rule = self.rules[node]
        labels = rule.spec.inputs[slot] or ()
        bits = rule.label_bits(exponents)
        return tuple(
            sorted((b for label in rule.spec.label_order if label not in labels for b in bits[label]), reverse=True)
        )

    def backward_runs(self, node: int) -> bool:
        """Whether the operator has a backward pass (some input needs a gradient)."""
        return backward_runs(self.rules[node], self.requires_grad)

    def kept_by(self, node: int) -> frozenset[str]:
        """The activations one operator's backward needs (`kept_by`, as a fused attention kernel keeps them)."""
        return kept_by(self.rules[node], self.graph, self.requires_grad, self.fused)

    @cached_property
    def kept_by_operator(self) -> tuple[frozenset[str], ...]:
        """`kept_by` of every operator, in order (a pipeline's cut search asks it of every stage it costs)."""
        return tuple(self.kept_by(node) for node in range(self.size))

    @cached_property
    def fork_uses(self) -> tuple[TensorUse, ...]:
        """The uses that read a fork (an operator with gradient labels), in order."""
        return tuple(use for use in self.uses if self.rules[use.src_node].spec.gradient_labels)

    def work_multiple(self, node: int) -> float:
        """Forward and backward work in units of the forward: 1 + backward factor x backward passes, plus the
        forward once more where a fused attention kernel's backward recomputes its scores (FlashAttention's
        backward runs five products where the forward runs two); 0 for the operators inside the kernel."""
        part = self.fused.get(self.rules[node].op.name)
        passes = self.backward_passes(node)
        if part is None:
            return 1.0 + self.cost.backward_factor * passes
        if part.role == "inner":
            return 0.0
        if part.role == "kernel":  # both products' backward and the scores' again: 2.5 forwards, once it runs
            return 1.0 + 2.5 * self.cost.backward_factor if self.backward_runs(node) else 1.0
        again = 1.0 if part.role == "scores" and passes else 0.0
        return 1.0 + self.cost.backward_factor * passes + again

    def backward_passes(self, node: int) -> int:
        """Backward work in units of the forward: a matmul/conv pays once per operand needing a gradient."""
        rule = self.rules[node]
        op = rule.op
        if not rule.differentiable:
            return 0
        grad_inputs = [slot for slot, name in enumerate(op.inputs) if name and self.requires_grad.get(name, False)]
        if rule.spec.op_class == "cube":
            return len([slot for slot in grad_inputs if slot < 2])
        return 1 if grad_inputs else 0


def backward_runs(rule: OpRule, requires_grad: Mapping[str, bool]) -> bool:
    return rule.differentiable and any(requires_grad.get(name, False) for name in rule.op.inputs if name)


def fused_parts(graph: Graph, cost: CostModel) -> Mapping[str, FusedPart]:
    """The operators a fused attention kernel runs, by name: none where the profile has no such kernel."""
    if cost.attention_flops is None:
        return MappingProxyType({})
    parts: dict[str, FusedPart] = {}
    for region in find_attention(graph):
        hidden = frozenset(region.hidden)
        parts[region.scores] = FusedPart("scores", region.kept_share, hidden)
        parts[region.values] = FusedPart("values", region.kept_share, hidden)
        parts.update((name, FusedPart("inner", region.kept_share, hidden)) for name in region.inner)
    for op in graph.ops:
        if op.op_type == "Attention" and op.domain in ("", "ai.onnx"):
            parts[op.name] = FusedPart("kernel", _causal_share(graph, op) if op.attrs.get("is_causal", 0) else 1.0)
    return MappingProxyType(parts)


def _causal_share(graph: Graph, op: OpNode) -> float:
    """The share of the scores a causal ``Attention`` computes: query i (of q, the last q of k positions, past
    keys first) sees the keys up to its own position."""
    q_shape, k_shape = graph.tensor(op.inputs[0]).shape, graph.tensor(op.inputs[1]).shape
    axis = 2 if len(q_shape) == 4 else 1
    queries, keys = q_shape[axis], k_shape[axis]
    if len(op.inputs) > 4 and op.inputs[4]:  # the past keys come first
        keys += graph.tensor(op.inputs[4]).shape[2]
    return causal_share(queries, keys)


def _kept_for_backward(
    graph: Graph, rules: Sequence[OpRule], requires_grad: Mapping[str, bool], fused: Mapping[str, FusedPart]
) -> frozenset[str]:
    """The activations some backward needs (`Keeps`): each counted once, however many keep it.

    Parameters, inputs and constants are resident anyway and are counted as such. What a fork's
    readers keep (`autopar.ops.fork`) is the forked tensor, counted at its producer, as it was
    before the fork was there.
    """
    return frozenset(backward_readers(graph, rules, requires_grad, fused))


def backward_readers(
    graph: Graph, rules: Sequence[OpRule], requires_grad: Mapping[str, bool], fused: Mapping[str, FusedPart]
) -> dict[str, set[int]]:
    """Each activation some backward needs, with the operators whose backward needs it (a fork's readers'
    needs counted at the forked tensor)."""
    keepers: dict[str, set[int]] = {}
    for node, rule in enumerate(rules):
        for name in kept_by(rule, graph, requires_grad, fused):
            keepers.setdefault(name, set()).add(node)
    for rule in rules:  # a fork's output is its input: kept, it is counted once, at the producer
        if rule.spec.gradient_labels and rule.op.outputs[0] in keepers:
            keepers.setdefault(rule.op.inputs[0], set()).update(keepers.pop(rule.op.outputs[0]))
    return keepers


VIEWS = frozenset({"Transpose", "Reshape", "Cast", "Identity", "Squeeze", "Unsqueeze"})
"""Operators that only re-lay a weight out (a Linear's weight transposed by the exporter is still the weight)."""


def weight_products(graph: Graph, rules: Sequence[OpRule]) -> frozenset[str]:
    """The matrix products (MatMul, Gemm) of which an operand is a weight, a parameter or a view of one
    (`VIEWS`): Transformer Engine's Linear layers, which ``--precision fp8`` runs in FP8. A product of two
    activations (attention's) stays in BF16."""
    ops = {op.name: op for op in graph.ops}

    def weight(name: str, depth: int = 0) -> bool:
        info = graph.tensor(name)
        if info.kind == "parameter":
            return True
        producer = graph.producer.get(name)
        op = ops.get(producer) if producer else None
        return op is not None and op.op_type in VIEWS and depth < 8 and weight(op.inputs[0], depth + 1)

    return frozenset(
        rule.op.name
        for rule in rules
        if rule.spec.matmul_labels is not None and any(weight(name) for name in rule.op.inputs[:2] if name)
    )


def _kept_only_by(
    graph: Graph,
    rules: Sequence[OpRule],
    requires_grad: Mapping[str, bool],
    fused: Mapping[str, FusedPart],
    products: frozenset[str],
) -> frozenset[str]:
    """The kept activations only ``products`` keep: in FP8 they are kept in FP8 (`CostModel.kept_product_itemsize`)."""
    keepers = backward_readers(graph, rules, requires_grad, fused)
    return frozenset(name for name, nodes in keepers.items() if all(rules[n].op.name in products for n in nodes))


def kept_by(
    rule: OpRule, graph: Graph, requires_grad: Mapping[str, bool], fused: Mapping[str, FusedPart] | None = None
) -> frozenset[str]:
    """The activations one operator's backward needs (`Keeps`).

    Inside a fused attention kernel (``fused``) no s x s tensor is kept, and the product with the values
    keeps its output: the kernel's backward reads queries, keys, values and output.
    """
    if not backward_runs(rule, requires_grad):
        return frozenset()
    op, keeps = rule.op, rule.keeps
    part = (fused or {}).get(op.name)
    if part is not None and part.role != "kernel":
        plain = kept_by(rule, graph, requires_grad) - part.hidden
        return plain | ({op.outputs[0]} if part.role == "values" else frozenset())
    kept: set[str] = set()
    inputs = [name for name in op.inputs if name]
    if Keeps.INPUTS in keeps:
        kept.update(inputs)
    if Keeps.OUTPUTS in keeps:
        kept.update(name for name in op.outputs if name)
    if Keeps.DIVISOR in keeps and len(op.inputs) > 1 and op.inputs[1]:
        kept.add(op.inputs[1])
    if Keeps.SELECTORS in keeps:
        kept.update(name for name in inputs if not graph.tensor(name).is_float)
    if Keeps.OPERANDS in keeps:
        factors = list(op.inputs[:2])
        for slot, name in enumerate(factors):
            other = factors[1 - slot] if len(factors) == 2 else None
            if name and other and requires_grad.get(other, False):
                kept.add(name)
    return frozenset(name for name in kept if graph.tensor(name).kind == "activation")


def _uses(graph: Graph, rules: Sequence[OpRule]) -> tuple[tuple[TensorUse, ...], dict[str, tuple[int, int]]]:
    """Every use of a tensor from a source layout, and the owner of each parameter and data input."""
    node_of = {rule.op.name: i for i, rule in enumerate(rules)}
    uses: list[TensorUse] = []
    owner: dict[str, tuple[int, int]] = {}
    for node, rule in enumerate(rules):
        for slot, name in enumerate(rule.op.inputs):
            if not name:
                continue
            info = graph.tensor(name)
            if info.kind == "constant":
                continue  # every rank holds constants whole and slices them locally
            if info.kind == "activation":
                producer = rules[node_of[graph.producer[name]]]
                src = node_of[producer.op.name]
                out_slot = producer.op.outputs.index(name)
                uses.append(TensorUse(name, src, out_slot, True, node, slot))
            elif name not in owner:
                owner[name] = (node, slot)
            else:
                src, src_slot = owner[name]
                uses.append(TensorUse(name, src, src_slot, False, node, slot))
    return tuple(uses), owner
