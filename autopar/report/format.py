"""Words and numbers both report faces print the same way: the terminal table and the HTML page.

Kept in one place so a strategy, a link level or a time reads identically in both.
"""

from __future__ import annotations

import html
from collections.abc import Sequence

from autopar.cost.mesh import Mesh
from autopar.lowering.planfile import Totals
from autopar.units import human_bytes


def figure_ms(seconds: float) -> str:
    """Seconds as milliseconds with three decimals, no unit ("16.208"): a table's column."""
    return f"{seconds * 1e3:.3f}"


def ms(seconds: float) -> str:
    """Seconds as milliseconds with the unit ("16.208 ms"): prose."""
    return f"{figure_ms(seconds)} ms"


def escape(value: object) -> str:
    """Text made safe inside HTML elements and quoted attributes."""
    return html.escape(str(value), quote=True)


def strategy_text(entry: Sequence[Sequence[int]]) -> str:
    """An in_strategy as MindSpore writes it: ((8,1,1,1),(1,)) — a one-element tuple keeps its comma."""
    return "(" + ",".join("(" + ",".join(str(f) for f in s) + ("," if len(s) == 1 else "") + ")" for s in entry) + ")"


def link_levels(mesh: Mesh, bits: Sequence[int]) -> str:
    """The link levels a collective's bits cross on ``mesh``, fastest first ("HCCS+PCIe")."""
    level_of = mesh.link_names()
    names: list[str] = []
    for bit in sorted(bits):
        if level_of.get(bit, "?") not in names:
            names.append(level_of.get(bit, "?"))
    return "+".join(names)


def memory_against_usable(totals: Totals, with_used: bool = True) -> str:
    """Memory per device against what a plan may fill, saying the reserve left free:
    ``60.00 GB of 72.00 GB usable (83.3%; the device's 80.00 GB less a 8.00 GB reserve)``."""
    used, usable = totals.memory_per_device_bytes, totals.memory_usable_bytes
    share = f"{used / usable:.1%}" if usable else "-"
    reserve = totals.memory_reserve_bytes
    left = (
        f"; the device's {human_bytes(totals.memory_capacity_bytes)} less a {human_bytes(reserve)} reserve"
        if reserve
        else ""
    )
    text = f"of {human_bytes(usable)} usable ({share}{left})"
    return f"{human_bytes(used)} {text}" if with_used else text
