"""SPMD verification: run a plan on N virtual devices and compare with the single-device model.

Random weights (where the file has none) and inputs (labels in range) are materialised once
(`values`). The reference is the original graph run by onnxruntime on one device
(`reference`). The plan then runs on N virtual ranks: each rank holds only its shards,
computes every operator on its local shards (`kernels`), and every collective the plan lists
is carried out on the ranks' buffers (`devices`). Nothing is computed from a full tensor
behind the plan's back; a plan file whose collectives do not lead to the layout a consumer
needs is reported by name before any arithmetic on that tensor.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import numpy as np

from autopar import progress
from autopar.errors import TooLargeError
from autopar.layout import Layout
from autopar.limits import MAX_VERIFY_BYTES
from autopar.lowering import GRAPH_OUTPUT, PlanProgram
from autopar.redistribute import Collective, Step, apply_steps
from autopar.spmd.compare import ATOL, RTOL, Tally, VerifyReport, collectives_differ, compare_output
from autopar.spmd.devices import assemble, run_step, shard
from autopar.spmd.kernels import Shards, run_operator
from autopar.spmd.reference import reference_outputs, session
from autopar.spmd.values import materialise
from autopar.units import human_bytes

Key = tuple[str, str, str]


class _PlanBroken(Exception):
    """The plan's collectives do not lead where a consumer needs its input."""


class _Runner:
    """Executes one plan rank by rank; buffers map (tensor, holder) to (layout, per-rank arrays)."""

    def __init__(self, program: PlanProgram, steps: Mapping[Key, list[Step]], values: Mapping[str, np.ndarray]) -> None:
        self.program, self.steps, self.values = program, steps, values
        self.buffers: dict[tuple[str, str], tuple[Layout, Shards]] = {}
        self.executed = Tally()

    def run(self) -> None:
        program = self.program
        last_read = {name: node for node, planned in enumerate(program.ops) for name in planned.rule.op.inputs if name}
        keep = set(program.graph.outputs)
        for node, planned in enumerate(program.ops):
            progress.report("verify forward", node, len(program.ops))
            op = planned.rule.op
            inputs = [self._input(node, slot) for slot in range(len(op.inputs))]
            outputs = run_operator(planned, inputs, program.num_devices, session)
            for name, layout, per_rank in zip(
                [o for o in op.outputs if o], [lay for o, lay in zip(op.outputs, planned.outputs) if o], outputs
            ):
                assert layout is not None
                self.buffers[(name, op.name)] = (layout, per_rank)
            for name in set(op.inputs):  # free what no later operator reads (large models, big batches)
                if name and last_read[name] == node and name not in keep:
                    for key in [key for key in self.buffers if key[0] == name]:
                        del self.buffers[key]

    def _redistribute(
        self, tensor: str, producer: str, consumer: str, src: Layout, dst: Layout, per_rank: Shards
    ) -> Shards:
        steps = self.steps.get((tensor, producer, consumer), [])
        try:
            reached = apply_steps(src, steps)
        except ValueError as exc:
            raise _PlanBroken(
                f"the plan's redistribution of {tensor!r} from {producer!r} to {consumer!r} is malformed: {exc}"
            ) from None
        if reached != dst:
            raise _PlanBroken(
                f"the plan's redistribution of {tensor!r} from {producer!r} to {consumer!r} leaves it"
                f" in layout {reached.describe()} but {consumer!r} needs {dst.describe()}"
                " (a collective is missing or wrong)"
            )
        itemsize = self.program.itemsize(self.program.graph.tensor(tensor))
        for step in steps:
            after = run_step(per_rank, step)
            moved = after[0] if step.kind == Collective.ALL_GATHER else per_rank[0]
            self.executed.add("forward", step, moved.size * itemsize)
            per_rank = after
        return per_rank

    def _input(self, node: int, slot: int) -> Shards | None:
        program = self.program
        planned = program.ops[node]
        name = planned.rule.op.inputs[slot]
        if not name:  # an absent optional input: the spec may have no entry for it
            return None
        layout = planned.input_layout(slot)
        info = program.graph.tensor(name)
        if info.kind == "constant" or program.owner.get(name) == (node, slot):
            per_rank = shard(self.values[name], layout, program.mesh_bits)  # stored or loaded as this op wants
            if info.kind != "constant":
                self.buffers[(name, planned.name)] = (layout, per_rank)
            return per_rank
        source = program.producer_of(name)
        src_layout, held = self.buffers[(name, source)]
        return self._redistribute(name, source, planned.name, src_layout, layout, held)

    def output(self, name: str) -> np.ndarray:
        producer = self.program.graph.producer[name]
        layout, per_rank = self.buffers[(name, producer)]
        if layout.partial:
            target = Layout(layout.dims)
            per_rank = self._redistribute(name, producer, GRAPH_OUTPUT, layout, target, per_rank)
            layout = target
        return assemble(per_rank, layout, self.program.graph.tensor(name).shape)


