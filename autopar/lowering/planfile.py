"""The plan file: typed, validated, with a JSON Schema (``autopar schema`` prints it).

Every part is a frozen pydantic model that forbids unknown fields and types its figures strictly (no
``"8"``, ``8.0`` or ``true`` for 8), its kinds as their enumerations, and the whole file agrees with
itself (its devices spell its mesh bits; every layout names each of those bits at most once, and no
other; every strategy splits by powers of two, at most the devices, with a tuple per input of its
rank), so a plan file written by hand or by another tool is either read exactly or rejected with one
sentence naming the field. `autopar.lowering.lower.check_context` checks it against a model.
`Plan.to_dict()` is `PlanFile`'s dump; `read_plan_file` is the one way in for every reader.

>>> read_plan_file({"schema": SCHEMA, "ops": "garbage"}, origin="p.json")
Traceback (most recent call last):
...
autopar.errors.PlanFileError: Plan file 'p.json' is not a valid autopar plan: model: field required.
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from autopar.cost.mesh import Mesh
from autopar.errors import AutoparError, PlanFileError, first_problem
from autopar.layout import Layout, ReduceOp, is_power_of_two, mesh_bits_for
from autopar.limits import MAX_DEVICES
from autopar.options import Optimizer, Precision, shown
from autopar.redistribute import Collective, Step

SCHEMA = "autopar.plan/3"
# version 2: each redistribution step also named the dual collective the search charged for its
# backward (version 3 charges and lists the gradient's own way back, under "gradients");
# version 1: version 2 without pipeline stages
READABLE_SCHEMAS = ("autopar.plan/1", "autopar.plan/2", SCHEMA)
GRAPH_OUTPUT = "<graph output>"  # the consumer named by the reduction of a partial graph output


def _integer(value: object) -> int:
    """An integer as JSON writes one: pydantic alone would read "8", true and 8.0 as 8."""
    if type(value) is int:  # (most are: the check below asks the abstract class, a tenth of lowering a large plan)
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"an integer is expected, not {shown(value)}")
    return int(value)


def _number(value: object) -> object:
    """A number as JSON writes one: pydantic alone would read "1.5" and true as numbers."""
    if type(value) is float or type(value) is int:
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"a number is expected, not {shown(value)}")
    return value


def _flag(value: object) -> bool:
    """true or false (numpy's booleans too): pydantic alone would read 1, "yes" and "on" as true."""
    if isinstance(value, bool) or getattr(getattr(value, "dtype", None), "kind", None) == "b":
        return bool(value)
    raise ValueError(f"true or false is expected, not {shown(value)}")


# the plan file's figures are typed strictly: a string, a boolean or a fraction where a count belongs is refused
NonNegativeInt = Annotated[int, BeforeValidator(_integer), Field(ge=0)]
PositiveInt = Annotated[int, BeforeValidator(_integer), Field(gt=0)]
Number = Annotated[float, BeforeValidator(_number)]
NonNegativeFloat = Annotated[float, BeforeValidator(_number), Field(ge=0)]
Flag = Annotated[bool, BeforeValidator(_flag)]


class _Part(BaseModel):
    """Every figure is finite: a plan never says Infinity or NaN (strict JSON)."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True, allow_inf_nan=False)


class _OmitsUnset(_Part):
    """Optional fields that are None are left out of the dump (they do not apply)."""

    _omit: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        omit = type(self)._omit  # a class attribute: read it once, not through pydantic's instance lookup
        return {key: value for key, value in data.items() if value is not None or key not in omit}


class LayoutEntry(_OmitsUnset):
    """A `Layout`: the mesh bits splitting each dimension (most significant first), and partial bits."""

    _omit: ClassVar[tuple[str, ...]] = ("partial", "partial_op")
    dims: list[list[NonNegativeInt]]
    partial: list[NonNegativeInt] | None = None
    partial_op: ReduceOp | None = None

    @model_validator(mode="after")
    def _each_bit_once(self) -> "LayoutEntry":
        """A mesh bit splits one dimension, or is partial, never both nor twice (as `Layout` requires)."""
        used = self.bits
        twice = next((bit for bit in used if used.count(bit) > 1), None)
        if twice is not None:
            raise ValueError(f"mesh bit {twice} is used twice in the layout {self.described}")
        return self

    @property
    def described(self) -> str:
        """The layout as the file spells it: its dims, then its partial bits."""
        text = str(self.dims)
        return f"{text} partial over {self.partial}" if self.partial else text

    @property
    def bits(self) -> list[int]:
        """Every mesh bit the layout uses."""
        return [bit for bits in self.dims for bit in bits] + list(self.partial or ())

    @classmethod
    def of(cls, layout: Layout) -> "LayoutEntry":
        if not layout.partial:
            return cls(dims=[list(bits) for bits in layout.dims])
        return cls(
            dims=[list(bits) for bits in layout.dims], partial=list(layout.partial), partial_op=layout.partial_op
        )

    def layout(self) -> Layout:
        return Layout(
            tuple(tuple(bits) for bits in self.dims), tuple(self.partial or ()), self.partial_op or ReduceOp.SUM
        )


class CollectiveStep(_OmitsUnset):
    """One collective (see `autopar.redistribute.Step`), with its cost."""

    _omit: ClassVar[tuple[str, ...]] = ("dim", "concat_dim", "reduce_op")
    collective: Collective
    group_size: PositiveInt
    bits: list[NonNegativeInt] = Field(min_length=1)
    bytes: NonNegativeInt = Field(description="per-rank payload")
    dim: NonNegativeInt | None = None
    concat_dim: NonNegativeInt | None = None
    reduce_op: ReduceOp | None = None
    seconds: NonNegativeFloat

    def step(self) -> Step:
        return Step(
            self.collective, tuple(self.bits), self.bytes, self.dim, self.concat_dim, self.reduce_op or ReduceOp.SUM
        )


class StepEntry(CollectiveStep):
    """One collective of a forward redistribution (files of schema version 2 or older also name the
    dual the search then charged for its backward)."""

    _omit: ClassVar[tuple[str, ...]] = (*CollectiveStep._omit, "backward", "backward_seconds")
    backward: Collective | None = Field(default=None, description="version 2 or older: the dual charged")
    backward_seconds: NonNegativeFloat | None = Field(default=None, description="version 2 or older")


class TensorLayout(_Part):
    tensor: str
    layout: LayoutEntry


class OpCost(_OmitsUnset):
    _omit: ClassVar[tuple[str, ...]] = ("update_s",)
    compute_s: NonNegativeFloat
    communication_s: Number = Field(description="gradient sync and partial graph outputs it owns")
    memory_bytes: NonNegativeInt
    update_s: NonNegativeFloat | None = Field(
        default=None, description="the optimizer update of the parameters it owns, once a step (None: it owns none)"
    )


class OpEntry(_OmitsUnset):
    """One operator: its MindSpore-style in_strategy and the layouts it implies."""

    _omit: ClassVar[tuple[str, ...]] = ("fixed", "source", "domain", "fused")
    name: str
    op_type: str
    domain: str | None = Field(
        default=None, description="autopar's own operators only (a Fork, `autopar.ops.fork`): not in the model's file"
    )
    strategy: list[list[PositiveInt]]
    inputs: list[TensorLayout]
    outputs: list[TensorLayout]
    cost: OpCost
    fallback: Flag
    fixed: Flag | None = Field(default=None, description="true where the user fixed the strategy (semi-auto mode)")
    source: str | None = Field(default=None, description="the exporting framework's name for the layer, if recorded")
    fused: Literal["scores", "inner", "values", "kernel"] | None = Field(
        default=None,
        description="its part in a fused attention kernel (`autopar.graph.attention`): the product of queries and"
        " keys, an operator inside, the product with the values, or the whole kernel (None: it runs on its own)",
    )

    @field_validator("strategy")
    @classmethod
    def _powers_of_two(cls, strategy: list[list[int]]) -> list[list[int]]:
        for position, splits in enumerate(strategy):
            odd = next((split for split in splits if not is_power_of_two(split)), None)
            if odd is not None:
                raise ValueError(f"input {position} is split {odd} ways ({splits}), not a power of two")
        return strategy

    @model_validator(mode="after")
    def _strategy_fits_the_layouts(self) -> "OpEntry":
        problem = _strategy_mismatch(self)
        if problem is not None:
            raise ValueError(problem)
        return self


def _entries(count: int) -> str:
    return f"{count} entr{'y' if count == 1 else 'ies'}"


def _splits(layout: LayoutEntry) -> list[int]:
    return [1 << len(bits) for bits in layout.dims]


def _strategy_mismatch(op: OpEntry) -> str | None:
    """What in ``op``'s strategy disagrees with the input layouts it records (None: nothing): a tuple per
    recorded input, of its rank, splitting it as its layout does.

    The strategy has a tuple per input of the operator, an absent one's empty, where the file records the
    layouts of the present inputs: each present input's tuple splits it as its layout does (a OneHot's first
    tuple spells its output's layout instead, as MindSpore's does); a fork (`autopar.ops.fork`) adds a tuple
    for its gradients.
    """
    outputs = [_splits(entry.layout) for entry in op.outputs]
    recorded = list(op.inputs)
    for given in op.strategy:
        if not recorded:
            if given and op.domain is None:
                return f"the strategy has a tuple {given} beyond the {len(op.inputs)} inputs it records"
            continue
        entry = recorded[0]
        if len(given) == len(entry.layout.dims):
            if given != _splits(entry.layout):
                return (
                    f"the strategy splits input {entry.tensor!r} as {given}, but its recorded layout"
                    f" {entry.layout.described} splits it as {_splits(entry.layout)}"
                )
            recorded.pop(0)
        elif given in outputs:  # a OneHot's
            recorded.pop(0)
        elif given:  # not an absent input's
            return (
                f"the strategy's tuple {given} for input {entry.tensor!r} has {_entries(len(given))}, but its recorded"
                f" layout {entry.layout.described} has {len(entry.layout.dims)}"
            )
    if recorded:
        return f"the strategy has no tuple for input {recorded[0].tensor!r}"
    return None


class Redistribution(_OmitsUnset):
    """The collectives that take a tensor from its producer's layout to its consumer's."""

    _omit: ClassVar[tuple[str, ...]] = ("hidden_s",)
    tensor: str
    producer: str
    consumer: str = Field(description=f"an operator name, or {GRAPH_OUTPUT!r} for a partial graph output")
    from_: LayoutEntry = Field(alias="from")
    to: LayoutEntry
    steps: list[StepEntry]
    seconds: NonNegativeFloat
    hidden_s: NonNegativeFloat | None = Field(
        default=None,
        description="of these seconds and of the gradient's way back, those that run under the fused attention"
        " kernel reading the tensor: keys or values gathered round a ring (`autopar.search.ring`); None: none",
    )

    @property
    def key(self) -> tuple[str, str, str]:
        return self.tensor, self.producer, self.consumer


class GradientPath(_OmitsUnset):
    """How a consumer's gradient of a tensor reaches the tensor's producer (or a parameter's owner).

    The consumer's local gradient is partial over the bits of the labels its input lacks (a
    column-split MatMul's input, say); the steps take it from that layout to the producer's,
    where every consumer's contribution is summed (a fork, `autopar.ops.fork`, may take it partial:
    its readers add theirs locally, and its own way back reduces them once). This is the exact dual of the forward
    dataflow: a ReduceScatter where the forward gathered what the consumer splits, an AllReduce
    where an input is read whole, an AllGather where the forward sliced.

    With ``carries`` "max" (or "min") the steps carry the reduced values instead: a partial
    maximum completed only by a ReduceScatter leaves each rank a slice of it, and its backward
    needs the whole maximum on every rank to send the gradient to the ranks that held it.
    """

    _omit: ClassVar[tuple[str, ...]] = ("carries",)
    tensor: str
    producer: str = Field(description="the operator producing the tensor, or the one that loads a parameter")
    consumer: str
    slot: NonNegativeInt = Field(description="the consumer's input the gradient is of")
    carries: Literal["max", "min"] | None = Field(
        default=None, description="absent for a gradient; max or min: the reduced values a partial max's backward needs"
    )
    from_: LayoutEntry = Field(alias="from", description="the gradient's layout as the consumer's backward leaves it")
    to: LayoutEntry = Field(description="the layout the producer's gradient is summed in")
    steps: list[CollectiveStep] = Field(min_length=1)
    seconds: NonNegativeFloat

    @property
    def key(self) -> tuple[str, str, str, int]:
        return self.tensor, self.producer, self.consumer, self.slot


class GradientSync(_OmitsUnset):
    """The AllReduce of a trainable parameter's gradient over the bits it is partial on.

    With a parallel optimizer (``optimizer_shards``) it is a ReduceScatter instead: each device
    updates its share of the parameter, then an AllGather over the same bits restores the whole
    weights for the next forward pass; ``seconds`` counts both.
    """

    _omit: ClassVar[tuple[str, ...]] = ("optimizer_shards", "dim")
    parameter: str
    op: str
    layout: LayoutEntry
    collective: Literal["AllReduce", "ReduceScatter"] | None
    bits: list[NonNegativeInt]
    group_size: PositiveInt
    bytes: NonNegativeInt
    seconds: NonNegativeFloat
    optimizer_shards: PositiveInt | None = Field(
        default=None, description="the parallel optimizer splits gradient and optimizer state this many ways"
    )
    dim: NonNegativeInt | None = Field(default=None, description="the dimension a ReduceScatter splits")

    def step(self) -> Step | None:
        """The collective as a redistribution step (None when the gradient is already whole)."""
        if self.collective is None:
            return None
        return Step(Collective(self.collective), tuple(self.bits), self.bytes, self.dim)


class Totals(_OmitsUnset):
    _omit: ClassVar[tuple[str, ...]] = ("free_step_time_s", "fixed_cost_s", "pipeline_bubble_s")
    step_time_s: NonNegativeFloat
    compute_s: NonNegativeFloat
    communication_s: Number = Field(description="communication the step waits for (exposed)")
    hidden_communication_s: NonNegativeFloat = Field(
        description="gradient synchronisation that runs beside the backward pass (overlapped)"
    )
    gradient_sync_s: NonNegativeFloat = Field(description="every parameter's gradient synchronisation, hidden or not")
    optimizer_update_s: NonNegativeFloat = Field(
        default=0.0,
        description="the optimizer update of every trainable parameter, once a step after the gradient sync"
        " (each rank its shard under a parallel optimizer; 0 in files older than its charging)",
    )
    memory_per_device_bytes: NonNegativeInt = Field(
        description="the most a device holds in a step: on one device less than memory_breakdown's sum, one process"
        " making its gradients in the backward as it frees activations"
    )
    memory_capacity_bytes: NonNegativeInt = Field(description="the device's memory, as the hardware profile gives it")
    memory_reserve_bytes: NonNegativeInt = Field(
        default=0,
        description="device memory the plan leaves free for workspace, communication buffers and allocator"
        " fragmentation (the profile's reserve or --memory-reserve; 0 in files older than the reserve)",
    )
    memory_breakdown: dict[str, NonNegativeInt] = Field(
        description="bytes per device: parameter_state (weights, gradients, optimizer state), activations (kept"
        " for the backward pass), inputs (the data each device loads)"
    )
    training_flops: NonNegativeFloat
    ideal_step_time_s: NonNegativeFloat
    data_parallel_step_time_s: NonNegativeFloat = Field(
        description="the step of pure data parallel (the batch split over every device, nothing fixed)"
    )
    speedup_vs_data_parallel: NonNegativeFloat = Field(description="data_parallel_step_time_s / step_time_s")
    free_step_time_s: NonNegativeFloat | None = Field(
        default=None,
        description="with fixed strategies (semi-auto): the step of the plan the search finds with nothing fixed",
    )
    fixed_cost_s: Number | None = Field(
        default=None,
        description="with fixed strategies (semi-auto): what they cost, step_time_s - free_step_time_s",
    )
    pipeline_bubble_s: NonNegativeFloat | None = Field(
        default=None,
        description="with pipeline stages: the step's idle slots, (S - 1) x the slowest stage's time per"
        " micro-batch (compute_s and communication_s are that stage's over its M micro-batches)",
    )

    @property
    def memory_usable_bytes(self) -> int:
        """What the plan may fill: the device's memory less the reserve."""
        return self.memory_capacity_bytes - self.memory_reserve_bytes


