"""A pipelined plan as the runtime executes it: stages, the tensors crossing them, and each transfer.

A pipelined plan file holds one micro-batch's strategies on one stage's N/S devices and the
pipeline (`PipelineEntry`): each stage's range of operators and every tensor sent between
stages. `staged_program` reads that into a `StagedProgram`: the stage program (a `PlanProgram`
over the micro-batch's graph on N/S devices; a stage runs its own range of it), each crossing
with the layouts it leaves and arrives in, and refuses, in one sentence naming the tensor, the
stages and the micro-batch, a plan whose stages or sends would leave a rank waiting forever.

A crossing travels point to point (`routes`): each device of the reading stage receives its
region of the tensor from the device of the writing stage that holds it and agrees with it on
the most mesh bits (the matching device, when it holds the whole region); a partial writer
reduces first, within its stage. The gradient comes back the same way, reduced first over the
bits the reader leaves it partial on. Everything here is read from the plan: the runtime's
transfers and the planned ones come from the same layouts, so a difference is the runtime's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from autopar.cost.mesh import Mesh
from autopar.cost.model import CostModel
from autopar.errors import PlanFileError
from autopar.graph import Graph
from autopar.layout import Layout
from autopar.lowering.planfile import PlanFile, SendEntry
from autopar.lowering.program import PlanProgram, program_from_file

FORWARD, BACKWARD = "forward", "backward"


@dataclass(frozen=True)
class Piece:
    """One point-to-point message of a crossing: a region from a sending device to a receiving one
    (local ranks within their stages), with where it sits in each one's buffer."""

    sender: int
    receiver: int
    source: tuple[slice, ...]  # in the sender's local buffer
    target: tuple[slice, ...]  # in the receiver's local buffer
    numel: int


@dataclass(frozen=True)
class Crossing:
    """A tensor one stage's operator writes and a later stage's reads (one plan file send)."""

    index: int  # its place in the plan's sends: the message tag
    tensor: str
    producer: str
    consumer: str
    slot: int  # the consumer's input slot
    from_stage: int
    to_stage: int
    written: Layout  # the producer's output layout (may be partial)
    read: Layout  # the consumer's input layout
    gradient: Layout | None  # the consumer's gradient of it (partial over some bits), None: no gradient flows
    itemsize: int
    forward: tuple[Piece, ...]
    backward: tuple[Piece, ...]


@dataclass(frozen=True)
class Transfer:
    """One message as planned or as run: direction, crossing, micro-batch, global ranks, bytes."""

    direction: str
    crossing: int
    micro_batch: int
    sender: int
    receiver: int
    nbytes: int


@dataclass(frozen=True)
class StagedProgram:
    """A pipelined plan as the runtime executes it (see the module docstring)."""

    program: PlanProgram  # one micro-batch on one stage's devices
    stages: tuple[range, ...]  # each stage's operators (indices into program.ops)
    micro_batches: int
    crossings: tuple[Crossing, ...]
    num_devices: int

    @property
    def stage_devices(self) -> int:
        return self.program.num_devices

    def planned_transfers(self) -> list[Transfer]:
        """Every message the plan implies, in a fixed order: per crossing, micro-batch and direction."""
        found = []
        per = self.stage_devices
        for crossing in self.crossings:
            ways = (
                (FORWARD, crossing.forward, crossing.from_stage, crossing.to_stage),
                (BACKWARD, crossing.backward, crossing.to_stage, crossing.from_stage),
            )
            for m in range(self.micro_batches):
                for direction, pieces, sender, receiver in ways:
                    for piece in pieces:
                        found.append(
                            Transfer(
                                direction,
                                crossing.index,
                                m,
                                sender * per + piece.sender,
                                receiver * per + piece.receiver,
                                piece.numel * crossing.itemsize,
                            )
                        )
        return sorted(found, key=transfer_key)

    def describe(self, transfer: Transfer) -> str:
        """A transfer in words: tensor, stages, micro-batch and ranks."""
        crossing = self.crossings[transfer.crossing]
        stages = (crossing.from_stage, crossing.to_stage)
        if transfer.direction == BACKWARD:
            stages = stages[::-1]
        what = repr(crossing.tensor) if transfer.direction == FORWARD else f"the gradient of {crossing.tensor!r}"
        return (
            f"{what} from stage {stages[0]} (rank {transfer.sender}) to stage {stages[1]} (rank {transfer.receiver})"
            f" in micro-batch {transfer.micro_batch}"
        )


def transfer_key(transfer: Transfer) -> tuple[int, int, int, int, int]:
    return (transfer.crossing, transfer.micro_batch, transfer.direction == BACKWARD, transfer.receiver, transfer.sender)


def _box(layout: Layout, rank: int, shape: Sequence[int]) -> tuple[tuple[int, int], ...]:
    return tuple((s.start, s.stop) for s in layout.local_slices(rank, shape))


