"""The costed search problem: a cost vector per operator and a cost table per dataflow edge.

`costing.build_problem` fills the arrays once; this value only reads them. Edge tables are over
the layouts at the edge's two ends (`dp.Factor`), not over candidates; runs of repeated blocks
(`fold`) are costed once, every copy sharing copy 0's arrays. The solvers (`fold.Solver`,
`ilp`) take the arrays; none is stored here.

The objective (predicted step time) is additive: a node's cost covers its forward and
backward compute, the gradient AllReduce of the parameters it owns and the reduction of any
partial graph output; an edge's cost is the redistribution between the producer's output
layout and the consumer's input layout forward, and the gradient's way back as the runtime runs
it (from the consumer's layout, partial where its gradient is). Memory per device is
additive too and is kept beside the time, for the capacity constraint.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from types import MappingProxyType

import numpy as np

from autopar.errors import StrategyError
from autopar.search.dataflow import Dataflow, TensorUse
from autopar.search.dp import Factor
from autopar.search.fold import RunEdges
from autopar.search.memory import (
    NO_MEMORY_CHOICES,
    Alternative,
    MemoryChoices,
    gradient_bytes,
    input_bytes,
    memory_items,
    released_after,
)
from autopar.search.repeats import Repeat, Unfolded
from autopar.strategy import OpRule


@dataclass(frozen=True, eq=False)
class SearchProblem(Dataflow):
    """The dataflow with every candidate and edge costed: what the solvers need, and what lowering
    needs to explain the answer.

    Per operator and candidate: seconds (``node_time``, of which ``node_compute`` computing and
    ``node_communication`` communicating), bytes (``node_memory``), gradient sync hidden behind the
    backward (``node_hidden``) and exposed, paid once a step (``node_sync``). ``sharded``: the same
    figures under a parallel optimizer, where it saves memory; ``recompute_*``: for the operators
    of folded runs, the forward paid again, the bytes freed (<= 0) and the share of their
    activations that stays. ``factors`` are the main graph's edges; ``folds`` each folded run's
    copy-0 edges, and ``recompute_folds`` the same with their forward paid twice; ``unfolded`` the
    stretches of identical blocks that could not be folded, with the reason; ``ties`` the operators of
    twin branches (`twins`) the DP gives the candidate of their twin.
    """

    node_time: tuple[np.ndarray, ...]
    node_compute: tuple[np.ndarray, ...]
    node_communication: tuple[np.ndarray, ...]
    node_memory: tuple[np.ndarray, ...]
    node_hidden: tuple[np.ndarray, ...]
    node_sync: tuple[np.ndarray, ...]
    sharded: Mapping[int, Alternative]
    recompute_time: Mapping[int, np.ndarray]
    recompute_memory: Mapping[int, np.ndarray]
    recompute_share: Mapping[int, float]
    factors: tuple[Factor, ...]
    folds: list[tuple[Repeat, RunEdges]]
    recompute_folds: list[tuple[Repeat, RunEdges]]
    layouts_costed: int = 0
    pairs_costed: int = 0
    unfolded: tuple[Unfolded, ...] = ()  # stretches of copies left unfolded, with the reason
    ties: Mapping[int, int] = field(default_factory=lambda: MappingProxyType({}))  # operator -> its twin
    node_activations: tuple[np.ndarray, ...] = ()  # the part of ``node_memory`` kept for backward
    in_flight: int = 1  # micro-batches whose activations are held at once (a pipeline stage's, under 1F1B)
    blocks: tuple[Repeat, ...] = ()  # every run of repeated blocks, folded or not (where stages may be cut)
    recompute_factors: tuple[Factor, ...] = ()  # ``factors`` with recomputed forwards paid twice, where they differ
    forks_meet: bool = True  # the forks' candidates are where their readers meet (False: they only pass through)
    one_process: bool = False  # one device, no stages: the gradients are made in the backward (`memory`)

    def objective(self, choice: Sequence[int], choices: MemoryChoices = NO_MEMORY_CHOICES) -> float:
        """Predicted step time of one assignment (candidate index per node).

        With k micro-batches the step is k micro-steps, the gradient sync paid once.
        """
        total = sum(float(self.node_arrays(i, choices)[0][c]) for i, c in enumerate(choice))
        for factor, scope in self.all_factors(choices.recompute):
            total += factor.value([choice[u] for u in scope])
        if choices.micro_batches == 1:
            return total
        once = sum(
            float((self.sharded[i].sync if i in choices.sharded else self.node_sync[i])[c])
            for i, c in enumerate(choice)
        )
        return choices.micro_batches * (total - once) + once

    def restricted(self, first: int, last: int) -> SearchProblem:
        """Operators ``first`` .. ``last - 1`` as a problem of their own, numbered from 0: their arrays, the
        uses, owners, ties and edges among them, and each folded run's copies inside, still folded
        (`_restricted_runs`); recomputing, one block's activations stay of the copies inside, not of the
        whole run's. What crosses the ends is the caller's (`pipeline.stage_problem` adds a stage's)."""
        nodes = range(first, last)
        plain, folds, copies_in = _restricted_runs(self.folds, first, last)
        plain_again, recompute_folds, _ = _restricted_runs(self.recompute_folds, first, last)

        def inside(factors: Sequence[Factor]) -> list[Factor]:
            return [
                Factor(tuple(u - first for u in f.scope), f.maps, f.table)
                for f in factors
                if all(first <= u < last for u in f.scope)
            ]

        share = {i - first: 1.0 / copies_in.get(i - first, 1) for i in self.recompute_share if first <= i < last}
        recompute_memory = {
            i - first: (share[i - first] - self.in_flight) * self.node_activations[i] if i - first in share else freed
            for i, freed in self.recompute_memory.items()
            if first <= i < last
        }
        ties = {a - first: b - first for a, b in self.ties.items() if first <= a < last and first <= b < last}
        for repeat, _ in self.folds:  # the twins of every copy inside, where the run's own name copy 0's
            for a, b in self.ties.items():
                if a in repeat.block(0) and b in repeat.block(0):
                    for k in range(1, repeat.copies):
                        a_k, b_k = a + k * repeat.period, b + k * repeat.period
                        if first <= a_k < last and first <= b_k < last:
                            ties[a_k - first] = b_k - first
        uses = tuple(
            TensorUse(u.tensor, u.src_node - first, u.src_slot, u.src_is_output, u.dst_node - first, u.dst_slot)
            for u in self.uses
            if first <= u.src_node < last and first <= u.dst_node < last
        )
        main = inside(self.factors)
        again = plain_again or self.recompute_factors
        return replace(
            self,
            rules=self.rules[first:last],
            uses=uses,
            owner=MappingProxyType({t: (n - first, slot) for t, (n, slot) in self.owner.items() if first <= n < last}),
            fixed=frozenset(i - first for i in self.fixed if first <= i < last),
            node_time=self.node_time[first:last],
            node_compute=self.node_compute[first:last],
            node_communication=self.node_communication[first:last],
            node_memory=self.node_memory[first:last],
            node_hidden=self.node_hidden[first:last],
            node_sync=self.node_sync[first:last],
            node_activations=self.node_activations[first:last],
            sharded=MappingProxyType({i - first: alt for i, alt in self.sharded.items() if first <= i < last}),
            recompute_time=MappingProxyType({i - first: t for i, t in self.recompute_time.items() if i in nodes}),
            recompute_memory=MappingProxyType(recompute_memory),
            recompute_share=MappingProxyType(share),
            factors=tuple(main + plain),
            recompute_factors=tuple(inside(self.main_factors(True)) + plain_again) if again else (),
            folds=folds,
            recompute_folds=recompute_folds,
            unfolded=(),
            blocks=(),
            ties=MappingProxyType(ties),
        )

    def micro_batch_relaxation(self, share: float, lacking: Sequence[np.ndarray], beyond: float) -> SearchProblem:
        """This problem (the whole batch on one stage) as a relaxation of one stage over 1 / ``share``
        micro-batches: every byte that grows with the batch, its activations and data inputs, scaled by
        ``share``, and the candidates a micro-batch lacks (``lacking``, per operator: a split its smaller batch
        does not divide) costing ``beyond`` seconds more. No plan of the micro-batches that fits is faster than
        ``beyond`` or than this one's best plan that fits.

        Each plan of the micro-batches is a plan here (its splits divide the whole batch too), no slower: the
        same work at sizes no less efficient, each collective's latency paid once (the argument
        `ShapeSearch._fewer_micro_batches_win` reads). Its parameters' state is the same, the gradients held all
        step either way (gradient accumulation), and what grows with the batch is no less than ``share`` of the
        whole batch's (a size c + d x batch, times ``share``, is at most c + d x batch x ``share``). So that plan,
        at this problem's time with ``share`` of its activations and inputs, fits wherever the micro-batches'
        plan fits."""
        grows = [self.node_activations[i] + input_bytes(self, i) for i in range(self.size)]
        less = [(1.0 - share) * part for part in grows]
        extra = [np.where(lacks, beyond, 0.0) for lacks in lacking]
        return replace(
            self,
            node_time=tuple(time + more for time, more in zip(self.node_time, extra)),
            node_memory=tuple(memory - cut for memory, cut in zip(self.node_memory, less)),
            sharded=MappingProxyType(
                {
                    i: replace(alt, time=alt.time + extra[i], memory=alt.memory - less[i])
                    for i, alt in self.sharded.items()
                }
            ),
            recompute_memory=MappingProxyType({i: share * freed for i, freed in self.recompute_memory.items()}),
            node_activations=tuple(share * activations for activations in self.node_activations),
            one_process=False,
        )

    def per_micro_batch_relaxation(self, lacking: Sequence[np.ndarray], beyond: float) -> SearchProblem:
        """This problem (one micro-batch's, on one stage's devices) as a relaxation, memory aside, of the same
        model at a smaller micro-batch, ``share`` of this one's: each operator's time per micro-batch alone (its
        exposed sync and its update, paid once a step, left out), the candidates the smaller one lacks
        (``lacking``) costing ``beyond`` seconds more. Scaled by ``share``, no plan of the smaller micro-batch
        is faster per micro-batch (`ShapeSearch._smaller_batch_refutes` says why and checks the premise).

        An operator's time less its sync is its compute and communication per micro-batch
        (`costing._compose`); the edges are per micro-batch already."""
        extra = [np.where(lacks, beyond, 0.0) for lacks in lacking]
        zeros = [np.zeros_like(sync) for sync in self.node_sync]
        return replace(
            self,
            node_time=tuple(time - sync + more for time, sync, more in zip(self.node_time, self.node_sync, extra)),
            node_sync=tuple(zeros),
            sharded=MappingProxyType(
                {i: replace(alt, time=alt.time - alt.sync + extra[i], sync=zeros[i]) for i, alt in self.sharded.items()}
            ),
            one_process=False,
        )

    def counts_relaxation(
        self, latency: SearchProblem, shares: tuple[float, float], lacking: Sequence[np.ndarray], beyond: float
    ) -> SearchProblem:
        """This problem (the whole batch on one stage's devices) as a relaxation of its stages over each of
        several micro-batch counts M (each dividing the batch), searched as the least of them, M0, over
        ``shares`` = (slot share, batch share): the slot share is (M1 + S - 1) / (M1 x (M0 + S - 1)) for S
        stages and M1 the most micro-batches, the batch share 1 / M1. ``latency``: the same problem with every
        edge at zero bytes (`costing.build_with_latency`); ``lacking``: candidates no count has,
        costing ``beyond`` seconds more. The caller gives each stage's cuts the sizes of the M1 count's model.

        A plan over M micro-batches pays each operator's time per micro-batch and each edge in M + S - 1
        slots, what it pays once a step once. Per micro-batch, an operator's compute is at least 1 / M of its
        whole batch's (the same candidate: FLOPs and bytes at least that share, a rate no higher), and an
        edge is its latency plus seconds per byte times bytes at least 1 / M of the whole batch's; so over
        M + S - 1 slots, the compute and the bytes cost at least (M + S - 1) / M >= (M1 + S - 1) / M1 of the
        whole batch's, the latency M + S - 1 >= M0 + S - 1 times: the slot share of the whole batch's per slot
        of M0 + S - 1. Paid once a step, the optimizer update is the same at any batch; the exposed gradient
        sync is left out (at a smaller micro-batch less of it hides). Bytes that grow with the batch are at
        least the batch share of the whole batch's, as `micro_batch_relaxation` scales them, and M0 holds no
        more micro-batches in flight than any M. So no plan of any of the counts that fits is faster than
        this problem's plans over M0 micro-batches that fit."""
        slot_share, batch_share = shares
        grows = [self.node_activations[i] + input_bytes(self, i) for i in range(self.size)]
        less = [(1.0 - batch_share) * part for part in grows]
        extra = [np.where(lacks, beyond, 0.0) for lacks in lacking]

        def once(time: np.ndarray, compute: np.ndarray, communication: np.ndarray) -> np.ndarray:
            # the update, what is left of the time less compute and communication (rounding taken off)
            return np.maximum(time - compute - communication, 0.0) * (1.0 - 1e-9)

        def per_slot(time: np.ndarray, sync: np.ndarray) -> np.ndarray:
            return slot_share * (time - sync)

        made: dict[tuple[int, int], np.ndarray] = {}  # per pair of tables (by identity: both held), its mix

        def mixed(factors: Sequence[Factor], latencies: Sequence[Factor]) -> tuple[Factor, ...]:
            # latency + slot share x (table - latency), made once for the tables a run's copies and the
            # recomputed forwards share, in place of fresh temporaries (the same sums)
            for f, least in zip(factors, latencies):
                if (id(f.table), id(least.table)) not in made:
                    table = np.subtract(f.table, least.table)
                    table *= slot_share
                    table += least.table
                    made[id(f.table), id(least.table)] = table
            return tuple(replace(f, table=made[id(f.table), id(least.table)]) for f, least in zip(factors, latencies))

        def runs(
            folds: Sequence[tuple[Repeat, RunEdges]], latencies: Sequence[tuple[Repeat, RunEdges]]
        ) -> list[tuple[Repeat, RunEdges]]:
            return [
                (repeat, RunEdges(mixed(edges.first, least.first), mixed(edges.later, least.later)))
                for (repeat, edges), (_, least) in zip(folds, latencies)
            ]

        paid = [once(*arrays) for arrays in zip(self.node_time, self.node_compute, self.node_communication)]
        sharded = {}
        for i, alt in self.sharded.items():
            update = once(alt.time, self.node_compute[i], alt.communication)
            time = per_slot(alt.time, alt.sync) + update + extra[i]
            communication = slot_share * alt.communication
            sharded[i] = Alternative(time, communication, alt.memory - less[i], np.zeros_like(update), update)
        return replace(
            self,
            node_time=tuple(per_slot(t, y) + u + e for t, y, u, e in zip(self.node_time, self.node_sync, paid, extra)),
            node_compute=tuple(slot_share * compute for compute in self.node_compute),
            node_communication=tuple(slot_share * communication for communication in self.node_communication),
            node_memory=tuple(memory - cut for memory, cut in zip(self.node_memory, less)),
            node_hidden=tuple(np.zeros_like(u) for u in paid),
            node_sync=tuple(paid),
            sharded=MappingProxyType(sharded),
            recompute_time=MappingProxyType({i: slot_share * t for i, t in self.recompute_time.items()}),
            recompute_memory=MappingProxyType({i: batch_share * f for i, f in self.recompute_memory.items()}),
            node_activations=tuple(batch_share * activations for activations in self.node_activations),
            factors=mixed(self.factors, latency.factors),
            recompute_factors=mixed(self.recompute_factors, latency.recompute_factors),
            folds=runs(self.folds, latency.folds),
            recompute_folds=runs(self.recompute_folds, latency.recompute_folds),
            one_process=False,
        )

    def main_factors(self, recompute: bool = False) -> tuple[Factor, ...]:
        """The edge factors outside folded runs, with recomputed forwards paid twice if ``recompute``."""
        return self.recompute_factors if recompute and self.recompute_factors else self.factors

    def all_factors(self, recompute: bool = False) -> list[tuple[Factor, tuple[int, ...]]]:
        """Every edge factor with the operators it joins in its copy (its own scope outside folded runs)."""
        found = [(factor, factor.scope) for factor in self.main_factors(recompute)]
        for repeat, edges in self.recompute_folds if recompute else self.folds:
            found += [(f, f.scope) for f in edges.first]
            found += [(f, repeat.shift(f.scope, k)) for k in range(1, repeat.copies) for f in edges.later]
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
        ways = (MemoryChoices(recompute=recompute), MemoryChoices(frozenset(self.sharded), recompute))
        unary: list[np.ndarray] = []
        takes: list[np.ndarray | None] = []
        for node in range(self.size):
            cost, taken = self._lagrangian_of(node, weight, time_scale, ways)
            unary.append(cost)
            takes.append(taken)
        return unary, takes

    def node_lagrangian(
        self, node: int, weight: float, recompute: bool, time_scale: float = 1.0
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """`lagrangian` of one operator."""
        ways = (MemoryChoices(recompute=recompute), MemoryChoices(frozenset((node,)), recompute))
        return self._lagrangian_of(node, weight, time_scale, ways)

    def _lagrangian_of(
        self, node: int, weight: float, time_scale: float, ways: tuple[MemoryChoices, MemoryChoices]
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """`lagrangian` of one operator, given the memory choices without and with its parallel optimizer."""
        time, memory = self.node_arrays(node, ways[0])
        plain = time_scale * time + weight * memory if weight else time_scale * time
        if node not in self.sharded:
            return plain, None
        time, memory = self.node_arrays(node, ways[1])
        other = time_scale * time + weight * memory if weight else time_scale * time
        better = other < plain
        return np.where(better, other, plain), (better if better.any() else None)

    def node_sources(self, node: int, recompute: bool) -> tuple[int | None, ...]:
        """The identities of the arrays an operator's `node_lagrangian` is made of: operators whose sources are
        the same (the copies of a folded run share their arrays) have the same Lagrangian at every weight."""
        alternative = self.sharded.get(node)
        again = recompute and node in self.recompute_time
        return (
            id(self.node_time[node]),
            id(self.node_memory[node]),
            id(alternative.time) if alternative is not None else None,
            id(alternative.memory) if alternative is not None else None,
            id(self.recompute_time[node]) if again else None,
            id(self.recompute_memory[node]) if again else None,
        )

    def fastest_choices(self, choice: Sequence[int]) -> MemoryChoices:
        """The memory choices that make ``choice`` fastest, memory aside, as the search takes them where memory is
        to spare: each operator's parameters under the parallel optimizer where that is faster (each rank
        updating its shard), nothing recomputed."""
        return self.choices_at(choice, self.lagrangian(0.0, False)[1], False)  # memory weighs nothing

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
        for factor, (i, j) in self.all_factors(recompute):
            rows, cols = factor.maps
            matrix = factor.table[np.ix_(rows, cols)]
            edges[(i, j)] = edges[(i, j)] + matrix if (i, j) in edges else matrix
        return edges

    def memory(self, choice: Sequence[int], choices: MemoryChoices = NO_MEMORY_CHOICES) -> float:
        """Bytes a device holds at the step's peak: the sum of what every operator keeps resident, but on one
        process over one micro-batch (`one_process`), where the gradients are not held beside every
        activation (`backward_peak`)."""
        if self.one_process and choices.micro_batches == 1:
            return backward_peak(*self._held(choice, choices), self._released)
        return sum(float(self.node_arrays(i, choices)[1][c]) for i, c in enumerate(choice))

    def _held(self, choice: Sequence[int], choices: MemoryChoices) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per operator of a plan: the bytes it keeps resident, the activations among them (what recomputing
        keeps of them) and the gradients among them (`backward_peak`'s arguments)."""
        held = np.array([float(self.node_arrays(i, choices)[1][c]) for i, c in enumerate(choice)])
        activations = np.array([self._activations(i, choices.recompute)[c] for i, c in enumerate(choice)])
        gradients = np.array([gradient_bytes(self, i, c) for i, c in enumerate(choice)])
        return held, activations, gradients

    @cached_property
    def _released(self) -> tuple[int, ...]:
        """`memory.released_after`, for `backward_peak` (one process only)."""
        return released_after(self)

    def _activations(self, node: int, recompute: bool) -> np.ndarray:
        """An operator's bytes kept for the backward per candidate, less what recomputing frees of them."""
        if recompute and node in self.recompute_memory:
            return self.node_activations[node] + self.recompute_memory[node]
        return self.node_activations[node]

    def memory_floor(self, recompute: bool) -> float:
        """The least memory any plan needs, with or without recomputation: memory is a sum over
        operators, so no plan needs less than each operator's leanest candidate (with its parameters
        under a parallel optimizer where that is leaner); on one process, `backward_peak` of each
        operator's least of each of its parts."""
        known = self._memory_floors
        if recompute not in known:
            known[recompute] = self._least_memory(recompute)
        return known[recompute]

    @cached_property
    def _memory_floors(self) -> dict[bool, float]:
        """`memory_floor`'s, by recompute: a search asks it of one problem many times."""
        return {}

    def _least_memory(self, recompute: bool) -> float:
        """`memory_floor`, worked out: the copies of a folded run (and the stages cut from one problem) share
        their arrays, so each set of arrays an operator's bytes come from is taken its least once."""
        total = 0.0
        parts: list[tuple[float, float, float]] = []  # one process: the least held all step, activations, gradients
        least: dict[tuple[int, int, int], float] = {}
        for node in range(self.size):
            if self.one_process:
                memory = self.node_arrays(node, MemoryChoices(recompute=recompute))[1]
                activations = self._activations(node, recompute)
                gradients = np.array([gradient_bytes(self, node, c) for c in range(len(memory))])
                parts.append((float((memory - activations - gradients).min()), activations.min(), gradients.min()))
                continue
            again = self.recompute_memory.get(node) if recompute and node in self.recompute_time else None
            alternative = self.sharded[node].memory if node in self.sharded else None
            sources = (id(self.node_memory[node]), id(again), id(alternative))
            if sources not in least:
                memory = self.node_arrays(node, MemoryChoices(recompute=recompute))[1]
                if node in self.sharded:
                    memory = np.minimum(memory, self.node_arrays(node, MemoryChoices(frozenset({node}), recompute))[1])
                least[sources] = float(memory.min())
            total += least[sources]
        if parts:
            always, activations, gradients = (np.array(part, dtype=float) for part in zip(*parts))
            return backward_peak(always + activations + gradients, activations, gradients, self._released)
        return total

    def memory_items(
        self, node: int, choice: int, choices: MemoryChoices = NO_MEMORY_CHOICES
    ) -> list[tuple[str, str, float]]:
        """(tensor, role, bytes per device) one operator's candidate keeps resident (`memory.memory_items`)."""
        return memory_items(self, node, choice, choices, self.recompute_share, self.in_flight)

    @staticmethod
    def _candidate(rule: OpRule, strategy: Sequence[Sequence[int]]) -> int:
        try:
            return rule.candidates.index(rule.parse(strategy))
        except ValueError:
            raise StrategyError(
                f"Strategy {tuple(tuple(s) for s in strategy)} for {rule.op.name!r} is not one of its candidates"
                f" ({len(rule.candidates)}; `autopar.candidates` lists them)."
            ) from None

    def choice_for(self, strategies: Mapping[str, Sequence[Sequence[int]]]) -> list[int]:
        """Candidate indices for a full assignment of strategies; StrategyError on anything invalid.

        Forks (`autopar.ops.fork`, not in the model's file) may be left out: each then takes the candidate
        that costs least beside its producer's and readers' (what a search with every other operator fixed
        takes, so a plan exported without its forks reads back as the plan), passing its tensor through in
        its producer's layout where nothing is cheaper."""
        names = {rule.op.name for rule in self.rules}
        unknown = sorted(set(strategies) - names)
        if unknown:
            raise StrategyError(f"Strategies name operators the model does not have: {', '.join(unknown[:5])}.")
        missing = [r.op.name for r in self.rules if r.op.name not in strategies and not r.spec.gradient_labels]
        if missing:
            raise StrategyError(f"No strategy given for {len(missing)} operator(s), e.g. {missing[0]!r}.")
        choice = [
            self._candidate(rule, strategies[rule.op.name]) if rule.op.name in strategies else -1 for rule in self.rules
        ]
        for use in self.uses:
            if choice[use.dst_node] < 0 and choice[use.src_node] >= 0:  # a fork after its producer
                produced = self.source_layout(use, choice[use.src_node])
                fork = self.rules[use.dst_node]
                choice[use.dst_node] = next(
                    c
                    for c in range(len(fork.candidates))
                    if fork.input_layout(c, 0).dims == produced.dims and not fork.gradient_bits(fork.candidates[c])
                )
        left_out = {node for node, rule in enumerate(self.rules) if rule.op.name not in strategies}
        return self._cheapest_forks(choice, left_out) if left_out else choice

    def _cheapest_forks(self, choice: list[int], forks: set[int]) -> list[int]:
        """``choice`` with each fork in ``forks`` moved to its cheapest candidate given every other operator
        (no edge joins two forks, so each is settled alone); a tie keeps the candidate it has."""
        touching: dict[int, list[tuple[Factor, tuple[int, ...]]]] = {fork: [] for fork in forks}
        for factor, scope in self.all_factors():
            for node in scope:
                if node in touching:
                    touching[node].append((factor, scope))

        def cost(fork: int, candidate: int) -> float:
            edges = (f.value([candidate if u == fork else choice[u] for u in scope]) for f, scope in touching[fork])
            return float(self.node_time[fork][candidate]) + sum(edges)

        for fork in sorted(forks):
            costs = [cost(fork, c) for c in range(len(self.rules[fork].candidates))]
            best = min(range(len(costs)), key=costs.__getitem__)
            if costs[best] < costs[choice[fork]]:
                choice[fork] = best
        return choice


def _restricted_runs(
    folds: Sequence[tuple[Repeat, RunEdges]], first: int, last: int
) -> tuple[list[Factor], list[tuple[Repeat, RunEdges]], dict[int, int]]:
    """The part of each folded run within operators ``first`` .. ``last - 1``: its copies inside, still
    folded, but for a first copy that reads a copy before ``first`` (its edges become plain factors).

    Returns (plain factors, runs, run copies per operator), every scope in the part's own indices."""
    plain: list[Factor] = []
    runs: list[tuple[Repeat, RunEdges]] = []
    copies_in: dict[int, int] = {}

    def moved(factor: Factor, repeat: Repeat, k: int) -> Factor:
        return Factor(tuple(u - first for u in repeat.shift(factor.scope, k)), factor.maps, factor.table)

    for repeat, edges in folds:
        ks = [k for k in range(repeat.copies) if first <= repeat.block(k).start and repeat.block(k).stop <= last]
        if not ks:
            continue
        for k in ks:
            for node in repeat.block(k):
                copies_in[node - first] = len(ks)
        ka, kb = ks[0], ks[-1] + 1
        c0 = ka if repeat.last(ka - 1) >= first else ka + 1  # the first copy reading a copy of this stage
        pairs = [
            (f, g)
            for f, g in zip(edges.first, edges.later)
            if all(u >= repeat.start - 1 or first <= u < last for u in f.scope)  # its shared operators are here
        ]
        folded = kb - c0 >= 1
        for k in range(ka, kb if not folded else c0):
            for f, g in pairs:
                factor = moved(f if k == 0 else g, repeat, k)
                if all(0 <= u < last - first for u in factor.scope):
                    plain.append(factor)
        if folded:
            start = repeat.start + c0 * repeat.period - first
            shared = tuple(x - first for x in repeat.shared if first <= x < last)
            sub = Repeat(start, repeat.period, kb - c0, shared)
            if c0 == 0:
                run = RunEdges(
                    tuple(moved(f, repeat, 0) for f, _ in pairs), tuple(moved(g, repeat, 0) for _, g in pairs)
                )
            else:
                later = tuple(moved(g, repeat, c0) for _, g in pairs)
                run = RunEdges(later, later)
            runs.append((sub, run))
    return plain, runs, copies_in


def backward_peak(
    held: np.ndarray, activations: np.ndarray, gradients: np.ndarray, released: Sequence[int] | None = None
) -> float:
    """The most bytes one process holds in a step, given per operator (in graph order) what it keeps resident
    and, among that, its activations and its parameters' gradients, and the operator after whose backward its
    activations are freed (``released``, `memory.released_after`; its own where not given). Everything else is
    held all step, an activation from the forward until it is freed, each gradient from its operator's
    backward on: a single process makes gradients in the backward, as PyTorch's autograd does after
    ``zero_grad(set_to_none=True)``. With data parallel, DDP's buckets and Megatron's gradient buffer hold
    them all step, and so does `SearchProblem.memory` wherever there is more than one device. The backward
    runs from the last operator to the first, so while operator k's runs the activations freed at 0..k and
    the gradients of k..n-1 are held: the most of that over k, which lies between the larger of the two
    sums and their total.

    Two products, the first's output kept for the second's weight gradient, 4 B held all step: while the
    second's backward runs, that output (3) and the second's gradient (2); while the first's, both gradients.

    >>> backward_peak(np.array([5.0, 6.0]), np.array([3.0, 0.0]), np.array([2.0, 2.0]), released=[1, 1])
    9.0
    """
    if not len(held):
        return 0.0
    always = float(held.sum() - activations.sum() - gradients.sum())
    freed = np.zeros(len(held))
    np.add.at(freed, np.asarray(released if released is not None else range(len(held))), activations)
    while_running = np.cumsum(freed) + np.cumsum(gradients[::-1])[::-1]
    return always + float(while_running.max())
