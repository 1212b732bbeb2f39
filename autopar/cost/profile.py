"""Hardware profiles: a device and its interconnect, every number with its source.

Profiles live in `costmodels/*.toml` (bundled) or any TOML file; each number is a
``{value, source}`` pair, and the source says "assumed" or "fitted" where it is not published.
A plain number (``peak_flops_fp16 = 312e12``) is accepted with an `UnsourcedNumberWarning`
naming it; anything else malformed is a `CostModelError` in one sentence (see README,
"Hardware profiles").
"""

from __future__ import annotations

import tomllib
import warnings
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from autopar.errors import AutoparWarning, CostModelError, UnknownProfileError


class UnsourcedNumberWarning(AutoparWarning):
    """A profile gives a number without saying where it comes from (it is used as given)."""


OptimizerName = Literal["adam", "sgd"]


class Sourced(BaseModel):
    """A hardware number and where it comes from: a finite positive value and its source.

    ``source`` is None for a number given plain (``hbm_bandwidth = 2.0e12``); the profile warns.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    value: float = Field(gt=0, allow_inf_nan=False, strict=True)
    source: str | None = Field(default=None, min_length=3)

    @model_validator(mode="before")
    @classmethod
    def _plain_number(cls, data: Any) -> Any:
        if isinstance(data, (int, float)) and not isinstance(data, bool):
            return {"value": data}
        return data


class SourcedAmount(Sourced):
    """A sourced number that may be zero (a memory reserve: none at all is a valid choice)."""

    value: float = Field(ge=0, allow_inf_nan=False, strict=True)


class SourcedChoice(BaseModel):
    """A named choice and why it is the profile's: the default optimizer (``{ value = "sgd", source = ... }``).

    A plain name (``optimizer = "sgd"``) is accepted with the same warning as a plain number.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    value: OptimizerName
    source: str | None = Field(default=None, min_length=3)

    @model_validator(mode="before")
    @classmethod
    def _plain_name(cls, data: Any) -> Any:
        return {"value": data} if isinstance(data, str) else data


class Falloff(BaseModel):
    """How a matmul's efficiency falls as the smallest of its per-device M, N and K shrinks.

    ``smallest_dim`` (strictly increasing) and ``factor`` (the share of the large-matmul efficiency
    reached at that size, non-decreasing, in (0, 1]) are read as a table: between two sizes the factor
    is interpolated on log2 of the size, outside them it is the nearest end's.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    smallest_dim: tuple[int, ...] = Field(min_length=1)
    factor: tuple[float, ...] = Field(min_length=1)
    source: str | None = Field(default=None, min_length=3)

    @model_validator(mode="after")
    def _a_table(self) -> Falloff:
        if len(self.smallest_dim) != len(self.factor):
            raise ValueError(
                f"gives {len(self.smallest_dim)} sizes but {len(self.factor)} factors; give one factor per size"
            )
        if any(size < 1 for size in self.smallest_dim) or any(
            a >= b for a, b in zip(self.smallest_dim, self.smallest_dim[1:])
        ):
            raise ValueError(f"smallest_dim must be whole sizes from 1 up, increasing, got {list(self.smallest_dim)}")
        if any(not 0 < f <= 1 for f in self.factor) or any(a > b for a, b in zip(self.factor, self.factor[1:])):
            raise ValueError(
                f"factor must not fall as the size grows, each above 0 and at most 1, got {list(self.factor)}"
            )
        return self


# Ranges (ours, not a vendor's): a number outside its range is a typo or a unit slip, and would
# give absurd or non-finite times (a 1e308-byte fusion bucket or memory reserve overflows a plan's
# figures to infinity). Efficiencies are fractions of a peak; a rate below one per second
# (a bandwidth of 1e-300 B/s) is a slip. Each range is wide enough for any device of the next
# decades. The lower bound is open, the upper one closed.
PLAUSIBLE: dict[str, tuple[float, float]] = {
    "peak_flops_fp16": (1.0, 1e21),
    "peak_flops_fp32": (1.0, 1e21),
    "peak_flops_fp8": (1.0, 1e21),
    "hbm_bandwidth": (1.0, 1e18),
    "hbm_capacity": (0.0, 1e18),
    "cube_efficiency": (0.0, 1.0),
    "matmul_efficiency": (0.0, 1.0),
    "memory_reserve": (0.0, 1e18),
    "memory_efficiency": (0.0, 1.0),
    "attention_efficiency": (0.0, 1.0),
    "vector_flops_fraction": (0.0, 1.0),
    "backward_compute_factor": (0.0, 100.0),
    "gradient_fusion_bytes": (0.0, 1e18),
    "bandwidth": (1.0, 1e18),
    "latency": (0.0, 60.0),
}


class _Spec(BaseModel):
    """Checks every `Sourced` field against its `PLAUSIBLE` range (lower bound open, upper closed)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @field_validator("*")
    @classmethod
    def _plausible(cls, number: Any, info: ValidationInfo) -> Any:
        if isinstance(number, Sourced) and info.field_name in PLAUSIBLE:
            low, high = PLAUSIBLE[info.field_name]
            if isinstance(number, SourcedAmount) and number.value == low:
                return number  # zero allowed
            if not low < number.value <= high:
                if isinstance(number, SourcedAmount):
                    raise ValueError(f"must be from {low:g} to {high:g}, got {number.value:g}")
                raise ValueError(f"must be above {low:g} and at most {high:g}, got {number.value:g}")
        return number