def routes(src: Layout, dst: Layout, shape: Sequence[int], devices: int) -> tuple[Piece, ...]:
    """The messages that give each of ``devices`` receivers its ``dst`` region from senders holding ``src``
    (whole, not partial): per distinct source region it overlaps, one sender, the one agreeing with the
    receiver on the most mesh bits (itself where it can).

    >>> [(p.sender, p.receiver, p.numel) for p in routes(Layout(((0,),)), Layout(((0,),)), (4,), 2)]
    [(0, 0, 2), (1, 1, 2)]
    >>> [(p.sender, p.receiver, p.numel) for p in routes(Layout(((0,),)), Layout(((),)), (4,), 2)]
    [(0, 0, 2), (1, 0, 2), (1, 1, 2), (0, 1, 2)]
    """
    pieces = []
    for receiver in range(devices):
        want = _box(dst, receiver, shape)
        holders: dict[tuple[tuple[int, int], ...], int] = {}
        for sender in sorted(range(devices), key=lambda q: (bin(q ^ receiver).count("1"), q)):
            holders.setdefault(_box(src, sender, shape), sender)
        for have, sender in holders.items():
            overlap = [(max(a, c), min(b, d)) for (a, b), (c, d) in zip(have, want)]
            if any(lo >= hi for lo, hi in overlap):
                continue
            numel = 1
            for lo, hi in overlap:
                numel *= hi - lo
            pieces.append(
                Piece(
                    sender,
                    receiver,
                    tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(overlap, have)),
                    tuple(slice(lo - c, hi - c) for (lo, hi), (c, _) in zip(overlap, want)),
                    numel,
                )
            )
    return tuple(pieces)


def stage_mesh(plan: PlanFile, stages: int) -> Mesh:
    """One stage's devices: the plan's mesh without the bits that spell the stage."""
    mesh = plan.mesh
    per = mesh.num_devices // stages
    bits = per.bit_length() - 1
    levels = [(level.name, [b for b in level.bits if b < bits]) for level in mesh.levels]
    return Mesh.named(per, [(name, b) for name, b in levels if b], plan.cost_model)


def staged_program(graph: Graph, plan: PlanFile, cost: CostModel) -> StagedProgram:
    """The runtime's view of a pipelined ``plan`` over ``graph`` (one micro-batch's); PlanFileError, one
    sentence, where a rank would wait forever: a stage out of order, a send missing or misdirected."""
    pipeline = plan.pipeline
    if pipeline is None:
        raise PlanFileError("The plan has no pipeline stages.")
    count = len(pipeline.stages)
    per = plan.devices // count
    if count & (count - 1) or per * count != plan.devices:
        raise PlanFileError(
            f"The plan's {count} stages do not divide its {plan.devices} devices in equal powers of two."
        )
    program = program_from_file(graph, plan, plan.devices, cost, stage_mesh(plan, count))
    names = [op.name for op in graph.ops]
    position = {name: node for node, name in enumerate(names)}
    for index, stage in enumerate(pipeline.stages):
        if stage.first_op not in position or stage.last_op not in position:
            missing = stage.first_op if stage.first_op not in position else stage.last_op
            raise PlanFileError(f"Stage {index} names operator {missing!r}, which the model does not have.")
    starts = {position[stage.first_op]: index for index, stage in enumerate(pipeline.stages)}
    if 0 not in starts:
        raise PlanFileError(f"No stage starts at the model's first operator {names[0]!r}.")
    stage_of, current = [], 0
    for node in range(len(names)):
        current = starts.get(node, current)
        stage_of.append(current)
    ranges = []
    for index in range(count):
        nodes = [node for node, s in enumerate(stage_of) if s == index]
        if not nodes or nodes != list(range(nodes[0], nodes[-1] + 1)):
            raise PlanFileError(f"Stage {index}'s operators are not one contiguous range of the model's operators.")
        ranges.append(range(nodes[0], nodes[-1] + 1))
    _check_parameters(graph, stage_of)
    listed: dict[tuple[str, str, str], list[tuple[int, SendEntry]]] = {}  # an operator may read a tensor twice
    for i, send in enumerate(pipeline.sends):
        listed.setdefault((send.tensor, send.from_op, send.to_op), []).append((i, send))
    crossings = []
    for node, op in enumerate(graph.ops):
        for slot, name in enumerate(op.inputs):
            if not name or graph.tensor(name).kind != "activation":
                continue
            producer = graph.producer[name]
            src, dst = stage_of[position[producer]], stage_of[node]
            if src == dst:
                continue
            if src > dst:
                raise PlanFileError(
                    f"Stage {dst} reads {name!r} (at {op.name!r}) from stage {src}, which runs after it: micro-batch"
                    f" 0's forward on stage {dst} would wait for it forever (the stages are out of order)."
                )
            found = listed[(name, producer, op.name)].pop(0) if listed.get((name, producer, op.name)) else None
            if found is None:
                raise PlanFileError(
                    f"The plan sends no {name!r} from stage {src} to stage {dst} ({producer!r} to {op.name!r}):"
                    f" micro-batch 0's forward on stage {dst} would wait for it forever."
                )
            index, send = found
            if (send.from_stage, send.to_stage) != (src, dst):
                raise PlanFileError(
                    f"The plan sends {name!r} from stage {send.from_stage} to stage {send.to_stage}, but"
                    f" {producer!r} runs on stage {src} and {op.name!r} on stage {dst}: micro-batch 0's forward on"
                    f" stage {dst} would wait for it forever."
                )
            crossings.append(_crossing(program, index, name, position[producer], node, slot, src, dst))
    left = [(i, send) for entries in listed.values() for i, send in entries]
    if left:
        _, send = min(left, key=lambda item: item[0])
        name, producer, consumer = send.tensor, send.from_op, send.to_op
        raise PlanFileError(
            f"The plan sends {name!r} from stage {send.from_stage} to stage {send.to_stage} ({producer!r} to"
            f" {consumer!r}), which no operator there reads from another stage: micro-batch 0's receive would"
            " never be posted."
        )
    for index, stage in enumerate(pipeline.stages):  # after the order: swapped stages name a tensor first
        if stage.first_device != index * per or stage.devices != per:
            raise PlanFileError(
                f"Stage {index} is on devices {stage.first_device}..{stage.first_device + stage.devices - 1}, but"
                f" stage {index} of {count} runs on devices {index * per}..{(index + 1) * per - 1}."
            )
    crossings.sort(key=lambda c: c.index)
    for crossing in crossings:
        _check_bytes(crossing, pipeline.sends[crossing.index].bytes, pipeline.sends[crossing.index].gradient_bytes)
    return StagedProgram(program, tuple(ranges), pipeline.micro_batches, tuple(crossings), plan.devices)


