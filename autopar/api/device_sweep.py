"""The device-count sweep: plan a model at each count, with throughput, scaling efficiency, MFU and memory."""

from __future__ import annotations

import html
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, overload

from autopar import progress
from autopar.api.planning import ModelLike, common_batch, model_graph, plan_with
from autopar.errors import AutoparError, InfeasibleError, TooLargeError
from autopar.graph import Graph
from autopar.limits import MAX_DIMENSION
from autopar.lowering.advice import plan_warnings
from autopar.lowering.decisions import degrees
from autopar.lowering.plan import write_page
from autopar.options import (
    DEFAULT_COST_MODEL,
    CostModelLike,
    Optimizer,
    PlanOptions,
    Precision,
    check_devices,
    shown,
)
from autopar.report.sweep import sweep_html, sweep_table


@dataclass(frozen=True)
class Sweep(Sequence[dict[str, Any]]):
    """A model planned at several device counts: one dict per count (a sequence of them, in count order).

    ``print(sweep)`` shows the table ``autopar sweep`` prints; in Jupyter it displays as its page (throughput
    and MFU charts, in a frame that keeps its styles apart); `report` writes that page; `to_list` gives the
    plain list (JSON-safe).
    """

    model: str
    points: tuple[dict[str, Any], ...]
    per_device_batch: int | None = None  # weak scaling: the global batch grew with the devices

    @overload
    def __getitem__(self, index: int) -> dict[str, Any]: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[dict[str, Any]]: ...

    def __getitem__(self, index: int | slice) -> dict[str, Any] | Sequence[dict[str, Any]]:
        return self.points[index]

    def __len__(self) -> int:
        return len(self.points)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.points)

    def to_list(self) -> list[dict[str, Any]]:
        """The points as a plain list (``json.dumps`` takes it)."""
        return list(self.points)

    def __str__(self) -> str:
        return sweep_table(self.points)

    def html(self) -> str:
        """The sweep as one self-contained HTML page (as ``autopar sweep -o`` writes)."""
        return sweep_html(self.model, self.points, self.per_device_batch)

    def report(self, path: str | Path) -> Path:
        """Write the page (`html`) to ``path``."""
        return write_page(path, self.html)

    def _repr_html_(self) -> str:
        return (
            f'<iframe srcdoc="{html.escape(self.html(), quote=True)}" title="autopar sweep: {html.escape(self.model)}"'
            ' style="width:100%;height:640px;border:0"></iframe>'
        )


def _counts(devices: object) -> list[int]:
    """The device counts to sweep, in order, once each: one count or several, each a power of two."""
    if isinstance(devices, int) and not isinstance(devices, bool):
        devices = (devices,)
    if not isinstance(devices, Iterable) or isinstance(devices, str | bytes | Mapping):
        raise AutoparError(
            f"devices must be a device count or a list of them, such as [1, 8, 64], got {shown(devices)}."
        )
    counts = [check_devices(count) for count in devices]
    if not counts:
        raise AutoparError("devices names no device count to sweep; give at least one, such as [1, 8, 64].")
    twice = sorted({count for count in counts if counts.count(count) > 1})
    if twice:
        raise AutoparError(f"devices names {', '.join(map(str, twice))} more than once, got {shown(devices)}.")
    return sorted(counts)


def _check_per_device_batch(per_device_batch: object, batch: int | None, model: object, counts: list[int]) -> None:
    """One sentence where ``per_device_batch`` cannot be: beside ``batch``, for an imported Graph, or past the
    largest batch at the most devices."""
    if batch is not None:
        raise AutoparError(
            "Give either batch (the global batch at every count) or per_device_batch (the batch of each"
            " device), not both."
        )
    if isinstance(model, Graph):
        raise AutoparError(
            "per_device_batch rebinds the batch at each device count: give the model as a file or an ONNX"
            " model, not an imported Graph."
        )
    most = MAX_DIMENSION // max(counts)
    if isinstance(per_device_batch, bool) or not isinstance(per_device_batch, int) or not 1 <= per_device_batch <= most:
        raise AutoparError(
            f"per_device_batch must be an integer from 1 to {most:,} at {max(counts):,} devices,"
            f" got {shown(per_device_batch)}."
        )