class LinkUse(_Part):
    """One level of the device mesh: the link that joins the devices differing in these bits."""

    name: str
    bits: list[NonNegativeInt] = Field(description="the mesh bits on this level, lowest first")


class MemoryPlan(_Part):
    """What the plan does beside its strategies to fit in device memory (searched where memory binds), or, for
    the parallel optimizer, to update faster (each rank its shard)."""

    parallel_optimizer: list[str] = Field(
        description="parameters whose gradient and optimizer state are split over the devices they are replicated on"
    )
    recompute: list[str] = Field(
        description="the first operator of each run of repeated blocks whose activations are recomputed"
    )
    micro_batches: PositiveInt = Field(
        description="the step runs this many micro-batches (shapes in the plan are one micro-batch's) and"
        " synchronises gradients once: gradient accumulation, or a pipeline's micro-batches"
    )


class StageEntry(_Part):
    """One pipeline stage: a contiguous range of operators on its own group of devices."""

    first_op: str
    last_op: str
    operators: PositiveInt
    first_device: NonNegativeInt = Field(
        description="the stage's devices are first_device .. first_device + devices - 1"
    )
    devices: PositiveInt
    micro_batches_in_flight: PositiveInt = Field(
        description="micro-batches whose activations the stage holds at once under 1F1B"
    )
    step_time_s: NonNegativeFloat = Field(description="the step were every stage as slow as this one")
    memory_per_device_bytes: NonNegativeInt


