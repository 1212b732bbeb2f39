"""A pipelined plan's training step: each stage's ranks run their operators over the micro-batches in 1F1B order.

Each stage runs the SPMD step (`TrainingStep`) of one micro-batch on its own range of operators
and its N/S ranks. What a stage reads from an earlier one arrives point to point before the
micro-batch's forward; the gradients a later stage sends back arrive before its backward (the
messages are the plan's, `autopar.lowering.staged`). Parameter gradients accumulate over the
micro-batches unsynchronised; each stage then runs its gradient synchronisation once.

`Links` carries the messages: `VirtualLinks` (one process computes every rank: a mailbox) or
`DistributedLinks` (torch.distributed isend/irecv, tagged by crossing, micro-batch and direction).
A receive that does not arrive within the timeout ends the rank with one sentence naming the
tensor, the stages, the ranks and the micro-batch, never a hang.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

import numpy as np
import torch

from autopar.layout import Layout
from autopar.lowering.staged import BACKWARD, FORWARD, Crossing, Piece, StagedProgram, Transfer
from autopar.lowering.stages import one_f_one_b
from autopar.runtime.collectives import Collectives
from autopar.runtime.program import Buffers, PlanBroken, Schedule, TrainingStep
from autopar.spmd.compare import Tally

Held = tuple[dict[str, Any], list[np.ndarray]]


class Links(Protocol):
    """Point-to-point messages between the ranks of two stages."""

    def send(self, transfer: Transfer, tensor: torch.Tensor) -> None: ...

    def receive(self, transfer: Transfer, like: torch.Tensor) -> torch.Tensor: ...

    def finish(self) -> None: ...


class VirtualLinks:
    """Every rank in this process: a message waits in a mailbox until its receiver takes it."""

    def __init__(self, program: StagedProgram) -> None:
        self.program = program
        self.mailbox: dict[Transfer, torch.Tensor] = {}

    def send(self, transfer: Transfer, tensor: torch.Tensor) -> None:
        self.mailbox[transfer] = tensor.detach().clone()

    def receive(self, transfer: Transfer, like: torch.Tensor) -> torch.Tensor:
        if transfer not in self.mailbox:
            raise PlanBroken(f"{self.program.describe(transfer)} was never sent")
        return self.mailbox.pop(transfer)

    def finish(self) -> None:
        if self.mailbox:
            transfer = min(self.mailbox, key=lambda t: (t.crossing, t.micro_batch, t.receiver))
            raise PlanBroken(f"{self.program.describe(transfer)} was sent but never received")


class DistributedLinks:
    """One rank of a torch.distributed job: isend/irecv, each receive waited on at most ``timeout_s``."""

    def __init__(self, program: StagedProgram, timeout_s: float) -> None:
        self.program, self.timeout = program, timedelta(seconds=timeout_s)
        self.pending: list[Any] = []

    def _tag(self, transfer: Transfer) -> int:
        return (transfer.crossing * self.program.micro_batches + transfer.micro_batch) * 2 + (
            transfer.direction == BACKWARD
        )

    def send(self, transfer: Transfer, tensor: torch.Tensor) -> None:
        import torch.distributed as dist

        payload = tensor.detach().contiguous().clone()
        self.pending.append((dist.isend(payload, transfer.receiver, tag=self._tag(transfer)), payload, transfer))

    def receive(self, transfer: Transfer, like: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        out = torch.empty_like(like).contiguous()
        work = dist.irecv(out, transfer.sender, tag=self._tag(transfer))
        assert work is not None  # a point-to-point call always returns its request
        try:
            work.wait(self.timeout)
        except RuntimeError:
            raise PlanBroken(
                f"rank {transfer.receiver} waited {self.timeout.total_seconds():g} s for"
                f" {self.program.describe(transfer)}, which never came"
            ) from None
        return out

    def finish(self) -> None:
        for work, _, transfer in self.pending:
            try:
                work.wait(self.timeout)
            except RuntimeError:
                raise PlanBroken(
                    f"rank {transfer.sender} waited {self.timeout.total_seconds():g} s for"
                    f" {self.program.describe(transfer)} to be received"
                ) from None
        self.pending.clear()


@dataclass
class StagedResult:
    """What some ranks hold after a pipelined step: each graph output per micro-batch and each parameter's
    gradient (buffers of the stage's ranks this process computes), the collectives and messages run."""

    ranks: list[int]
    outputs: dict[str, list[Held]] = field(default_factory=dict)
    gradients: dict[str, Held] = field(default_factory=dict)
    executed: Tally = field(default_factory=Tally)
    received: list[Transfer] = field(default_factory=list)
    sent: list[Transfer] = field(default_factory=list)
    problem: str | None = None


def _numpy(layout: Layout, buffers: Buffers) -> Held:
    return layout.to_dict(), [b.detach().cpu().numpy() for b in buffers]


class StageRun:
    """One stage's micro-batches on the ranks ``collectives`` computes (all N/S, or one)."""

    def __init__(
        self,
        staged: StagedProgram,
        stage: int,
        schedule: Schedule,
        values: Sequence[Mapping[str, np.ndarray]],
        cotangents: Sequence[Mapping[str, np.ndarray]] | None,
        collectives: Collectives,
        links: Links,
        result: StagedResult,
    ) -> None:
        self.staged, self.stage, self.schedule = staged, stage, schedule
        self.values, self.cotangents = values, cotangents
        self.collectives, self.links, self.result = collectives, links, result
        self.per = staged.stage_devices
        self.local = [rank % self.per for rank in collectives.ranks]
        self.nodes = staged.stages[stage]
        names = {staged.program.ops[node].name for node in self.nodes}
        self.outputs = [name for name in staged.program.graph.outputs if staged.program.graph.producer[name] in names]
        self.into = [c for c in staged.crossings if c.to_stage == stage]
        self.out = [c for c in staged.crossings if c.from_stage == stage]
        self.steps: dict[int, TrainingStep] = {}
        self.grads: dict[str, tuple[Layout, Buffers]] = {}  # parameter -> accumulated, unsynchronised
        self.first: TrainingStep | None = None

    # --- messages --------------------------------------------------------------------------

    def _transfer(self, direction: str, crossing: Crossing, m: int, piece: Piece) -> Transfer:
        sender_stage, receiver_stage = crossing.from_stage, crossing.to_stage
        if direction == BACKWARD:
            sender_stage, receiver_stage = receiver_stage, sender_stage
        nbytes = piece.numel * crossing.itemsize
        return Transfer(
            direction,
            crossing.index,
            m,
            sender_stage * self.per + piece.sender,
            receiver_stage * self.per + piece.receiver,
            nbytes,
        )

    def _send(self, direction: str, crossing: Crossing, m: int, buffers: Buffers, pieces: Sequence[Piece]) -> None:
        for index, local in enumerate(self.local):
            for piece in pieces:
                if piece.sender == local:
                    transfer = self._transfer(direction, crossing, m, piece)
                    self.links.send(transfer, buffers[index][piece.source])
                    self.result.sent.append(transfer)

    def _receive(self, direction: str, crossing: Crossing, m: int, layout: Layout, dtype: torch.dtype) -> Buffers:
        shape = layout.local_shape(self.staged.program.graph.tensor(crossing.tensor).shape)
        out = []
        for local in self.local:
            buffer = torch.zeros(shape, dtype=dtype, device=self.collectives.device)
            pieces = crossing.forward if direction == FORWARD else crossing.backward
            for piece in pieces:
                if piece.receiver == local:
                    transfer = self._transfer(direction, crossing, m, piece)
                    buffer[piece.target] = self.links.receive(transfer, buffer[piece.target])
                    self.result.received.append(transfer)
            out.append(buffer)
        return out

    def _dtype(self, name: str) -> torch.dtype:
        info = self.staged.program.graph.tensor(name)
        return torch.float64 if info.is_float else torch.from_numpy(np.zeros(0, dtype=np.dtype(info.dtype))).dtype

    # --- 1F1B ------------------------------------------------------------------------------

    def forward(self, m: int) -> None:
        step = TrainingStep(
            self.staged.program, self.schedule, self.values[m], self.collectives, self.nodes, defer_sync=True
        )
        self.first = self.first or step
        for crossing in self.into:
            buffers = self._receive(FORWARD, crossing, m, crossing.read, self._dtype(crossing.tensor))
            step.received[(crossing.tensor, crossing.consumer, crossing.slot)] = buffers
        step.forward()
        for name in self.outputs:
            layout, buffers = step.output(name)
            self.result.outputs.setdefault(name, []).append(_numpy(layout, buffers))
        for crossing in self.out:
            _, buffers = step.reduce_for_send(crossing.tensor, crossing.producer)
            self._send(FORWARD, crossing, m, buffers, crossing.forward)
        if self.cotangents is not None:
            self.steps[m] = step
        else:
            self.result.executed.merge(step.executed)

    def backward(self, m: int) -> None:
        assert self.cotangents is not None  # a backward runs only with cotangents
        step = self.steps.pop(m)
        arrived: dict[tuple[str, str], tuple[Layout, Buffers]] = {}
        for crossing in self.out:
            if crossing.gradient is None:
                continue
            layout = Layout(crossing.written.dims)
            buffers = self._receive(BACKWARD, crossing, m, layout, self._dtype(crossing.tensor))
            key = (crossing.tensor, crossing.producer)
            if key in arrived:
                buffers = [a + b for a, b in zip(arrived[key][1], buffers)]
            arrived[key] = (layout, buffers)
        seeds = {name: seed for name, seed in self.cotangents[m].items() if name in self.outputs}
        step.backward(seeds, arrived)
        for crossing in self.into:
            if crossing.gradient is None:
                continue
            found = step.outgoing.get((crossing.tensor, crossing.consumer, crossing.slot))
            if found is None:  # the reader gives this input no gradient
                shape = Layout(crossing.read.dims).local_shape(self.staged.program.graph.tensor(crossing.tensor).shape)
                found = (
                    Layout(crossing.read.dims),
                    [torch.zeros(shape, dtype=torch.float64, device=self.collectives.device) for _ in self.local],
                )
            elif found[0] != crossing.gradient:
                raise PlanBroken(
                    f"the gradient of {crossing.tensor!r} leaves {crossing.consumer!r} in layout"
                    f" {found[0].describe()}, not the {crossing.gradient.describe()} its strategy gives"
                )
            _, buffers = step.reduce_gradient(crossing.tensor, *found)
            self._send(BACKWARD, crossing, m, buffers, crossing.backward)
        for name, (layout, buffers) in step.unsynced.items():
            if name in self.grads:
                buffers = [a + b for a, b in zip(self.grads[name][1], buffers)]
            self.grads[name] = (layout, buffers)
        self.result.executed.merge(step.executed)
        if step is not self.first:  # other readers' gradients, synchronised by their own paths
            assert self.first is not None  # a backward follows a forward
            owned = set(self.owned())
            for (name, holder), (layout, buffers) in step.grads.items():
                if name in owned:
                    self.first._accumulate(name, holder, layout, buffers)

    def owned(self) -> list[str]:
        program = self.staged.program
        return sorted(
            name
            for name, (node, _) in program.owner.items()
            if node in self.nodes
            and program.graph.tensor(name).kind == "parameter"
            and program.graph.tensor(name).trainable
        )

    def finish(self, parameters: Sequence[str]) -> None:
        """Each accumulated gradient's synchronisation, once; then what the ranks hold."""
        if self.first is None:
            return
        first = self.first
        if self.cotangents is None:
            return
        first.executed = Tally()  # its micro-batch's collectives are counted already
        for name in sorted(self.grads):
            first.synchronise(name, *self.grads[name])
        self.result.executed.merge(first.executed)
        for name in parameters:
            if name in self.owned():
                self.result.gradients[name] = _numpy(*first.parameter_gradient(name))


def stage_order(staged: StagedProgram, training: bool) -> list[list[tuple[str, int]]]:
    """Each stage's (``"F"`` or ``"B"``, micro-batch) in 1F1B order (forwards alone without training)."""
    if not training:
        return [[("F", m) for m in range(staged.micro_batches)] for _ in staged.stages]
    rows = one_f_one_b(len(staged.stages), staged.micro_batches, 1.0, 2.0)
    return [[(kind, m) for kind, m, _ in row] for row in rows]


def execute_stage(
    staged: StagedProgram,
    schedule: Schedule,
    values: Sequence[Mapping[str, np.ndarray]],
    cotangents: Sequence[Mapping[str, np.ndarray]] | None,
    collectives: Collectives,
    links: Links,
    parameters: Sequence[str],
    stage: int,
) -> StagedResult:
    """What one rank of a real runtime runs: its stage's micro-batches in 1F1B order."""
    result = StagedResult(list(collectives.ranks))
    run = StageRun(staged, stage, schedule, values, cotangents, collectives, links, result)
    for kind, m in stage_order(staged, cotangents is not None)[stage]:
        run.forward(m) if kind == "F" else run.backward(m)
    run.finish(parameters)
    links.finish()
    return result


def execute_virtual(
    staged: StagedProgram,
    schedule: Schedule,
    values: Sequence[Mapping[str, np.ndarray]],
    cotangents: Sequence[Mapping[str, np.ndarray]] | None,
    collectives: Collectives,
    parameters: Sequence[str],
) -> StagedResult:
    """Every rank in this process: the stages' 1F1B orders interleaved as the schedule times them."""
    result = StagedResult(list(range(staged.num_devices)))
    links = VirtualLinks(staged)
    runs = [
        StageRun(staged, stage, schedule, values, cotangents, collectives, links, result)
        for stage in range(len(staged.stages))
    ]
    if cotangents is None:
        events = [(float(m), stage, "F", m) for stage in range(len(runs)) for m in range(staged.micro_batches)]
    else:
        rows = one_f_one_b(len(staged.stages), staged.micro_batches, 1.0, 2.0)
        events = sorted((start, stage, kind, m) for stage, row in enumerate(rows) for kind, m, start in row)
    try:
        for _, stage, kind, m in sorted(events):
            runs[stage].forward(m) if kind == "F" else runs[stage].backward(m)
        for run in runs:
            run.finish(parameters)
        links.finish()
    except PlanBroken as exc:
        result.problem = str(exc)
    return result
