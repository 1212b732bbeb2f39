"""One operator on one rank's local shards, for the SPMD verifier.

Almost every operator runs unchanged on its shards (that is what a strategy rule promises);
onnxruntime executes it on the local shapes. The exceptions are spelled out here:
- Reshape and Expand targets become the local output shape;
- a bias under a split contraction (Gemm, Conv) is added only by the first rank of each
  partial group, so the reduction counts it once;
- a mean over a split axis (ReduceMean, a mean loss) divides by the global count (its partial
  results then sum);
- OneHot over a split class axis writes only the classes the rank holds;
- Gather over a split axis looks up only the rows the rank holds and writes zeros elsewhere.
"""

from __future__ import annotations


import numpy as np
import onnx
from onnx import helper

from autopar.ops.indexing import GATHERED
from autopar.search.problem import SearchProblem
from autopar.strategy import OpRule


def _mini_model(rule: OpRule, graph, local_inputs: list[np.ndarray | None]) -> onnx.ModelProto:
    op = rule.op
    node = onnx.NodeProto()
    node.CopyFrom(op.proto)
    # one graph input per slot: a tensor read twice may arrive in two different layouts
    for slot, name in enumerate(op.inputs):
        if name:
            node.input[slot] = _slot_name(slot)
    inputs = [helper.make_tensor_value_info(_slot_name(slot), helper.np_dtype_to_tensor_dtype(x.dtype), list(x.shape))
              for slot, (name, x) in enumerate(zip(op.inputs, local_inputs)) if name]
    outputs = [helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(np.dtype(graph.tensor(name).dtype)),
                                             None) for name in op.outputs if name]
    mini = helper.make_graph([node], f"local_{op.name}", inputs, outputs)
    model = helper.make_model(mini, opset_imports=list(graph.model.opset_import), ir_version=graph.model.ir_version)
    return model


def _slot_name(slot: int) -> str:
    return f"autopar_input_{slot}"


def _is_first_of_partial_group(rank: int, bits: dict[str, tuple[int, ...]], reduced: tuple[str, ...]) -> bool:
    return all(((rank >> b) & 1) == 0 for label in reduced for b in bits[label])


def run_local(ort, problem: SearchProblem, rule: OpRule, choice: int, inputs: list, ranks: int) -> list[list[np.ndarray]]:
    """Each output's per-rank buffers after running ``rule.op`` on the ranks' local inputs."""
    from autopar.verify import _session

    op, graph = rule.op, problem.graph
    exps = rule.candidates[choice]
    in_layouts, out_layouts = rule.candidate_layouts(choice)
    bits = rule.label_bits(exps)
    reduced = tuple(label for label in rule.spec.reduced_labels if bits[label])
    out_shapes = [layout.local_shape(graph.tensor(name).shape) if name else None
                  for name, layout in zip(op.outputs, out_layouts)]
    if op.op_type == "OneHot":
        return [[_one_hot(rule, exps, inputs, rank) for rank in range(ranks)]]
    if op.op_type == "Gather" and bits.get(GATHERED):
        return [[_gather_rows(rule, exps, inputs, rank) for rank in range(ranks)]]
    session = None
    results: list[list[np.ndarray]] = [[] for name in op.outputs if name]
    for rank in range(ranks):
        local = [x[rank] if x is not None else None for x in inputs]
        for slot in rule.spec.local_once_inputs:
            if slot < len(local) and local[slot] is not None and reduced and not _is_first_of_partial_group(
                    rank, bits, reduced):
                local[slot] = np.zeros_like(local[slot])
        if op.op_type in ("Reshape", "Expand"):
            local[1] = np.asarray(out_shapes[0], dtype=np.int64)
        if session is None:
            session = _session(ort, _mini_model(rule, graph, local))
        feeds = {_slot_name(slot): x for slot, (name, x) in enumerate(zip(op.inputs, local)) if name}
        outs = session.run(None, feeds)
        if rule.spec.local_mean and reduced:
            outs[0] = (outs[0] / (1 << sum(len(bits[label]) for label in reduced))).astype(outs[0].dtype)
        for position, value in enumerate(outs):
            results[position].append(np.asarray(value))
    return results


def _shard_of(rank: int, bits: tuple[int, ...]) -> int:
    """Which shard of a dimension split over ``bits`` (most significant first) a rank holds."""
    shard = 0
    for bit in bits:
        shard = (shard << 1) | ((rank >> bit) & 1)
    return shard


def _gather_rows(rule: OpRule, exps, inputs, rank: int) -> np.ndarray:
    """Gather from a rank's rows of the gathered axis; indices outside them give zeros."""
    data = np.asarray(inputs[0][rank])
    indices = np.asarray(inputs[1][rank]).astype(np.int64)
    axis = rule.spec.inputs[0].index(GATHERED)
    full = rule.graph.tensor(rule.op.inputs[0]).shape[axis]
    local = data.shape[axis]
    indices = np.where(indices < 0, indices + full, indices) - _shard_of(rank, rule.label_bits(exps)[GATHERED]) * local
    held = (indices >= 0) & (indices < local)
    picked = np.take(data, np.where(held, indices, 0), axis=axis)
    mask = held.reshape((1,) * axis + held.shape + (1,) * (data.ndim - axis - 1))
    return np.where(mask, picked, np.zeros((), dtype=data.dtype))


def _one_hot(rule: OpRule, exps, inputs, rank: int) -> np.ndarray:
    """OneHot on a rank's slice of the class axis: ones where (index - first class) falls in range."""
    indices = np.asarray(inputs[0][rank]).astype(np.int64)
    depth = int(np.asarray(inputs[1][rank]).reshape(-1)[0])
    off_value, on_value = np.asarray(inputs[2][rank]).reshape(-1)[:2]
    out_labels = rule.spec.outputs[0]
    axis = out_labels.index("cls")
    bits = rule.label_bits(exps)["cls"]
    split = 1 << len(bits)
    local_depth = depth // split
    indices = np.where(indices < 0, indices + depth, indices) - _shard_of(rank, bits) * local_depth
    classes = np.arange(local_depth).reshape([-1 if d == axis else 1 for d in range(indices.ndim + 1)])
    hot = np.expand_dims(indices, axis) == classes
    return np.where(hot, on_value, off_value).astype(np.asarray(inputs[2][rank]).dtype)


__all__ = ["run_local"]
