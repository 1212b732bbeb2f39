"""The imported model as autopar sees it: operators, tensors with static shapes, dataflow."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import onnx

TensorKind = Literal["input", "parameter", "constant", "activation"]
FLOAT_TYPES = frozenset(np.dtype(t) for t in ("float16", "float32", "float64"))


@dataclass(frozen=True)
class ElidedValue:
    """A tensor whose shape and dtype are known but whose values are not stored (elided weights)."""

    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)


@dataclass
class TensorInfo:
    """A tensor of the graph: its static shape, element type and role."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    kind: TensorKind
    trainable: bool = False
    value: np.ndarray | None = field(default=None, repr=False)

    @property
    def numel(self) -> int:
        return math.prod(self.shape) if self.shape else 1

    @property
    def is_float(self) -> bool:
        return np.dtype(self.dtype) in FLOAT_TYPES


@dataclass
class OpNode:
    """One operator of the graph, in topological order (``index``)."""

    name: str
    op_type: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: dict[str, Any]
    index: int
    flops: float = 0.0
    domain: str = ""
    proto: onnx.NodeProto | None = field(default=None, repr=False, compare=False)
    source: str = ""  # the exporting framework's name for the layer ("blocks.0.qkv"), where it left one


@dataclass
class Graph:
    """The imported model: operators, tensors and the dataflow between them."""

    name: str
    ops: list[OpNode]
    tensors: dict[str, TensorInfo]
    inputs: list[str]
    outputs: list[str]
    model: onnx.ModelProto = field(repr=False)
    producer: dict[str, str] = field(default_factory=dict)
    consumers: dict[str, list[str]] = field(default_factory=dict)
    renamed_ops: dict[str, str] = field(default_factory=dict)  # a name given here -> the name in the file

    def __post_init__(self) -> None:
        self._by_name = {op.name: op for op in self.ops}
        for op in self.ops:
            for out in op.outputs:
                if out:
                    self.producer[out] = op.name
            for inp in op.inputs:
                if inp:
                    users = self.consumers.setdefault(inp, [])
                    if op.name not in users:
                        users.append(op.name)

    def op(self, name: str) -> OpNode:
        return self._by_name[name]

    @property
    def opset(self) -> int:
        """The model's version of the default ONNX domain (operators changed meaning across versions)."""
        return opset_of(self.model)

    @property
    def parameters(self) -> list[TensorInfo]:
        return [t for t in self.tensors.values() if t.kind == "parameter"]

    @property
    def fingerprint(self) -> str:
        """A digest of the structure (operators, attributes, wiring, parameter and constant shapes), not
        of weights or data shapes: the same model at another batch has the same fingerprint."""
        digest = hashlib.sha256()
        for op in self.ops:
            attributes = sorted(
                (k, repr(v) if not isinstance(v, np.ndarray) else v.tobytes()) for k, v in op.attrs.items()
            )
            digest.update(repr((op.name, op.op_type, op.domain, op.inputs, op.outputs, attributes)).encode())
        for name in sorted(self.tensors):
            info = self.tensors[name]
            if info.kind in ("parameter", "constant"):
                digest.update(repr((name, info.kind, info.shape, info.dtype)).encode())
        return digest.hexdigest()[:16]

    @property
    def total_flops(self) -> float:
        return sum(op.flops for op in self.ops)

    def tensor(self, name: str) -> TensorInfo:
        return self.tensors[name]


def opset_of(model: onnx.ModelProto) -> int:
    for entry in model.opset_import:
        if entry.domain in ("", "ai.onnx"):
            return int(entry.version)
    return 1
