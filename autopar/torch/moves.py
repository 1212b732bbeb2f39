"""The plan's collectives inside autograd: each move runs its forward steps and, on the way back, the steps
the plan lists for the gradient, never their automatic duals.

A read of a tensor in another layout is `Move`: forward, the plan's redistribution (producer to consumer);
backward, the plan's gradient path (`autopar.lowering.planfile.GradientPath`) from the layout the
consumer's local backward leaves the gradient in to the one its producer sums its readers' gradients in,
with the no-communication step of making a whole gradient partial (`autopar.redistribute.as_partial`)
where a fork takes it so. A parameter read by its owner goes through `Load` (identity, or the parallel
optimizer's AllGather) whose backward is the gradient synchronisation; its other readers read the loaded
value and send their gradients straight to the parameter (`ParameterRead`). Every collective is counted
by phase in a `Tally` (`autopar.spmd.compare`), so a step's collectives can be compared with the plan's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from autopar.layout import shard_index
from autopar.redistribute import Collective, Step
from autopar.runtime.collectives import Collectives
from autopar.spmd.compare import Tally


@dataclass
class Mover:
    """Carries out steps on this rank's tensor and counts them (``itemsize``: bytes per element counted)."""

    collectives: Collectives
    tally: Tally
    rank: int

    def run(self, local: torch.Tensor, steps: Sequence[Step], phase: str, itemsize: int) -> torch.Tensor:
        for step in steps:
            after = self.collectives.run([local.detach()], step)[0]
            numel = after.numel() if step.kind == Collective.ALL_GATHER else local.numel()
            self.tally.add(phase, step, numel * itemsize)
            local = after
        return local

    def masked(self, local: torch.Tensor, bits: Sequence[int]) -> torch.Tensor:
        """A gradient whole over ``bits`` made partial over them: one rank of each group keeps it."""
        if bits and shard_index(self.rank, bits) != 0:
            return torch.zeros_like(local)
        return local


Backward = Callable[[torch.Tensor], torch.Tensor | None]


class Move(torch.autograd.Function):
    """``forward(x)`` then, for the gradient, ``backward(grad)``: both plain callables on local tensors."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        x: torch.Tensor,
        forward: Callable[[torch.Tensor], torch.Tensor],
        backward: Backward,
    ) -> torch.Tensor:
        ctx.backward = backward  # type: ignore[attr-defined]
        out = forward(x.detach())
        return out if out is not x else out.view_as(out)

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, None, None]:
        return ctx.backward(grad.contiguous()), None, None  # type: ignore[attr-defined]


class ParameterRead(torch.autograd.Function):
    """A parameter's non-owning reader: the value comes from the loaded parameter (no gradient through it);
    the gradient goes to the stored parameter, by the reader's own path (``backward``)."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        stored: torch.Tensor,
        loaded: torch.Tensor,
        forward: Callable[[torch.Tensor], torch.Tensor],
        backward: Backward,
    ) -> torch.Tensor:
        ctx.backward = backward  # type: ignore[attr-defined]
        out = forward(loaded.detach())
        return out.clone() if out is loaded else out

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, None, None, None]:
        return ctx.backward(grad.contiguous()), None, None, None  # type: ignore[attr-defined]
