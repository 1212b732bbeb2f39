"""Verify a pipelined training step against one device running the whole global batch.

The reference is the model at the global batch: onnxruntime's forward and torch autograd's
gradients (float64). The pipelined step runs the plan's micro-batch graph: micro-batch m takes
the m-th slice of every data input along its first dimension, the same weights, and the m-th
slice of each output's cotangent; a scalar output is the batch's mean (the loss), as gradient
accumulation takes it, so its micro-batches average and each is seeded with 1/M. Outputs with
the batch first are put back together in micro-batch order.

The proof is the single runtime's, plus the messages: the point-to-point transfers the ranks
ran must be the plan's, one by one (direction, crossing, micro-batch, sender, receiver, bytes),
and the collectives the plan lists, M times within the stages and the synchronisation once.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import numpy as np

from autopar.errors import AutoparError, TooLargeError
from autopar.graph import Graph
from autopar.layout import Layout
from autopar.limits import MAX_VERIFY_BYTES
from autopar.lowering.staged import BACKWARD, StagedProgram, Transfer, transfer_key
from autopar.redistribute import redistribute
from autopar.runtime.collectives import VirtualCollectives
from autopar.runtime.launch import DEFAULT_TIMEOUT_S, run_workers
from autopar.runtime.pipeline import DistributedLinks, StagedResult, execute_stage, execute_virtual
from autopar.runtime.program import Schedule
from autopar.runtime.verify import compare_gradients, in_float64, reference_gradients, training_bytes
from autopar.spmd.compare import (
    ATOL,
    RTOL,
    Tally,
    VerifyReport,
    against_reference,
    collectives_differ,
    compare_output,
)
from autopar.spmd.devices import assemble
from autopar.spmd.reference import reference_outputs
from autopar.spmd.values import materialise
from autopar.units import human_bytes


class MicroBatchError(AutoparError):
    """The model's batch does not split into the plan's micro-batches."""


def micro_values(
    graph: Graph, micro: Graph, values: Mapping[str, np.ndarray], micro_batches: int
) -> list[dict[str, np.ndarray]]:
    """Each micro-batch's values: its slice of every data input, the same weights, the micro graph's constants."""
    found: list[dict[str, np.ndarray]] = [{} for _ in range(micro_batches)]
    for name, info in sorted(micro.tensors.items()):
        if info.kind == "activation":
            continue
        if info.kind == "input":
            whole = values[name]
            if not whole.ndim or whole.shape[0] != info.shape[0] * micro_batches:
                raise MicroBatchError(
                    f"Input {name!r} of shape {list(whole.shape)} does not split into {micro_batches} micro-batches"
                    f" of shape {list(info.shape)}; verify at the batch the plan was made for."
                )
            for m in range(micro_batches):
                found[m][name] = whole[m * info.shape[0] : (m + 1) * info.shape[0]]
        elif info.kind == "constant" and info.value is not None:
            for part in found:
                part[name] = np.asarray(info.value)
        else:
            if name not in values or tuple(values[name].shape) != tuple(info.shape):
                raise MicroBatchError(f"Tensor {name!r} has another shape in one micro-batch than in the whole batch.")
            for part in found:
                part[name] = values[name]
    return found


def global_cotangents(graph: Graph, requires_grad: Mapping[str, bool], seed: int) -> dict[str, np.ndarray]:
    """The seed gradient of each global output that carries one: 1 for a scalar, else seeded normals."""
    rng = np.random.default_rng(seed + 1)
    seeds = {}
    for name in graph.outputs:
        info = graph.tensor(name)
        if not requires_grad.get(name, False):
            continue
        seeds[name] = (
            np.ones(info.shape, dtype=np.float64) if info.numel == 1 else rng.standard_normal(info.shape)
        ).astype(np.float64)
    return seeds


def micro_cotangents(seeds: Mapping[str, np.ndarray], micro: Graph, micro_batches: int) -> list[dict[str, np.ndarray]]:
    found: list[dict[str, np.ndarray]] = [{} for _ in range(micro_batches)]
    for name, whole in seeds.items():
        info = micro.tensor(name)
        for m in range(micro_batches):
            if info.numel == 1 and whole.size == 1:
                found[m][name] = whole / micro_batches
            else:
                found[m][name] = whole[m * info.shape[0] : (m + 1) * info.shape[0]]
    return found


def _combine(name: str, parts: Sequence[np.ndarray], whole_shape: Sequence[int]) -> np.ndarray:
    if len(parts[0].shape) == len(whole_shape) and int(np.prod(whole_shape)) == 1:
        return np.mean(np.stack(parts), axis=0)
    joined = np.concatenate(parts, axis=0)
    if tuple(joined.shape) != tuple(whole_shape):
        raise MicroBatchError(
            f"Output {name!r} does not carry the batch on its first dimension, so its micro-batches cannot be"
            " put back together."
        )
    return joined


def planned_tally(staged: StagedProgram, schedule: Schedule, gradients: bool) -> Tally:
    """The collectives the plan lists (M times within the stages, the synchronisation once), the reductions
    before a partial tensor or gradient leaves its stage, and every message."""
    tally = Tally()
    times = staged.micro_batches
    for phase, step in schedule.listed:
        if phase == "forward" or (gradients and phase == "backward"):
            for _ in range(times):
                tally.add(phase, step, step.nbytes)
        elif gradients and phase == "sync":
            tally.add(phase, step, step.nbytes)
    for crossing in staged.crossings:
        shape = staged.program.graph.tensor(crossing.tensor).shape
        leaving = [("forward", crossing.written)]
        if gradients and crossing.gradient is not None:
            leaving.append(("backward", crossing.gradient))
        for phase, layout in leaving:
            for step in redistribute(layout, Layout(layout.dims), shape, crossing.itemsize):
                for _ in range(times):
                    tally.add(phase, step, step.nbytes)
    for transfer in staged.planned_transfers():
        if gradients or transfer.direction != BACKWARD:
            tally.add_send(send_label(staged, transfer), transfer.nbytes)
    return tally


def send_label(staged: StagedProgram, transfer: Transfer) -> str:
    per = staged.stage_devices
    return f"{transfer.direction} {transfer.sender // per}->{transfer.receiver // per}"


def transfers_differ(staged: StagedProgram, ran: Sequence[Transfer], planned: Sequence[Transfer]) -> str | None:
    """One sentence naming the first message run and not planned, or planned and not run."""
    extra = sorted(set(ran) - set(planned), key=transfer_key)
    missing = sorted(set(planned) - set(ran), key=transfer_key)
    if missing:
        return f"the plan sends {staged.describe(missing[0])} ({missing[0].nbytes} bytes), which never ran"
    if extra:
        return f"the ranks sent {staged.describe(extra[0])} ({extra[0].nbytes} bytes), which the plan does not list"
    if len(ran) != len(planned):
        return "the ranks ran some of the plan's messages more than once"
    return None


def merge_staged(staged: StagedProgram, results: Sequence[StagedResult]) -> StagedResult:
    """One result from each rank's (rank order): each output and gradient from its stage's ranks, the
    collectives of each stage's first rank, every message."""
    merged = StagedResult([rank for r in results for rank in r.ranks])
    per = staged.stage_devices
    for result in results:
        for name, parts in result.outputs.items():
            have = merged.outputs.setdefault(name, [(layout, []) for layout, _ in parts])
            for (_, buffers), (_, more) in zip(have, parts):
                buffers.extend(more)
        for name, (layout, buffers) in result.gradients.items():
            merged.gradients.setdefault(name, (layout, []))[1].extend(buffers)
        merged.received += result.received
        merged.sent += result.sent
    for stage in range(len(staged.stages)):
        first = results[stage * per]
        merged.executed.merge(first.executed)
        if any(r.executed.as_dict() != first.executed.as_dict() for r in results[stage * per : (stage + 1) * per]):
            merged.problem = f"the ranks of stage {stage} executed different collectives"
    return merged


