"""What a plan is asked for, as one frozen, validated value (Alpa's ``AutoShardingOption``).

The API's functions take these as keyword arguments (``autopar.plan(model, devices=8,
mode="data_parallel")``) and the CLI as flags; both build one `PlanOptions` and pass it on, so
the checks, the default device count and the rank-table reading happen in one place. The kinds
a user picks by name are str-valued enums: ``mode="data_parallel"`` and ``Mode.DATA_PARALLEL``
are the same value, and a bad name is one sentence (`AutoparError`), never a traceback.

>>> PlanOptions.resolve(mode="data_parallel").mode is Mode.DATA_PARALLEL
True
>>> PlanOptions.resolve(precision="fp16")
Traceback (most recent call last):
...
autopar.errors.AutoparError: Unknown precision 'fp16'; choose one of: mixed, fp32, fp8.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from os import PathLike
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal, TypeVar

from autopar.cost import CostModel, HardwareProfile, load_profile
from autopar.cost.rank_table import Cluster, read_rank_table
from autopar.errors import AutoparError, MemoryReserveError
from autopar.layout import is_power_of_two
from autopar.limits import MAX_DEVICES, MAX_MICRO_BATCHES
from autopar.units import parse_bytes

DEFAULT_DEVICES = 8
"""Devices when neither a count nor a rank table is given: one Ascend 910 server."""

DEFAULT_COST_MODEL = "ascend910"

RankTable = str | Path | Mapping[str, Any]
CostModelLike = str | Path | HardwareProfile


class Mode(enum.StrEnum):
    """MindSpore's parallel modes: search everything, search around fixed operators, or fix every strategy."""

    AUTO_PARALLEL = "auto_parallel"
    SEMI_AUTO_PARALLEL = "semi_auto_parallel"
    DATA_PARALLEL = "data_parallel"
    STAND_ALONE = "stand_alone"

    @property
    def searched(self) -> bool:
        """The search chooses strategies (the other modes fix every one)."""
        return self in (Mode.AUTO_PARALLEL, Mode.SEMI_AUTO_PARALLEL)


class Precision(enum.StrEnum):
    """Mixed precision (FP16 compute, FP32 master weights), FP32 throughout, or FP8 matrix products in mixed
    precision (`autopar.cost.CostModel`)."""

    MIXED = "mixed"
    FP32 = "fp32"
    FP8 = "fp8"

    @property
    def element_sizes(self) -> Precision:
        """The precision whose element sizes this one's collectives and tensors have (FP8's are mixed
        precision's: its FP8 casts live inside the products), so that a plan file's runtime needs no FP8 units.

        >>> Precision.FP8.element_sizes
        <Precision.MIXED: 'mixed'>
        """
        return Precision.MIXED if self is Precision.FP8 else self


class Optimizer(enum.StrEnum):
    """The optimizer whose state every trainable parameter keeps (`autopar.cost.model.OPTIMIZER_STATE_BYTES`):
    Adam (two FP32 moments; 16 B a parameter in mixed precision) or SGD with momentum (one; 12 B)."""

    ADAM = "adam"
    SGD = "sgd"


class SearchAlgorithm(enum.StrEnum):
    """The exact elimination DP, or the ILP that cross-checks it (needs ``autopar[ilp]``)."""

    DP = "dp"
    ILP = "ilp"


class Runtime(enum.StrEnum):
    """Where verification runs: every rank in this process, or one torch.distributed process per rank."""

    VIRTUAL = "virtual"
    TORCH = "torch"


E = TypeVar("E", bound=enum.StrEnum)


def choose(kind: type[E], value: object, what: str) -> E:
    """``value`` as a member of ``kind``; AutoparError "Unknown <what> 'x'; choose one of: ..." otherwise."""
    if isinstance(value, kind):
        return value
    try:
        return kind(value)  # type: ignore[arg-type]  # any value: a bad one is the sentence below
    except ValueError:
        names = ", ".join(member.value for member in kind)
        raise AutoparError(f"Unknown {what} {value!r}; choose one of: {names}.") from None


