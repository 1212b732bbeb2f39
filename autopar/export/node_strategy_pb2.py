"""MindSpore's strategy-checkpoint messages (`node_strategy.proto` beside this file), built without protoc.

`MESSAGES` declares every message of ``node_strategy.proto`` (package ``mindspore.straspb``) with
MindSpore's field names, numbers, types and labels; this module turns it into a
``FileDescriptorProto`` and the message classes at import. They live in a private descriptor pool,
so MindSpore's own ``mindspore.train.node_strategy_pb2`` (same full names, default pool) can be
imported beside them.

>>> item = ParallelStrategyItem(node_name="mm", parallel_strategys=ParallelStrategys(stage=0))
>>> item.parallel_strategys.parallel_strategy.add().dim.extend([2, 4])
>>> ParallelStrategyItem.FromString(item.SerializeToString()).parallel_strategys.parallel_strategy[0].dim[:]
[2, 4]
"""

from __future__ import annotations

from typing import Any

from google.protobuf import (  # type: ignore[import-untyped, unused-ignore]  # no stubs without types-protobuf
    descriptor_pb2,
    descriptor_pool,
    message_factory,
)

PACKAGE = "mindspore.straspb"
FILE_NAME = "autopar/node_strategy.proto"

_F = descriptor_pb2.FieldDescriptorProto
REQUIRED, REPEATED = _F.LABEL_REQUIRED, _F.LABEL_REPEATED
SCALARS = {"uint32": _F.TYPE_UINT32, "int32": _F.TYPE_INT32, "int64": _F.TYPE_INT64, "string": _F.TYPE_STRING}

# message -> fields (name, number, label, type: a scalar name or a message name), in file order
MESSAGES: dict[str, tuple[tuple[str, int, int, str], ...]] = {
    "ParallelStrategy": (("dim", 1, REPEATED, "uint32"),),
    "ParallelStrategys": (("stage", 1, REQUIRED, "uint32"), ("parallel_strategy", 2, REPEATED, "ParallelStrategy")),
    "ParallelStrategyItem": (
        ("node_name", 1, REQUIRED, "string"),
        ("parallel_strategys", 2, REQUIRED, "ParallelStrategys"),
    ),
    "DevMatrix": (("dim", 1, REPEATED, "uint32"),),
    "TensorMap": (("dim", 1, REPEATED, "int32"),),
    "ParamSplitShape": (("dim", 1, REPEATED, "int64"),),
    "IndicesOffset": (("dim", 1, REPEATED, "int64"),),
    "ParallelLayouts": (
        ("dev_matrix", 1, REPEATED, "DevMatrix"),
        ("tensor_map", 2, REPEATED, "TensorMap"),
        ("param_split_shape", 3, REPEATED, "ParamSplitShape"),
        ("indices_offset", 4, REPEATED, "IndicesOffset"),
        ("field", 5, REQUIRED, "int32"),
        ("opt_weight_shard_step", 6, REQUIRED, "int32"),
        ("opt_weight_shard_size", 7, REQUIRED, "int32"),
    ),
    "ParallelLayoutItem": (
        ("param_name", 1, REQUIRED, "string"),
        ("parallel_layouts", 2, REQUIRED, "ParallelLayouts"),
    ),
    "ParallelGroupRanks": (("dim", 1, REPEATED, "uint32"),),
    "ParallelGroupItem": (
        ("group_name", 1, REQUIRED, "string"),
        ("parallel_group_ranks", 2, REQUIRED, "ParallelGroupRanks"),
    ),
    "ParallelGroupMap": (
        ("parallel_group_item", 1, REPEATED, "ParallelGroupItem"),
        ("ckpt_restore_rank_list", 2, REQUIRED, "ParallelGroupRanks"),
    ),
    "ParallelStrategyMap": (
        ("current_stage", 1, REQUIRED, "uint32"),
        ("parallel_strategy_item", 2, REPEATED, "ParallelStrategyItem"),
        ("parallel_layout_item", 3, REPEATED, "ParallelLayoutItem"),
    ),
}


def file_descriptor_proto() -> descriptor_pb2.FileDescriptorProto:
    """``node_strategy.proto`` as a FileDescriptorProto (proto2, package mindspore.straspb)."""
    proto = descriptor_pb2.FileDescriptorProto(name=FILE_NAME, package=PACKAGE, syntax="proto2")
    for message, fields in MESSAGES.items():
        declared = proto.message_type.add(name=message)
        for name, number, label, kind in fields:
            field = declared.field.add(name=name, number=number, label=label)
            if kind in SCALARS:
                field.type = SCALARS[kind]
            else:
                field.type = _F.TYPE_MESSAGE
                field.type_name = f".{PACKAGE}.{kind}"
    return proto


POOL = descriptor_pool.DescriptorPool()
# by name, not Add()'s return value: the pure-Python protobuf (which MindSpore selects through
# PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION, inherited by child processes) returns None there
POOL.AddSerializedFile(file_descriptor_proto().SerializeToString())
DESCRIPTOR = POOL.FindFileByName(file_descriptor_proto().name)
_CLASSES = {name: message_factory.GetMessageClass(DESCRIPTOR.message_types_by_name[name]) for name in MESSAGES}

# The message classes (typed Any: their fields are made at run time).
ParallelStrategy: Any = _CLASSES["ParallelStrategy"]
ParallelStrategys: Any = _CLASSES["ParallelStrategys"]
ParallelStrategyItem: Any = _CLASSES["ParallelStrategyItem"]
DevMatrix: Any = _CLASSES["DevMatrix"]
TensorMap: Any = _CLASSES["TensorMap"]
ParamSplitShape: Any = _CLASSES["ParamSplitShape"]
IndicesOffset: Any = _CLASSES["IndicesOffset"]
ParallelLayouts: Any = _CLASSES["ParallelLayouts"]
ParallelLayoutItem: Any = _CLASSES["ParallelLayoutItem"]
ParallelGroupRanks: Any = _CLASSES["ParallelGroupRanks"]
ParallelGroupItem: Any = _CLASSES["ParallelGroupItem"]
ParallelGroupMap: Any = _CLASSES["ParallelGroupMap"]
ParallelStrategyMap: Any = _CLASSES["ParallelStrategyMap"]
