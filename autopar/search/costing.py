"""Costing: every candidate of every operator and every edge between them, as arrays.

`build_problem` binds the operators to the mesh, traces the dataflow, finds the repeated
blocks, refuses a search too large to run (before anything is costed), then fills the node
arrays (`_node_costs`, `_compose`) and the edge tables (`_edge_costs`) and returns the frozen
`SearchProblem`. Edge tables are computed from the coefficients of each distinct pair of
layouts, once (`coefficients`); runs of repeated blocks are costed once, every copy sharing
copy 0's arrays.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, cast

import numpy as np

from autopar import progress
from autopar.context import planning
from autopar.cost import CostModel
from autopar.errors import FixedStrategyError, StrategyError, TooLargeError
from autopar.graph import Graph
from autopar.layout import Layout
from autopar.limits import MAX_CANDIDATES_PER_OPERATOR, MAX_EDGE_CELLS, MAX_LAYOUT_PAIRS
from autopar.redistribute import Collective, symbolic_steps
from autopar.search import native, ring
from autopar.search.coefficients import KeySet, LayoutTable, PairCache, PairSlots
from autopar.search.dataflow import Dataflow, TensorUse
from autopar.search.dp import Factor, over_rows
from autopar.search.fold import RunEdges, Solver
from autopar.search.memory import Alternative, CandidateSplits, recompute_savings, resident
from autopar.search.problem import SearchProblem
from autopar.search.repeats import Repeat, find_repeats, signatures
from autopar.search.twins import find_twins
from autopar.strategy import OpRule


@planning
def build_problem(
    graph: Graph,
    cost: CostModel,
    num_devices: int,
    fold: bool = True,
    fixed: Mapping[str, Sequence[Sequence[int]]] | None = None,
    twins: bool = True,
    meet: bool = True,
) -> SearchProblem:
    """Cost every candidate of every operator and every edge between them.

    With ``fold``, runs of structurally identical blocks (`autopar.search.fold`) are costed
    once: every copy shares copy 0's node costs and edge tables. ``fixed`` maps operator names to
    the in_strategy each must keep (semi-auto mode): those operators have that one candidate,
    and a block holding one is no longer a copy of the others. With ``twins``, twin branches
    (`autopar.search.twins`) are tied: the search takes one candidate for both. Forks
    (`autopar.ops.fork`) take the layouts where their readers meet, unless the search would then go
    over its limits (T5 at 64 devices): they then only pass their tensor through, which is exactly
    the search without them (``forks_meet`` is then False on the problem). Without ``meet`` they pass
    through from the start.
    """
    return _costed(_planned_within_limits(graph, cost, num_devices, fold, fixed, twins, meet), cost, num_devices)


@planning
def build_with_latency(
    graph: Graph, cost: CostModel, num_devices: int, fixed: Mapping[str, Sequence[Sequence[int]]] | None = None
) -> tuple[SearchProblem, SearchProblem]:
    """`build_problem`, and the same problem with every edge at its collectives' latency alone, its table at
    zero bytes: each edge table is that plus seconds per byte times its tensor's bytes, so the second is the
    part of each edge that does not shrink with the batch (`SearchProblem.counts_relaxation`). Both from one
    planning of the operators (half of a build of GPT-3 175B's on 512 devices), their edges costed apart."""
    planned = _planned_within_limits(graph, cost, num_devices, True, fixed, True, True)
    return _costed(planned, cost, num_devices), _costed(planned, cost, num_devices, latency_only=True)


def _planned_within_limits(
    graph: Graph,
    cost: CostModel,
    num_devices: int,
    fold: bool,
    fixed: Mapping[str, Sequence[Sequence[int]]] | None,
    twins: bool,
    meet: bool,
) -> _Planned:
    """`_planned`, its forks passing through where meeting would pass the table limits (`build_problem`)."""
    bound = _Bound.of(graph, cost, num_devices, fixed)
    planned = _planned(bound, fold, twins, meet)
    if meet and not planned.exact():
        # forks are a saving, not a need: where meeting would pass the table limits, they pass through
        planned = _planned(bound, fold, twins, meet=False)
    return planned


def _costed(planned: _Planned, cost: CostModel, num_devices: int, latency_only: bool = False) -> SearchProblem:
    """The problem of a planning: its edges costed (``latency_only``: each at zero bytes, `build_with_latency`)
    and its operators' arrays composed."""
    flow, costs, costed, layouts = planned.flow, planned.costs, planned.costed, planned.layouts
    rules = flow.rules
    repeats, blocks, unfolded, ties = planned.repeats, planned.blocks, planned.unfolded, planned.ties
    run_of, copy_of, entry_of = planned.run_of, planned.copy_of, planned.entry_of
    main: list[Factor] = []
    first: list[list[Factor]] = [[] for _ in repeats]
    later: list[list[Factor]] = [[] for _ in repeats]
    forwards: list[list[np.ndarray]] = [[] for _ in repeats]
    own: dict[int, np.ndarray] = {}  # operators reading their own output pay that redistribution themselves
    compute = [c.compute for c in costs]
    edges, layouts_costed, pairs_costed = _edge_costs(flow, costed, layouts, entry_of, compute, latency_only)
    for use, (factor, forward, twin) in zip(costed, edges):
        if factor is None:
            own[use.src_node] = own.get(use.src_node, 0.0) + forward
        elif use.dst_node in run_of:
            assert twin is not None  # every edge with a table has its twin
            run = run_of[use.dst_node]
            first[run].append(factor)
            later[run].append(twin)
            forwards[run].append(factor.table + forward)
        else:
            main.append(factor)
    folds = [RunEdges(tuple(f), tuple(g)) for f, g in zip(first, later)]
    again = [edges.with_tables(tables) for edges, tables in zip(folds, forwards)]
    own_by_node = {node: own[copy_of.get(node, node)] for node in range(len(rules)) if copy_of.get(node, node) in own}
    arrays = _compose(cost, costs, own_by_node, repeats, blocks)
    flow_fields: dict[str, Any] = {f.name: getattr(flow, f.name) for f in dataclasses.fields(Dataflow)}
    return SearchProblem(
        **flow_fields,
        node_time=tuple(arrays.time),
        node_compute=tuple(c.compute for c in costs),
        node_communication=tuple(arrays.communication),
        node_memory=tuple(arrays.memory),
        node_hidden=tuple(arrays.hidden),
        node_sync=tuple(arrays.sync),
        sharded=MappingProxyType(arrays.sharded),
        recompute_time=MappingProxyType(arrays.recompute_time),
        recompute_memory=MappingProxyType(arrays.recompute_memory),
        recompute_share=MappingProxyType(arrays.recompute_share),
        factors=tuple(main),
        folds=list(zip(repeats, folds)),
        recompute_folds=list(zip(repeats, again)),
        layouts_costed=layouts_costed,
        pairs_costed=pairs_costed,
        unfolded=tuple(unfolded),
        ties=MappingProxyType(ties),
        node_activations=tuple(c.activations for c in costs),
        blocks=tuple(blocks),
        forks_meet=planned.meet,
        one_process=num_devices == 1,
    )


@dataclass(frozen=True)
class _Planned:
    """What costing knows before any edge is costed: the operators bound to the mesh, their node
    costs, the uses to cost, the repeated blocks and the twin ties."""

    flow: Dataflow
    costs: list[NodeCosts]
    costed: list[TensorUse]
    layouts: "_Layouts"
    repeats: list[Repeat]
    blocks: list[Repeat]
    unfolded: list[Any]
    ties: Mapping[int, int]
    run_of: dict[int, int]
    copy_of: dict[int, int]
    entry_of: dict[int, int]
    meet: bool  # the forks take the layouts where their readers meet (else they pass through)

    def exact(self) -> bool:
        """Whether the search stays within its table limits (`_search_is_exact`), known before any edge is
        costed."""
        return _search_is_exact(
            self.flow.rules, self.layouts, self.costed, self.entry_of, self.repeats, self.run_of, self.ties
        )


@dataclass(frozen=True)
class _Bound:
    """What costing derives before any fork's candidates are chosen, whether forks meet or not: the
    operators bound to the mesh (the fixed ones pinned), the dataflow and the repeated blocks."""

    graph: Graph
    rules: tuple[OpRule, ...]
    pinned: Mapping[int, tuple[int, ...]]
    flow: Dataflow  # (its rules' candidates are not read: forks take theirs in `_planned`)
    blocks: list[Repeat]
    unfolded: list[Any]

    @classmethod
    def of(
        cls, graph: Graph, cost: CostModel, num_devices: int, fixed: Mapping[str, Sequence[Sequence[int]]] | None
    ) -> "_Bound":
        mesh_bits = num_devices.bit_length() - 1
        rules = [OpRule.build(op, graph, mesh_bits) for op in graph.ops]
        pinned = _pin(rules, fixed or {})
        flow = Dataflow.of(graph, rules, cost, num_devices, frozenset(pinned))
        # repeated blocks bound the overlap windows whether or not they are folded, so folding never
        # changes the objective
        owner, grad = dict(flow.owner), dict(flow.requires_grad)
        signature = signatures(graph, flow.uses, owner, grad, flow.kept, set(graph.outputs), pinned)
        blocks, unfolded = find_repeats(len(rules), flow.uses, signature)
        return cls(graph, tuple(rules), MappingProxyType(pinned), flow, blocks, unfolded)


def _met(bound: _Bound, repeats: Sequence[Repeat], meet: bool) -> list[OpRule]:
    """The rules with each fork's candidates (`meeting_layouts`), in graph order. A fork in a later copy of
    a folded run takes its first copy's candidates (`_planned`), so its own are not derived, unless a fork
    after it reads its output (a fork's candidates read its producer's)."""
    graph, rules, pinned = bound.graph, list(bound.rules), bound.pinned
    later_copies = {node for repeat in repeats for node in range(repeat.block(1).start, repeat.folded.stop)}
    forks = [node for node, rule in enumerate(rules) if rule.spec.gradient_labels and node not in pinned]
    producers = {graph.position[graph.producer[rules[node].op.inputs[0]]] for node in forks}
    for node in forks:
        if node not in later_copies or node in producers:
            rules[node] = rules[node].with_candidates(meeting_layouts(graph, rules, node, meet))
    return rules


def _planned(bound: _Bound, fold: bool, twins: bool, meet: bool = True) -> _Planned:
    graph, pinned, blocks, unfolded = bound.graph, bound.pinned, bound.blocks, bound.unfolded
    repeats = blocks if fold else []
    rules = _met(bound, repeats, meet)
    copy_of: dict[int, int] = {}  # operators of copies 1.. -> the same operator of copy 0
    run_of: dict[int, int] = {}  # operators of copy 0 -> their run
    shared = [u for block in blocks for u in block.shared]
    for node in _weight_only(graph, rules, shared):  # folded or not
        if node not in pinned:
            rules[node] = rules[node].with_candidates([(0,) * len(rules[node].spec.label_order)])
    for node in shared:  # a fork every copy reads (T5's encoder output): one more choice all copies share
        if rules[node].spec.gradient_labels and node not in pinned:
            rules[node] = rules[node].with_candidates(meeting_layouts(graph, rules, node, meet=False))
    for index, repeat in enumerate(repeats):
        for node in repeat.block(0):
            run_of[node] = index
        for k in range(1, repeat.copies):
            for node in repeat.block(k):
                copy_of[node] = node - k * repeat.period
                rules[node] = rules[node].with_candidates(rules[copy_of[node]].candidates)
    flow = dataclasses.replace(bound.flow, rules=tuple(rules))
    costed = [use for use in flow.uses if use.dst_node not in copy_of]
    # copy 0 reads the operator before its run where every later copy reads the previous copy's last
    entry_of = {
        index: repeats[run_of[use.dst_node]].last(0)
        for index, use in enumerate(costed)
        if use.dst_node in run_of and use.src_node == repeats[run_of[use.dst_node]].start - 1
    }
    _check_size(flow, costed)
    every = max(1, len(rules) // 100)
    costs: list[NodeCosts] = []
    for node in range(len(rules)):
        if node % every == 0:
            progress.report("costing operators", node, len(rules))
        costs.append(costs[copy_of[node]] if node in copy_of else _node_costs(flow, node))
    layouts = _Layouts(flow)
    ties = _twins(flow, costed, layouts, costs, repeats) if twins else {}
    return _Planned(flow, costs, costed, layouts, repeats, blocks, unfolded, ties, run_of, copy_of, entry_of, meet)


@dataclass(frozen=True)
class NodeCosts:
    """One operator's figures per candidate, before overlap and the memory choices apply."""

    compute: np.ndarray  # forward and backward seconds
    forward: np.ndarray  # forward seconds, paid again when the operator is recomputed
    communication: np.ndarray  # collectives on the critical path (a partial graph output's AllReduce)
    gradient_sync: np.ndarray  # the AllReduce of the trainable parameters it owns
    scatter: np.ndarray  # with a parallel optimizer: their gradients' ReduceScatter instead ...
    gather: np.ndarray  # ... and the AllGather of the updated weights before the next forward
    update: np.ndarray  # the optimizer update of the trainable parameters it owns (paid once a step) ...
    update_sharded: np.ndarray  # ... and under a parallel optimizer, each rank updating its shard
    memory: np.ndarray  # bytes per device: parameter state, inputs, activations kept for backward
    state_saving: np.ndarray  # bytes a parallel optimizer saves (0 where the parameters are split everywhere)
    activations: np.ndarray  # bytes of its outputs kept for backward (dropped when recomputed)
    parameter_elements: int  # of the trainable parameters it owns (their sync starts after its backward)


@dataclass(frozen=True)
class _NodeArrays:
    """What `_compose` makes of the node costs: the problem's per-operator arrays."""

    time: list[np.ndarray]
    communication: list[np.ndarray]
    memory: list[np.ndarray]
    hidden: list[np.ndarray]
    sync: list[np.ndarray]
    sharded: dict[int, Alternative]
    recompute_time: dict[int, np.ndarray]
    recompute_memory: dict[int, np.ndarray]
    recompute_share: dict[int, float]


def _compose(
    cost: CostModel,
    costs: list[NodeCosts],
    own: Mapping[int, np.ndarray],
    repeats: Sequence[Repeat],
    blocks: Sequence[Repeat],
) -> _NodeArrays:
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

    arrays = _NodeArrays([], [], [], [], [], {}, {}, {}, {})
    cache: dict[int, tuple] = {}  # copies share their first copy's arrays
    for node, c in enumerate(costs):
        key = id(c)
        if key not in cache:
            extra = own.get(node, 0.0)
            shown = exposed(c.gradient_sync, node)
            communication = c.communication + extra + shown
            once = shown + c.update  # the exposed sync and the update, paid once a step
            entry: list = [c.compute + communication + c.update, communication, c.memory, c.gradient_sync - shown]
            entry += [once, None]
            if c.parameter_elements and c.state_saving.any():
                shown = exposed(c.scatter, node)
                communication = c.communication + extra + shown + c.gather
                entry[5] = Alternative(
                    c.compute + communication + c.update_sharded,
                    communication,
                    c.memory - c.state_saving,
                    c.scatter - shown,
                    shown + c.gather + c.update_sharded,
                )
            cache[key] = tuple(entry)
        time, communication, memory, hidden, sync, alternative = cache[key]
        arrays.communication.append(communication)
        arrays.time.append(time)
        arrays.memory.append(memory)
        arrays.hidden.append(hidden)
        arrays.sync.append(sync)
        if alternative is not None:
            arrays.sharded[node] = alternative
    activations = [c.activations for c in costs]
    for repeat in repeats:
        nodes = range(repeat.start, repeat.start + repeat.copies * repeat.period)
        for node in nodes:
            arrays.recompute_time[node] = costs[node].forward
        freed, share = recompute_savings(activations, repeat.copies, nodes, last_of_copy)
        arrays.recompute_memory.update(freed)
        arrays.recompute_share.update(share)
    return arrays


def meeting_layouts(graph: Graph, rules: Sequence[OpRule], node: int, meet: bool = True) -> list[tuple[int, ...]]:
    """A fork's candidates (`autopar.ops.fork`): each layout its producer gives, taking the gradient
    whole (the fork as a pass-through: no plan dearer than without it), and each layout a reader
    reads in, taking it partial over the bits that reader's gradient comes out partial over (where
    readers meet). A reader's layout that splits a dimension the producer never splits (a layer
    norm's normalised axis) is left out: meeting there only adds a redistribution on the way, and
    each candidate of a fork is one more the search minimises over, for every layer. Without ``meet``,
    the pass-throughs alone."""
    fork = rules[node]
    index = graph.position  # ``rules`` are the graph's operators', in order
    name, out = fork.op.inputs[0], fork.op.outputs[0]
    producer = rules[index[graph.producer[name]]]
    length, code, _ = producer.encoded_layouts(True, producer.op.outputs.index(name))
    met = [_packed(length, code, np.zeros(len(length), dtype=np.int64))]
    never = (length == 0).all(axis=0)  # dimensions no candidate of the producer splits
    for reader in graph.consumers.get(out, ()) if meet else ():
        rule = rules[index[reader]]
        splits = CandidateSplits(rule.candidates, rule.spec.label_order)
        for slot, read in enumerate(rule.op.inputs):
            if read == out:
                length, code, _ = rule.encoded_layouts(False, slot)
                rows = _packed(length, code, splits.absent_mask(rule.spec.inputs[slot]))
                met.append(rows[(length[:, never] == 0).all(axis=1)])
    length, code, _ = fork.encoded_layouts(False, 0)
    rows = _packed(length, code, fork.encoded_layouts(True, 0, gradient=True)[2])
    keep = np.isin(rows, np.concatenate(met))
    return [candidate for candidate, kept in zip(fork.candidates, keep.tolist()) if kept]


def _packed(length: np.ndarray, code: np.ndarray, partial: np.ndarray) -> np.ndarray:
    """Layout rows (`OpRule.encoded_layouts`) as one comparable value each."""
    rows = np.ascontiguousarray(
        np.concatenate([length.view(np.uint64), code, partial.view(np.uint64)[:, None]], axis=1)
    )
    return rows.view(np.dtype((np.void, rows.dtype.itemsize * rows.shape[1]))).reshape(-1)


def _weight_only(graph: Graph, rules: Sequence[OpRule], shared: Sequence[int]) -> list[int]:
    """The shared operators of a folded run that read parameters and constants alone (ALBERT's one
    Transpose of each weight every layer shares): each is held whole, its one candidate replication.

    Every copy of the run reads the shared operators' outputs, so the copies' chain is solved once
    per joint layout of them all: ten layouts of each of ALBERT's six shared weights at 8 devices
    are a million joint states, beyond any exact search. An operator on weights alone does the same
    work whatever the batch, and a copy that wants its output split slices it locally at no cost
    (its gradient gathered on the way back); held whole, it leaves the copies nothing to
    condition on but their boundary, as a constant does. The search stays exact over every other
    choice; the shared weight itself is stored, and its gradient synchronised, as replication says.
    """
    found = []
    for node in shared:
        inputs = [name for name in rules[node].op.inputs if name]
        if inputs and all(graph.tensor(name).kind in ("parameter", "constant") for name in inputs):
            found.append(node)
    return found


def _pin(rules: list[OpRule], fixed: Mapping[str, Sequence[Sequence[int]]]) -> dict[int, tuple[int, ...]]:
    """Give each fixed operator (in ``rules``) a rule with its one candidate; FixedStrategyError for a
    strategy that cannot be."""
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
        rules[index[name]] = rule.with_candidates([exponents])
        pinned[index[name]] = exponents
    return pinned


def _check_size(flow: Dataflow, uses: Sequence[TensorUse]) -> None:
    """Refuse, before anything is built, a problem whose candidates or cost tables exceed the limits."""
    devices = f"{flow.num_devices:,} devices"
    for rule in flow.rules:
        if rule.candidate_count > MAX_CANDIDATES_PER_OPERATOR:
            raise TooLargeError(
                f"Operator {rule.op.name!r} ({rule.op.op_type}) has {rule.candidate_count:,} candidate strategies on"
                f" {devices} (limit {MAX_CANDIDATES_PER_OPERATOR:,}); use fewer devices."
            )
    cells = sum(flow.rules[u.src_node].candidate_count * flow.rules[u.dst_node].candidate_count for u in uses)
    if cells > MAX_EDGE_CELLS:
        raise TooLargeError(
            f"The cost tables between operators would hold {cells:,} entries on {devices} (limit {MAX_EDGE_CELLS:,});"
            " use fewer devices."
        )


def _node_costs(flow: Dataflow, node: int) -> NodeCosts:
    """Per candidate: compute and communication seconds the node owns, memory bytes.

    Vectorised over candidates (`memory.CandidateSplits`): every figure is the one
    `memory.memory_items` and `Dataflow.gradient_sync_bits` give for the candidate, term for term.
    """
    rule = flow.rules[node]
    op, graph, cost, spec = rule.op, flow.graph, flow.cost, rule.spec
    splits = CandidateSplits(rule.candidates, spec.label_order)
    count = splits.count
    part = flow.fused.get(op.name)
    hidden = part.hidden if part is not None else frozenset()
    traffic = np.zeros(count, dtype=np.int64)
    for labels, name in list(zip(spec.inputs, op.inputs)) + list(zip(spec.outputs, op.outputs)):
        if name and name not in hidden:  # a fused attention kernel keeps its scores on chip
            info = graph.tensor(name)
            traffic += splits.local(info, labels) * flow.itemsize(info)
    op_class = spec.op_class
    if op_class == "free" or (part is not None and part.role == "inner"):
        forward = np.zeros(count)
    else:
        if part is not None:  # the fused kernel's rate, on the scores it computes
            rate, flops = np.full(count, cost.attention_rate), op.flops * part.share
        elif spec.matmul_labels is not None:  # a matmul's rate depends on its shape on one device
            fp8 = op.name in flow.fp8_products
            rate, flops = cost.matmul_rate(matmul_smallest_dim(rule, splits), fp8), op.flops
        else:
            rate, flops = np.full(count, cost.cube_flops if op_class == "cube" else cost.vector_flops), op.flops
        work = flops / np.ldexp(1.0, splits.split(spec.label_order)) / rate
        forward = np.maximum(work, traffic / cost.memory_bandwidth)
    compute = forward * flow.work_multiple(node)

    communication = np.zeros(count)
    gradient_sync, scatter, gather = np.zeros(count), np.zeros(count), np.zeros(count)
    update, update_sharded = np.zeros(count), np.zeros(count)
    gradient_bytes = cost.gradient_itemsize()
    parameter_elements = 0
    for slot, name in enumerate(op.inputs):
        if not name:
            continue
        labels = spec.inputs[slot] if slot < len(spec.inputs) else None
        owns = flow.owner.get(name) == (node, slot)
        info = graph.tensor(name)
        if not (owns and info.kind == "parameter" and info.trainable):
            continue
        parameter_elements += info.numel
        mask = splits.absent_mask(labels)
        local = splits.local(info, labels)
        nbytes = local * gradient_bytes
        update += cost.update_time(local)
        update_sharded += cost.update_time(local / np.ldexp(1.0, np.bitwise_count(mask).astype(np.int64)))
        scale = np.minimum(1.0, nbytes / cost.fusion_bytes)  # fused buckets pay the latency once
        for kind, total in (
            (Collective.ALL_REDUCE, gradient_sync),
            (Collective.REDUCE_SCATTER, scatter),
            (Collective.ALL_GATHER, gather),
        ):
            latency, per_byte = _collective_coefficients(kind, mask, cost)
            total += latency * scale + per_byte * nbytes
    outputs_graph = set(graph.outputs)
    if any(name in outputs_graph for name in op.outputs) and spec.reduced_labels:
        for c in range(count):  # a partial graph output is reduced: rare, costed one candidate at a time
            for name, layout in zip(op.outputs, rule.candidate_layouts(c)[1]):
                if name and name in outputs_graph and layout is not None and layout.partial:
                    communication[c] += flow.redistribution(name, layout, Layout(layout.dims))[1]
    held = resident(flow, node, splits)
    return NodeCosts(
        compute,
        forward,
        communication,
        gradient_sync,
        scatter,
        gather,
        update,
        update_sharded,
        held.memory,
        held.state_saving,
        held.activations,
        parameter_elements,
    )


def matmul_smallest_dim(rule: OpRule, splits: CandidateSplits) -> np.ndarray:
    """Per candidate, the smallest of a matmul's M, N and K on one device (an absent M or N counts 1; the batch
    dimensions the second operand broadcasts over count in M, `OpSpec.matmul_folded`).

    The backward's two products (the input and the weight gradient) multiply the same three sizes in
    another order, so one smallest size sets the efficiency of all three.
    """
    smallest = np.full(splits.count, np.inf)
    spec = rule.spec
    for position, label in enumerate(spec.matmul_labels or ()):
        sizes = rule.label_sizes.get(label, set()) if label is not None else set()
        if label is None or not sizes:
            return np.ones(splits.count)
        size = max(sizes) / np.ldexp(1.0, splits.exponents[:, splits.column[label]])
        for folded in spec.matmul_folded if position == 0 else ():  # batch dimensions the product runs as M
            shards = np.ldexp(1.0, splits.exponents[:, splits.column[folded]])
            size = size * max(rule.label_sizes.get(folded, {1})) / shards
        smallest = np.minimum(smallest, size)
    return smallest


def _collective_coefficients(kind: Collective, masks: np.ndarray, cost: CostModel) -> tuple[np.ndarray, np.ndarray]:
    """(latency, per byte) of a collective over each candidate's bit mask, each distinct mask once."""
    unique, inverse = np.unique(masks, return_inverse=True)
    latency = np.empty(len(unique))
    per_byte = np.empty(len(unique))
    for index, mask in enumerate(unique.tolist()):
        bits = tuple(b for b in range(mask.bit_length() - 1, -1, -1) if (mask >> b) & 1)
        latency[index], per_byte[index] = cost.collective_coefficients(kind, bits)
    return latency[inverse.reshape(-1)], per_byte[inverse.reshape(-1)]


def unique_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`np.unique` of a table's rows (``axis=0``), with each one's first index and every row's position among
    them: the same arrays, by one lexicographic sort of the row indices (`np.lexsort`, stable), where numpy
    sorts the rows as records, three times as long on a layout table.

    >>> [a.tolist() for a in unique_rows(np.array([[2, 1], [1, 5], [2, 1]], dtype=np.uint64))]
    [[[1, 5], [2, 1]], [1, 0], [1, 0, 1]]
    """
    order = np.lexsort(rows.T[::-1]) if rows.shape[1] else np.arange(len(rows))
    ordered = rows[order]
    starts = np.ones(len(order), dtype=bool)
    starts[1:] = (ordered[1:] != ordered[:-1]).any(axis=1)
    positions = np.empty(len(order), dtype=np.int64)
    positions[order] = np.cumsum(starts) - 1
    return ordered[starts], order[starts], positions


class _Layouts:
    """Each tensor end's distinct layouts, numbered across the model, and every candidate's among them.

    A consumer's end of a use that carries a gradient back (`carries`) is numbered with the bits its
    gradient comes out partial on (the partial mask of its row): two candidates reading alike but
    leaving different partial gradients send different collectives back."""

    def __init__(self, flow: Dataflow) -> None:
        self.flow = flow
        self.rules = flow.rules
        self.requires_grad = flow.requires_grad
        self.ids: dict[bytes, int] = {}  # a packed layout row -> its number
        self.rows: list[tuple[np.ndarray, np.ndarray, int]] = []  # (lengths, codes, partial mask) by number
        self._cache: dict[tuple[int, bool, int, bool], tuple[np.ndarray, np.ndarray]] = {}
        self._stripped: dict[int, np.ndarray] = {}  # bits no longer partial -> per layout number, that of it less them
        self._partials = np.zeros(0, dtype=np.int64)  # each numbered layout's partial mask (`partial`)

    def carries(self, use: TensorUse) -> bool:
        """Whether the consumer sends a gradient back along the use (the runtime's rule)."""
        return self.requires_grad.get(use.tensor, False) and self.rules[use.dst_node].differentiable

    def accepts(self, use: TensorUse) -> bool:
        """Whether the use's source may take the gradient partial (a fork's output, `OpRule.gradient_bits`):
        its rows then carry those bits, which its forward never has."""
        return use.src_is_output and self.carries(use) and bool(self.rules[use.src_node].spec.gradient_labels)

    def target(self, use: TensorUse) -> tuple[np.ndarray, np.ndarray]:
        """`of` the use's consumer end, with its gradient's partial bits where it carries one."""
        return self.of(use.dst_node, False, use.dst_slot, self.carries(use))

    def of(self, node: int, is_output: bool, slot: int, gradient: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """(numbers of the distinct layouts, each candidate's position among them); with ``gradient``,
        an input's rows carry the bits its gradient is partial on, an output's those its gradient may
        arrive partial over."""
        key = (node, is_output, slot, gradient)
        if key not in self._cache:
            rule = self.rules[node]
            length, code, partial = rule.encoded_layouts(is_output, slot, gradient)
            if gradient and not is_output:
                splits = CandidateSplits(rule.candidates, rule.spec.label_order)
                partial = splits.absent_mask(rule.spec.inputs[slot])
            packed = np.concatenate([length.view(np.uint64), code, partial.view(np.uint64)[:, None]], axis=1)
            unique, first, positions = unique_rows(packed)
            rows = np.ascontiguousarray(unique).view(np.dtype((np.void, unique.dtype.itemsize * unique.shape[1])))
            packed_rows = cast(list[bytes], rows.reshape(-1).tolist())  # each row's bytes
            found = [self.ids.get(row) for row in packed_rows]
            for index in [index for index, number in enumerate(found) if number is None]:  # numbered in order
                found[index] = self._number(packed_rows[index], length, code, partial, int(first[index]))
            self._cache[key] = (np.asarray(found, dtype=np.int64), positions.reshape(-1).astype(np.int64))
        return self._cache[key]

    def _number(self, row: bytes, length: np.ndarray, code: np.ndarray, partial: np.ndarray, at: int) -> int:
        """The number of a packed layout row, given a new one if it has none (its arrays: row ``at``)."""
        index = self.ids.setdefault(row, len(self.ids))
        if index == len(self.rows):
            self.rows.append((length[at], code[at], int(partial[at])))
        return index

    def whole(self, ids: np.ndarray) -> np.ndarray:
        """The numbers of the same layouts with no partial bits (what a redistribution delivers)."""
        return self.without(ids, -1)

    def without(self, ids: np.ndarray, kept: int) -> np.ndarray:
        """The numbers of the same layouts no longer partial over the bits ``kept``: a gradient
        redistributed to a fork that takes it partial over ``kept`` reduces only its other bits."""
        found = np.array(ids, dtype=np.int64)
        changed = np.flatnonzero(self.partial(ids) & kept)
        if not len(changed):
            return found
        known = self._stripped.get(kept, np.zeros(0, dtype=np.int64))
        wanted = found[changed]
        if len(known) <= wanted.max() or (known[wanted] < 0).any():  # some layout not stripped of these bits yet
            grown = np.full(max(len(self.rows), len(known)), -1, dtype=np.int64)
            grown[: len(known)] = known
            unknown = wanted[grown[wanted] < 0]
            for index in unknown[np.sort(np.unique(unknown, return_index=True)[1])].tolist():  # numbered in order
                length, code, partial = self.rows[index]
                row = np.concatenate([length.view(np.uint64), code, np.asarray([partial & ~kept]).view(np.uint64)])
                stripped = np.asarray([partial & ~kept], dtype=np.int64)
                grown[index] = self._number(row.tobytes(), length[None], code[None], stripped, 0)
            self._stripped[kept] = known = grown
        found[changed] = known[wanted]
        return found

    def partial(self, ids: np.ndarray) -> np.ndarray:
        """The partial masks of these layouts."""
        if len(self._partials) < len(self.rows):  # rows were numbered since: the masks again
            self._partials = np.asarray([partial for _, _, partial in self.rows], dtype=np.int64)
        return self._partials[ids]

    def source(self, use: TensorUse, entry: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(numbers of the distinct layouts at the use's source, the source's candidates' positions
        among them, the entry's). With ``entry`` (the operator later copies read instead), the layouts
        are the source's then the entry's others, so the table has a row for each."""
        accepts = self.accepts(use)
        ids, positions = self.of(use.src_node, use.src_is_output, use.src_slot, accepts)
        if entry is None:
            return ids, positions, positions
        assert not accepts and not self.rules[entry].spec.gradient_labels  # a fork never ends a repeated block
        entry_ids, entry_positions = self.of(entry, use.src_is_output, use.src_slot)
        union = np.concatenate([ids, np.setdiff1d(entry_ids, ids)])
        where = {int(layout): at for at, layout in enumerate(union.tolist())}
        return union, positions, np.asarray([where[int(i)] for i in entry_ids], dtype=np.int64)[entry_positions]

    def factor_shape(self, use: TensorUse, entry: int | None) -> tuple[Factor, Factor] | None:
        """The use's factor and its twin for later copies (`fold.RunEdges`), with placeholder tables of
        the right shape (None for a node reading itself)."""
        if use.src_node == use.dst_node:
            return None
        src_ids, src_pos, entry_pos = self.source(use, entry)
        dst_ids, dst_pos = self.target(use)
        width = len(dst_ids)
        if ring.reads_through(self.flow, use):  # a ring reader's columns apart (`ring.columns`)
            dst_pos, layout_of = ring.columns(dst_pos, ring.reads_round(self.flow, use.dst_node))
            width = len(layout_of)
        table = np.broadcast_to(np.zeros(()), (len(src_ids), width))
        return _factor(use, src_pos, dst_pos, table), _factor(use, entry_pos, dst_pos, table)


def _factor(use: TensorUse, src_pos: np.ndarray, dst_pos: np.ndarray, table: np.ndarray) -> Factor:
    """The use's edge as a factor over its two operators, the lower-numbered first."""
    if use.src_node < use.dst_node:
        return Factor((use.src_node, use.dst_node), (src_pos, dst_pos), table)
    return Factor((use.dst_node, use.src_node), (dst_pos, src_pos), table.T)


def _search_is_exact(
    rules: Sequence[OpRule],
    layouts: _Layouts,
    uses: list[TensorUse],
    entry_of: Mapping[int, int],
    repeats: Sequence[Repeat],
    run_of: dict[int, int],
    ties: Mapping[int, int],
) -> bool:
    """Plan the search on placeholder tables before any cost is computed: whether every elimination step
    stays within the table limits. Planning reads shapes only, so the driver's solver, planned on the costed
    problem, is this one."""
    main: list[Factor] = []
    first: list[list[Factor]] = [[] for _ in repeats]
    later: list[list[Factor]] = [[] for _ in repeats]
    for index, use in enumerate(uses):
        found = layouts.factor_shape(use, entry_of.get(index))
        if found is None:
            continue
        if use.dst_node in run_of:
            first[run_of[use.dst_node]].append(found[0])
            later[run_of[use.dst_node]].append(found[1])
        else:
            main.append(found[0])
    folds = [(repeat, RunEdges(tuple(f), tuple(g))) for repeat, f, g in zip(repeats, first, later)]
    return Solver(sizes=[len(rule.candidates) for rule in rules], factors=main, folds=folds, ties=ties).exact


def _twins(
    flow: Dataflow, uses: Sequence[TensorUse], layouts: _Layouts, costs: Sequence[NodeCosts], repeats: Sequence[Repeat]
) -> dict[int, int]:
    """Twin branches (`autopar.search.twins`): each operator tied to a twin -> the one whose candidate it takes.

    A table's key is what fills it: the layouts and candidate maps at both ends, the bytes and
    whether a gradient flows back (`_edge_costs`). An operator's key is its costs per candidate;
    operators owning trained parameters (their gradient sync hides behind a window that depends on
    where they are) and operators reading their own output are never tied. Twins lie in one part
    of the search: the main graph, or the first copy of a folded run without its boundaries.
    """
    region = [0] * flow.size
    for index, repeat in enumerate(repeats):
        for node in repeat.folded:
            region[node] = index + 1 if node in repeat.block(0) else -1
    for repeat in repeats:
        for node in (repeat.last(-1), repeat.last(0), repeat.last(repeat.copies - 1), *repeat.shared):
            region[node] = -1
    keys: dict[tuple, int] = {}
    edges: list[tuple[int, int, int]] = []
    for use in uses:
        if use.src_node == use.dst_node:
            region[use.src_node] = -1
            continue
        src_ids, src_pos, _ = layouts.source(use, None)
        dst_ids, dst_pos = layouts.target(use)
        info = flow.graph.tensor(use.tensor)
        table = (info.numel * flow.itemsize(info), layouts.carries(use))
        ends = (src_ids.tobytes(), src_pos.tobytes(), dst_ids.tobytes(), dst_pos.tobytes())
        edges.append((use.src_node, use.dst_node, keys.setdefault((*ends, *table), len(keys))))
    node_keys: list[tuple | None] = []
    for node, c in enumerate(costs):
        if c.parameter_elements or region[node] < 0:  # never tied either way: no key to make
            node_keys.append(None)
            continue
        arrays = (c.compute, c.forward, c.communication, c.gradient_sync, c.scatter, c.gather, c.memory)
        node_keys.append(tuple(a.tobytes() for a in (*arrays, c.state_saving, c.activations)))
    return find_twins(flow.size, edges, node_keys, region)


def _edge_costs(
    flow: Dataflow,
    uses: Sequence[TensorUse],
    layouts: _Layouts,
    entry_of: Mapping[int, int],
    compute: Sequence[np.ndarray],
    latency_only: bool = False,
) -> tuple[list[tuple[Factor | None, np.ndarray, Factor | None]], int, int]:
    """Each use's cost table, the table of its forward part alone (paid again when the consumer
    is recomputed) and the table's twin for later copies of a run (`fold.RunEdges`), from the
    coefficients of each distinct layout pair computed once. An operator reading its own output
    has no table (None) and its cost per candidate instead. Then how many distinct layouts and
    layout pairs were costed.

    A use costs its forward redistribution and, where a gradient comes back, the redistribution
    the runtime runs for it: from the consumer's layout, partial over the bits its gradient is
    partial on, to the producer's (`lowering.lower.gradient_paths`). A use into the keys or values a
    fused attention kernel passes round a ring is charged what its product's compute (``compute``, per
    operator and candidate) does not hide (`autopar.search.ring`). ``latency_only``: every table at zero bytes
    (`build_with_latency`)."""
    groups: dict[tuple[bytes, bytes, bool, bool], tuple[np.ndarray, np.ndarray, bool, bool]] = {}
    names: dict[tuple[bytes, bytes, bool, bool], tuple] = {}  # a group's name: its first use and its entry
    sources = [layouts.source(use, entry_of.get(index)) for index, use in enumerate(uses)]
    keys = []
    for index, (use, (src_ids, _, _)) in enumerate(zip(uses, sources)):
        dst_ids = layouts.target(use)[0]
        keys.append((src_ids.tobytes(), dst_ids.tobytes(), layouts.carries(use), layouts.accepts(use)))
        if keys[-1] not in groups:
            groups[keys[-1]] = (src_ids, dst_ids, *keys[-1][2:])
            ends = (use.src_node, use.src_slot, use.src_is_output, use.dst_node, use.dst_slot, entry_of.get(index))
            names[keys[-1]] = (*ends, *keys[-1][2:])
    cells = sum(len(a) * len(b) for a, b, _, _ in groups.values())
    if cells > 2 * MAX_LAYOUT_PAIRS:
        raise TooLargeError(
            f"The edges between operators pair {cells:,} layouts on {flow.num_devices:,} devices (limit"
            f" {2 * MAX_LAYOUT_PAIRS:,}): costing them would take minutes and gigabytes; use fewer devices."
        )
    cache = PairCache.of(flow.cost)
    numbers = cache.numbers(list(layouts.ids))
    slots = {key: cache.reused(names[key], numbers[src], numbers[dst]) for key, (src, dst, _, _) in groups.items()}
    _number_delivered(layouts, {key: group for key, group in groups.items() if slots[key] is not None})
    missing = {key: group for key, group in groups.items() if slots[key] is None}
    if missing:  # only their pairs are looked up: a later problem's other groups hold millions
        _costed_slots(flow, layouts, missing, names, cache, slots)
    latency, per_byte = cache.values
    found_slots = {key: found for key, found in slots.items() if found is not None}  # every group's, now
    cells = sum(found.size for found in found_slots.values())
    compiled = native.worth(cells, native.ENTRIES)  # one pass per use, where numpy gathers each coefficient first
    distinct = _distinct_pairs(flow, cache, list(found_slots.values()), compiled)
    per_group: dict[tuple[bytes, bytes, bool, bool], tuple[np.ndarray, ...]] = {}
    for key, found in () if compiled else found_slots.items():
        forward_slots = found.forward_slots()
        gathered = (latency[forward_slots], per_byte[forward_slots])
        backward = found.backward_slots()
        if backward is not None:
            per_group[key] = (*gathered, gathered[0] + latency[backward].T, gathered[1] + per_byte[backward].T)
        else:
            per_group[key] = (*gathered, *gathered)

    factors: list[tuple[Factor | None, np.ndarray, Factor | None]] = []
    tables: dict[tuple[tuple[bytes, bytes, bool, bool], int], tuple[np.ndarray, np.ndarray]] = {}
    for index, (use, (_, src_pos, entry_pos), key) in enumerate(zip(uses, sources, keys)):
        dst_pos = layouts.target(use)[1]
        info = flow.graph.tensor(use.tensor)
        total_bytes = 0 if latency_only else info.numel * flow.itemsize(info)
        if (key, total_bytes) not in tables:  # uses of one group and size (a layer's q, k and v) share theirs
            if compiled:
                tables[key, total_bytes] = _compiled_tables(latency, per_byte, found_slots[key], total_bytes)
            else:
                forward_latency, forward_per_byte, both_latency, both_per_byte = per_group[key]
                tables[key, total_bytes] = (
                    forward_latency + forward_per_byte * total_bytes,
                    both_latency + both_per_byte * total_bytes,
                )
        forward, small = tables[key, total_bytes]
        if ring.reads_through(flow, use):
            sides = (src_pos, entry_pos, entry_of.get(index), dst_pos)
            small, forward, dst_pos = _under_kernel(flow, use, sides, small, forward, compute[use.dst_node])
        factors.append(_use_factors(use, (src_pos, entry_pos, dst_pos), small, forward))
    return factors, len(layouts.rows), distinct


def _use_factors(
    use: TensorUse, positions: tuple[np.ndarray, np.ndarray, np.ndarray], small: np.ndarray, forward: np.ndarray
) -> tuple[Factor | None, np.ndarray, Factor | None]:
    """A use's factor, its forward table and its twin for later copies (`_edge_costs`), from its tables over
    source rows and consumer columns and each candidate's ``positions`` (the source's, the entry's, the
    consumer's); an operator reading its own output has its cost per candidate instead of a factor."""
    src_pos, entry_pos, dst_pos = positions
    if use.src_node == use.dst_node:
        return None, small[src_pos, dst_pos], None
    if use.src_node > use.dst_node:  # tables in scope order, contiguous
        scope, small, forward = (use.dst_node, use.src_node), np.ascontiguousarray(small.T), forward.T
        pair = (Factor(scope, (dst_pos, src_pos), small), Factor(scope, (dst_pos, entry_pos), small))
    else:
        pair = _factor(use, src_pos, dst_pos, small), _factor(use, entry_pos, dst_pos, small)
    return pair[0], np.ascontiguousarray(forward), pair[1]


def _under_kernel(
    flow: Dataflow,
    use: TensorUse,
    sides: tuple[np.ndarray, np.ndarray, int | None, np.ndarray],
    small: np.ndarray,
    forward: np.ndarray,
    compute: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A ring input's tables less what its product hides (`ring.hidden_under`), and the consumer's
    positions in them (`ring.columns`). ``sides``: the source's candidates' rows, the entry's (the operator
    later copies of a folded run read instead: ``entry``), and the consumer's layout columns."""
    src_pos, entry_pos, entry, dst_pos = sides
    src_layouts: list[Layout | None] = [None] * small.shape[0]
    for candidate, row in enumerate(src_pos.tolist()):
        src_layouts[row] = src_layouts[row] or flow.source_layout(use, candidate)
    if entry is not None:
        rule = flow.rules[entry]
        for candidate, row in enumerate(entry_pos.tolist()):
            ends = rule.candidate_layouts(candidate)
            src_layouts[row] = src_layouts[row] or (ends[1] if use.src_is_output else ends[0])[use.src_slot]
    dst_layouts: list[Layout | None] = [None] * small.shape[1]
    consumer = flow.rules[use.dst_node]
    for candidate, column in enumerate(dst_pos.tolist()):
        dst_layouts[column] = dst_layouts[column] or consumer.input_layout(candidate, use.dst_slot)
    rows = [layout for layout in src_layouts if layout is not None]
    columns = [layout for layout in dst_layouts if layout is not None]
    assert len(rows) == small.shape[0] and len(columns) == small.shape[1]  # every row and column has a candidate
    placed, least = ring.placed_windows(flow, use, dst_pos, compute)
    axis = ring.key_axis(flow, use.dst_node)
    small, forward = ring.hidden_under((small, forward), (rows, columns), placed[1], least, axis)
    return small, forward, placed[0]


def ring_windows(flow: Dataflow, use: TensorUse, compute: np.ndarray, candidate: int) -> tuple[float, float]:
    """The forward and backward windows a ring input's transfer is charged under at the consumer's
    ``candidate``, as costing charges them (`ring.least_windows` over the columns of its edge's table):
    what lowering lists as hidden."""
    placed, least = ring.placed_windows(flow, use, _Layouts(flow).target(use)[1], compute)
    column = int(placed[0][candidate])
    return float(least[0][column]), float(least[1][column])


def _compiled_tables(
    latency: np.ndarray, per_byte: np.ndarray, found: PairSlots, total_bytes: int
) -> tuple[np.ndarray, np.ndarray]:
    """A use's forward table and its table with the gradient's way back (the same table where none comes
    back), as the numpy path makes them, by `native_jit.edge_tables`, its rows split between threads."""
    shape = (len(found.sources), len(found.targets))
    forward = np.empty(shape)
    both = forward if found.backward is None else np.empty(shape)
    backward = found.backward if found.backward is not None else np.zeros((0, 0), dtype=found.forward.dtype)
    places = found.through()
    kernel = native.kernels().edge_tables

    def rows(first: int, last: int) -> None:
        kernel(latency, per_byte, found.forward, backward, *places, float(total_bytes), forward, both, first, last)

    over_rows(rows, shape[0], found.size)
    return forward, both


def _too_many_pairs(flow: Dataflow, count: int) -> None:
    if count > MAX_LAYOUT_PAIRS:
        raise TooLargeError(
            f"{count:,} distinct redistributions between layouts would have to be costed on"
            f" {flow.num_devices:,} devices (limit {MAX_LAYOUT_PAIRS:,}, about a minute); use fewer devices."
        )


def _number_delivered(
    layouts: _Layouts, groups: Mapping[tuple[bytes, bytes, bool, bool], tuple[np.ndarray, np.ndarray, bool, bool]]
) -> None:
    """Number the layout rows `_costed_slots` numbers beyond the groups' own (the whole rows a
    redistribution delivers, the consumer rows a gradient's way back starts from), costing nothing: the
    count of layouts costed is the same whichever of the two costs the edges."""
    for src, dst, carries, accepts in groups.values():
        if accepts:
            layouts.whole(src)
        layouts.whole(dst)
        if carries:
            _Backward.starts(layouts, src, dst, accepts)
            layouts.whole(src)


def _distinct_pairs(flow: Dataflow, cache: PairCache, groups: Sequence[PairSlots], compiled: bool) -> int:
    """How many distinct layout pairs the groups have, all costed (a pair has one slot); refused as
    `_costed_slots` refuses, where their forward pairs are too many. ``compiled``: the groups' slots are
    read through their places by the compiled kernel, not copied out (`PairSlots`)."""
    seen = np.zeros(len(cache.values[0]), dtype=bool)
    for found in groups:
        _mark(seen, found, False, compiled)
    _too_many_pairs(flow, int(np.count_nonzero(seen)))
    for found in groups:
        if found.backward is not None:
            _mark(seen, found, True, compiled)
    return int(np.count_nonzero(seen))


def _mark(seen: np.ndarray, found: PairSlots, backward: bool, compiled: bool) -> None:
    """Set ``seen`` at a group's forward (or ``backward``) slots: read through its places by the compiled
    kernel where it has them (`PairSlots`), else as the group's own table."""
    if compiled and found.rows is not None:
        rows, columns = found.through()
        table, ends = (found.backward, (columns, rows)) if backward else (found.forward, (rows, columns))
        native.kernels().mark_slots(seen, table, *ends)
    else:
        seen[found.backward_slots() if backward else found.forward_slots()] = True


def _costed_slots(
    flow: Dataflow,
    layouts: _Layouts,
    groups: Mapping[tuple[bytes, bytes, bool, bool], tuple[np.ndarray, np.ndarray, bool, bool]],
    names: Mapping[tuple[bytes, bytes, bool, bool], tuple],
    cache: PairCache,
    slots: dict[tuple[bytes, bytes, bool, bool], PairSlots | None],
) -> None:
    """The slots of ``groups`` (into ``slots``, each kept in the cache for the problems after), costing
    the layout pairs not costed before. Refused before any costing where their distinct forward pairs
    are too many."""
    rows = layouts.rows
    # forward: from the source's layout (a fork's rows carry gradient bits its forward lacks) to the
    # consumer's, whole; back: from the consumer's, partial where its gradient is, to the source's,
    # whole or partial over the bits a fork takes it partial over (`_Backward`)
    forwards = {key: layouts.whole(src) if accepts else src for key, (src, _, _, accepts) in groups.items()}
    wholes = {key: layouts.whole(dst_ids) for key, (_, dst_ids, _, _) in groups.items()}
    backwards = {key: _Backward.of(layouts, *group) for key, group in groups.items() if group[2]}
    count = len(rows)
    kind = _pair_key_type(count)
    forward_keys = {
        key: forwards[key].astype(kind)[:, None] * kind(count) + wholes[key].astype(kind)[None, :] for key in groups
    }
    backward_keys = {key: backward.keys(count, kind) for key, backward in backwards.items()}
    pairs = _distinct_keys(flow, list(forward_keys.values()), list(backward_keys.values()))
    unique = pairs.keys
    width = max((len(length) for length, _, _ in rows), default=1) or 1
    lengths = np.zeros((len(rows), width), dtype=np.int64)
    codes = np.zeros((len(rows), width), dtype=np.uint64)
    for index, (length, code, _) in enumerate(rows):
        lengths[index, : len(length)] = length
        codes[index, : len(code)] = code
    table = LayoutTable(lengths, codes, np.array([partial for _, _, partial in rows], dtype=np.int64))
    numbers = cache.numbers(list(layouts.ids))  # the rows numbered since too (partial rows made whole)
    where = cache.narrowed(cache.slots_of(numbers, table, *np.divmod(unique, count), flow.cost))
    for key, (src, dst, _, _) in groups.items():
        backward = pairs.position(backward_keys[key], where) if key in backward_keys else None
        found = PairSlots(numbers[src], numbers[dst], pairs.position(forward_keys[key], where), backward)
        slots[key] = cache.keep(names[key], found)


def _distinct_keys(flow: Dataflow, forward: Sequence[np.ndarray], backward: Sequence[np.ndarray]) -> KeySet:
    """The distinct pair keys of the groups' ``forward`` and ``backward`` tables of keys, refused where the
    forward ones alone are too many (`_too_many_pairs`): a set of them is listed only then, where every pair
    is too many (a first problem's forward set was a second one of tens of millions of keys, half a GB)."""
    pairs = KeySet.of([keys.reshape(-1) for keys in (*forward, *backward)])
    if len(pairs) > MAX_LAYOUT_PAIRS:
        _too_many_pairs(flow, len(KeySet.of([keys.reshape(-1) for keys in forward])))
    return pairs


def _pair_key_type(layouts: int) -> type[np.signedinteger]:
    """The integer type of a layout pair's key (source row x ``layouts`` + target row): 32 bits where every
    key fits, as a first problem's tens of millions of keys then take half the memory, else 64.

    >>> _pair_key_type(46_340).__name__, _pair_key_type(46_341).__name__
    ('int32', 'int64')
    """
    return np.int32 if layouts * layouts <= np.iinfo(np.int32).max else np.int64


@dataclass(frozen=True)
class _Backward:
    """The ways back of one group of uses, consumer rows by source rows: each from the consumer's layout,
    partial where its gradient is, to the source's layout, partial over the bits a fork takes the
    gradient partial over. The bits both are partial over stay so; the consumer's others are reduced,
    and over the fork's others the gradient is whole and made partial locally, at no cost
    (`redistribute.as_partial`). So a pair costs as the consumer's row, less the fork's bits, to the
    source's row, whole."""

    dst: np.ndarray  # consumer rows, partial only over the bits the source does not take partial
    src: np.ndarray  # the source's rows, whole

    @classmethod
    def of(
        cls, layouts: _Layouts, src_ids: np.ndarray, dst_ids: np.ndarray, carries: bool, accepts: bool
    ) -> "_Backward":
        """``accepts``: the source is a fork, whose rows' partial bits are those it takes the gradient
        partial over (any other source's are its forward's, which its gradient never is)."""
        kept, starts = cls.starts(layouts, src_ids, dst_ids, accepts)
        dst = np.empty((len(dst_ids), len(src_ids)), dtype=np.int32)  # (layout rows: far fewer than 2**31)
        for mask, rows in starts.items():
            dst[:, kept == mask] = rows[:, None]
        return cls(dst, layouts.whole(src_ids))

    @staticmethod
    def starts(
        layouts: _Layouts, src_ids: np.ndarray, dst_ids: np.ndarray, accepts: bool
    ) -> tuple[np.ndarray, dict[int, np.ndarray]]:
        """Per source row, the bits its gradient is taken partial over (none but a fork's), and per such
        set of bits the consumer rows less them: where the ways back start."""
        kept = layouts.partial(src_ids) if accepts else np.zeros(len(src_ids), dtype=np.int64)
        return kept, {mask: layouts.without(dst_ids, mask) for mask in sorted(set(kept.tolist()))}

    def keys(self, count: int, kind: type[np.signedinteger]) -> np.ndarray:
        """The (consumer row, source row) pair keys, numbered as `_edge_costs` numbers pairs, of type ``kind``."""
        keys = self.dst.astype(kind)
        keys *= kind(count)
        keys += self.src.astype(kind)[None, :]
        return keys


def redistribution_coefficients(cost: CostModel, src: Layout, dst: Layout) -> tuple[float, float]:
    """(latency, seconds per byte of the whole tensor) of redistributing ``src`` to ``dst`` (whose
    partial bits, a gradient's, are not asked for: a redistribution delivers whole values).

    Shape-free, one pair at a time: the scalar reference `coefficients.pair_coefficients` equals.
    """
    latency = per_byte = 0.0
    for kind, bits, shift, *_ in symbolic_steps(src, Layout(dst.dims)):
        lat, coef = cost.collective_coefficients(kind, bits)
        latency += lat
        per_byte += coef / (1 << shift)
    return latency, per_byte