class SendEntry(_Part):
    """A tensor one stage sends another every micro-batch: each device receives its shard point to point."""

    tensor: str
    from_op: str
    to_op: str
    from_stage: NonNegativeInt
    to_stage: NonNegativeInt
    bytes: NonNegativeInt = Field(description="bytes each receiving device gets per micro-batch (forward)")
    gradient_bytes: NonNegativeInt = Field(
        description="bytes of the gradient each sending device gets back per micro-batch (0: no gradient flows)"
    )
    link: str = Field(description="the link between the two stages' devices")


class PipelineEntry(_Part):
    """The pipeline: stages over the slowest mesh bits, micro-batches and their schedule."""

    schedule: Literal["1F1B"]
    micro_batches: PositiveInt
    bits: list[NonNegativeInt] = Field(description="the mesh bits that spell a device's stage, lowest first")
    bubble_fraction: NonNegativeFloat = Field(description="(S - 1) / (M + S - 1): the share of a step stages idle")
    stages: list[StageEntry] = Field(min_length=2)
    sends: list[SendEntry]


class RepeatedBlock(_Part):
    """A run of structurally identical blocks the search solved once (`autopar.search.fold`)."""

    first_op: str = Field(description="the first operator of the first copy")
    operators: PositiveInt = Field(description="operators per copy")
    copies: PositiveInt


