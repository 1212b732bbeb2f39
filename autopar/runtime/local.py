"""One operator on one rank's shards, in torch: the torch twin of `autopar.spmd.kernels`.

The same two adjustments follow from the spec (a bias under a split contraction is added by
the first rank of each partial group only; a mean over a split axis divides by the global
count), and an operator's registered ``torch_local_kernel`` does the rest (Reshape's local
target, OneHot's class range, a masked Gather). Everything stays differentiable.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from autopar.layout import shard_index
from autopar.ops import LocalCall
from autopar.runtime.single import run_op
from autopar.strategy import OpRule


def run_local(
    rule: OpRule,
    exponents: Sequence[int],
    rank: int,
    inputs: list[torch.Tensor | None],
    output_shapes: Sequence[tuple[int, ...] | None],
) -> list[torch.Tensor]:
    """``rule.op``'s outputs on ``rank`` from its local inputs under the strategy ``exponents``."""
    op, graph, spec = rule.op, rule.graph, rule.spec
    bits = rule.label_bits(exponents)
    reduced = [label for label in spec.reduced_labels if bits[label]]
    if reduced and not all(shard_index(rank, bits[label]) == 0 for label in reduced):
        for slot in spec.local_once_inputs:
            value = inputs[slot] if slot < len(inputs) else None
            if value is not None:  # times zero, not a new zero: its gradient (zero) still flows through autograd
                inputs[slot] = value * 0

    def run(local: list[torch.Tensor | None]) -> list[torch.Tensor]:
        return run_op(op, graph, local)

    kernel = rule.definition.torch_local_kernel if rule.definition is not None else None
    if kernel is not None:
        outputs = list(kernel(LocalCall(op, graph, spec, bits, rank, inputs, list(output_shapes), run)))
    else:
        outputs = run(inputs)
    if spec.local_mean and reduced:
        outputs[0] = outputs[0] / (1 << sum(len(bits[label]) for label in reduced))
    return outputs
