"""Comparing a sharded run with the single-device reference, and the report of a verification."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from autopar.redistribute import Step
from autopar.units import human_bytes

RTOL, ATOL = 1e-4, 1e-5

_ROUNDING = {"float16": 2.0**-9, "bfloat16": 2.0**-6}  # four units in the last place of each


def against_reference(dtypes: Iterable[str], rtol: float) -> float:
    """The relative tolerance a training step's outputs take against onnxruntime's, given the element types the
    model's tensors hold: the step runs in float64, and where the model rounds a value to float16 or bfloat16 (an
    output, a cast on the way) the reference rounds it there (four units in the last place of the coarsest).

    >>> against_reference(["float32"], 1e-4), against_reference(["float32", "float16"], 1e-4)
    (0.0001, 0.001953125)
    """
    return max([rtol, *(_ROUNDING.get(dtype, 0.0) for dtype in dtypes)])


def _error(value: float | bool | None) -> str:
    return "not finite" if value is None else f"{value:.3g}"


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


PHASES = ("forward", "backward", "sync", "send")  # "send": a pipeline's point-to-point messages


@dataclass
class Tally:
    """Collectives by phase (forward, backward, sync), kind and group size: how many, and their bytes.

    >>> from autopar.redistribute import Collective, Step
    >>> tally = Tally()
    >>> tally.add("forward", Step(Collective.ALL_REDUCE, (0, 1), 64), 64)
    >>> tally.as_dict()["forward"]
    {'AllReduce over 4': {'count': 1, 'bytes': 64}}
    """

    count: Counter[tuple[str, str, int]] = field(default_factory=Counter)
    nbytes: Counter[tuple[str, str, int]] = field(default_factory=Counter)

    def add(self, phase: str, step: Step, nbytes: int) -> None:
        key = (phase, str(step.kind), step.group_size)
        self.count[key] += 1
        self.nbytes[key] += nbytes

    def add_send(self, label: str, nbytes: int) -> None:
        """One point-to-point message of a pipeline (``label``: its direction and stages)."""
        key = ("send", label, 2)
        self.count[key] += 1
        self.nbytes[key] += nbytes

    def merge(self, other: "Tally") -> None:
        self.count.update(other.count)
        self.nbytes.update(other.nbytes)

    def as_dict(self) -> dict[str, dict[str, dict[str, int]]]:
        """{phase: {"AllGather over 2": {"count", "bytes"}}}, every phase present ("send" only with messages)."""
        out: dict[str, dict[str, dict[str, int]]] = {phase: {} for phase in PHASES if phase != "send"}
        for key in sorted(self.count, key=lambda k: (PHASES.index(k[0]), k[1], k[2])):
            phase, kind, size = key
            label = kind if phase == "send" else f"{kind} over {size}"
            out.setdefault(phase, {})[label] = {"count": self.count[key], "bytes": self.nbytes[key]}
        return out


def by_kind(phases: dict[str, dict[str, dict[str, int]]], phase: str = "forward") -> dict[str, dict[str, int]]:
    """One phase's collectives summed over group sizes: {"AllGather": {"count", "bytes"}}."""
    out: dict[str, dict[str, int]] = {}
    for label, entry in phases.get(phase, {}).items():
        kind = label.split(" over ")[0]
        total = out.setdefault(kind, {"count": 0, "bytes": 0})
        total["count"] += entry["count"]
        total["bytes"] += entry["bytes"]
    return out


def collectives_differ(executed: dict[str, Any], planned: dict[str, Any]) -> str:
    """One sentence naming the first phase and collective where execution and plan disagree."""
    for phase in PHASES:
        ran, listed = executed.get(phase, {}), planned.get(phase, {})
        for label in sorted(set(ran) | set(listed)):
            if ran.get(label) != listed.get(label):
                done = ran.get(label, {"count": 0, "bytes": 0})
                want = listed.get(label, {"count": 0, "bytes": 0})
                return (
                    f"the {phase} collectives executed differ from those the plan lists: {label} ran"
                    f" {done['count']} time(s) ({done['bytes']} bytes), the plan lists {want['count']}"
                    f" ({want['bytes']} bytes)"
                )
    return "the collectives executed differ from those the plan lists"