def runtime_of(value: object) -> Runtime:
    """The verify runtime by name; one sentence when it is neither."""
    if isinstance(value, Runtime):
        return value
    try:
        return Runtime(value)  # type: ignore[arg-type]  # any value: a bad one is the sentence below
    except ValueError:
        raise AutoparError(f"The runtime must be 'virtual' or 'torch', got {value!r}.") from None


def shown(value: object) -> str:
    """A value as a sentence names it: its repr when short, else its type (a model's bytes, a long list)."""
    text = repr(value)
    return text if len(text) <= 60 else f"a {type(value).__name__} object"


def expect(value: Any, kinds: type | tuple[type, ...], what: str) -> Any:
    """``value`` when it is one of ``kinds`` (a bool is not an int); else one sentence, "<what>, got <value>."
    (``what`` names the argument and what it takes: "overlap must be True or False").

    >>> expect(3, str, "cost_model must be a profile's name")
    Traceback (most recent call last):
    ...
    autopar.errors.AutoparError: cost_model must be a profile's name, got 3.
    """
    wanted = kinds if isinstance(kinds, tuple) else (kinds,)
    if isinstance(value, wanted) and not (isinstance(value, bool) and bool not in wanted):
        return value
    raise AutoparError(f"{what}, got {shown(value)}.")


def names_of(value: object, what: str) -> tuple[str, ...]:
    """One name or several (any iterable of str but a mapping) as a tuple; one sentence otherwise."""
    if isinstance(value, str):
        return (value,)
    if isinstance(value, Iterable) and not isinstance(value, Mapping | bytes):
        names = tuple(value)
        if all(isinstance(name, str) for name in names):
            return names
    raise AutoparError(f"{what} must be a name or a list of names, got {shown(value)}.")


def mapping_of(value: object, what: str, shape: str, *, none: bool = False) -> Mapping[str, Any]:
    """A mapping keyed by names (None, where ``none`` allows it: an empty one); one sentence, "<what> must be
    a mapping <shape>", otherwise."""
    if value is None and none:
        return {}
    if isinstance(value, Mapping) and all(isinstance(key, str) for key in value):
        return value
    raise AutoparError(f"{what} must be a mapping {shape}, got {shown(value)}.")


COST_MODEL_TYPES = (str, PathLike, HardwareProfile)
COST_MODEL_SAID = "cost_model must be a bundled profile's name, a .toml file's path or a HardwareProfile"


def check_devices(devices: object) -> int:
    """A device count the search takes: a power of two up to `MAX_DEVICES` (one sentence otherwise)."""
    if isinstance(devices, bool) or not isinstance(devices, int) or not is_power_of_two(devices):
        raise AutoparError(f"The device count must be a power of two (1, 2, 4, 8, ...), got {devices!r}.")
    if devices > MAX_DEVICES:
        raise AutoparError(f"The device count {devices:,} is too large (at most {MAX_DEVICES:,}).")
    return devices


def memory_reserve_of(value: object) -> float | None:
    """A memory reserve in bytes: a number, or a size with its unit (``"4GB"``, ``"512MiB"``); None keeps
    the profile's. One sentence (`MemoryReserveError`) when it is neither."""
    if value is None:
        return None
    if isinstance(value, str):
        parsed = parse_bytes(value)
        if parsed is not None:
            return parsed
    elif not isinstance(value, bool) and isinstance(value, (int, float)) and 0 <= value < math.inf:
        return float(value)
    raise MemoryReserveError(
        f"The memory reserve must be a size such as 4GB, 512MiB or 0 (bytes from 0 up), got {value!r}."
    )


def _micro_batches(value: object) -> int | None:
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_MICRO_BATCHES
    ):
        raise AutoparError(f"micro_batches must be an integer from 1 to {MAX_MICRO_BATCHES}, got {value!r}.")
    return value


