"""The device-count sweep: plan a model at each count, with throughput, scaling efficiency, MFU and memory."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from autopar import progress
from autopar.api.planning import ModelLike, common_batch, model_graph, plan_with
from autopar.errors import InfeasibleError, TooLargeError
from autopar.lowering.advice import plan_warnings
from autopar.options import DEFAULT_COST_MODEL, CostModelLike, Optimizer, PlanOptions, Precision, check_devices


def sweep(
    model: ModelLike,
    devices: Sequence[int] = (1, 8, 64, 512),
    cost_model: CostModelLike = DEFAULT_COST_MODEL,
    batch: int | None = None,
    *,
    dims: Mapping[str, int] | None = None,
    precision: Precision | str = Precision.MIXED,
    overlap: bool = True,
    optimizer: Optimizer | str | None = None,
    memory_reserve: float | str | None = None,
) -> list[dict[str, Any]]:
    """Plan ``model`` at each device count: step time, throughput, scaling efficiency, MFU, memory.

    ``warnings`` lists the plan's own (`autopar.lowering.advice`: devices that repeat one another's
    work, the memory plan, ...). A count whose plan is no faster than a smaller count's is flagged
    (``warning``); one where nothing fits, or that is too large to search, has ``error`` instead of figures.
    ``optimizer`` and ``memory_reserve`` are `autopar.plan`'s.
    """
    counts = sorted(set(devices))
    for count in counts:
        check_devices(count)
    options = PlanOptions.resolve(
        cost_model=cost_model,
        batch=batch,
        dims=dims or {},
        precision=precision,
        overlap=overlap,
        optimizer=optimizer,
        memory_reserve=memory_reserve,
    )
    step_batch = common_batch(model_graph(model, batch, dims))
    points: list[dict[str, Any]] = []
    base: tuple[int, float] | None = None  # (devices, samples per second per device) of the first that fits
    for count in counts:
        progress.report("sweep", counts.index(count), len(counts))
        try:
            found = plan_with(model, options.replace(num_devices=count))
        except (InfeasibleError, TooLargeError) as exc:
            points.append({"devices": count, "error": str(exc)})
            continue
        totals = found.to_dict()["totals"]
        step = totals["step_time_s"]
        samples = (step_batch or 1) / step if step > 0 else math.inf
        if base is None:
            base = (count, samples / count)
        point: dict[str, Any] = {
            "devices": count,
            "step_time_s": step,
            "samples_per_s": samples,
            "scaling_efficiency": samples / count / base[1],
            "mfu": totals["ideal_step_time_s"] / step if step > 0 else 0.0,
            "memory_per_device_bytes": totals["memory_per_device_bytes"],
            "memory_plan": found.to_dict()["memory_plan"],
            "warnings": plan_warnings(found.file),
        }
        faster = [p for p in points if "step_time_s" in p and p["step_time_s"] <= step * (1 + 1e-9)]
        if faster:
            point["warning"] = (
                f"no faster than on {faster[0]['devices']} devices: the other {count - faster[0]['devices']} add"
                " nothing (the model has too little work to split further)"
            )
        points.append(point)
    return points
