"""The search problem: a cost vector per operator and a cost table per dataflow edge.

Edge tables are over the layouts at the edge's two ends (`dp.Factor`), not over candidates;
runs of repeated blocks (`fold`) are costed once, every copy sharing copy 0's arrays.

The objective (predicted step time) is additive: a node's cost covers its forward and
backward compute, the gradient AllReduce of the parameters it owns and the reduction of any
partial graph output; an edge's cost is the redistribution between the producer's output
layout and the consumer's input layout, forward and (dual) backward. Parameters and data
inputs are owned by their first consumer, which stores or loads them in the layout it wants;
every later consumer redistributes from there. Memory per device is additive too and is
kept beside the time, for the capacity constraint.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from autopar import progress
from autopar.cost import CostModel
from autopar.errors import FixedStrategyError, StrategyError, TooLargeError
from autopar.graph import Graph, TensorInfo
from autopar.layout import Layout
from autopar.limits import MAX_CANDIDATES_PER_OPERATOR, MAX_EDGE_CELLS, MAX_LAYOUT_PAIRS
from autopar.ops import Keeps
from autopar.redistribute import BACKWARD_DUAL, Collective, Step, redistribute, symbolic_steps
from autopar.search.coefficients import LayoutTable, pair_coefficients
from autopar.search.dp import Factor
from autopar.search.fold import Repeat, Solver, find_repeats, signatures
from autopar.strategy import OpRule

STATISTICS_BYTES_PER_ROW = 8  # a normalisation's FP32 mean and inverse deviation per row


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
class MemoryChoices:
    """What a plan does to save memory, beside its strategies (searched only when memory binds).

    ``sharded``: operators whose trainable parameters use a parallel optimizer (MindSpore's
    ``enable_parallel_optimizer``, ZeRO-2: gradient and optimizer state split over the bits the
    parameter is replicated on; ReduceScatter, then AllGather of the updated weights);
    ``recompute``: every folded run of repeated blocks keeps only each block's input and runs
    its forward again in the backward pass; ``micro_batches``: the problem is one micro-batch of
    a step that accumulates gradients over this many (the gradient sync is paid once a step).
    """

    sharded: frozenset[int] = frozenset()
    recompute: bool = False
    micro_batches: int = 1


NO_MEMORY_CHOICES = MemoryChoices()


@dataclass(frozen=True)
class Alternative:
    """An operator's figures per candidate with its parameters under a parallel optimizer."""

    time: np.ndarray
    communication: np.ndarray
    memory: np.ndarray
    hidden: np.ndarray
    sync: np.ndarray  # the part of ``time`` paid once a step: exposed gradient sync and weight gathers


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
    node_hidden: list[np.ndarray] = field(default_factory=list)  # gradient sync hidden behind the backward
    node_sync: list[np.ndarray] = field(default_factory=list)  # gradient sync exposed (paid once a step)
    sharded: dict[int, Alternative] = field(default_factory=dict)  # where a parallel optimizer saves memory
    recompute_time: dict[int, np.ndarray] = field(default_factory=dict)  # run operators: forward again
    recompute_memory: dict[int, np.ndarray] = field(default_factory=dict)  # run operators: bytes freed (<= 0)
    recompute_share: dict[int, float] = field(default_factory=dict)  # of their activations, what stays
    factors: list[Factor] = field(default_factory=list)
    folds: list[tuple[Repeat, list[Factor]]] = field(default_factory=list)
    recompute_folds: list[tuple[Repeat, list[Factor]]] = field(default_factory=list)  # forward edges paid twice
    layouts_costed: int = 0
    pairs_costed: int = 0
    solver: Solver | None = field(default=None, repr=False)  # planned on placeholders, bound after costing
    uses: list[TensorUse] = field(default_factory=list)
    requires_grad: dict[str, bool] = field(default_factory=dict)
    kept: frozenset[str] = frozenset()  # activations kept for the backward pass
    fixed: frozenset[int] = frozenset()  # operators whose strategy the user fixed (semi-auto)
    owner: dict[str, tuple[int, int]] = field(default_factory=dict)
    _redistribution_cache: dict = field(default_factory=dict, repr=False)

    @property
    def size(self) -> int:
        return len(self.rules)

    def candidates(self, node: int) -> list[tuple[int, ...]]:
        return self.rules[node].candidates

    def objective(self, choice: Sequence[int], choices: MemoryChoices = NO_MEMORY_CHOICES) -> float:
        """Predicted step time of one assignment (candidate index per node).

        With k micro-batches the step is k micro-steps, the gradient sync paid once.
        """
        total = sum(float(self.node_arrays(i, choices)[0][c]) for i, c in enumerate(choice))
        for factor, scope in self._all_factors(choices.recompute):
            total += factor.value([choice[u] for u in scope])
        if choices.micro_batches == 1:
            return total
        once = sum(
            float((self.sharded[i].sync if i in choices.sharded else self.node_sync[i])[c])
            for i, c in enumerate(choice)
        )
        return choices.micro_batches * (total - once) + once

    def _all_factors(self, recompute: bool = False) -> list[tuple[Factor, tuple[int, ...]]]:
        """Every edge factor with the operators it joins in its copy (its own scope outside folded runs)."""
        found = [(factor, factor.scope) for factor in self.factors]
        for repeat, factors in self.recompute_folds if recompute else self.folds:
            found += [(f, repeat.shift(f.scope, k)) for k in range(repeat.copies) for f in factors]
        return found

    def node_arrays(self, node: int, choices: MemoryChoices = NO_MEMORY_CHOICES) -> tuple[np.ndarray, np.ndarray]:
        """(seconds, bytes) per candidate of one operator under the memory choices."""
        if node in choices.sharded:
            time, memory = self.sharded[node].time, self.sharded[node].memory
        else:
            time, memory = self.node_time[node], self.node_memory[node]
        if choices.recompute and node in self.recompute_time:
            time, memory = time + self.recompute_time[node], memory + self.recompute_memory[node]
        return time, memory

    def lagrangian(
        self, weight: float, recompute: bool, time_scale: float = 1.0
    ) -> tuple[list[np.ndarray], list[np.ndarray | None]]:
        """Per operator, time_scale x time + weight x memory per candidate at its better optimizer choice,
        and where (per candidate) that choice is the parallel optimizer (None: never). Ties keep the
        plain one."""
        with_recompute = MemoryChoices(recompute=recompute)
        sharding = MemoryChoices(frozenset(self.sharded), recompute)
        unary: list[np.ndarray] = []
        takes: list[np.ndarray | None] = []
        for node in range(self.size):
            time, memory = self.node_arrays(node, with_recompute)
            plain = time_scale * time + weight * memory if weight else time_scale * time
            if node not in self.sharded:
                unary.append(plain)
                takes.append(None)
                continue
            time, memory = self.node_arrays(node, sharding)
            other = time_scale * time + weight * memory if weight else time_scale * time
            better = other < plain
            unary.append(np.where(better, other, plain))
            takes.append(better if better.any() else None)
        return unary, takes

    @staticmethod
    def choices_at(choice: Sequence[int], takes: Sequence[np.ndarray | None], recompute: bool) -> MemoryChoices:
        """The memory choices `lagrangian` made for the candidates of one plan."""
        sharded = frozenset(i for i, (c, t) in enumerate(zip(choice, takes)) if t is not None and t[c])
        return MemoryChoices(sharded, recompute)

    def hidden(self, choice: Sequence[int], choices: MemoryChoices = NO_MEMORY_CHOICES) -> float:
        """Seconds of gradient synchronisation hidden behind the backward pass."""
        return sum(
            float((self.sharded[i].hidden if i in choices.sharded else self.node_hidden[i])[c])
            for i, c in enumerate(choice)
        )

    @cached_property
    def edges(self) -> dict[tuple[int, int], np.ndarray]:
        """Full candidate-by-candidate cost matrix per pair of operators (for the ILP and brute force)."""
        return self.edges_for(False)

    def edges_for(self, recompute: bool) -> dict[tuple[int, int], np.ndarray]:
        """`edges`, with the forward redistributions inside repeated blocks paid twice if ``recompute``."""
        edges: dict[tuple[int, int], np.ndarray] = {}
        for factor, (i, j) in self._all_factors(recompute):
            rows, cols = factor.maps
            matrix = factor.table[np.ix_(rows, cols)]
            edges[(i, j)] = edges[(i, j)] + matrix if (i, j) in edges else matrix
        return edges

    def memory(self, choice: Sequence[int], choices: MemoryChoices = NO_MEMORY_CHOICES) -> float:
        return sum(float(self.node_arrays(i, choices)[1][c]) for i, c in enumerate(choice))

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


