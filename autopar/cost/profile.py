"""Hardware profiles: a device and its interconnect, every number with its source.

Profiles live in `costmodels/*.toml` (bundled) or any TOML file; each number is a
``{value, source}`` pair, and the source says "assumed" or "fitted" where it is not published.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from autopar.errors import CostModelError


class Sourced(BaseModel):
    """A hardware number and where it comes from."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    value: float = Field(gt=0)
    source: str = Field(min_length=3)


class ComputeSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    peak_flops_fp16: Sourced
    peak_flops_fp32: Sourced
    hbm_bandwidth: Sourced
    hbm_capacity: Sourced
    cube_efficiency: Sourced
    memory_efficiency: Sourced
    vector_flops_fraction: Sourced


class TrainingSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    backward_compute_factor: Sourced
    optimizer_state_bytes_per_param: Sourced
    master_weight_bytes_per_param: Sourced
    gradient_fusion_bytes: Sourced


class LinkLevel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    bits: int = Field(ge=1)
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


def _profiles_dir() -> Path:
    import costmodels

    return Path(costmodels.__file__).parent


def available_profiles() -> list[str]:
    return sorted(p.stem for p in _profiles_dir().glob("*.toml"))


def load_profile(name_or_path: str | Path) -> HardwareProfile:
    """A bundled profile by name (``ascend910``) or a TOML file by path."""
    path = Path(name_or_path)
    if not path.suffix:
        candidate = _profiles_dir() / f"{name_or_path}.toml"
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
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise CostModelError(f"Cost model {str(path)!r}: {where}: {first['msg']}.") from None
