"""The device mesh as one frozen value: devices, mesh bits, and the link each bit crosses (Alpa's LogicalDeviceMesh).

N = 2^k devices; bit b of a rank is mesh axis b, bit 0 the fastest link. A profile (or a rank
table's re-derived profile) lists link levels fastest first, each covering some bits; the mesh
keeps the levels its k bits reach, each with the alpha (latency) and beta (bandwidth) that the
collectives over its bits pay. Built once, read by the plan, the exporters and the report.

>>> from autopar.cost import load_profile
>>> mesh = Mesh.of(load_profile("ascend910"), 8)
>>> mesh.mesh_bits, [(level.name, level.bits) for level in mesh.levels]
(3, [('HCCS', (0, 1)), ('PCIe', (2,))])
>>> mesh.level_of(2).name
'PCIe'
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.cost.model import CostModel
from autopar.cost.profile import HardwareProfile
from autopar.errors import AutoparError
from autopar.layout import is_power_of_two, mesh_bits_for


@dataclass(frozen=True)
class MeshLevel:
    """One link level as the mesh uses it: its mesh bits (lowest first), latency and bandwidth."""

    name: str
    bits: tuple[int, ...]
    latency_s: float
    bandwidth_bytes_per_s: float

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
        found: dict[str, MeshLevel] = {}
        for bit in range(bits):
            link = profile.level_of_bit(bit)
            grouped.setdefault(link.name, []).append(bit)
            found[link.name] = MeshLevel(link.name, (), link.latency.value, link.bandwidth.value)
        levels = tuple(
            MeshLevel(name, tuple(grouped[name]), found[name].latency_s, found[name].bandwidth_bytes_per_s)
            for name in grouped
        )
        return cls(num_devices, bits, levels, profile.name)

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
