"""Comparing a sharded run with the single-device reference, and the report of a verification."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

RTOL, ATOL = 1e-4, 1e-5


def _finite(value: float) -> float | None:
    return value if np.isfinite(value) else None


@dataclass(frozen=True)
class OutputCheck:
    """One graph output: its largest error against the reference, and whether that is close enough."""

    max_abs_error: float
    max_rel_error: float
    ok: bool
    problem: str | None = None

    def to_dict(self) -> dict[str, float | bool | None]:
        """Errors as numbers, or None where the sharded run gave no finite value (strict JSON)."""
        return {
            "max_abs_error": _finite(self.max_abs_error),
            "max_rel_error": _finite(self.max_rel_error),
            "ok": self.ok,
        }


def compare_output(
    name: str, got: np.ndarray, expected: np.ndarray, rtol: float = RTOL, atol: float = ATOL
) -> OutputCheck:
    """Norm-wise: the largest absolute error at most ``atol + rtol x`` the output's largest magnitude.

    A sharded sum adds the same terms in another order; its rounding error scales with the
    tensor's magnitude, not with an element that cancels to about zero.

    >>> compare_output("y", np.array([1.0, 1e-9]), np.array([1.0, 0.0])).ok
    True
    """
    error = np.abs(got.astype(np.float64) - expected.astype(np.float64))
    magnitude = float(np.abs(expected.astype(np.float64)).max(initial=0.0))
    worst_error = float(error.max(initial=0.0))
    close = bool(np.isfinite(worst_error)) and worst_error <= atol + rtol * magnitude
    problem = None
    if not close:
        worst = np.unravel_index(int(np.argmax(error)), error.shape) if error.size else ()
        problem = (
            f"output {name!r} differs from the single-device reference: max abs error {worst_error:.3g}"
            f" against a largest magnitude of {magnitude:.3g} (worst at index {tuple(int(i) for i in worst)})"
        )
    return OutputCheck(worst_error, worst_error / magnitude if magnitude else worst_error, close, problem)


@dataclass(frozen=True)
class VerifyReport:
    """What a verification found: per-output errors and the collectives carried out."""

    ok: bool
    devices: int
    outputs: dict[str, dict[str, float | bool | None]]
    executed: dict[str, dict[str, int]]
    planned: dict[str, dict[str, int]]
    problems: list[str] = field(default_factory=list)
    time_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "devices": self.devices,
            "outputs": self.outputs,
            "collectives_executed": self.executed,
            "collectives_planned": self.planned,
            "problems": self.problems,
            "time_s": round(self.time_s, 3),
        }
