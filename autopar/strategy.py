"""Strategies: enumerate them in factor space, turn each into exact layouts in bit space.

A strategy is MindSpore's ``in_strategy``: one tuple of power-of-two split factors per input.
Internally it is one exponent per label of the operator's `OpSpec` (the same information,
without repetition). The data-parallel strategy comes first in every candidate list; the
search breaks ties toward earlier candidates, so ties go to data parallel as in MindSpore.
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np

from autopar.errors import StrategyError
from autopar.graph import Graph, OpNode
from autopar.layout import Layout, is_power_of_two
from autopar.ops import Keeps, OpDef, OpSpec, definition_for, spec_for
from autopar.ops.base import Labels

InStrategy = tuple[tuple[int, ...], ...]
_KEPT_WITH_CANDIDATES = ("label_sizes", "batch_label", "candidate_count", "data_parallel")
"""What an `OpRule` derives from its operator and mesh alone, whatever its candidates."""


@dataclass(frozen=True)
class OpRule:
    """An operator bound to its spec and to the mesh: the source of candidates and layouts.

    Frozen: what it derives (label sizes, candidates, layouts) is computed once on first use and
    cached on the instance. ``given`` replaces the enumerated candidates (`with_candidates`).
    """

    op: OpNode
    spec: OpSpec
    graph: Graph
    mesh_bits: int
    definition: OpDef | None = None
    given: tuple[tuple[int, ...], ...] | None = None

    @classmethod
    def build(cls, op: OpNode, graph: Graph, mesh_bits: int) -> "OpRule":
        return cls(op, spec_for(op, graph), graph, mesh_bits, definition_for(op, graph))

    def with_candidates(self, candidates: Sequence[tuple[int, ...]]) -> "OpRule":
        """The same rule with these candidates only: a strategy the user fixed, or a repeated block's
        copy that shares its first copy's list (`candidate_count` still counts them all). What the rule
        derives apart from its candidates is carried over, not derived again."""
        rule = replace(self, given=tuple(candidates))
        for name in _KEPT_WITH_CANDIDATES:
            if name in self.__dict__:
                rule.__dict__[name] = self.__dict__[name]
        return rule

    @property
    def differentiable(self) -> bool:
        """Whether gradients flow through the operator (unknown operators are assumed to pass them)."""
        return self.definition is None or self.definition.differentiable

    @property
    def keeps(self) -> Keeps:
        """What the backward needs kept (unknown operators are assumed to need their inputs)."""
        return Keeps.INPUTS if self.definition is None else self.definition.keeps

    # --- labels ------------------------------------------------------------------------

    @cached_property
    def label_sizes(self) -> dict[str, set[int]]:
        sizes: dict[str, set[int]] = {label: set() for label in self.spec.label_order}
        tensors = [(labels, name) for labels, name in zip(self.spec.inputs, self.op.inputs)]
        tensors += [(labels, name) for labels, name in zip(self.spec.outputs, self.op.outputs)]
        for labels, name in tensors:
            if labels is None or not name:
                continue
            for label, size in zip(labels, self.graph.tensor(name).shape):
                if label is not None:
                    sizes[label].add(size)
        return sizes

    def max_exponent(self, label: str) -> int:
        """Largest e with 2^e dividing every dimension the label names, capped by the mesh."""
        exponent = self.mesh_bits
        for size in self.label_sizes[label]:
            exponent = min(exponent, (size & -size).bit_length() - 1 if size > 0 else 0)
        return max(exponent, 0)

    @cached_property
    def batch_label(self) -> str | None:
        """The label of the leading dimension of the first data (non-weight) input."""
        for labels, name in zip(self.spec.inputs, self.op.inputs):
            if labels is None or not name or self.graph.tensor(name).kind in ("parameter", "constant"):
                continue
            return labels[0] if labels else None
        return None

    # --- candidates ----------------------------------------------------------------------

    @cached_property
    def candidate_count(self) -> int:
        """How many candidates there are, counted without listing them (for the size limits)."""
        return _counted(tuple(self.max_exponent(label) for label in self.spec.label_order), self.mesh_bits)

    @cached_property
    def candidates(self) -> list[tuple[int, ...]]:
        """All label exponent vectors with total split <= devices, data parallel first (or ``given``)."""
        if self._enumeration is None:
            return list(self.given or ())
        return list(_enumerated(*self._enumeration))

    @cached_property
    def _enumeration(self) -> tuple[tuple[int, ...], int, int | None, tuple[int, ...]] | None:
        """What `_enumerated` lists the candidates from (None: they are ``given``): rules alike in these
        have the same candidates, so what is derived from them alone is derived once (`encoded_layouts`)."""
        if self.given is not None:
            return None
        labels = self.spec.label_order
        limits = tuple(self.max_exponent(label) for label in labels)
        batch = labels.index(self.batch_label) if self.batch_label in labels else None
        return limits, self.mesh_bits, batch, self.data_parallel

    @cached_property
    def data_parallel(self) -> tuple[int, ...]:
        exponents = [0] * len(self.spec.label_order)
        if self.batch_label in self.spec.label_order:
            i = self.spec.label_order.index(self.batch_label)
            exponents[i] = self.max_exponent(self.batch_label)
        return tuple(exponents)

    @property
    def stand_alone(self) -> tuple[int, ...]:
        return tuple(0 for _ in self.spec.label_order)

    # --- strategy <-> exponents ------------------------------------------------------------

    def in_strategy(self, exponents: Sequence[int]) -> InStrategy:
        factor = {label: 1 << e for label, e in zip(self.spec.label_order, exponents)}
        strategy: list[tuple[int, ...]] = []
        names = list(self.op.inputs) + [""] * (len(self.spec.strategy_labels) - len(self.op.inputs))
        for position, (labels, name) in enumerate(zip(self.spec.strategy_labels, names)):
            if position >= len(self.op.inputs):  # a tuple beyond the inputs: a fork's gradient label
                strategy.append(tuple(factor[label] if label is not None else 1 for label in labels or ()))
            elif not name:
                strategy.append(())
            elif labels is None:
                strategy.append(tuple(1 for _ in self.graph.tensor(name).shape))
            else:
                strategy.append(tuple(factor[label] if label is not None else 1 for label in labels))
        return tuple(strategy)

    def parse(self, strategy: Sequence[Sequence[int]]) -> tuple[int, ...]:
        """Exponents for a user's in_strategy, or a StrategyError saying what is wrong."""
        name = self.op.name

        def integer(factor: object) -> int:
            if isinstance(factor, bool) or not isinstance(factor, numbers.Integral):
                raise TypeError(factor)
            return int(factor)

        try:
            strategy = tuple(tuple(integer(f) for f in entry) for entry in strategy)
        except (TypeError, ValueError):
            raise StrategyError(f"Strategy for {name!r} must be a tuple of integer tuples, got {strategy!r}.") from None
        expected = self.in_strategy(self.stand_alone)
        if len(strategy) != len(expected) or any(len(s) != len(e) for s, e in zip(strategy, expected)):
            shape = tuple(len(e) for e in expected)
            raise StrategyError(
                f"Strategy {strategy} for {name!r} ({self.op.op_type}) has the wrong shape: expected one tuple per"
                f" input with {shape} entries."
            )
        exponents: dict[str, int] = {}
        for position, (entry, labels) in enumerate(zip(strategy, self.spec.strategy_labels)):
            for dim, factor in enumerate(entry):
                label = labels[dim] if labels is not None else None
                if factor < 1 or not is_power_of_two(factor):
                    raise StrategyError(
                        f"The value of strategy must be a power of 2, but got {factor} for input {position},"
                        f" dimension {dim} of {name!r}."
                    )
                if label is None:
                    if factor != 1:
                        raise StrategyError(
                            f"Strategy for {name!r}: input {position} dim {dim} cannot be split by"
                            f" {self.op.op_type} (factor {factor}, must be 1)."
                        )
                    continue
                e = factor.bit_length() - 1
                if exponents.setdefault(label, e) != e:
                    raise StrategyError(
                        f"Strategy for {name!r}: inputs disagree on how to split the same axis"
                        f" ({1 << exponents[label]} vs {factor})."
                    )
        result = tuple(exponents.get(label, 0) for label in self.spec.label_order)
        if sum(result) > self.mesh_bits:
            raise StrategyError(
                f"Strategy for {name!r} splits into {1 << sum(result)} parts, more than the"
                f" {1 << self.mesh_bits} device{'s' if self.mesh_bits else ''}."
            )
        for label, e in zip(self.spec.label_order, result):
            bad = [size for size in self.label_sizes[label] if size % (1 << e)]
            if bad:
                raise StrategyError(
                    f"Strategy for {name!r}: split factor {1 << e} does not divide dimension size {bad[0]}."
                )
        return result

    # --- layouts -------------------------------------------------------------------------

    def label_bits(self, exponents: Sequence[int]) -> dict[str, tuple[int, ...]]:
        """Bits per label: the last label of the device matrix takes the lowest bits."""
        bits: dict[str, tuple[int, ...]] = {}
        next_bit = 0
        for label, e in reversed(list(zip(self.spec.label_order, exponents))):
            bits[label] = tuple(range(next_bit + e - 1, next_bit - 1, -1))
            next_bit += e
        return bits

    def _layout(self, labels: Labels, bits: dict[str, tuple[int, ...]]) -> Layout:
        return Layout(tuple(bits[label] if label is not None else () for label in labels))

    def input_layouts(self, exponents: Sequence[int]) -> list[Layout | None]:
        bits = self.label_bits(exponents)
        layouts: list[Layout | None] = []
        for labels, name in zip(self.spec.inputs, self.op.inputs):
            if not name:
                layouts.append(None)
            elif labels is None:
                layouts.append(Layout.replicated(len(self.graph.tensor(name).shape)))
            else:
                layouts.append(self._layout(labels, bits))
        return layouts

    def output_layouts(self, exponents: Sequence[int]) -> list[Layout | None]:
        bits = self.label_bits(exponents)
        partial = tuple(sorted((b for label in self.spec.reduced_labels for b in bits[label]), reverse=True))
        layouts: list[Layout | None] = []
        for labels, name in zip(self.spec.outputs, self.op.outputs):
            if not name:
                layouts.append(None)
                continue
            layout = self._layout(labels, bits)
            layouts.append(Layout(layout.dims, partial, self.spec.reduce_op) if partial else layout)
        return layouts

    def candidate_layouts(self, index: int) -> tuple[list[Layout | None], list[Layout | None]]:
        """(input layouts, output layouts) of candidate ``index``, computed once."""
        cache = self.__dict__.setdefault("_layout_cache", {})
        hit = cache.get(index)
        if hit is None:
            exponents = self.candidates[index]
            hit = cache[index] = (self.input_layouts(exponents), self.output_layouts(exponents))
        return hit

    def input_layout(self, index: int, slot: int) -> Layout:
        """The layout candidate ``index`` wants for a present input."""
        return _present(self.candidate_layouts(index)[0][slot], self.op.name, "input", slot)

    def output_layout(self, index: int, slot: int) -> Layout:
        """The layout candidate ``index`` gives a present output."""
        return _present(self.candidate_layouts(index)[1][slot], self.op.name, "output", slot)

    def gradient_bits(self, exponents: Sequence[int]) -> tuple[int, ...]:
        """Bits the outputs' gradients may arrive partial over: those of the gradient labels (a fork's,
        `autopar.ops.fork`); none for every operator of a model's file."""
        bits = self.label_bits(exponents)
        return tuple(sorted((b for label in self.spec.gradient_labels for b in bits[label]), reverse=True))

    def gradient_target(self, exponents: Sequence[int], slot: int) -> Layout:
        """Where readers' gradients of output ``slot`` go: its layout, whole, or partial over the bits a
        fork takes them partial over (`gradient_bits`)."""
        dims = _present(self.output_layouts(exponents)[slot], self.op.name, "output", slot).dims
        kept = self.gradient_bits(exponents)
        return Layout(dims, kept) if kept else Layout(dims)

    def encoded_layouts(
        self, is_output: bool, slot: int, gradient: bool = False
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every candidate's layout of one tensor as arrays, without building `Layout` objects.

        Per candidate and dimension: how many bits split it and their packed code (four bits
        per mesh bit, most significant first, as `search.coefficients.LayoutTable` reads them);
        per candidate: the mask of partial bits (with ``gradient``, of an output: the bits its
        gradient may arrive partial over, `gradient_bits`). Equal rows mean equal layouts. The arrays are
        read-only: rules listing the same candidates share them.
        """
        labels = self.spec.outputs[slot] if is_output else self.spec.inputs[slot]
        name = (self.op.outputs if is_output else self.op.inputs)[slot]
        ndim = len(self.graph.tensor(name).shape)
        partial_labels = (self.spec.gradient_labels if gradient else self.spec.reduced_labels) if is_output else ()
        how = (self.spec.label_order, labels, ndim, partial_labels)
        if self._enumeration is not None:  # the same arrays for every rule listing the same candidates
            return _encoded_enumeration(self._enumeration, *how)
        return _encoded(tuple(self.candidates), *how)

    def shards(self, exponents: Sequence[int]) -> int:
        """How many distinct pieces of work the operator is cut into."""
        return 1 << sum(exponents)

    def describe(self, exponents: Sequence[int]) -> str:
        return str(self.in_strategy(exponents)).replace(" ", "")


def _present(layout: Layout | None, op: str, role: str, slot: int) -> Layout:
    if layout is None:
        raise ValueError(f"operator {op!r} has no {role} {slot}")
    return layout


def _encoded(
    candidates: Sequence[tuple[int, ...]],
    order: tuple[str, ...],
    labels: Labels | None,
    ndim: int,
    partial_labels: tuple[str, ...],
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`OpRule.encoded_layouts` of these candidates (exponents over the labels in ``order``), for a tensor of
    ``ndim`` dimensions labelled ``labels``, partial over the bits of ``partial_labels``; read-only arrays."""
    count = len(candidates)
    exponents = np.asarray(candidates, dtype=np.int64).reshape(count, len(order))
    offsets = np.cumsum(exponents[:, ::-1], axis=1)[:, ::-1] - exponents
    lengths = np.zeros((count, ndim), dtype=np.int64)
    codes = np.zeros((count, ndim), dtype=np.uint64)
    for dim, label in enumerate(labels or ()):
        if label is None:
            continue
        e, offset = exponents[:, order.index(label)], offsets[:, order.index(label)]
        lengths[:, dim] = e
        for t in range(int(e.max(initial=0))):
            bit = np.where(t < e, offset + t, 0).astype(np.uint64)
            codes[:, dim] |= np.where(t < e, bit << np.uint64(4 * t), np.uint64(0))
    partial = np.zeros(count, dtype=np.int64)
    for label in partial_labels:
        i = order.index(label)
        partial |= ((np.int64(1) << exponents[:, i]) - 1) << offsets[:, i]
    for array in (lengths, codes, partial):
        array.flags.writeable = False  # shared between rules (`_encoded_enumeration`)
    return lengths, codes, partial


@functools.lru_cache(maxsize=256)
def _encoded_enumeration(
    enumeration: tuple[tuple[int, ...], int, int | None, tuple[int, ...]],
    order: tuple[str, ...],
    labels: Labels | None,
    ndim: int,
    partial_labels: tuple[str, ...],
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`_encoded` of the candidates `_enumerated` lists from ``enumeration``: the operators of every layer of a
    model, and of every problem planned at the same limits (each micro-batch count's), share them."""
    return _encoded(_enumerated(*enumeration), order, labels, ndim, partial_labels)


@functools.lru_cache(maxsize=1024)
def _counted(limits: tuple[int, ...], mesh_bits: int) -> int:
    """How many exponent vectors under ``limits`` sum to at most ``mesh_bits`` (`OpRule.candidate_count`).

    >>> _counted((1, 1), 1), _counted((3,), 2)
    (3, 3)
    """
    ways = [1] + [0] * mesh_bits  # ways[s]: label prefixes whose exponents sum to s
    for limit in limits:
        ways = [sum(ways[s - e] for e in range(min(limit, s) + 1)) for s in range(mesh_bits + 1)]
    return sum(ways)


@functools.lru_cache(maxsize=1024)
def _enumerated(
    limits: tuple[int, ...], mesh_bits: int, batch: int | None, data_parallel: tuple[int, ...]
) -> tuple[tuple[int, ...], ...]:
    """Every exponent vector under ``limits`` (per label) with total at most ``mesh_bits``, data parallel
    first, then by how much splits labels other than the batch (``batch``: its label's index), more batch
    first. The same few lists serve every layer of a model, and every model planned at those limits:
    listed once (a 96-layer transformer's operators ask two thousand times).

    >>> _enumerated((1, 1), 1, 0, (1, 0))
    ((1, 0), (0, 0), (0, 1))
    """
    found: list[tuple[int, ...]] = []

    def extend(prefix: list[int], budget: int) -> None:
        if len(prefix) == len(limits):
            found.append(tuple(prefix))
            return
        for e in range(min(limits[len(prefix)], budget) + 1):
            extend(prefix + [e], budget - e)

    extend([], mesh_bits)

    def order(exponents: tuple[int, ...]) -> tuple:
        others = sum(e for i, e in enumerate(exponents) if i != batch)
        return (exponents != data_parallel, others, -(exponents[batch] if batch is not None else 0), exponents)

    return tuple(sorted(found, key=order))