class UnfoldedRun(_Part):
    """A stretch of structurally identical blocks the search could not fold, and why."""

    first_op: str = Field(description="the first operator of the first copy")
    operators: PositiveInt = Field(description="operators per copy")
    copies: PositiveInt
    reason: str = Field(description="why the copies are searched one by one")


Asked = Literal["micro_batches", "recompute"]
"""A memory measure the options may ask for rather than leave to the search (`SearchSummary.asked`)."""


class SearchSummary(_OmitsUnset):
    """How the plan was found. Seconds are measured, so only they differ between two runs."""

    _omit: ClassVar[tuple[str, ...]] = (
        "phases_s",
        "layouts",
        "layout_pairs",
        "candidates_kept",
        "candidates_dropped",
        "unfolded_runs",
        "exact",
        "lower_bound_s",
        "gap",
        "steps_split",
        "runs_relaxed",
        "asked",
    )
    algorithm: str = Field(description="how the strategies were chosen: dp, ilp, data_parallel, stand_alone, given")
    time_s: NonNegativeFloat
    candidates: NonNegativeInt
    operators: NonNegativeInt
    memory_multiplier: NonNegativeFloat
    exact: Flag | None = Field(
        default=None,
        description="the search proved no plan of this pipeline shape that fits is faster (dp and ilp only)",
    )
    lower_bound_s: Number | None = Field(
        default=None, description="where not exact: no plan of this pipeline shape that fits steps faster"
    )
    gap: NonNegativeFloat | None = Field(
        default=None, description="where not exact: the plan's step over lower_bound_s, less one"
    )
    steps_split: NonNegativeInt | None = Field(
        default=None, description="elimination steps split into groups to stay within the table limits"
    )
    runs_relaxed: NonNegativeInt | None = Field(
        default=None,
        description="repeated runs searched relaxed, each copy reading the operators the copies share in its own"
        " best layout (a lower bound), where no exact search was within the table limits; summed over stages",
    )
    asked: list[Asked] | None = Field(
        default=None,
        description="the memory measures the options asked for, where the search did not choose them: the"
        " micro-batch count, recomputation (absent: none)",
    )
    phases_s: dict[str, NonNegativeFloat] | None = Field(
        default=None, description="measured seconds of import, costing, search and lowering"
    )
    layouts: NonNegativeInt | None = Field(default=None, description="distinct tensor layouts costed")
    layout_pairs: NonNegativeInt | None = Field(default=None, description="distinct redistributions costed")
    candidates_kept: NonNegativeInt | None = Field(
        default=None, description="candidates the exact search kept as states (one per distinct set of layouts)"
    )
    candidates_dropped: NonNegativeInt | None = Field(
        default=None,
        description="candidates dropped as exactly dominated (same layouts, never cheaper) or taken from a twin branch",
    )
    repeated_blocks: list[RepeatedBlock] = Field(default_factory=list)
    unfolded_runs: list[UnfoldedRun] | None = Field(
        default=None, description="stretches of identical blocks searched one by one, with the reason"
    )