def verification_bytes(program: PlanProgram) -> int:
    """About how much a forward check holds: every weight and input whole (for the reference) and
    again as shards, the reference's activations and every rank's shards of them (a replicated
    activation is held once per rank), each bounded by its sum (onnxruntime and the ranks free what
    is no longer read)."""
    graph = program.graph
    tensors = graph.tensors.values()
    values = sum(t.numel * np.dtype(t.dtype).itemsize for t in tensors if t.kind != "activation")
    activations = sum(t.numel * np.dtype(t.dtype).itemsize for t in tensors if t.kind == "activation")
    shards = 0
    for planned in program.ops:
        for name, layout in zip(planned.rule.op.outputs, planned.outputs):
            if name and layout is not None:
                info = graph.tensor(name)
                shards += layout.local_numel(info.shape) * program.num_devices * np.dtype(info.dtype).itemsize
    return 3 * values + activations + shards


def check_verification_size(program: PlanProgram) -> None:
    """Refuse, before drawing any value, a forward check this machine could not hold (`verification_bytes`)."""
    need = verification_bytes(program)
    if need > MAX_VERIFY_BYTES:
        raise TooLargeError(
            f"Verifying {program.graph.name!r} on {program.num_devices} devices would hold about {human_bytes(need)}"
            f" of weights, inputs and every rank's activations (limit {human_bytes(MAX_VERIFY_BYTES)}); verify"
            " at a smaller batch, or on fewer devices (each rank holds its own copy of what it does not split)."
        )


def verify_program(program: PlanProgram, seed: int = 0, rtol: float = RTOL, atol: float = ATOL) -> VerifyReport:
    """Run a plan's forward pass on its virtual devices and compare every output with one device."""
    start = time.perf_counter()
    check_verification_size(program)
    steps = {entry.key: [s.step() for s in entry.steps] for entry in program.redistributions}
    planned = Tally()
    for entry in program.redistributions:
        for s in entry.steps:
            planned.add("forward", s.step(), s.bytes)
    values = materialise(program.graph, seed)
    reference = reference_outputs(program.graph, values)
    runner = _Runner(program, steps, values)
    outputs: dict[str, dict[str, float | bool | None]] = {}
    problems: list[str] = []
    try:
        runner.run()
        for name, expected in reference.items():
            check = compare_output(name, runner.output(name), expected, rtol, atol)
            outputs[name] = check.to_dict()
            if check.problem:
                problems.append(check.problem)
    except _PlanBroken as exc:
        problems.append(str(exc))
    executed, planned_dict = runner.executed.as_dict(), planned.as_dict()
    if not problems and executed != planned_dict:
        problems.append(collectives_differ(executed, planned_dict))
    return VerifyReport(
        ok=not problems,
        devices=program.num_devices,
        outputs=outputs,
        collectives={"executed": executed, "planned": planned_dict},
        problems=problems,
        time_s=time.perf_counter() - start,
    )