def check_staged_size(staged: StagedProgram) -> None:
    """Refuse, before drawing any value, a pipelined check this machine could not hold: about one
    micro-batch's training-step check (`training_bytes`) for each micro-batch."""
    need = training_bytes(staged.program) * staged.micro_batches
    if need > MAX_VERIFY_BYTES:
        raise TooLargeError(
            f"Checking the pipelined training step of {staged.program.graph.name!r} on {staged.num_devices} devices"
            f" would hold about {human_bytes(need)} in float64 (limit {human_bytes(MAX_VERIFY_BYTES)}); verify at a"
            " smaller batch."
        )


def verify_staged(
    staged: StagedProgram,
    graph: Graph,
    seed: int = 0,
    runtime: str = "virtual",
    gradients: bool = True,
    rtol: float = RTOL,
    atol: float = ATOL,
    port: int | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> VerifyReport:
    """Run a pipelined plan's step (``runtime`` "virtual" or "torch") and compare it with one device running
    ``graph``, the model at the global batch."""
    start = time.perf_counter()
    program, micro_batches = staged.program, staged.micro_batches
    check_staged_size(staged)
    schedule = Schedule.of(program.redistributions, program.gradients, program.gradient_sync)
    values = materialise(graph, seed)
    precise = in_float64(values)
    parts = [in_float64(part) for part in micro_values(graph, program.graph, values, micro_batches)]
    parameters = (
        sorted(p.name for p in program.graph.parameters if p.trainable and p.name in program.owner) if gradients else []
    )
    seeds = global_cotangents(graph, program.requires_grad, seed) if gradients else None
    micro_seeds = micro_cotangents(seeds, program.graph, micro_batches) if seeds is not None else None
    if runtime == "torch":
        per = staged.stage_devices

        def work(rank: int, world: int, device: object) -> StagedResult:
            from autopar.runtime.collectives import DistributedCollectives
            from autopar.runtime.launch import _bit_sets

            collectives = DistributedCollectives(rank, world, _bit_sets(schedule), device)  # type: ignore[arg-type]
            links = DistributedLinks(staged, timeout_s)
            return execute_stage(staged, schedule, parts, micro_seeds, collectives, links, parameters, rank // per)

        result = merge_staged(staged, run_workers(staged.num_devices, work, port, timeout_s))
    else:
        collectives = VirtualCollectives(staged.stage_devices)
        result = execute_virtual(staged, schedule, parts, micro_seeds, collectives, parameters)
    return _judge(staged, graph, result, values, precise, seeds, parameters, schedule, runtime, rtol, atol, start)


def _judge(
    staged: StagedProgram,
    graph: Graph,
    result: StagedResult,
    values: Mapping[str, np.ndarray],
    precise: Mapping[str, np.ndarray],
    seeds: Mapping[str, np.ndarray] | None,
    parameters: Sequence[str],
    schedule: Schedule,
    runtime: str,
    rtol: float,
    atol: float,
    start: float,
) -> VerifyReport:
    problems: list[str] = [result.problem] if result.problem else []
    training = seeds is not None
    planned_messages = [t for t in staged.planned_transfers() if training or t.direction != BACKWARD]
    if not problems:
        differ = transfers_differ(staged, result.received, planned_messages)
        differ = differ or (
            "the messages sent differ from those received"
            if sorted(result.sent, key=transfer_key) != sorted(result.received, key=transfer_key)
            else None
        )
        if differ:
            problems.append(differ)
    outputs: dict[str, dict[str, float | bool | None]] = {}
    check = None
    if not problems:
        micro = staged.program.graph
        for name, expected in reference_outputs(graph, values).items():
            pieces = [
                assemble(buffers, Layout.from_dict(layout), micro.tensor(name).shape)
                for layout, buffers in result.outputs[name]
            ]
            whole = _combine(name, pieces, graph.tensor(name).shape)
            tolerance = against_reference({info.dtype for info in graph.tensors.values()}, rtol)
            found = compare_output(name, whole, expected, tolerance, atol)
            outputs[name] = found.to_dict()
            if found.problem:
                problems.append(found.problem)
        if seeds is not None:

            def held(name: str) -> np.ndarray:
                layout, buffers = result.gradients[name]
                return assemble(buffers, Layout.from_dict(layout), graph.tensor(name).shape)

            wanted = reference_gradients(graph, precise, seeds, parameters)
            check = compare_gradients(wanted, held, parameters, rtol, atol)
            if not check.ok:
                problems.append(
                    f"the gradient of {check.worst!r} differs from the single-device gradient: max abs error"
                    f" {check.max_abs_error:.3g}"
                )
    executed = result.executed
    for transfer in result.received:
        executed.add_send(send_label(staged, transfer), transfer.nbytes)
    ran, planned = executed.as_dict(), planned_tally(staged, schedule, training).as_dict()
    if not problems and ran != planned:
        problems.append(collectives_differ(ran, planned))
    return VerifyReport(
        ok=not problems,
        devices=staged.num_devices,
        outputs=outputs,
        collectives={"executed": ran, "planned": planned},
        problems=problems,
        time_s=time.perf_counter() - start,
        runtime=runtime,
        processes=staged.num_devices if runtime == "torch" else 1,
        gradients=check,
        training=training,
    )