class PlanContext(_Part):
    """What the plan was made for: verify and export refuse it for anything else."""

    model_fingerprint: str = Field(description="the graph's structure and parameter shapes (not weights), hashed")
    inputs: dict[str, list[NonNegativeInt]] = Field(description="the data inputs' shapes (the batch)")
    cost_model_fingerprint: str = Field(description="the hardware profile's numbers, hashed")


class PlanFile(_OmitsUnset):
    """A whole plan as ``autopar plan --format json`` writes it."""

    _omit: ClassVar[tuple[str, ...]] = ("pipeline", "frozen")
    model_config = ConfigDict(json_schema_extra={"title": "autopar plan", "$id": SCHEMA})
    schema_: Literal["autopar.plan/1", "autopar.plan/2", "autopar.plan/3"] = Field(alias="schema")
    model: str
    devices: PositiveInt
    mesh_bits: NonNegativeInt
    links: list[LinkUse] = Field(description="the mesh levels, fastest first (from the profile or a rank table)")
    cost_model: str
    precision: Precision
    optimizer: Optimizer | None = Field(
        default=None,
        description="the optimizer whose state each trainable parameter keeps: adam or sgd (absent in old files)",
    )
    mode: Literal["auto_parallel", "semi_auto_parallel", "data_parallel", "stand_alone", "given"] = Field(
        description="the parallel mode (`autopar.options.Mode`), or given: a plan of strategies chosen by hand"
    )
    objective_s: NonNegativeFloat
    ops: list[OpEntry] = Field(min_length=1)
    redistributions: list[Redistribution]
    gradients: list[GradientPath] = Field(
        default_factory=list, description="the backward pass's collectives: each consumer's gradient to its producer"
    )
    gradient_sync: list[GradientSync]
    frozen: list[str] | None = Field(
        default=None, description="the trainable parameters the plan was made not to train (absent: none)"
    )
    fallback_ops: list[str]
    totals: Totals
    memory_plan: MemoryPlan
    search: SearchSummary
    context: PlanContext | None = Field(default=None, description="what the plan was made for (absent in old files)")
    pipeline: PipelineEntry | None = Field(
        default=None, description="the pipeline stages (absent for a plan of one stage, and in version 1 files)"
    )

    @field_validator("ops")
    @classmethod
    def _each_operator_once(cls, ops: list[OpEntry]) -> list[OpEntry]:
        """One strategy an operator: a file listing one twice says two things about it."""
        seen: set[str] = set()
        for op in ops:
            if op.name in seen:
                raise ValueError(f"operator {op.name!r} is listed twice")
            seen.add(op.name)
        return ops

    @model_validator(mode="after")
    def _consistent(self) -> "PlanFile":
        """The file agrees with itself: its devices spell its mesh bits, its links and layouts use those bits,
        and no strategy splits an input more ways than there are devices."""
        problem = _mesh_problem(self) or _bits_problem(self) or _split_problem(self)
        if problem is not None:
            raise ValueError(problem)
        return self

    def dump(self) -> dict[str, Any]:
        """The JSON-safe dict (enums as their strings)."""
        return self.model_dump(by_alias=True, mode="json")

    @property
    def strategies(self) -> dict[str, tuple[tuple[int, ...], ...]]:
        return {op.name: tuple(tuple(s) for s in op.strategy) for op in self.ops}

    def without_forks(self) -> "PlanFile":
        """The plan as the model's file has it, for an exporter: no forks (`autopar.ops.fork`), each
        reader of a fork reading the forked tensor in the layout it reads. A framework inserts its own
        redistributions and sums its own gradients; the readers' strategies say all it needs."""
        forks = {op.outputs[0].tensor: op.inputs[0].tensor for op in self.ops if op.domain and op.outputs}
        if not forks:
            return self
        named = {op.name for op in self.ops if op.domain}

        def renamed(entries: list[TensorLayout]) -> list[TensorLayout]:
            return [e.model_copy(update={"tensor": forks.get(e.tensor, e.tensor)}) for e in entries]

        ops = [op.model_copy(update={"inputs": renamed(op.inputs)}) for op in self.ops if op.name not in named]
        return self.model_copy(
            update={
                "ops": ops,
                "redistributions": [r for r in self.redistributions if not {r.producer, r.consumer} & named],
                "gradients": [g for g in self.gradients if not {g.producer, g.consumer} & named],
            }
        )

    @property
    def stage_of(self) -> dict[str, int]:
        """Each operator's pipeline stage, in graph order (0 for all without stages): a stage runs from its
        first operator up to the next stage's."""
        starts = {stage.first_op: index for index, stage in enumerate(self.pipeline.stages)} if self.pipeline else {}
        found, stage = {}, 0
        for op in self.ops:
            stage = starts.get(op.name, stage)
            found[op.name] = stage
        return found

    @property
    def mesh(self) -> Mesh:
        """The mesh the plan was made for, as its file lists it (link names and bits, no speeds; the file's
        devices, bits and links agree, checked as it was read: `_mesh_problem`)."""
        return Mesh.named(self.devices, ((link.name, link.bits) for link in self.links), self.cost_model)


