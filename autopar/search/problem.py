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
from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType

import numpy as np

from autopar.errors import StrategyError
from autopar.search.dataflow import Dataflow
from autopar.search.dp import Factor
from autopar.search.fold import RunEdges
from autopar.search.memory import NO_MEMORY_CHOICES, Alternative, MemoryChoices, memory_items
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
        for factor, (i, j) in self.all_factors(recompute):
            rows, cols = factor.maps
            matrix = factor.table[np.ix_(rows, cols)]
            edges[(i, j)] = edges[(i, j)] + matrix if (i, j) in edges else matrix
        return edges

    def memory(self, choice: Sequence[int], choices: MemoryChoices = NO_MEMORY_CHOICES) -> float:
        return sum(float(self.node_arrays(i, choices)[1][c]) for i, c in enumerate(choice))

    def memory_floor(self, recompute: bool) -> float:
        """The least memory any plan needs, with or without recomputation: memory is a sum over
        operators, so no plan needs less than each operator's leanest candidate (with its parameters
        under a parallel optimizer where that is leaner)."""
        total = 0.0
        for node in range(self.size):
            memory = self.node_arrays(node, MemoryChoices(recompute=recompute))[1]
            if node in self.sharded:
                memory = np.minimum(memory, self.node_arrays(node, MemoryChoices(frozenset({node}), recompute))[1])
            total += float(memory.min())
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

        Forks (`autopar.ops.fork`, not in the model's file) may be left out: each then passes its
        tensor through in its producer's layout, as if it were not there."""
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
        return choice
