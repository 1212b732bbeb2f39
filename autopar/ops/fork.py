"""Fork: autopar's own operator where one tensor fans out to several readers that split it alike.

ONNX has no such operator: the importer inserts one (`autopar.graph.forks`) after a tensor that
two or more operators read whole along a label they split (q, k and v reading a layer norm's
output, each splitting its weight's columns). It computes nothing: its output is its input. What
it adds is a place for the readers to meet, in both directions:

- forward, the tensor is redistributed once to the fork's layout, and readers that want that
  layout read it as it is (one AllGather for q, k and v, where each would gather its own copy);
- backward, the fork's output may take its gradient *partial* over the bits of its gradient
  label ``g``, a label no tensor carries: readers whose gradients come out partial over the same
  bits add them locally, and the fork's own input gradient, partial over ``g`` (a label its
  input lacks), is reduced once on the way back to the producer (Megatron's one AllReduce for
  q, k and v, or one ReduceScatter under sequence parallelism).

Its in_strategy has a second tuple, beyond its one input: the split of ``g``. With ``g`` unsplit the
fork is a plain pass-through, so every plan without forks is still one
with them, at the same cost. Exports and the strategy tables leave forks out: the readers'
strategies say everything a framework needs.
"""

from __future__ import annotations

from typing import Any

from autopar.ops.base import OpSpec, shape
from autopar.ops.registry import INTERNAL_DOMAIN, Keeps, LocalCall, no_flops, register
from autopar.ops.views import GraphView, NodeView

FORK_DOMAIN = INTERNAL_DOMAIN
FORK = "Fork"
GRADIENT_LABEL = "g"


def _local(call: LocalCall) -> list[Any]:
    return [call.inputs[0]]


def _torch(t: Any, op: NodeView, inputs: list[Any]) -> list[Any]:
    return [inputs[0]]


@register(
    FORK,
    domain=FORK_DOMAIN,
    flops=no_flops,
    keeps=Keeps.NOTHING,
    local_kernel=_local,
    torch_kernel=_torch,
    torch_local_kernel=_local,
    foldable=False,
    mindspore=None,
)
def fork(op: NodeView, graph: GraphView) -> OpSpec:
    """The input's dims in and out, and the gradient label last (on the lowest mesh bits, where a
    reader's split contraction or column label sits, so the fork can take the readers' layouts)."""
    labels: tuple[str, ...] = tuple(f"d{i}" for i in range(len(shape(graph, op.inputs[0]))))
    return OpSpec(
        inputs=(labels,),
        outputs=(labels,),
        op_class="free",
        label_order=(*labels, GRADIENT_LABEL),
        strategy_labels=(labels, (GRADIENT_LABEL,)),
    )
