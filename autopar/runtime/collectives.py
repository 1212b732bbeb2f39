"""Collectives on torch tensors: on virtual ranks in one process, or with torch.distributed.

Both carry out a plan's `Step` (AllGather, ReduceScatter, AllToAll, AllReduce, local Slice) on
the buffers of the ranks a process computes: all N in the virtual runtime, its own one in a
real one. The group of a step is the ranks that differ only in its bits, ordered by the
index those bits spell (`autopar.layout.shard_index`), exactly as `autopar.spmd.devices` does
it in numpy, so a shard's position in a gathered tensor is the layout's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from autopar.layout import ReduceOp, shard_index
from autopar.redistribute import Collective, Step
from autopar.spmd.devices import group_of


class Collectives(Protocol):
    """Carries out steps on the buffers of ``ranks`` (the ranks this process computes)."""

    ranks: list[int]
    device: torch.device

    def run(self, buffers: list[torch.Tensor], step: Step) -> list[torch.Tensor]: ...


def _reduce(parts: Sequence[torch.Tensor], op: ReduceOp) -> torch.Tensor:
    out = parts[0]
    for part in parts[1:]:
        if op == ReduceOp.SUM:
            out = out + part
        elif op == ReduceOp.MAX:
            out = torch.maximum(out, part)
        else:
            out = torch.minimum(out, part)
    return out


class VirtualCollectives:
    """N virtual ranks in one process: a collective reads only its group's buffers."""

    def __init__(self, num_devices: int) -> None:
        self.ranks = list(range(num_devices))
        self.device = torch.device("cpu")

    def run(self, buffers: list[torch.Tensor], step: Step) -> list[torch.Tensor]:
        size = step.group_size
        dim = step.dim if step.dim is not None else 0
        result = []
        for rank in self.ranks:
            group = [buffers[q] for q in group_of(rank, step.bits)]
            me = shard_index(rank, step.bits)
            if step.kind == Collective.ALL_GATHER:
                result.append(torch.cat(group, dim=dim))
            elif step.kind == Collective.SLICE:
                result.append(torch.chunk(buffers[rank], size, dim=dim)[me].clone())
            elif step.kind == Collective.ALL_REDUCE:
                result.append(_reduce(group, step.reduce_op))
            elif step.kind == Collective.REDUCE_SCATTER:
                result.append(torch.chunk(_reduce(group, step.reduce_op), size, dim=dim)[me].clone())
            elif step.kind == Collective.ALL_TO_ALL:
                assert step.concat_dim is not None  # a validated plan step names it
                pieces = [torch.chunk(buffer, size, dim=dim)[me] for buffer in group]
                result.append(torch.cat(pieces, dim=step.concat_dim))
            else:
                raise ValueError(f"unknown collective {step.kind!r}")
        return result


_TORCH_OPS = {ReduceOp.SUM: "SUM", ReduceOp.MAX: "MAX", ReduceOp.MIN: "MIN"}


class DistributedCollectives:
    """One rank of a torch.distributed job: one process group per set of mesh bits.

    Every process creates every group in the same order (torch requires it), before any step
    runs. torch orders a group's members by global rank; a shard's place is its index under
    the step's bits, so buffers are permuted between the two orders.
    """

    def __init__(self, rank: int, num_devices: int, bit_sets: Sequence[tuple[int, ...]], device: torch.device) -> None:
        self.ranks = [rank]
        self.rank, self.device = rank, device
        self.groups: dict[tuple[int, ...], tuple[Any, list[int]]] = {}
        for bits in sorted(set(bit_sets)):
            seen: set[tuple[int, ...]] = set()
            for member in range(num_devices):
                group = tuple(group_of(member, bits))
                if group in seen:
                    continue
                seen.add(group)
                handle = dist.new_group(ranks=sorted(group))
                if rank in group:
                    self.groups[bits] = (handle, list(group))

    def run(self, buffers: list[torch.Tensor], step: Step) -> list[torch.Tensor]:
        (local,) = buffers
        handle, members = self.groups[step.bits]
        size = step.group_size
        dim = step.dim if step.dim is not None else 0
        me = shard_index(self.rank, step.bits)
        by_rank = sorted(members)  # torch's order of the group
        index_of = {member: shard_index(member, step.bits) for member in members}
        if step.kind == Collective.SLICE:
            return [torch.chunk(local, size, dim=dim)[me].clone()]
        if step.kind == Collective.ALL_REDUCE:
            out = local.detach().clone().contiguous()
            dist.all_reduce(out, op=getattr(dist.ReduceOp, _TORCH_OPS[step.reduce_op]), group=handle)
            return [out]
        if step.kind == Collective.ALL_GATHER:
            received = [torch.empty_like(local).contiguous() for _ in by_rank]
            dist.all_gather(received, local.detach().contiguous(), group=handle)
            ordered = sorted(zip(by_rank, received), key=lambda pair: index_of[pair[0]])
            return [torch.cat([tensor for _, tensor in ordered], dim=dim)]
        if step.kind == Collective.REDUCE_SCATTER:
            chunks = torch.chunk(local.detach(), size, dim=dim)
            inputs = [chunks[index_of[member]].contiguous() for member in by_rank]
            out = torch.empty_like(chunks[me]).contiguous()
            dist.reduce_scatter(out, inputs, op=getattr(dist.ReduceOp, _TORCH_OPS[step.reduce_op]), group=handle)
            return [out]
        if step.kind == Collective.ALL_TO_ALL:
            assert step.concat_dim is not None  # a validated plan step names it
            chunks = torch.chunk(local.detach(), size, dim=dim)
            inputs = [chunks[index_of[member]].contiguous() for member in by_rank]
            received = [torch.empty_like(inputs[0]) for _ in by_rank]
            dist.all_to_all(received, inputs, group=handle)
            ordered = sorted(zip(by_rank, received), key=lambda pair: index_of[pair[0]])
            return [torch.cat([tensor for _, tensor in ordered], dim=step.concat_dim)]
        raise ValueError(f"unknown collective {step.kind!r}")
