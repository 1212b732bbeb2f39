"""The search problem: a cost vector per operator and a cost matrix per dataflow edge.

The objective (predicted step time) is additive: a node's cost covers its forward and
backward compute, the gradient AllReduce of the parameters it owns and the reduction of any
partial graph output; an edge's cost is the redistribution between the producer's output
layout and the consumer's input layout, forward and (dual) backward. Parameters and data
inputs are owned by their first consumer, which stores or loads them in the layout it wants;
every later consumer redistributes from there. Memory per device is additive too and is
kept beside the time, for the capacity constraint.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from autopar.cost import CostModel
from autopar.errors import StrategyError, TooLargeError
from autopar.graph import Graph, TensorInfo
from autopar.layout import Layout
from autopar.limits import MAX_CANDIDATES_PER_OPERATOR, MAX_EDGE_CELLS, MAX_LAYOUT_PAIRS
from autopar.redistribute import BACKWARD_DUAL, Collective, Step, redistribute, symbolic_steps
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


@dataclass
class SearchProblem:
    """Everything the solvers need, and everything lowering needs to explain the answer."""

    graph: Graph
    rules: list[OpRule]
    cost: CostModel
    num_devices: int
    mesh_bits: int
    node_time: list[np.ndarray] = field(default_factory=list)
    node_compute: list[np.ndarray] = field(default_factory=list)
    node_communication: list[np.ndarray] = field(default_factory=list)
    node_memory: list[np.ndarray] = field(default_factory=list)
    edges: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)
    uses: list[TensorUse] = field(default_factory=list)
    requires_grad: dict[str, bool] = field(default_factory=dict)
    owner: dict[str, tuple[int, int]] = field(default_factory=dict)
    _redistribution_cache: dict = field(default_factory=dict, repr=False)

    @property
    def size(self) -> int:
        return len(self.rules)

    def candidates(self, node: int) -> list[tuple[int, ...]]:
        return self.rules[node].candidates

    def objective(self, choice: Sequence[int]) -> float:
        """Predicted step time of one assignment (candidate index per node)."""
        total = sum(float(self.node_time[i][c]) for i, c in enumerate(choice))
        for (i, j), matrix in self.edges.items():
            total += float(matrix[choice[i], choice[j]])
        return total

    def memory(self, choice: Sequence[int]) -> float:
        return sum(float(self.node_memory[i][c]) for i, c in enumerate(choice))

    def choice_for(self, strategies: Mapping[str, Sequence[Sequence[int]]]) -> list[int]:
        """Candidate indices for a full assignment of strategies; StrategyError on anything invalid."""
        names = {rule.op.name for rule in self.rules}
        unknown = sorted(set(strategies) - names)
        if unknown:
            raise StrategyError(f"Strategies name operators the model does not have: {', '.join(unknown[:5])}.")
        missing = [rule.op.name for rule in self.rules if rule.op.name not in strategies]
        if missing:
            raise StrategyError(f"No strategy given for {len(missing)} operator(s), e.g. {missing[0]!r}.")
        return [rule.candidates.index(rule.parse(strategies[rule.op.name])) for rule in self.rules]

    # --- pieces shared with lowering ---------------------------------------------------------

    def source_layout(self, use: TensorUse, choice_of_src: int) -> Layout:
        rule = self.rules[use.src_node]
        if use.src_is_output:
            return rule.output_layout(choice_of_src, use.src_slot)
        return rule.input_layout(choice_of_src, use.src_slot)

    def itemsize(self, tensor: TensorInfo) -> int:
        return self.cost.activation_itemsize(tensor.dtype)

    def redistribution(self, tensor: str, src: Layout, dst: Layout) -> tuple[tuple[Step, ...], float, float]:
        """Steps and their forward / backward seconds."""
        info = self.graph.tensor(tensor)
        steps = redistribute(src, dst, info.shape, self.itemsize(info))
        forward = sum(self.cost.collective_time(s.kind, s.bits, s.nbytes) for s in steps)
        backward = 0.0
        if self.requires_grad.get(tensor, False):
            for s in steps:
                dual = BACKWARD_DUAL[s.kind]
                if dual is not None:
                    backward += self.cost.collective_time(dual, s.bits, s.nbytes)
        return steps, forward, backward

    def redistribution_coefficients(self, src: Layout, dst: Layout, with_backward: bool) -> tuple[float, float]:
        """(latency, seconds per byte of the whole tensor) of a redistribution, forward plus backward.

        Shape-free, so one computation serves every tensor with the same pair of layouts.
        """
        key = (src, dst, with_backward)
        hit = self._redistribution_cache.get(key)
        if hit is None:
            latency = per_byte = 0.0
            for kind, bits, shift, *_ in symbolic_steps(src, dst):
                dual = BACKWARD_DUAL[kind] if with_backward else None
                for k in (kind, dual) if dual is not None else (kind,):
                    lat, coef = self.cost.collective_coefficients(k, bits)
                    latency += lat
                    per_byte += coef / (1 << shift)
            hit = (latency, per_byte)
            self._redistribution_cache[key] = hit
        return hit

    def gradient_sync_bits(self, node: int, exponents: Sequence[int], slot: int) -> tuple[int, ...]:
        """Bits over which an input's gradient comes out partial: split labels the input lacks.

        For a parameter this is the gradient AllReduce (MindSpore's mirror operator); for an
        activation read whole by an operator that splits another axis (a column-split MatMul's
        input, say) it is the backward AllReduce dual to the forward identity.
        """
        rule = self.rules[node]
        labels = rule.spec.inputs[slot] or ()
        bits = rule.label_bits(exponents)
        return tuple(
            sorted((b for label in rule.spec.label_order if label not in labels for b in bits[label]), reverse=True)
        )


def build_problem(graph: Graph, cost: CostModel, num_devices: int) -> SearchProblem:
    """Cost every candidate of every operator and every edge between them."""
    mesh_bits = num_devices.bit_length() - 1
    rules = [OpRule.build(op, graph, mesh_bits) for op in graph.ops]
    problem = SearchProblem(graph, rules, cost, num_devices, mesh_bits)
    problem.requires_grad = _requires_grad(graph, rules)
    _assign_uses(problem)
    _check_size(problem)
    for node in range(len(rules)):
        compute, sync, memory = _node_costs(problem, node)
        problem.node_compute.append(compute)
        problem.node_communication.append(sync)
        problem.node_time.append(compute + sync)
        problem.node_memory.append(memory)
    _edge_costs(problem)
    return problem


def _check_size(problem: SearchProblem) -> None:
    """Refuse, before anything is built, a problem whose candidates or cost tables exceed the limits."""
    devices = f"{problem.num_devices:,} devices"
    for rule in problem.rules:
        if rule.candidate_count > MAX_CANDIDATES_PER_OPERATOR:
            raise TooLargeError(
                f"Operator {rule.op.name!r} ({rule.op.op_type}) has {rule.candidate_count:,} candidate strategies on"
                f" {devices} (limit {MAX_CANDIDATES_PER_OPERATOR:,}); use fewer devices."
            )
    cells = sum(
        problem.rules[u.src_node].candidate_count * problem.rules[u.dst_node].candidate_count for u in problem.uses
    )
    if cells > MAX_EDGE_CELLS:
        raise TooLargeError(
            f"The cost tables between operators would hold {cells:,} entries on {devices} (limit {MAX_EDGE_CELLS:,});"
            " use fewer devices."
        )


def _requires_grad(graph: Graph, rules: list[OpRule]) -> dict[str, bool]:
    grad = {name: info.kind == "parameter" and info.trainable for name, info in graph.tensors.items()}
    for rule in rules:
        op = rule.op
        needs = rule.differentiable and any(grad.get(name, False) for name in op.inputs if name)
        for out in op.outputs:
            if out:
                grad[out] = needs and graph.tensor(out).is_float
    return grad


def _assign_uses(problem: SearchProblem) -> None:
    graph = problem.graph
    node_of = {rule.op.name: i for i, rule in enumerate(problem.rules)}
    for node, rule in enumerate(problem.rules):
        for slot, name in enumerate(rule.op.inputs):
            if not name:
                continue
            info = graph.tensor(name)
            if info.kind == "constant":
                continue  # every rank holds constants whole and slices them locally
            if info.kind == "activation":
                producer = problem.rules[node_of[graph.producer[name]]]
                src = node_of[producer.op.name]
                out_slot = producer.op.outputs.index(name)
                problem.uses.append(TensorUse(name, src, out_slot, True, node, slot))
            elif name not in problem.owner:
                problem.owner[name] = (node, slot)
            else:
                src, src_slot = problem.owner[name]
                problem.uses.append(TensorUse(name, src, src_slot, False, node, slot))


def _local_bytes(layout: Layout | None, info: TensorInfo, itemsize: int) -> int:
    if layout is None:
        return 0
    return layout.local_numel(info.shape) * itemsize


def backward_passes(problem: SearchProblem, node: int) -> int:
    """Backward work in units of the forward: a matmul/conv pays once per operand needing a gradient."""
    rule = problem.rules[node]
    op = rule.op
    if not rule.differentiable:
        return 0
    grad_inputs = [slot for slot, name in enumerate(op.inputs) if name and problem.requires_grad.get(name, False)]
    if rule.spec.op_class == "cube":
        return len([slot for slot in grad_inputs if slot < 2])
    return 1 if grad_inputs else 0


def _node_costs(problem: SearchProblem, node: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per candidate: compute seconds, communication seconds the node owns, memory bytes."""
    rule = problem.rules[node]
    op, graph, cost = rule.op, problem.graph, problem.cost
    grad = problem.requires_grad
    op_class = rule.spec.op_class
    passes = backward_passes(problem, node)
    outputs_graph = set(graph.outputs)
    compute = np.zeros(len(rule.candidates))
    sync = np.zeros(len(rule.candidates))
    memory = np.zeros(len(rule.candidates))
    for c, exponents in enumerate(rule.candidates):
        in_layouts, out_layouts = rule.candidate_layouts(c)
        traffic = 0
        for name, layout in zip(op.inputs, in_layouts):
            if name:
                traffic += _local_bytes(layout, graph.tensor(name), problem.itemsize(graph.tensor(name)))
        for name, layout in zip(op.outputs, out_layouts):
            if name:
                traffic += _local_bytes(layout, graph.tensor(name), problem.itemsize(graph.tensor(name)))
        forward = cost.compute_time(op_class, op.flops / rule.shards(exponents), traffic)
        compute[c] = forward * (1.0 + cost.backward_factor * passes)
        seconds = 0.0
        for slot, name in enumerate(op.inputs):
            if not name:
                continue
            owns = problem.owner.get(name) == (node, slot)
            info = graph.tensor(name)
            if grad.get(name, False) and not (owns and info.kind == "parameter"):
                bits = problem.gradient_sync_bits(node, exponents, slot)
                if bits:
                    local = rule.input_layout(c, slot).local_numel(info.shape) * cost.gradient_itemsize()
                    seconds += cost.collective_time(Collective.ALL_REDUCE, bits, local)
            if owns and info.kind == "parameter" and info.trainable:
                numel = rule.input_layout(c, slot).local_numel(info.shape)
                bits = problem.gradient_sync_bits(node, exponents, slot)
                seconds += cost.gradient_sync_time(bits, numel * cost.gradient_itemsize())
        for name, layout in zip(op.outputs, out_layouts):
            if name and name in outputs_graph and layout is not None and layout.partial:
                _, fwd, _ = problem.redistribution(name, layout, Layout(layout.dims))
                seconds += fwd
        memory[c] = sum(nbytes for _, _, nbytes in memory_items(problem, node, c))
        sync[c] = seconds
    return compute, sync, memory


def memory_items(problem: SearchProblem, node: int, choice: int) -> list[tuple[str, str, float]]:
    """(tensor, role, bytes per device) an operator's candidate keeps resident.

    Roles: "parameter" (weights with their FP32 master copy, gradient and optimizer state, as the
    cost model prices them), "input" (data it loads) and "activation" (outputs kept for backward).
    """
    rule = problem.rules[node]
    op, graph, cost = rule.op, problem.graph, problem.cost
    out_layouts = rule.candidate_layouts(choice)[1]
    items: list[tuple[str, str, float]] = []
    for slot, name in enumerate(op.inputs):
        if not name or problem.owner.get(name) != (node, slot):
            continue
        info = graph.tensor(name)
        numel = rule.input_layout(choice, slot).local_numel(info.shape)
        if info.kind == "parameter":
            items.append((name, "parameter", numel * cost.parameter_bytes_per_element(info.trainable)))
        else:
            items.append((name, "input", numel * problem.itemsize(info)))
    for name, layout in zip(op.outputs, out_layouts):
        if name and problem.requires_grad.get(name, False):
            info = graph.tensor(name)
            items.append((name, "activation", _local_bytes(layout, info, problem.itemsize(info))))
    return items


def _edge_costs(problem: SearchProblem) -> None:
    layout_ids: dict[Layout, int] = {}
    layouts_cache: dict[tuple[int, bool, int], tuple[list[Layout], np.ndarray]] = {}
    coefficient_cache: dict[tuple[tuple[int, ...], tuple[int, ...], bool], tuple[np.ndarray, np.ndarray]] = {}

    def distinct_layouts(node: int, is_output: bool, slot: int) -> tuple[list[Layout], np.ndarray, tuple[int, ...]]:
        key = (node, is_output, slot)
        if key not in layouts_cache:
            rule = problem.rules[node]
            layout_of = rule.output_layout if is_output else rule.input_layout
            per_candidate = [layout_of(c, slot) for c in range(len(rule.candidates))]
            index: dict[Layout, int] = {}
            positions = np.array([index.setdefault(layout, len(index)) for layout in per_candidate], dtype=np.int64)
            layouts_cache[key] = (list(index), positions)
        unique, positions = layouts_cache[key]
        ids = tuple(layout_ids.setdefault(layout, len(layout_ids)) for layout in unique)
        return unique, positions, ids

    pairs: set[tuple[int, int, bool]] = set()  # distinct redistributions to cost, counted before costing any
    for use in problem.uses:
        src_ids = distinct_layouts(use.src_node, use.src_is_output, use.src_slot)[2]
        dst_ids = distinct_layouts(use.dst_node, False, use.dst_slot)[2]
        with_backward = problem.requires_grad.get(use.tensor, False)
        pairs.update((a, b, with_backward) for a in src_ids for b in dst_ids)
        if len(pairs) > MAX_LAYOUT_PAIRS:
            raise TooLargeError(
                f"More than {MAX_LAYOUT_PAIRS:,} distinct redistributions between layouts would have to be costed on"
                f" {problem.num_devices:,} devices (the limit keeps costing to about a minute); use fewer devices."
            )

    for use in problem.uses:
        src_unique, src_pos, src_ids = distinct_layouts(use.src_node, use.src_is_output, use.src_slot)
        dst_unique, dst_pos, dst_ids = distinct_layouts(use.dst_node, False, use.dst_slot)
        info = problem.graph.tensor(use.tensor)
        total_bytes = info.numel * problem.itemsize(info)
        with_backward = problem.requires_grad.get(use.tensor, False)
        key = (src_ids, dst_ids, with_backward)
        if key not in coefficient_cache:
            latency = np.zeros((len(src_unique), len(dst_unique)))
            per_byte = np.zeros_like(latency)
            for a, src in enumerate(src_unique):
                for b, dst in enumerate(dst_unique):
                    latency[a, b], per_byte[a, b] = problem.redistribution_coefficients(src, dst, with_backward)
            coefficient_cache[key] = (latency, per_byte)
        latency, per_byte = coefficient_cache[key]
        small = latency + per_byte * total_bytes
        matrix = small[np.ix_(src_pos, dst_pos)]
        i, j = use.src_node, use.dst_node
        if i == j:
            problem.node_time[i] = problem.node_time[i] + np.diagonal(matrix)
            problem.node_communication[i] = problem.node_communication[i] + np.diagonal(matrix)
            continue
        if i > j:
            i, j, matrix = j, i, matrix.T
        if (i, j) in problem.edges:
            problem.edges[(i, j)] = problem.edges[(i, j)] + matrix
        else:
            problem.edges[(i, j)] = np.ascontiguousarray(matrix)