@dataclass(frozen=True)
class GradientCheck:
    """Every trainable parameter's gradient, reassembled from its shards, against one device's."""

    checked: int
    max_abs_error: float
    max_rel_error: float
    worst: str | None
    ok: bool

    def to_dict(self) -> dict[str, Any]:
        return {
            "checked": self.checked,
            "max_abs_error": _finite(self.max_abs_error),
            "max_rel_error": _finite(self.max_rel_error),
            "worst": self.worst,
            "ok": self.ok,
        }


@dataclass(frozen=True)
class VerifyReport:
    """What a verification found: per-output errors, gradients, and the collectives carried out.

    ``collectives`` holds "executed" and "planned", each by phase (`Tally.as_dict`);
    ``executed`` / ``planned`` are the forward ones by kind.
    """

    ok: bool
    devices: int
    outputs: dict[str, dict[str, float | bool | None]]
    collectives: dict[str, dict[str, dict[str, dict[str, int]]]]
    problems: list[str] = field(default_factory=list)
    time_s: float = 0.0
    runtime: str = "virtual"
    processes: int = 1
    gradients: GradientCheck | None = None
    training: bool = False  # the step checked was a training step (gradients too), whether or not it got that far

    @property
    def executed(self) -> dict[str, dict[str, int]]:
        return by_kind(self.collectives["executed"])

    @property
    def planned(self) -> dict[str, dict[str, int]]:
        return by_kind(self.collectives["planned"])

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "runtime": self.runtime,
            "devices": self.devices,
            "processes": self.processes,
            "outputs": self.outputs,
            "gradients": self.gradients.to_dict() if self.gradients is not None else None,
            "training": self.training,
            "collectives": self.collectives,
            "problems": self.problems,
            "time_s": round(self.time_s, 3),
        }

    def table(self) -> str:
        """The verdict, each output's and the gradients' errors, and the collectives executed beside those
        planned: what ``autopar verify`` prints (also ``str(report)``)."""
        report = self
        verdict = "VERIFIED" if report.ok else "FAILED"
        where = (
            f"{report.processes} torch.distributed process{'es' if report.processes > 1 else ''}"
            if report.runtime == "torch"
            else f"{report.devices} virtual devices"
        )
        what = "forward, backward and gradient sync" if report.training or report.gradients is not None else "forward"
        lines = [f"autopar verify: {verdict} on {where} ({report.time_s:.1f} s): {what}", ""]
        for name, entry in report.outputs.items():
            lines.append(
                f"output {name:<16} max abs error {_error(entry['max_abs_error'])}"
                f"  max rel error {_error(entry['max_rel_error'])}  {'ok' if entry['ok'] else 'MISMATCH'}"
            )
        check = report.gradients
        if check is not None:
            lines.append(
                f"gradients: {check.checked} parameters, max abs error {_error(check.max_abs_error)}"
                f"  max rel error {_error(check.max_rel_error)}  {'ok' if check.ok else 'MISMATCH'}"
                + (f"  (worst: {check.worst})" if check.worst else "")
            )
        lines.append("")
        lines.append("collectives executed (plan lists):")
        executed, planned = report.collectives["executed"], report.collectives["planned"]
        empty = True
        for phase in PHASES:
            ran, listed = executed.get(phase, {}), planned.get(phase, {})
            for label in sorted(set(ran) | set(listed)):
                empty = False
                done = ran.get(label, {"count": 0, "bytes": 0})
                want = listed.get(label, {"count": 0, "bytes": 0})
                lines.append(
                    f"  {phase:<8} {label:<22} {done['count']:>5} x {human_bytes(done['bytes']):>10}"
                    f"   ({want['count']} x {human_bytes(want['bytes'])})"
                )
        if empty:
            lines.append("  none")
        for problem in report.problems:
            lines.append(f"problem: {problem}")
        return "\n".join(lines) + "\n"

    def __str__(self) -> str:
        return self.table()
