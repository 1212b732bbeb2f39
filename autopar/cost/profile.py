"""Hardware profiles: a device and its interconnect, every number with its source.

Profiles live in `costmodels/*.toml` (bundled) or any TOML file; each number is a
``{value, source}`` pair, and the source says "assumed" or "fitted" where it is not published.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from autopar.errors import CostModelError, first_problem


class Sourced(BaseModel):
    """A hardware number and where it comes from: a finite positive value and its source."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    value: float = Field(gt=0, allow_inf_nan=False)
    source: str = Field(min_length=3)


# Ranges (ours, not a vendor's): a number outside its range is a typo or a unit slip, and would
# give absurd or non-finite times (1e308 bytes of optimizer state per parameter overflows a
# plan's memory to infinity). Efficiencies are fractions of a peak; a rate below one per second
# (a bandwidth of 1e-300 B/s) is a slip. Each range is wide enough for any device of the next
# decades. The lower bound is open, the upper one closed.
PLAUSIBLE: dict[str, tuple[float, float]] = {
    "peak_flops_fp16": (1.0, 1e21),
    "peak_flops_fp32": (1.0, 1e21),
    "hbm_bandwidth": (1.0, 1e18),
    "hbm_capacity": (0.0, 1e18),
    "cube_efficiency": (0.0, 1.0),
    "memory_efficiency": (0.0, 1.0),
    "vector_flops_fraction": (0.0, 1.0),
    "backward_compute_factor": (0.0, 100.0),
    "optimizer_state_bytes_per_param": (0.0, 1024.0),
    "master_weight_bytes_per_param": (0.0, 1024.0),
    "gradient_fusion_bytes": (0.0, 1e18),
    "bandwidth": (1.0, 1e18),
    "latency": (0.0, 60.0),
}


class _Spec(BaseModel):
    """Checks every `Sourced` field against its `PLAUSIBLE` range (lower bound open, upper closed)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="after")
    def _plausible(self) -> _Spec:
        for name in type(self).model_fields:
            number = getattr(self, name)
            if isinstance(number, Sourced) and name in PLAUSIBLE:
                low, high = PLAUSIBLE[name]
                if not low < number.value <= high:
                    raise ValueError(f"{name} = {number.value:g} is outside ({low:g}, {high:g}]")
        return self


class ComputeSpec(_Spec):
    peak_flops_fp16: Sourced
    peak_flops_fp32: Sourced
    hbm_bandwidth: Sourced
    hbm_capacity: Sourced
    cube_efficiency: Sourced
    memory_efficiency: Sourced
    vector_flops_fraction: Sourced


class TrainingSpec(_Spec):
    backward_compute_factor: Sourced
    optimizer_state_bytes_per_param: Sourced
    master_weight_bytes_per_param: Sourced
    gradient_fusion_bytes: Sourced


class LinkLevel(_Spec):
    name: str
    bits: int = Field(ge=1, le=64)
    bandwidth: Sourced
    latency: Sourced


class HardwareProfile(BaseModel):
    """A device and its interconnect, validated; see costmodels/ascend910.toml."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    description: str = ""
    compute: ComputeSpec
    training: TrainingSpec
    links: tuple[LinkLevel, ...] = Field(min_length=1)

    @field_validator("links")
    @classmethod
    def _links_cover_mesh(cls, links: tuple[LinkLevel, ...]) -> tuple[LinkLevel, ...]:
        if sum(level.bits for level in links) < 30:
            raise ValueError("the link levels must cover at least 30 mesh bits (give the last level many bits)")
        return links

    def level_of_bit(self, bit: int) -> LinkLevel:
        first = 0
        for level in self.links:
            if bit < first + level.bits:
                return level
            first += level.bits
        return self.links[-1]


def profiles_dir() -> Path:
    """The folder of the bundled profiles (costmodels/)."""
    import costmodels

    return Path(costmodels.__file__).parent


def available_profiles() -> list[str]:
    return sorted(p.stem for p in profiles_dir().glob("*.toml"))


def load_profile(name_or_path: str | Path) -> HardwareProfile:
    """A bundled profile by name (``ascend910``) or a TOML file by path."""
    path = Path(name_or_path)
    if not path.suffix:
        candidate = profiles_dir() / f"{name_or_path}.toml"
        if not candidate.is_file():
            raise CostModelError(
                f"Unknown cost model {str(name_or_path)!r}; bundled: {', '.join(available_profiles())},"
                " or give a .toml path."
            )
        path = candidate
    if not path.is_file():
        raise CostModelError(f"Cost model file {str(path)!r} does not exist.")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise CostModelError(f"Cost model file {str(path)!r} is not valid TOML: {exc}.") from None
    try:
        return HardwareProfile.model_validate(data)
    except ValidationError as exc:
        raise CostModelError(f"Cost model {str(path)!r}: {first_problem(exc)}.") from None
