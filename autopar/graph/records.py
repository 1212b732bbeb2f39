"""What PyTorch's dynamo exporter recorded beside an operator and wrote differently in the graph.

The exporter keeps each operator's FX node in its metadata (``pkg.torch.onnx.fx_node``). One of its
translations changes what the operator computes: a BatchNorm in training mode
(``aten._native_batch_norm_legit_functional`` with ``training=True``) is written as ONNX's inference
form, normalising with the running statistics rather than the batch's own (torchlib forces
``training = False`` for onnxruntime's sake). A plan of that file would be the plan of another model:
one whose normalisation splits over the batch freely. `restore_training_batch_norms` gives such an
operator back its ``training_mode``, so the strategy rule keeps the batch statistics whole
(`autopar.ops.norm`) and verification computes what the module computes.

>>> import onnx
>>> node = onnx.helper.make_node("BatchNormalization", list("xsbmv"), ["y"])
>>> entry = node.metadata_props.add()
>>> call = f"call_function[target={TRAINING_BATCH_NORM}.default]"
>>> entry.key, entry.value = FX_NODE, call + "(args = (%x, %s, %b, %m, %v, True, 0.1, 1e-05), kwargs = {})"
>>> graph = onnx.helper.make_graph([node], "g", [], [])
>>> proto = onnx.helper.make_model(graph)
>>> restore_training_batch_norms(proto)
1
>>> list(proto.graph.node[0].output)
['y', 'y.running_mean', 'y.running_var']
>>> onnx.helper.get_attribute_value(proto.graph.node[0].attribute[0])
1
"""

from __future__ import annotations

import re

import onnx

FX_NODE = "pkg.torch.onnx.fx_node"
TRAINING_BATCH_NORM = "torch.ops.aten._native_batch_norm_legit_functional"


def fx_record(node: onnx.NodeProto) -> str:
    """The FX node the exporter recorded for ``node`` ("" where it recorded none)."""
    return next((entry.value for entry in node.metadata_props if entry.key == FX_NODE), "")


def fx_node_name(record: str) -> str | None:
    """The FX node an operator's ``pkg.torch.onnx.fx_node`` record names.

    >>> fx_node_name("%linear : [num_users=1] = call_function[target=torch.ops.aten.linear.default](...)")
    'linear'
    """
    found = re.match(r"\s*%([^\s:]+)", record)
    return found.group(1) if found else None


def _trains(record: str) -> bool:
    """Whether a recorded BatchNorm call normalises with the batch's statistics: its ``training`` argument,
    the sixth, is ``True``."""
    if f"target={TRAINING_BATCH_NORM}" not in record or "args = (" not in record:
        return False
    arguments = record.split("args = (", 1)[1].split(")", 1)[0].split(",")
    return len(arguments) > 5 and arguments[5].strip() == "True"


def restore_training_batch_norms(proto: onnx.ModelProto) -> int:
    """Set ``training_mode`` on every BatchNormalization the exporter recorded as training; how many."""
    restored = 0
    for node in proto.graph.node:
        if node.op_type != "BatchNormalization" or node.domain or not _trains(fx_record(node)):
            continue
        if any(attribute.name == "training_mode" and attribute.i for attribute in node.attribute):
            continue
        kept = [attribute for attribute in node.attribute if attribute.name != "training_mode"]
        del node.attribute[:]
        node.attribute.extend([*kept, onnx.helper.make_attribute("training_mode", 1)])
        while len(node.output) < 3:  # the training form writes the updated running statistics too (read by none)
            node.output.append(f"{node.output[0]}.running_{'mean' if len(node.output) == 1 else 'var'}")
        restored += 1
    return restored