def _pipeline_stages(value: object, devices: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or value & (value - 1):
        raise AutoparError(f"The pipeline stage count must be a power of two (1, 2, 4, ...), got {value!r}.")
    if isinstance(devices, int) and value > devices:
        raise AutoparError(f"{value} pipeline stages cannot run on {devices} devices: each stage needs one.")
    return value


def _stages_of(starts: tuple[str, ...], asked: int | None, devices: int) -> int | None:
    """The stage count the stage starts make (None: no starts, ``asked``), in the words of starts and stages."""
    if not starts:
        return asked
    repeated = next((name for name in starts if starts.count(name) > 1), None)
    if repeated is not None:
        raise AutoparError(f"The stage start {repeated!r} is named twice; each stage starts at its own operator.")
    stages = len(starts) + 1
    said = "1 stage start makes" if len(starts) == 1 else f"{len(starts)} stage starts make"
    made = f"{said} {stages} pipeline stages"
    if asked not in (None, stages):
        raise AutoparError(f"{made}, not the {asked} asked for.")
    if stages & (stages - 1):
        raise AutoparError(f"{made}; the stage count must be a power of two (1, 2, 4, ...).")
    if stages > devices:
        raise AutoparError(f"{made}, more than the {devices} devices: each stage needs one.")
    return stages


@dataclass(frozen=True)
class PlanOptions:
    """Everything a plan is asked for besides the model, checked once.

    ``cost_model`` is a bundled profile's name, a .toml file or a `HardwareProfile`; with a rank
    table it is the profile with its links re-derived for the table's servers (``cluster``).
    ``fixed`` maps operator names to the in_strategy each keeps (checked against the model later).
    ``optimizer`` and ``memory_reserve`` (bytes, or a size such as ``"4GB"``) are the profile's when None.
    ``pipeline_stages`` (a power of two) and ``micro_batches`` are searched when None; ``stage_starts``
    names the first operator of every stage after the first (it fixes the cuts, and the stage count).
    ``recompute`` True makes every plan recompute its repeated blocks' forward in the backward (Megatron's
    activation recomputation); None recomputes only where memory binds.
    """

    num_devices: int = DEFAULT_DEVICES
    cost_model: CostModelLike = DEFAULT_COST_MODEL
    batch: int | None = None
    dims: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    precision: Precision = Precision.MIXED
    mode: Mode = Mode.AUTO_PARALLEL
    search: SearchAlgorithm = SearchAlgorithm.DP
    frozen: tuple[str, ...] = ()
    trainable: tuple[str, ...] = ()
    overlap: bool = True
    micro_batches: int | None = None
    fixed: Mapping[str, Sequence[Sequence[int]]] | None = None
    optimizer: Optimizer | None = None
    memory_reserve: float | None = None
    pipeline_stages: int | None = None
    stage_starts: tuple[str, ...] = ()
    recompute: bool | None = None
    cluster: Cluster | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # a frozen value canonicalises its own fields once, here
        set_(self, "mode", choose(Mode, self.mode, "mode"))
        fixed = mapping_of(self.fixed, "fixed", "{operator: in_strategy}", none=True)
        if fixed and not self.mode.searched:
            raise AutoparError(
                f"Fixed strategies need a searched mode (semi_auto_parallel or auto_parallel), not {self.mode}."
            )
        set_(self, "search", choose(SearchAlgorithm, self.search, "search algorithm"))
        _micro_batches(self.micro_batches)
        check_devices(self.num_devices)
        expect(self.cost_model, COST_MODEL_TYPES, COST_MODEL_SAID)
        set_(self, "precision", choose(Precision, self.precision, "precision"))
        if self.optimizer is not None:
            set_(self, "optimizer", choose(Optimizer, self.optimizer, "optimizer"))
        set_(self, "memory_reserve", memory_reserve_of(self.memory_reserve))
        set_(self, "dims", MappingProxyType(dict(mapping_of(self.dims, "dims", "{dimension name: size}", none=True))))
        set_(self, "frozen", names_of(self.frozen, "frozen"))
        set_(self, "trainable", names_of(self.trainable, "trainable"))
        set_(self, "overlap", expect(self.overlap, bool, "overlap must be True or False"))
        expect(self.recompute, (bool, type(None)), "recompute must be True, False or None")
        set_(self, "fixed", MappingProxyType(dict(fixed)) if fixed else None)
        _pipeline_stages(self.pipeline_stages, self.num_devices)
        set_(self, "stage_starts", names_of(self.stage_starts, "stage_starts"))
        set_(self, "pipeline_stages", _stages_of(self.stage_starts, self.pipeline_stages, self.num_devices))
        if (self.pipeline_stages or 1) > 1 and not self.mode.searched:
            raise AutoparError(
                f"Pipeline stages need a searched mode (semi_auto_parallel or auto_parallel), not {self.mode}."
            )

    @classmethod
    def resolve(
        cls,
        devices: int | None = None,
        cost_model: CostModelLike = DEFAULT_COST_MODEL,
        rank_table: RankTable | None = None,
        *,
        devices_said_as: str = "devices=",
        **rest: Any,
    ) -> PlanOptions:
        """The options as given: ``devices`` (8 by default), or a rank table's count and servers.

        With ``rank_table`` (MindSpore's rank_table.json: a path or its parsed JSON) the device count
        is the table's (``devices``, when given, must agree; a disagreement names it ``devices_said_as``)
        and the cost model's links are re-derived for its servers. ``rest``: the other fields.
        """
        # the choices first, as the API always checked them, then the cluster
        for name, kind, what in (("mode", Mode, "mode"), ("search", SearchAlgorithm, "search algorithm")):
            if name in rest:
                rest[name] = choose(kind, rest[name], what)
        fixed = mapping_of(rest.get("fixed"), "fixed", "{operator: in_strategy}", none=True)
        if fixed and not rest.get("mode", Mode.AUTO_PARALLEL).searched:
            raise AutoparError(
                f"Fixed strategies need a searched mode (semi_auto_parallel or auto_parallel), not {rest['mode']}."
            )
        _micro_batches(rest.get("micro_batches"))
        _pipeline_stages(rest.get("pipeline_stages"), devices)
        expect(cost_model, COST_MODEL_TYPES, COST_MODEL_SAID)
        if rank_table is None:
            return cls(DEFAULT_DEVICES if devices is None else devices, cost_model, **rest)
        expect(rank_table, (str, PathLike, Mapping), "rank_table must be a rank_table.json path or its parsed JSON")
        profile = cost_model if isinstance(cost_model, HardwareProfile) else load_profile(cost_model)
        cluster = read_rank_table(rank_table, profile)
        return cls(cluster.devices_for(devices, devices_said_as), cluster.profile, cluster=cluster, **rest)

    def profile(self) -> HardwareProfile:
        """The hardware profile (a bundled name or a file loaded; errors as one sentence)."""
        return self.cost_model if isinstance(self.cost_model, HardwareProfile) else load_profile(self.cost_model)

    def costs(self) -> CostModel:
        """The cost model these options ask for."""
        precision: Literal["mixed", "fp32", "fp8"] = self.precision.value
        optimizer: Literal["adam", "sgd"] | None = None if self.optimizer is None else self.optimizer.value
        return CostModel(
            self.profile(), precision, overlap=self.overlap, optimizer=optimizer, memory_reserve=self.memory_reserve
        )

    def replace(self, **changes: Any) -> PlanOptions:
        """A copy with some fields changed (checked again)."""
        values = {name: getattr(self, name) for name in self.__dataclass_fields__}
        values.update(changes)
        return PlanOptions(**values)
