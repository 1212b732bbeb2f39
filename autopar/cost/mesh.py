"""The device mesh as one frozen value: devices, mesh bits, and the link each bit crosses (Alpa's LogicalDeviceMesh).

N = 2^k devices; bit b of a rank is mesh axis b, bit 0 the fastest link. A profile (or a rank
table's re-derived profile) lists link levels fastest first, each covering some bits; the mesh
keeps the levels its k bits reach, each with the alpha (latency) and beta (bandwidth) that the
collectives over its bits pay. Built once, read by the plan, the exporters and the report.
A plan file names its levels and their bits but keeps no link speeds, so the mesh read back
from one (`Mesh.named`) knows its shape and links, and asking it for a speed is an error.

>>> from autopar.cost import load_profile
>>> mesh = Mesh.of(load_profile("ascend910"), 8)
>>> mesh.mesh_bits, [(level.name, level.bits) for level in mesh.levels]
(3, [('HCCS', (0, 1)), ('PCIe', (2,))])
>>> mesh.level_of(2).name, mesh.axis_names, mesh.shape
('PCIe', ('b2', 'b1', 'b0'), (2, 2, 2))
>>> Mesh.named(8, [("HCCS", [0, 1]), ("PCIe", [2])], "ascend910").link_names()
{0: 'HCCS', 1: 'HCCS', 2: 'PCIe'}
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from autopar.cost.model import CostModel
from autopar.cost.profile import HardwareProfile
from autopar.errors import AutoparError
from autopar.layout import is_power_of_two, mesh_bits_for

SINGLE_AXIS = "single"  # the one mesh dimension (size 1) of a one-device mesh, as the exporters name it


@dataclass(frozen=True)
class LinkSpeed:
    """What a collective over a level's bits pays: alpha (latency, s) and beta's inverse (bytes/s)."""

    latency_s: float
    bandwidth_bytes_per_s: float


@dataclass(frozen=True)
class MeshLevel:
    """One link level as the mesh uses it: its mesh bits (lowest first) and, from a profile, its speed."""

    name: str
    bits: tuple[int, ...]
    speed: LinkSpeed | None = None  # None: read from a plan file, which keeps no link speeds

    @property
    def latency_s(self) -> float:
        return self._speed().latency_s

    @property
    def bandwidth_bytes_per_s(self) -> float:
        return self._speed().bandwidth_bytes_per_s

    def _speed(self) -> LinkSpeed:
        if self.speed is None:
            raise AutoparError(
                f"The {self.name} link's speed is unknown: this mesh was read from a plan file, which names its"
                " links but keeps no speeds (build it with Mesh.of from the cost model)."
            )
        return self.speed

    @property
    def devices_per_group(self) -> int:
        """Devices joined by this level and the faster ones."""
        return 1 << (max(self.bits) + 1) if self.bits else 1


@dataclass(frozen=True)
class Mesh:
    """``num_devices`` devices over ``mesh_bits`` bits, and the levels those bits use, fastest first."""

    num_devices: int
    mesh_bits: int
    levels: tuple[MeshLevel, ...]
    profile: str

    @classmethod
    def of(cls, cost: CostModel | HardwareProfile, num_devices: int) -> Mesh:
        """The mesh of ``num_devices`` devices (a power of two) on a cost model's (or a profile's) links."""
        if isinstance(num_devices, bool) or not isinstance(num_devices, int) or not is_power_of_two(num_devices):
            raise AutoparError(f"The device count must be a power of two (1, 2, 4, 8, ...), got {num_devices!r}.")
        profile = cost.profile if isinstance(cost, CostModel) else cost
        bits = mesh_bits_for(num_devices)
        grouped: dict[str, list[int]] = {}
        speeds: dict[str, LinkSpeed] = {}
        for bit in range(bits):
            link = profile.level_of_bit(bit)
            grouped.setdefault(link.name, []).append(bit)
            speeds[link.name] = LinkSpeed(link.latency.value, link.bandwidth.value)
        levels = tuple(MeshLevel(name, tuple(grouped[name]), speeds[name]) for name in grouped)
        return cls(num_devices, bits, levels, profile.name)

    @classmethod
    def named(cls, num_devices: int, levels: Iterable[tuple[str, Iterable[int]]], profile: str) -> Mesh:
        """The mesh a plan file lists: its levels by name and bits, fastest first, without speeds.

        Bits a level names twice, or outside the mesh, are refused; a bit no level names has no link
        (`link_names` leaves it out).
        """
        if isinstance(num_devices, bool) or not isinstance(num_devices, int) or not is_power_of_two(num_devices):
            raise AutoparError(f"The device count must be a power of two (1, 2, 4, 8, ...), got {num_devices!r}.")
        bits = mesh_bits_for(num_devices)
        named = tuple(MeshLevel(name, tuple(level_bits)) for name, level_bits in levels)
        seen: set[int] = set()
        for level in named:
            for bit in level.bits:
                if not 0 <= bit < bits or bit in seen:
                    raise AutoparError(
                        f"The {level.name} link names mesh bit {bit}, which is outside the {num_devices}-device"
                        f" mesh (bits 0..{bits - 1}) or on another link too."
                    )
                seen.add(bit)
        return cls(num_devices, bits, named, profile)

    @property
    def axis_names(self) -> tuple[str, ...]:
        """The exporters' names of the mesh dimensions, one per bit, highest first ("b2", "b1", "b0")."""
        if self.mesh_bits == 0:
            return (SINGLE_AXIS,)
        return tuple(f"b{bit}" for bit in range(self.mesh_bits - 1, -1, -1))

    @property
    def shape(self) -> tuple[int, ...]:
        """The mesh as the exporters shape it: one dimension of size 2 per bit, highest first ((1,) alone)."""
        return tuple(2 for _ in range(self.mesh_bits)) or (1,)

    def level_of(self, bit: int) -> MeshLevel:
        """The level whose link joins the devices that differ in ``bit``."""
        for level in self.levels:
            if bit in level.bits:
                return level
        raise AutoparError(
            f"Mesh bit {bit} is outside the {self.num_devices}-device mesh (bits 0..{self.mesh_bits - 1})."
        )

    def link_names(self) -> dict[int, str]:
        """Mesh bit -> the name of the link it crosses (the exporters' and the report's labels)."""
        return {bit: level.name for level in self.levels for bit in level.bits}
