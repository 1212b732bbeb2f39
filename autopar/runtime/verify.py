"""Verify a whole training step: outputs against onnxruntime, every gradient against one device.

The reference forward is onnxruntime's (as for `autopar.spmd`); the reference gradients come
from torch autograd through the same registered kernels on one device. Each graph output
that carries a gradient is seeded with a fixed cotangent (1 for a scalar loss, seeded
normal values otherwise), the same on one device and on N. The sharded step runs on
virtual ranks in this process or on N torch.distributed processes; both execute only the
collectives the plan lists, and those must equal the plan's, phase by phase.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from autopar.errors import TooLargeError
from autopar.graph import Graph
from autopar.layout import Layout
from autopar.limits import MAX_VERIFY_BYTES
from autopar.lowering import PlanProgram
from autopar.runtime.collectives import VirtualCollectives
from autopar.runtime.execute import RankResult, execute
from autopar.runtime.launch import DEFAULT_TIMEOUT_S, run_processes
from autopar.runtime.program import Schedule
from autopar.runtime.single import run_graph
from autopar.spmd.compare import (
    ATOL,
    RTOL,
    GradientCheck,
    VerifyReport,
    against_reference,
    collectives_differ,
    compare_output,
)
from autopar.spmd.devices import assemble
from autopar.spmd.reference import reference_outputs
from autopar.spmd.runner import check_verification_size
from autopar.spmd.values import materialise
from autopar.units import human_bytes


def trainable_parameters(program: PlanProgram) -> list[str]:
    return sorted(p.name for p in program.graph.parameters if p.trainable and p.name in program.owner)


def cotangents(program: PlanProgram, seed: int) -> dict[str, np.ndarray]:
    """The seed gradient of each graph output that carries one: 1 for a scalar, else seeded normals."""
    rng = np.random.default_rng(seed + 1)
    seeds = {}
    for name in program.graph.outputs:
        info = program.graph.tensor(name)
        if not program.requires_grad.get(name, False):
            continue
        if info.numel == 1:
            seeds[name] = np.ones(info.shape, dtype=np.dtype(info.dtype))
        else:
            seeds[name] = rng.standard_normal(info.shape).astype(np.dtype(info.dtype))
    return seeds


def reference_gradients(
    graph: Graph, values: Mapping[str, np.ndarray], seeds: Mapping[str, np.ndarray], parameters: Sequence[str]
) -> dict[str, np.ndarray]:
    """Every trainable parameter's gradient on one device: torch autograd through the same kernels."""
    outputs, leaves = run_graph(graph, values, requires_grad=parameters)
    pairs = [(outputs[name], torch.from_numpy(seed)) for name, seed in seeds.items() if outputs[name].requires_grad]
    if pairs:
        torch.autograd.backward([out for out, _ in pairs], [seed.to(out.dtype) for out, seed in pairs])
    found = {}
    for name in parameters:
        grad = leaves[name].grad
        found[name] = (grad if grad is not None else torch.zeros_like(leaves[name])).detach().numpy()
    return found


def _assembled(held: tuple[dict, list[np.ndarray]], shape: Sequence[int]) -> np.ndarray:
    layout, buffers = held
    return assemble(buffers, Layout.from_dict(layout), shape)


