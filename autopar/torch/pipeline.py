"""A pipelined plan on the user's module: each rank's stage a `torch.distributed.pipelining` stage under 1F1B.

The plan cuts the operators into stages over the slowest mesh bits (`autopar.lowering.staged`): rank r runs
stage ``r // per`` (``per`` ranks a stage) on its shards. `StageModule` is that stage as a module: its forward
runs the stage's units for the next micro-batch (`autopar.torch.step`; data inputs are each stage's own, taken
from the step's batch, not passed along) and returns what later stages read, one tensor per crossing, reduced
within the stage where its writer leaves it partial; the last stage returns the loss. `PlannedStage` is torch's
``PipelineStage`` whose point-to-point messages are the plan's: a crossing whose reader wants another layout
than its writer leaves arrives in pieces from several ranks of the writing stage (`autopar.lowering.staged.routes`),
where torch's own stage sends each whole output to one peer. torch's ``Schedule1F1B`` runs the micro-batches;
the gradient synchronisation runs once after them (`autopar.torch.step.RankProgram.synchronise`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage

from autopar.lowering.staged import BACKWARD, FORWARD, Crossing, Piece, StagedProgram
from autopar.spmd.compare import Tally


def _shape(slices: Sequence[slice]) -> tuple[int, ...]:
    return tuple(int(s.stop) - int(s.start) for s in slices)


def send_label(direction: str, sender_stage: int, receiver_stage: int) -> str:
    """How a message is counted: its direction and stages (as `autopar.runtime.staged_verify` counts them)."""
    return f"{direction} {sender_stage}->{receiver_stage}"


class PlannedStage(PipelineStage):
    """torch's pipeline stage, its messages the plan's pieces (see the module docstring)."""

    def __init__(
        self,
        module: torch.nn.Module,
        staged: StagedProgram,
        rank: int,
        device: torch.device,
        group: Any,
        tally: Tally,
        dtype_of: Callable[[str], torch.dtype],
    ) -> None:
        per = staged.stage_devices
        stage = rank // per
        self.staged, self.per, self.local, self.tally = staged, per, rank % per, tally
        self.into = [c for c in staged.crossings if c.to_stage == stage]
        self.out = [c for c in staged.crossings if c.from_stage == stage]
        self.dtype_of = dtype_of
        graph = staged.program.graph
        inputs = tuple(
            torch.zeros(c.read.local_shape(graph.tensor(c.tensor).shape), dtype=dtype_of(c.tensor)).requires_grad_(
                c.gradient is not None
            )
            for c in self.into
        )
        last = stage == len(staged.stages) - 1
        outputs: tuple[torch.Tensor, ...] = (
            (torch.zeros((), requires_grad=True),)
            if last
            else tuple(
                torch.zeros(
                    c.written.local_shape(graph.tensor(c.tensor).shape), dtype=dtype_of(c.tensor)
                ).requires_grad_(c.gradient is not None)
                for c in self.out
            )
        )
        super().__init__(module, stage, len(staged.stages), device, input_args=inputs, output_args=outputs, group=group)
        self._pending: dict[tuple[str, int], list[tuple[int, tuple[slice, ...], torch.Tensor]]] = {}
        self._sending: list[torch.Tensor] = []

    def _global(self, stage: int, local: int) -> int:
        return stage * self.per + local

    def _receive(self, key: tuple[str, int], crossings: list[Crossing], direction: str) -> list[dist.P2POp]:
        ops, pending = [], []
        for index, crossing in enumerate(crossings):
            pieces: Sequence[Piece] = crossing.forward if direction == FORWARD else crossing.backward
            sender_stage = crossing.from_stage if direction == FORWARD else crossing.to_stage
            for piece in pieces:
                if piece.receiver != self.local:
                    continue
                buffer = torch.empty(_shape(piece.target), dtype=self.dtype_of(crossing.tensor), device=self.device)
                ops.append(dist.P2POp(dist.irecv, buffer, self._global(sender_stage, piece.sender)))
                pending.append((index, piece.target, buffer))
        self._pending[key] = pending
        return ops

    def _send(
        self, values: Sequence[torch.Tensor | None], crossings: list[Crossing], direction: str
    ) -> list[dist.P2POp]:
        ops = []
        for crossing, value in zip(crossings, values):
            if value is None:
                continue
            pieces: Sequence[Piece] = crossing.forward if direction == FORWARD else crossing.backward
            sender_stage, receiver_stage = (
                (crossing.from_stage, crossing.to_stage)
                if direction == FORWARD
                else (crossing.to_stage, crossing.from_stage)
            )
            for piece in pieces:
                if piece.sender != self.local:
                    continue
                payload = value.detach()[piece.source].contiguous()
                self._sending.append(payload)
                ops.append(dist.P2POp(dist.isend, payload, self._global(receiver_stage, piece.receiver)))
                self.tally.add_send(
                    send_label(direction, sender_stage, receiver_stage), piece.numel * crossing.itemsize
                )
        return ops

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        return self._receive((FORWARD, fwd_chunk_id), self.into, FORWARD)

    def _retrieve_recv_activations(self, fwd_chunk_id: int) -> Any:
        graph = self.staged.program.graph
        infos = self.args_recv_info[fwd_chunk_id]
        for info, crossing in zip(infos, self.into):
            shape = crossing.read.local_shape(graph.tensor(crossing.tensor).shape)
            info.buffer = torch.zeros(shape, dtype=self.dtype_of(crossing.tensor), device=self.device)
        for index, target, buffer in self._pending.pop((FORWARD, fwd_chunk_id), []):
            infos[index].buffer[target] = buffer  # type: ignore[index]
        return super()._retrieve_recv_activations(fwd_chunk_id)

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        outputs, _ = self.fwd_cache[fwd_chunk_id]
        return self._send(list(outputs), self.out, FORWARD)

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        if not self.has_backward or self.is_last:
            return []
        return self._receive((BACKWARD, bwd_chunk_id), self.out, BACKWARD)

    def _retrieve_recv_grads(self, bwd_chunk_id: int) -> Any:
        graph = self.staged.program.graph
        grads: list[torch.Tensor | None] = [
            None
            if crossing.gradient is None
            else torch.zeros(crossing.written.local_shape(graph.tensor(crossing.tensor).shape), device=self.device)
            for crossing in self.out
        ]
        for index, target, buffer in self._pending.pop((BACKWARD, bwd_chunk_id), []):
            held = grads[index]
            assert held is not None  # only a crossing with a gradient has backward pieces
            held[target] = buffer
        return tuple(grads)

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        if not self.has_backward or self.is_first:
            return []
        self._check_chunk_id(bwd_chunk_id)
        grads = self.bwd_cache.pop(bwd_chunk_id)
        return self._send(list(grads), self.into, BACKWARD)

    def clear_runtime_states(self) -> None:
        super().clear_runtime_states()
        self._sending.clear()
        self._pending.clear()


class StageModule(torch.nn.Module):
    """One stage of the plan as a module: ``forward(*received)`` runs the next micro-batch (module docstring)."""

    def __init__(self, run: Callable[[int, Sequence[torch.Tensor]], Any]) -> None:
        super().__init__()
        self.run = run
        self.micro_batch = 0

    def forward(self, *received: torch.Tensor) -> Any:
        out = self.run(self.micro_batch, received)
        self.micro_batch += 1
        return out