def _mesh_problem(plan: PlanFile) -> str | None:
    if not is_power_of_two(plan.devices) or plan.devices > MAX_DEVICES:
        return f"devices is {plan.devices}, not a power of two up to {MAX_DEVICES}"
    if plan.mesh_bits != mesh_bits_for(plan.devices):
        return f"devices is {plan.devices} but mesh_bits is {plan.mesh_bits} (devices must be 2 ** mesh_bits)"
    try:
        Mesh.named(plan.devices, ((link.name, link.bits) for link in plan.links), plan.cost_model)
    except AutoparError as exc:
        return f"links: {str(exc)[:1].lower()}{str(exc)[1:].rstrip('.')}"
    return None


def _bits_used(plan: PlanFile) -> Iterator[tuple[str, list[int]]]:
    """Every list of mesh bits in the plan, with what uses it."""
    for op in plan.ops:
        for kind, entries in (("input", op.inputs), ("output", op.outputs)):
            for entry in entries:
                yield f"the layout of {kind} {entry.tensor!r} of operator {op.name!r}", entry.layout.bits
    for move in plan.redistributions:
        where = f"the redistribution of {move.tensor!r} from {move.producer!r} to {move.consumer!r}"
        yield where, move.from_.bits + move.to.bits + [bit for step in move.steps for bit in step.bits]
    for path in plan.gradients:
        where = f"the gradient of {path.tensor!r} from {path.consumer!r} to {path.producer!r}"
        yield where, path.from_.bits + path.to.bits + [bit for step in path.steps for bit in step.bits]
    for sync in plan.gradient_sync:
        yield f"the gradient sync of {sync.parameter!r}", sync.layout.bits + sync.bits
    if plan.pipeline is not None:
        yield "the pipeline", plan.pipeline.bits