def verify_training(
    program: PlanProgram,
    seed: int = 0,
    runtime: str = "virtual",
    gradients: bool = True,
    rtol: float = RTOL,
    atol: float = ATOL,
    port: int | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> VerifyReport:
    """Run a plan's training step (``runtime`` "virtual" or "torch") and compare it with one device."""
    start = time.perf_counter()
    schedule = Schedule.of(program.redistributions, program.gradients, program.gradient_sync)
    check_verification_size(program)
    check_training_size(program)
    values = materialise(program.graph, seed)
    precise = in_float64(values)
    parameters = trainable_parameters(program) if gradients else []
    seeds = in_float64(cotangents(program, seed)) if gradients else None
    if runtime == "torch":
        result = run_processes(program, schedule, precise, seeds, parameters, port=port, timeout_s=timeout_s)
    else:
        result = execute(program, schedule, precise, seeds, VirtualCollectives(program.num_devices), parameters)
    return _judge(program, result, values, seeds, parameters, schedule, runtime, rtol, atol, start)


def training_bytes(program: PlanProgram) -> int:
    """About how much a training step's check holds, in float64: the values (and a float32 copy)
    and their gradients, the single-device reference's activations twice (kept for its backward),
    and every rank's shards of every activation twice (outputs kept for the backward, inputs after
    their collectives). Measured peaks: ResNet-50 at batch 8 on 8 devices 10.2 GB (this says 12.0),
    Inception v2 18.7 GB (20.1)."""
    graph = program.graph
    values = sum(t.numel for t in graph.tensors.values() if t.kind != "activation")
    activations = sum(t.numel for t in graph.tensors.values() if t.kind == "activation")
    sharded = 0
    for planned in program.ops:
        for name, layout in zip(planned.rule.op.outputs, planned.outputs):
            if name and layout is not None:
                sharded += layout.local_numel(graph.tensor(name).shape) * program.num_devices
    return 8 * (2 * values + 2 * activations + 2 * sharded) + 4 * values


def check_training_size(program: PlanProgram) -> None:
    """Refuse, before drawing any value, a training-step check this machine could not hold."""
    need = training_bytes(program)
    if need > MAX_VERIFY_BYTES:
        raise TooLargeError(
            f"Checking the training step of {program.graph.name!r} on {program.num_devices} devices would hold"
            f" about {human_bytes(need)} (weights, every rank's activations and the single-device reference,"
            f" in float64; limit {human_bytes(MAX_VERIFY_BYTES)}); verify at a smaller batch, or the forward"
            " alone (without --gradients or --runtime torch)."
        )


def in_float64(values: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Floating values in float64: a deep backward in float32 drifts by 1e-3 (ResNet-50's first layers,
    on one device as on eight), which would hide a wrong gradient; in float64 rounding is 1e-12."""
    return {name: value.astype(np.float64) if value.dtype.kind == "f" else value for name, value in values.items()}


def _judge(
    program: PlanProgram,
    result: RankResult,
    values: Mapping[str, np.ndarray],
    seeds: Mapping[str, np.ndarray] | None,
    parameters: Sequence[str],
    schedule: Schedule,
    runtime: str,
    rtol: float,
    atol: float,
    start: float,
) -> VerifyReport:
    problems: list[str] = [result.problem] if result.problem else []
    outputs: dict[str, dict[str, float | bool | None]] = {}
    check = None
    if not problems:
        graph = program.graph
        for name, expected in reference_outputs(graph, values).items():
            found = compare_output(
                name,
                _assembled(result.outputs[name], graph.tensor(name).shape),
                expected,
                against_reference({info.dtype for info in graph.tensors.values()}, rtol),
                atol,
            )
            outputs[name] = found.to_dict()
            if found.problem:
                problems.append(found.problem)
        if seeds is not None:
            wanted = reference_gradients(program.graph, in_float64(values), seeds, parameters)
            graph = program.graph
            check = compare_gradients(
                wanted,
                lambda name: _assembled(result.gradients[name], graph.tensor(name).shape),
                parameters,
                rtol,
                atol,
            )
            if not check.ok:
                problems.append(
                    f"the gradient of {check.worst!r} differs from the single-device gradient: max abs error"
                    f" {check.max_abs_error:.3g}"
                    if np.isfinite(check.max_abs_error)
                    else f"the gradient of {check.worst!r} differs between ranks that should hold the same values"
                    " (a gradient synchronisation is missing or wrong)"
                )
    planned = schedule.planned(gradients=seeds is not None).as_dict()
    if not problems and result.executed != planned:
        problems.append(collectives_differ(result.executed, planned))
    return VerifyReport(
        ok=not problems,
        devices=program.num_devices,
        outputs=outputs,
        collectives={"executed": result.executed, "planned": planned},
        problems=problems,
        time_s=time.perf_counter() - start,
        runtime=runtime,
        processes=program.num_devices if runtime == "torch" else 1,
        gradients=check,
        training=seeds is not None,
    )


def compare_gradients(
    expected: Mapping[str, np.ndarray],
    held: Callable[[str], np.ndarray],
    parameters: Sequence[str],
    rtol: float,
    atol: float,
) -> GradientCheck:
    """Each parameter's gradient as the ranks hold it (``held``: assembled from its shards; KeyError
    or ValueError where it is missing or its replicas disagree) against the single-device one."""
    worst_name, worst_score, worst_abs, worst_rel, ok = None, -1.0, 0.0, 0.0, True
    for name in parameters:
        want = expected[name]
        magnitude = float(np.abs(want).max(initial=0.0))
        try:
            got = held(name)
        except (KeyError, ValueError):  # missing, or replicas disagree: a synchronisation is missing or wrong
            got = np.full(want.shape, np.inf)
        found = compare_output(name, got, want, rtol, atol)
        # the parameter nearest its tolerance is the worst; a gradient that is exactly zero (a key's
        # bias under softmax) has no meaningful relative error
        score = found.max_abs_error / (atol + rtol * magnitude)
        if score > worst_score:
            worst_name, worst_score = name, score
        worst_abs = max(worst_abs, found.max_abs_error)
        if magnitude > atol:
            worst_rel = max(worst_rel, found.max_abs_error / magnitude)
        ok = ok and found.ok
    return GradientCheck(len(parameters), worst_abs, worst_rel, worst_name, ok)