def sweep(
    model: ModelLike,
    devices: int | Sequence[int] = (1, 8, 64, 512),
    cost_model: CostModelLike = DEFAULT_COST_MODEL,
    batch: int | None = None,
    *,
    dims: Mapping[str, int] | None = None,
    precision: Precision | str = Precision.MIXED,
    overlap: bool = True,
    optimizer: Optimizer | str | None = None,
    memory_reserve: float | str | None = None,
    per_device_batch: int | None = None,
) -> Sweep:
    """Plan ``model`` at each device count: step time, throughput, scaling efficiency, MFU, memory (a `Sweep`).

    By default the model's batch (or ``batch``) is the global batch at every count (strong scaling).
    ``per_device_batch`` B holds each device's share fixed instead (weak scaling, what users sweep): at N
    devices the global batch is B x N. Each point says its ``global_batch``; ``replicated`` is how many
    devices repeat each one's work (1: every device does distinct work; `autopar.lowering.decisions.Degrees`).
    ``warnings`` lists the plan's own (`autopar.lowering.advice`: devices that repeat one another's
    work, the memory plan, ...). A count whose plan is no faster than a smaller count's is flagged
    (``warning``); one where nothing fits, or that is too large to search, has ``error`` instead of figures.
    ``optimizer`` and ``memory_reserve`` are `autopar.plan`'s.

    >>> sweep("model.onnx", [1, 8], batch=8, per_device_batch=4)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    autopar.errors.AutoparError: Give either batch (the global batch at every count) or per_device_batch ...
    """
    counts = _counts(devices)
    if per_device_batch is not None:
        _check_per_device_batch(per_device_batch, batch, model, counts)
    options = PlanOptions.resolve(
        cost_model=cost_model,
        batch=batch,
        dims=dims,
        precision=precision,
        overlap=overlap,
        optimizer=optimizer,
        memory_reserve=memory_reserve,
    )
    graph = model_graph(model, batch if per_device_batch is None else per_device_batch, dims)
    if per_device_batch is not None and common_batch(graph) is None:
        raise AutoparError(
            f"per_device_batch needs a batch: the data inputs of {graph.name!r} do not share a leading size."
        )
    points: list[dict[str, Any]] = []
    base: tuple[int, float] | None = None  # (devices, samples per second per device) of the first that fits
    for count in counts:
        progress.report("sweep", counts.index(count), len(counts))
        at_count = options.replace(num_devices=count)
        if per_device_batch is not None:
            at_count = at_count.replace(batch=per_device_batch * count)
        try:
            found = plan_with(model, at_count)
        except (InfeasibleError, TooLargeError) as exc:
            points.append({"devices": count, "error": str(exc)})
            continue
        totals = found.to_dict()["totals"]
        step = totals["step_time_s"]
        step_batch = per_device_batch * count if per_device_batch is not None else common_batch(graph)
        samples = (step_batch or 1) / step if step > 0 else math.inf
        if base is None:
            base = (count, samples / count)
        point: dict[str, Any] = {
            "devices": count,
            "global_batch": step_batch,
            "replicated": degrees(found.file).replicated,
            "pipeline_stages": degrees(found.file).pipeline,
            "step_time_s": step,
            "samples_per_s": samples,
            "scaling_efficiency": samples / count / base[1],
            "mfu": totals["ideal_step_time_s"] / step if step > 0 else 0.0,
            "memory_per_device_bytes": totals["memory_per_device_bytes"],
            "memory_plan": found.to_dict()["memory_plan"],
            "warnings": plan_warnings(found.file),
        }
        # throughput, not step time: under weak scaling a step of a larger batch may take longer and still pay
        faster = [p for p in points if "samples_per_s" in p and p["samples_per_s"] >= samples * (1 - 1e-9)]
        flags = []
        if faster:
            flags.append(
                f"no faster than on {faster[0]['devices']} devices: the other {count - faster[0]['devices']} add"
                " nothing (the model has too little work to split further)"
            )
        if point["replicated"] > 1:
            flags.append(
                f"devices repeat work: {count // point['replicated']:,} distinct of {count:,} (each shard computed"
                f" {point['replicated']} times)"
            )
        if flags:
            point["warning"] = "; ".join(flags)
        points.append(point)
    progress.report("sweep", len(counts), len(counts))
    name = Path(model).stem if isinstance(model, str | Path) else graph.name
    return Sweep(name, tuple(points), per_device_batch)