def _bits_problem(plan: PlanFile) -> str | None:
    for where, bits in _bits_used(plan):
        outside = next((bit for bit in bits if bit >= plan.mesh_bits), None)
        if outside is not None:
            devices = f"{plan.devices} devices have" if plan.devices > 1 else "1 device has"
            return f"{where} uses mesh bit {outside}, but the plan's {devices} {_bit_range(plan.mesh_bits)}"
    return None


def _bit_range(mesh_bits: int) -> str:
    return {0: "no mesh bits", 1: "mesh bit 0"}.get(mesh_bits, f"mesh bits 0 to {mesh_bits - 1}")


def _split_problem(plan: PlanFile) -> str | None:
    for op in plan.ops:
        for position, splits in enumerate(op.strategy):
            if math.prod(splits) > plan.devices:
                return (
                    f"operator {op.name!r} splits input {position} {math.prod(splits)} ways ({splits}), more than"
                    f" the plan's {plan.devices} devices"
                )
    return None


PLAN_FILE_FIELDS = tuple(field.alias or name for name, field in PlanFile.model_fields.items())


def read_plan_file(data: Any, origin: str = "the plan") -> PlanFile:
    """A validated `PlanFile` from parsed JSON; PlanFileError naming the first bad field."""
    label = f"Plan file {origin!r}" if origin != "the plan" else "The plan"
    if not isinstance(data, dict):
        raise PlanFileError(f"{label} is not an autopar plan (a JSON object is expected, got {type(data).__name__}).")
    schema = data.get("schema")
    if schema is not None and schema not in READABLE_SCHEMAS:
        raise PlanFileError(
            f"{label} has unknown schema {schema!r}; this autopar reads {', '.join(repr(s) for s in READABLE_SCHEMAS)}."
        )
    try:
        return PlanFile.model_validate(data)
    except ValidationError as exc:
        raise PlanFileError(f"{label} is not a valid autopar plan: {_problem(exc, data)}.") from None
    except RecursionError:
        raise PlanFileError(f"{label} is nested too deeply to be an autopar plan.") from None