def _check_parameters(graph: Graph, stage_of: Sequence[int]) -> None:
    readers: dict[str, set[int]] = {}
    for node, op in enumerate(graph.ops):
        for name in op.inputs:
            if name and graph.tensor(name).kind == "parameter" and graph.tensor(name).trainable:
                readers.setdefault(name, set()).add(stage_of[node])
    for name, stages in sorted(readers.items()):
        if len(stages) > 1:
            first, second = sorted(stages)[:2]
            raise PlanFileError(
                f"Parameter {name!r} is read on stages {first} and {second}; the runtime keeps each trainable"
                " parameter on one stage, so cut the model where no weight is shared across the cut."
            )


def _crossing(
    program: PlanProgram, index: int, name: str, producer: int, consumer: int, slot: int, src: int, dst: int
) -> Crossing:
    info = program.graph.tensor(name)
    written_op, read_op = program.ops[producer], program.ops[consumer]
    written = written_op.outputs[list(written_op.rule.op.outputs).index(name)]
    assert written is not None  # a present output has a layout
    read = read_op.input_layout(slot)
    devices = program.num_devices
    gradient = None
    backward: tuple[Piece, ...] = ()
    if program.requires_grad.get(name, False):  # a reader without a gradient sends back zeros
        bits = read_op.gradient_bits[slot]
        gradient = Layout(read.dims, bits) if bits else Layout(read.dims)
        backward = routes(Layout(read.dims), Layout(written.dims), info.shape, devices)
    return Crossing(
        index,
        name,
        written_op.name,
        read_op.name,
        slot,
        src,
        dst,
        written,
        read,
        gradient,
        program.itemsize(info),
        routes(Layout(written.dims), Layout(read.dims), info.shape, devices),
        backward,
    )


def _check_bytes(crossing: Crossing, forward: int, backward: int) -> None:
    """The plan's bytes per device must be what the layouts give each receiving device."""
    got, back = _per_receiver(crossing.forward), _per_receiver(crossing.backward)
    if (got * crossing.itemsize, back * crossing.itemsize) != (forward, backward):
        raise PlanFileError(
            f"The plan's send of {crossing.tensor!r} from stage {crossing.from_stage} to stage {crossing.to_stage}"
            f" lists {forward} bytes forward and {backward} back per device, but its layouts move"
            f" {got * crossing.itemsize} and {back * crossing.itemsize}."
        )


def _per_receiver(pieces: Sequence[Piece]) -> int:
    """Elements the fullest receiver gets (every receiver gets as many: the regions are equal)."""
    totals: dict[int, int] = {}
    for piece in pieces:
        totals[piece.receiver] = totals.get(piece.receiver, 0) + piece.numel
    return max(totals.values(), default=0)