def build_problem(
    graph: Graph,
    cost: CostModel,
    num_devices: int,
    fold: bool = True,
    fixed: Mapping[str, Sequence[Sequence[int]]] | None = None,
) -> SearchProblem:
    """Cost every candidate of every operator and every edge between them.

    With ``fold``, runs of structurally identical blocks (`autopar.search.fold`) are costed
    once: every copy shares copy 0's node costs and edge tables. ``fixed`` maps operator names to
    the in_strategy each must keep (semi-auto mode): those operators have that one candidate,
    and a block holding one is no longer a copy of the others.
    """
    mesh_bits = num_devices.bit_length() - 1
    rules = [OpRule.build(op, graph, mesh_bits) for op in graph.ops]
    pinned = _pin(rules, fixed or {})
    problem = SearchProblem(graph, rules, cost, num_devices, mesh_bits)
    problem.fixed = frozenset(pinned)
    problem.requires_grad = _requires_grad(graph, rules)
    problem.kept = _kept_for_backward(graph, rules, problem.requires_grad)
    _assign_uses(problem)
    # repeated blocks bound the overlap windows whether or not they are folded, so folding never
    # changes the objective
    signature = signatures(
        graph, problem.uses, problem.owner, problem.requires_grad, problem.kept, set(graph.outputs), pinned
    )
    blocks = find_repeats(len(rules), problem.uses, signature)
    repeats = blocks if fold else []
    copy_of: dict[int, int] = {}  # operators of copies 1.. -> the same operator of copy 0
    run_of: dict[int, int] = {}  # operators of copy 0 -> their run
    for index, repeat in enumerate(repeats):
        for node in repeat.block(0):
            run_of[node] = index
        for k in range(1, repeat.copies):
            for node in repeat.block(k):
                copy_of[node] = node - k * repeat.period
                rules[node].__dict__["candidates"] = rules[copy_of[node]].candidates
    costed = [use for use in problem.uses if use.dst_node not in copy_of]
    _check_size(problem, costed)
    problem.folds = [(repeat, []) for repeat in repeats]
    layouts = _Layouts(problem)
    solver = _plan_search(problem, layouts, costed, run_of)
    every = max(1, len(rules) // 100)
    costs: list[NodeCosts] = []
    for node in range(len(rules)):
        if node % every == 0:
            progress.report("costing operators", node, len(rules))
        costs.append(costs[copy_of[node]] if node in copy_of else _node_costs(problem, node))
    per_run: list[list[Factor]] = [[] for _ in repeats]
    per_run_again: list[list[Factor]] = [[] for _ in repeats]
    own: dict[int, np.ndarray] = {}  # operators reading their own output pay that redistribution themselves
    for use, (factor, forward) in zip(costed, _edge_costs(problem, costed, layouts)):
        if factor is None:
            own[use.src_node] = own.get(use.src_node, 0.0) + forward
        elif use.dst_node in run_of:
            per_run[run_of[use.dst_node]].append(factor)
            per_run_again[run_of[use.dst_node]].append(Factor(factor.scope, factor.maps, factor.table + forward))
        else:
            problem.factors.append(factor)
    _compose(
        problem,
        costs,
        {node: own[copy_of.get(node, node)] for node in range(len(rules)) if copy_of.get(node, node) in own},
        repeats,
        blocks,
    )
    problem.folds = list(zip(repeats, per_run))
    problem.recompute_folds = list(zip(repeats, per_run_again))
    solver.bind(problem.factors, problem.folds)
    problem.solver = solver
    return problem


def _compose(
    problem: SearchProblem,
    costs: list[NodeCosts],
    own: Mapping[int, np.ndarray],
    repeats: Sequence[Repeat],
    blocks: Sequence[Repeat],
) -> None:
    """Each operator's time and memory arrays: overlap, the parallel optimizer and recomputation.

    Overlap: the gradient sync of an operator's parameters starts once its backward is done and
    runs beside the backward of the operators before it, back to the previous operator with large
    parameters, whose sync comes next (one bucket at a time, in backward order). Small parameters
    (under 1% of the elements of the largest operator's: biases, norm scales) ride in the next
    bucket and hide nothing. The backward a bucket hides behind is taken at each operator's
    fastest candidate, so the objective stays additive and the DP exact; a plan that leaves
    devices idle hides somewhat more than this says, and slack in one window never covers the
    next (an upper bound on what the queue of buckets exposes). Inside a run of repeated blocks
    (``blocks``, folded or not) the window stops at the block's start, so every copy costs the
    same. ``repeats`` are the runs folded: recomputation applies to them.
    """
    cost = problem.cost
    backward = [float(np.min(c.compute - c.forward)) if len(c.compute) else 0.0 for c in costs]
    copy_start: dict[int, int] = {}
    for repeat in blocks:
        for k in range(repeat.copies):
            for node in repeat.block(k):
                copy_start[node] = repeat.block(k)[0]
    last_of_copy = {repeat.last(k) for repeat in repeats for k in range(repeat.copies)}
    previous = 0
    cumulative = np.concatenate([[0.0], np.cumsum(backward)])
    hide = [0.0] * len(costs)
    largest = max((c.parameter_elements for c in costs), default=0)
    for node, c in enumerate(costs):
        if not c.parameter_elements or 100 * c.parameter_elements < largest:
            continue
        start = max(previous, copy_start.get(node, 0))
        hide[node] = float(cumulative[node] - cumulative[start]) if cost.overlap else 0.0
        previous = node

    def exposed(sync: np.ndarray, node: int) -> np.ndarray:
        return np.maximum(sync - hide[node], 0.0)

    cache: dict[int, tuple] = {}  # copies share their first copy's arrays
    for node, c in enumerate(costs):
        key = id(c)
        if key not in cache:
            extra = own.get(node, 0.0)
            shown = exposed(c.gradient_sync, node)
            communication = c.communication + extra + shown
            entry: list = [c.compute + communication, communication, c.memory, c.gradient_sync - shown, shown, None]
            if c.parameter_elements and c.state_saving.any():
                shown = exposed(c.scatter, node)
                communication = c.communication + extra + shown + c.gather
                entry[5] = Alternative(
                    c.compute + communication,
                    communication,
                    c.memory - c.state_saving,
                    c.scatter - shown,
                    shown + c.gather,
                )
            cache[key] = tuple(entry)
        time, communication, memory, hidden, sync, alternative = cache[key]
        problem.node_compute.append(c.compute)
        problem.node_communication.append(communication)
        problem.node_time.append(time)
        problem.node_memory.append(memory)
        problem.node_hidden.append(hidden)
        problem.node_sync.append(sync)
        if alternative is not None:
            problem.sharded[node] = alternative
    for repeat in repeats:
        kept = (repeat.copies - 1) / repeat.copies  # one block's activations stay, rebuilt in turn
        for node in range(repeat.start, repeat.start + repeat.copies * repeat.period):
            c = costs[node]
            problem.recompute_time[node] = c.forward
            if node in last_of_copy:  # its output is the next block's input: kept
                problem.recompute_memory[node] = np.zeros(len(c.memory))
            else:
                problem.recompute_memory[node] = -kept * c.activations
                problem.recompute_share[node] = 1.0 - kept


def _pin(rules: list[OpRule], fixed: Mapping[str, Sequence[Sequence[int]]]) -> dict[int, tuple[int, ...]]:
    """Give each fixed operator its one candidate; FixedStrategyError for a strategy that cannot be."""
    index = {rule.op.name: node for node, rule in enumerate(rules)}
    pinned: dict[int, tuple[int, ...]] = {}
    for name, strategy in fixed.items():
        if name not in index:
            close = difflib.get_close_matches(str(name), list(index), n=1)
            hint = f"; did you mean {close[0]!r}" if close else ""
            raise FixedStrategyError(f"A strategy is fixed for {name!r}, which the model does not have{hint}.")
        rule = rules[index[name]]
        try:
            exponents = rule.parse(strategy)
        except StrategyError as exc:
            raise FixedStrategyError(str(exc)) from None
        rule.__dict__["candidates"] = [exponents]
        pinned[index[name]] = exponents
    return pinned


def _check_size(problem: SearchProblem, uses: Sequence[TensorUse]) -> None:
    """Refuse, before anything is built, a problem whose candidates or cost tables exceed the limits."""
    devices = f"{problem.num_devices:,} devices"
    for rule in problem.rules:
        if rule.candidate_count > MAX_CANDIDATES_PER_OPERATOR:
            raise TooLargeError(
                f"Operator {rule.op.name!r} ({rule.op.op_type}) has {rule.candidate_count:,} candidate strategies on"
                f" {devices} (limit {MAX_CANDIDATES_PER_OPERATOR:,}); use fewer devices."
            )
    cells = sum(problem.rules[u.src_node].candidate_count * problem.rules[u.dst_node].candidate_count for u in uses)
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


def _backward_runs(rule: OpRule, requires_grad: Mapping[str, bool]) -> bool:
    return rule.differentiable and any(requires_grad.get(name, False) for name in rule.op.inputs if name)


def _kept_for_backward(graph: Graph, rules: list[OpRule], requires_grad: Mapping[str, bool]) -> frozenset[str]:
    """The activations some backward needs (`Keeps`): each counted once, however many keep it.

    Parameters, inputs and constants are resident anyway and are counted as such.
    """
    kept: set[str] = set()
    for rule in rules:
        if not _backward_runs(rule, requires_grad):
            continue
        op, keeps = rule.op, rule.keeps
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


@dataclass(frozen=True)
class NodeCosts:
    """One operator's figures per candidate, before overlap and the memory choices apply."""

    compute: np.ndarray  # forward and backward seconds
    forward: np.ndarray  # forward seconds, paid again when the operator is recomputed
    communication: np.ndarray  # collectives on the critical path (backward AllReduce of inputs read whole, ...)
    gradient_sync: np.ndarray  # the AllReduce of the trainable parameters it owns
    scatter: np.ndarray  # with a parallel optimizer: their gradients' ReduceScatter instead ...
    gather: np.ndarray  # ... and the AllGather of the updated weights before the next forward
    memory: np.ndarray  # bytes per device: parameter state, inputs, activations kept for backward
    state_saving: np.ndarray  # bytes a parallel optimizer saves (0 where the parameters are split everywhere)
    activations: np.ndarray  # bytes of its outputs kept for backward (dropped when recomputed)
    parameter_elements: int  # of the trainable parameters it owns (their sync starts after its backward)


def _node_costs(problem: SearchProblem, node: int) -> NodeCosts:
    """Per candidate: compute and communication seconds the node owns, memory bytes.

    Vectorised over candidates: a tensor's local size is its size shifted right by the
    exponents of the labels splitting it, and the bits a gradient is partial over are a mask
    built from the labels' bit ranges (the last label of the device matrix takes the lowest
    bits, as `OpRule.label_bits` says). Every figure is the one `memory_items` and
    `SearchProblem.gradient_sync_bits` give for the candidate, term for term.
    """
    rule = problem.rules[node]
    op, graph, cost, spec = rule.op, problem.graph, problem.cost, rule.spec
    grad = problem.requires_grad
    count = len(rule.candidates)
    order = spec.label_order
    exponents = np.asarray(rule.candidates, dtype=np.int64).reshape(count, len(order))
    column = {label: i for i, label in enumerate(order)}
    # bit offset of each label: the sum of the exponents of the labels after it
    offsets = np.cumsum(exponents[:, ::-1], axis=1)[:, ::-1] - exponents
    label_mask = ((np.int64(1) << exponents) - 1) << offsets

    def split(labels: Sequence[str | None] | None) -> np.ndarray:
        """How many mesh bits split a tensor with these labels, per candidate."""
        bits = np.zeros(count, dtype=np.int64)
        for label in labels or ():
            if label is not None:
                bits += exponents[:, column[label]]
        return bits

    def local(info: TensorInfo, labels: Sequence[str | None] | None) -> np.ndarray:
        return np.int64(info.numel) >> split(labels)

    def absent_mask(labels: Sequence[str | None] | None) -> np.ndarray:
        mask = np.zeros(count, dtype=np.int64)
        for label in order:
            if label not in (labels or ()):
                mask |= label_mask[:, column[label]]
        return mask

    inputs = list(zip(spec.inputs, op.inputs))
    outputs = list(zip(spec.outputs, op.outputs))
    traffic = np.zeros(count, dtype=np.int64)
    for labels, name in inputs + outputs:
        if name:
            info = graph.tensor(name)
            traffic += local(info, labels) * problem.itemsize(info)
    op_class = spec.op_class
    if op_class == "free":
        forward = np.zeros(count)
    else:
        rate = cost.cube_flops if op_class == "cube" else cost.vector_flops
        work = op.flops / np.ldexp(1.0, split(order)) / rate
        forward = np.maximum(work, traffic / cost.memory_bandwidth)
    compute = forward * (1.0 + cost.backward_factor * backward_passes(problem, node))

    communication = np.zeros(count)
    gradient_sync, scatter, gather = np.zeros(count), np.zeros(count), np.zeros(count)
    memory, state_saving = np.zeros(count), np.zeros(count)
    gradient_bytes = cost.gradient_itemsize()
    parameter_elements = 0
    for slot, name in enumerate(op.inputs):
        if not name:
            continue
        labels = spec.inputs[slot] if slot < len(spec.inputs) else None
        owns = problem.owner.get(name) == (node, slot)
        info = graph.tensor(name)
        if grad.get(name, False) and not (owns and info.kind == "parameter"):
            latency, per_byte = _collective_coefficients(Collective.ALL_REDUCE, absent_mask(labels), cost)
            communication = communication + (latency * 1.0 + per_byte * (local(info, labels) * gradient_bytes))
        if not owns:
            continue
        numel = local(info, labels)
        if info.kind != "parameter":
            memory = memory + numel * problem.itemsize(info)
            continue
        memory = memory + numel * cost.parameter_bytes_per_element(info.trainable)
        if not info.trainable:
            continue
        parameter_elements += info.numel
        mask = absent_mask(labels)
        nbytes = numel * gradient_bytes
        scale = np.minimum(1.0, nbytes / cost.fusion_bytes)  # fused buckets pay the latency once
        for kind, total in (
            (Collective.ALL_REDUCE, gradient_sync),
            (Collective.REDUCE_SCATTER, scatter),
            (Collective.ALL_GATHER, gather),
        ):
            latency, per_byte = _collective_coefficients(kind, mask, cost)
            total += latency * scale + per_byte * nbytes
        shards = np.ldexp(1.0, np.bitwise_count(mask).astype(np.int64))
        state_saving = state_saving + numel * cost.parameter_bytes_split(True)[1] * (1.0 - 1.0 / shards)
    outputs_graph = set(graph.outputs)
    if any(name in outputs_graph for name in op.outputs) and spec.reduced_labels:
        for c in range(count):  # a partial graph output is reduced: rare, costed one candidate at a time
            for name, layout in zip(op.outputs, rule.candidate_layouts(c)[1]):
                if name and name in outputs_graph and layout is not None and layout.partial:
                    communication[c] += problem.redistribution(name, layout, Layout(layout.dims))[1]

    activations = np.zeros(count)
    for labels, name in outputs:
        if name and name in problem.kept:
            info = graph.tensor(name)
            activations = activations + local(info, labels) * problem.itemsize(info)
    memory = memory + activations
    if Keeps.STATISTICS in rule.keeps and _backward_runs(rule, grad):
        labels = spec.inputs[0] or ()
        rows = math.prod(size for size, label in zip(graph.tensor(op.inputs[0]).shape, labels) if label is not None)
        statistics = (np.int64(rows) >> split(labels)) * STATISTICS_BYTES_PER_ROW
        memory, activations = memory + statistics, activations + statistics
    return NodeCosts(
        compute,
        forward,
        communication,
        gradient_sync,
        scatter,
        gather,
        memory,
        state_saving,
        activations,
        parameter_elements,
    )


def _collective_coefficients(kind: Collective, masks: np.ndarray, cost: CostModel) -> tuple[np.ndarray, np.ndarray]:
    """(latency, per byte) of a collective over each candidate's bit mask, each distinct mask once."""
    unique, inverse = np.unique(masks, return_inverse=True)
    latency = np.empty(len(unique))
    per_byte = np.empty(len(unique))
    for index, mask in enumerate(unique.tolist()):
        bits = tuple(b for b in range(mask.bit_length() - 1, -1, -1) if (mask >> b) & 1)
        latency[index], per_byte[index] = cost.collective_coefficients(kind, bits)
    return latency[inverse.reshape(-1)], per_byte[inverse.reshape(-1)]


def memory_items(
    problem: SearchProblem, node: int, choice: int, choices: MemoryChoices = NO_MEMORY_CHOICES
) -> list[tuple[str, str, float]]:
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
            shards = 1
            if node in choices.sharded and info.trainable:
                shards = 1 << len(problem.gradient_sync_bits(node, rule.candidates[choice], slot))
            items.append((name, "parameter", numel * cost.parameter_bytes_per_element(info.trainable, shards)))
        else:
            items.append((name, "input", numel * problem.itemsize(info)))
    share = problem.recompute_share.get(node, 1.0) if choices.recompute else 1.0
    for name, layout in zip(op.outputs, out_layouts):
        if name and name in problem.kept:
            info = graph.tensor(name)
            items.append((name, "activation", share * _local_bytes(layout, info, problem.itemsize(info))))
    if Keeps.STATISTICS in rule.keeps and _backward_runs(rule, problem.requires_grad):
        layout = rule.input_layout(choice, 0)
        x = graph.tensor(op.inputs[0])
        labels = rule.spec.inputs[0] or ()
        rows = math.prod(size for size, label in zip(x.shape, labels) if label is not None)
        shards = x.numel // max(1, layout.local_numel(x.shape))
        items.append((f"{op.name} statistics", "activation", share * (rows // shards * STATISTICS_BYTES_PER_ROW)))
    return items


class _Layouts:
    """Each tensor end's distinct layouts, numbered across the model, and every candidate's among them."""

    def __init__(self, problem: SearchProblem) -> None:
        self.problem = problem
        self.ids: dict[bytes, int] = {}  # a packed layout row -> its number
        self.rows: list[tuple[np.ndarray, np.ndarray, int]] = []  # (lengths, codes, partial mask) by number
        self._cache: dict[tuple[int, bool, int], tuple[np.ndarray, np.ndarray]] = {}

    def of(self, node: int, is_output: bool, slot: int) -> tuple[np.ndarray, np.ndarray]:
        """(numbers of the distinct layouts, each candidate's position among them)."""
        key = (node, is_output, slot)
        if key not in self._cache:
            length, code, partial = self.problem.rules[node].encoded_layouts(is_output, slot)
            packed = np.concatenate([length.view(np.uint64), code, partial.view(np.uint64)[:, None]], axis=1)
            unique, first, positions = np.unique(packed, axis=0, return_index=True, return_inverse=True)
            ids = []
            for row, at in zip(unique, first):
                index = self.ids.setdefault(row.tobytes(), len(self.ids))
                if index == len(self.rows):
                    self.rows.append((length[at], code[at], int(partial[at])))
                ids.append(index)
            self._cache[key] = (np.asarray(ids, dtype=np.int64), positions.reshape(-1).astype(np.int64))
        return self._cache[key]

    def factor_shape(self, use: TensorUse) -> Factor | None:
        """The use's factor with a placeholder table of the right shape (None for a node reading itself)."""
        src_ids, src_pos = self.of(use.src_node, use.src_is_output, use.src_slot)
        dst_ids, dst_pos = self.of(use.dst_node, False, use.dst_slot)
        if use.src_node == use.dst_node:
            return None
        table = np.broadcast_to(np.zeros(()), (len(src_ids), len(dst_ids)))
        if use.src_node < use.dst_node:
            return Factor((use.src_node, use.dst_node), (src_pos, dst_pos), table)
        return Factor((use.dst_node, use.src_node), (dst_pos, src_pos), table.T)


def _plan_search(problem: SearchProblem, layouts: _Layouts, uses: list[TensorUse], run_of: dict[int, int]) -> Solver:
    """Plan the search on placeholder tables before any cost is computed: a table too large is
    refused now, in a second, not after a minute of costing; the plan is kept for the search."""
    main: list[Factor] = []
    per_run: list[list[Factor]] = [[] for _ in problem.folds]
    for use in uses:
        factor = layouts.factor_shape(use)
        if factor is not None:
            (per_run[run_of[use.dst_node]] if use.dst_node in run_of else main).append(factor)
    sizes = [len(rule.candidates) for rule in problem.rules]
    folds = [(repeat, factors) for (repeat, _), factors in zip(problem.folds, per_run)]
    return Solver(sizes=sizes, factors=main, folds=folds)


def _edge_costs(
    problem: SearchProblem, uses: Sequence[TensorUse], layouts: _Layouts
) -> list[tuple[Factor | None, np.ndarray]]:
    """Each use's cost table and the table of its forward part alone (paid again when the consumer
    is recomputed), from the coefficients of each distinct layout pair computed once. An operator
    reading its own output has no table (None) and its cost per candidate instead."""
    distinct_layouts = layouts.of
    rows, layout_ids = layouts.rows, layouts.ids
    groups: dict[tuple[bytes, bytes], tuple[np.ndarray, np.ndarray]] = {}
    for use in uses:
        src_ids = distinct_layouts(use.src_node, use.src_is_output, use.src_slot)[0]
        dst_ids = distinct_layouts(use.dst_node, False, use.dst_slot)[0]
        groups.setdefault((src_ids.tobytes(), dst_ids.tobytes()), (src_ids, dst_ids))
    cells = sum(len(a) * len(b) for a, b in groups.values())
    if cells > 2 * MAX_LAYOUT_PAIRS:
        raise TooLargeError(
            f"The edges between operators pair {cells:,} layouts on {problem.num_devices:,} devices (limit"
            f" {2 * MAX_LAYOUT_PAIRS:,}): costing them would take minutes and gigabytes; use fewer devices."
        )
    keys = np.empty(cells, dtype=np.int64)
    at = 0
    for src_ids, dst_ids in groups.values():
        size = len(src_ids) * len(dst_ids)
        keys[at : at + size] = (src_ids[:, None] * len(layout_ids) + dst_ids[None, :]).reshape(-1)
        at += size
    unique, inverse = np.unique(keys, return_inverse=True)
    if len(unique) > MAX_LAYOUT_PAIRS:
        raise TooLargeError(
            f"{len(unique):,} distinct redistributions between layouts would have to be costed on"
            f" {problem.num_devices:,} devices (limit {MAX_LAYOUT_PAIRS:,}, about a minute); use fewer devices."
        )
    width = max((len(length) for length, _, _ in rows), default=1) or 1
    lengths = np.zeros((len(rows), width), dtype=np.int64)
    codes = np.zeros((len(rows), width), dtype=np.uint64)
    for index, (length, code, _) in enumerate(rows):
        lengths[index, : len(length)] = length
        codes[index, : len(code)] = code
    table = LayoutTable(lengths, codes, np.array([partial for _, _, partial in rows], dtype=np.int64))
    problem.layouts_costed, problem.pairs_costed = len(rows), len(unique)
    coefficients = pair_coefficients(table, unique // len(layout_ids), unique % len(layout_ids), problem.cost)
    per_group: dict[tuple[bytes, bytes], tuple[np.ndarray, ...]] = {}
    at = 0
    for key, (src_ids, dst_ids) in groups.items():
        size = len(src_ids) * len(dst_ids)
        where = inverse[at : at + size]
        per_group[key] = tuple(c[where].reshape(len(src_ids), len(dst_ids)) for c in coefficients)
        at += size

    factors: list[tuple[Factor | None, np.ndarray]] = []
    for use in uses:
        src_ids, src_pos = distinct_layouts(use.src_node, use.src_is_output, use.src_slot)
        dst_ids, dst_pos = distinct_layouts(use.dst_node, False, use.dst_slot)
        info = problem.graph.tensor(use.tensor)
        total_bytes = info.numel * problem.itemsize(info)
        forward_latency, forward_per_byte, latency, per_byte = per_group[(src_ids.tobytes(), dst_ids.tobytes())]
        forward = forward_latency + forward_per_byte * total_bytes
        small = latency + per_byte * total_bytes if problem.requires_grad.get(use.tensor, False) else forward
        i, j = use.src_node, use.dst_node
        if i == j:
            factors.append((None, small[src_pos, dst_pos]))
        elif i < j:
            factors.append((Factor((i, j), (src_pos, dst_pos), small), forward))
        else:
            factors.append(
                (Factor((j, i), (dst_pos, src_pos), np.ascontiguousarray(small.T)), np.ascontiguousarray(forward.T))
            )
    return factors