class ComputeSpec(_Spec):
    peak_flops_fp16: Sourced
    peak_flops_fp32: Sourced
    hbm_bandwidth: Sourced
    hbm_capacity: Sourced
    memory_reserve: SourcedAmount
    cube_efficiency: Sourced
    matmul_efficiency: Sourced
    matmul_falloff: Falloff
    memory_efficiency: Sourced
    vector_flops_fraction: Sourced
    attention_efficiency: Sourced | None = None  # the fused attention kernel's share of peak; None: it has none
    peak_flops_fp8: Sourced | None = None  # dense FP8 matrix-unit peak (`--precision fp8`); None: no FP8 units

    @model_validator(mode="after")
    def _reserve_below_capacity(self) -> ComputeSpec:
        if self.memory_reserve.value >= self.hbm_capacity.value:
            raise ValueError(
                f"memory_reserve ({self.memory_reserve.value:g} B) must be below hbm_capacity"
                f" ({self.hbm_capacity.value:g} B)"
            )
        return self


# Numbers the optimizer choice (`autopar.cost.model.OPTIMIZER_STATE_BYTES`) replaced: a profile that
# still gives them is told what to write instead.
RETIRED_TRAINING_FIELDS = ("optimizer_state_bytes_per_param", "master_weight_bytes_per_param")


class TrainingSpec(_Spec):
    backward_compute_factor: Sourced
    optimizer: SourcedChoice
    gradient_fusion_bytes: Sourced

    @model_validator(mode="before")
    @classmethod
    def _retired(cls, data: Any) -> Any:
        if isinstance(data, dict):
            retired = [name for name in RETIRED_TRAINING_FIELDS if name in data]
            if retired:
                raise ValueError(
                    f"gives {_and(retired)}, which the optimizer now sets (--optimizer adam|sgd); write"
                    ' optimizer = { value = "sgd" or "adam", source = "..." } for the profile\'s default instead'
                )
        return data


MIN_MESH_BITS = 30


class LinkLevel(_Spec):
    name: str = Field(min_length=1)
    bits: int = Field(ge=1, le=64, strict=True)
    bandwidth: Sourced
    latency: Sourced