def _problem(exc: ValidationError, data: dict[str, Any]) -> str:
    """`first_problem`, saying which operator a field under ``ops`` belongs to and what a value of the wrong
    type was; a problem of the whole file (its parts disagree) is said without a place."""
    error = exc.errors()[0]
    text = first_problem(exc)
    loc = error["loc"]
    if not loc:
        return text.removeprefix("the top level: ")
    if error["type"] != "value_error" and isinstance(error.get("input"), str | int | float | bool):
        text = f"{text} (got {shown(error['input'])})"
    ops = data.get("ops")
    if len(loc) > 1 and loc[0] == "ops" and isinstance(loc[1], int) and isinstance(ops, list) and loc[1] < len(ops):
        name = ops[loc[1]].get("name") if isinstance(ops[loc[1]], dict) else None
        if isinstance(name, str):
            where = ".".join(str(part) for part in loc)
            text = text.replace(where, f"{where} (operator {shown(name)})", 1)
    return text


def load_plan_file(path: str | Path) -> PlanFile:
    """Read and validate a plan JSON file; PlanFileError (one sentence) on anything wrong."""
    where = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PlanFileError(f"Plan file {where!r} does not exist.") from None
    except IsADirectoryError:
        raise PlanFileError(f"Plan file {where!r} is a directory.") from None
    except UnicodeDecodeError:
        raise PlanFileError(f"Plan file {where!r} is not JSON (write one with 'autopar plan --format json').") from None
    except OSError as exc:
        raise PlanFileError(f"Plan file {where!r} cannot be read: {exc.strerror}.") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        raise PlanFileError(f"Plan file {where!r} is not JSON (write one with 'autopar plan --format json').") from None
    except RecursionError:
        raise PlanFileError(f"Plan file {where!r} is nested too deeply to be an autopar plan.") from None
    return read_plan_file(data, where)


def json_schema() -> dict[str, Any]:
    """The plan file's JSON Schema."""
    return PlanFile.model_json_schema(by_alias=True)
