"""Run a plan's training step on the ranks one process computes, and hand back what they hold.

`execute` is what every process of a real runtime runs, and what the virtual runtime runs
once for all N ranks: forward, the graph outputs, backward from the given cotangents, then
each trainable parameter's synchronised gradient. A broken plan stops it with one sentence.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from autopar.lowering.program import PlanProgram
from autopar.runtime.collectives import Collectives
from autopar.runtime.program import PlanBroken, Schedule, TrainingStep

Held = tuple[dict[str, Any], list[np.ndarray]]  # (layout as a dict, one array per rank computed here)


@dataclass
class RankResult:
    """What some ranks hold after a step: outputs and gradients by name, and the collectives they ran."""

    ranks: list[int]
    outputs: dict[str, Held] = field(default_factory=dict)
    gradients: dict[str, Held] = field(default_factory=dict)
    executed: dict[str, dict[str, dict[str, int]]] = field(default_factory=dict)
    problem: str | None = None


def execute(
    program: PlanProgram,
    schedule: Schedule,
    values: Mapping[str, np.ndarray],
    cotangents: Mapping[str, np.ndarray] | None,
    collectives: Collectives,
    parameters: Sequence[str],
) -> RankResult:
    """Forward, then (with ``cotangents``) backward and gradient synchronisation."""
    step = TrainingStep(program, schedule, values, collectives)
    result = RankResult(list(collectives.ranks))
    try:
        step.forward()
        for name in program.graph.outputs:
            layout, buffers = step.output(name)
            result.outputs[name] = (layout.to_dict(), [_array(b) for b in buffers])
        if cotangents is not None:
            step.backward(cotangents)
            for name in parameters:
                layout, buffers = step.parameter_gradient(name)
                result.gradients[name] = (layout.to_dict(), [_array(b) for b in buffers])
    except PlanBroken as exc:
        result.problem = str(exc)
    result.executed = step.executed.as_dict()
    return result


def _array(buffer: torch.Tensor) -> np.ndarray:
    """A rank's buffer as numpy holds it: bfloat16, which numpy lacks, as the float32 that holds it exactly."""
    found = buffer.detach().cpu()
    return (found.float() if found.dtype == torch.bfloat16 else found).numpy()