class HardwareProfile(BaseModel):
    """A device and its interconnect, validated; see costmodels/ascend910.toml."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = Field(min_length=1)
    description: str = ""
    compute: ComputeSpec
    training: TrainingSpec
    links: tuple[LinkLevel, ...] = Field(min_length=1)

    @field_validator("links")
    @classmethod
    def _links_cover_mesh(cls, links: tuple[LinkLevel, ...]) -> tuple[LinkLevel, ...]:
        bits = sum(level.bits for level in links)
        if bits < MIN_MESH_BITS:
            raise ValueError(
                f"cover {bits} mesh bits; they must cover at least {MIN_MESH_BITS}"
                f" (give the last level the rest, e.g. bits = {64 - bits + links[-1].bits})"
            )
        return links

    @model_validator(mode="after")
    def _warn_unsourced(self) -> HardwareProfile:
        missing = self.unsourced()
        if missing:
            verb = "has" if len(missing) == 1 else "have"
            warnings.warn(
                f"Hardware profile {self.name!r}: {_and(missing)} {verb} no source"
                ' (write { value = ..., source = "where it comes from" }).',
                UnsourcedNumberWarning,
                stacklevel=2,
            )
        return self

    def unsourced(self) -> list[str]:
        """Dotted names of the numbers given without a source (``compute.peak_flops_fp16``)."""
        named: list[tuple[str, BaseModel]] = [("compute", self.compute), ("training", self.training)]
        named += [(f"links[{i}]", level) for i, level in enumerate(self.links)]
        return [
            f"{prefix}.{field}"
            for prefix, spec in named
            for field in type(spec).model_fields
            if isinstance(number := getattr(spec, field), (Sourced, SourcedChoice, Falloff)) and number.source is None
        ]

    def level_of_bit(self, bit: int) -> LinkLevel:
        first = 0
        for level in self.links:
            if bit < first + level.bits:
                return level
            first += level.bits
        return self.links[-1]


def _and(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def profiles_dir() -> Path:
    """The folder of the bundled profiles (costmodels/)."""
    import costmodels

    return Path(costmodels.__file__).parent


def available_profiles() -> list[str]:
    return sorted(p.stem for p in profiles_dir().glob("*.toml"))


def profile_path(name_or_path: str | Path) -> Path:
    """The file of a bundled profile (``a100``, any case) or of a TOML path; a sentence if there is none."""
    path = Path(name_or_path)
    if not path.suffix:
        bundled = {name.lower(): name for name in available_profiles()}
        candidate = profiles_dir() / f"{bundled.get(str(name_or_path).lower(), name_or_path)}.toml"
        if path.is_dir() and str(name_or_path).lower() not in bundled:
            raise _a_directory(path)
        if not candidate.is_file():
            raise UnknownProfileError(
                f"Unknown cost model {str(name_or_path)!r}; bundled: {', '.join(available_profiles())},"
                " or give a .toml path."
            )
        return candidate
    if path.is_dir():
        raise _a_directory(path)
    if not path.is_file():
        raise CostModelError(f"Cost model file {str(path)!r} does not exist.")
    return path


def _a_directory(path: Path) -> CostModelError:
    return CostModelError(f"Cost model {str(path)!r} is a directory; give a bundled profile's name or a .toml file.")


def load_profile(name_or_path: str | Path) -> HardwareProfile:
    """A bundled profile by name (``ascend910``) or a TOML file by path."""
    path = profile_path(name_or_path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise CostModelError(f"Cost model file {str(path)!r} is not valid TOML: {exc}.") from None
    try:
        return HardwareProfile.model_validate(data)
    except ValidationError as exc:
        raise CostModelError(f"Cost model {str(path)!r}: {profile_problem(exc)}.") from None


_SECTIONS: dict[str, type[BaseModel]] = {"compute": ComputeSpec, "training": TrainingSpec, "links": LinkLevel}
_NUMBER_TYPES = {"float_type", "float_parsing", "model_type", "model_attributes_type", "dict_type"}


def profile_problem(exc: ValidationError) -> str:
    """The first thing wrong with a profile, as a plain clause (``compute.hbm_bandwidth is missing``)."""
    error = exc.errors()[0]
    kind, given, context = error["type"], error.get("input"), error.get("ctx") or {}
    loc = list(error["loc"])
    if loc[-1:] == ["value"] and kind != "missing":
        loc.pop()  # a number's value: name the number
    where = _where(loc)
    field = str(loc[-1]) if loc else ""
    if kind == "missing":
        return f"{where} is missing"
    if kind == "extra_forbidden":
        return f"{where} is not a profile field; {_takes(loc[:-1])}"
    if kind == "finite_number":
        return f"{where} must be a finite number, got {given!r}"
    if field == "links" and kind == "too_short":
        return "links must list at least one level ([[links]] with name, bits, bandwidth and latency)"
    if field == "bits" and kind in ("greater_than_equal", "less_than_equal", "int_type", "int_parsing"):
        return f"{where} must be a whole number from 1 to 64, got {given!r}"
    if field == "source":
        return f"{where} must say where the number comes from, got {given!r}"
    if kind in _NUMBER_TYPES and field in ("compute", "training"):
        return f"{where} must be a table ([{field}] followed by its numbers), got {given!r}"
    if kind in _NUMBER_TYPES and field == "optimizer":
        return f'{where} must be adam or sgd, or {{ value = "adam", source = "..." }}, got {given!r}'
    if kind in _NUMBER_TYPES and field == "matmul_falloff":
        return (
            f'{where} must be a table {{ smallest_dim = [32, ...], factor = [0.12, ...], source = "..." }},'
            f" got {given!r}"
        )
    if kind in _NUMBER_TYPES and isinstance(loc[-1], int):
        return f"{where} must be a table ([[links]] with name, bits, bandwidth and latency), got {given!r}"
    if kind in _NUMBER_TYPES:
        return f'{where} must be a number or {{ value = <number>, source = "..." }}, got {given!r}'
    if kind == "tuple_type" and field == "links":
        return f"{where} must be a list of levels ([[links]] tables), got {given!r}"
    if kind == "tuple_type":
        return f"{where} must be a list, got {given!r}"
    if kind == "literal_error":
        return f"{where} must be {context.get('expected', 'one of the names given')}, got {given!r}"
    if kind == "greater_than":
        return f"{where} must be above {context.get('gt', 0):g}, got {given!r}"
    if kind == "string_type":
        return f"{where} must be text, got {given!r}"
    if kind == "string_too_short":
        return f"{where} must not be empty"
    message = str(error["msg"]).removeprefix("Value error, ").rstrip(".")
    return f"{where} {message[:1].lower()}{message[1:]}" if loc else message


def _where(loc: list[int | str]) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else f".{part}" if text else str(part)
    return text or "the profile"


def _takes(loc: list[int | str]) -> str:
    """What a section accepts, for an unknown key in it."""
    names = [str(part) for part in loc if isinstance(part, str)]
    if not names:
        fields = HardwareProfile.model_fields
        return f"a profile has {', '.join(fields)}"
    if names[-1] in _SECTIONS:
        return f"{_where(loc)} takes {', '.join(_SECTIONS[names[-1]].model_fields)}"
    return "a number takes value and source"
