"""The imported model as autopar sees it: operators, tensors with static shapes, dataflow."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal

import numpy as np
import onnx

from autopar.ops.registry import INTERNAL_DOMAIN

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


@dataclass(frozen=True)
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


@dataclass(frozen=True)
class OpNode:
    """One operator of the graph, in topological order (``index``).

    Frozen, so a rule, a cost or a plan can hold it without copying. ``attrs`` is read-only by
    type; its values are kept as onnx decodes them (lists), which the fingerprint spells.
    """

    name: str
    op_type: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: Mapping[str, Any]
    index: int
    flops: float = 0.0
    domain: str = ""
    proto: onnx.NodeProto | None = field(default=None, repr=False, compare=False)
    source: str = ""  # the exporting framework's name for the layer ("blocks.0.qkv"), where it left one


@dataclass(frozen=True)
class Graph:
    """The imported model: operators, tensors and the dataflow between them.

    Frozen and built once by the importer; the dataflow maps (``producer``, ``consumers``) are
    derived from the operators on first use.

    >>> relu = OpNode("relu", "Relu", ("x",), ("y",), {}, 0)
    >>> tensors = {n: TensorInfo(n, (2,), "float32", "activation") for n in ("x", "y")}
    >>> g = Graph("g", (relu,), tensors, ("x",), ("y",), onnx.ModelProto())
    >>> g.producer["y"], g.consumers["x"]
    ('relu', ('relu',))
    """

    name: str
    ops: tuple[OpNode, ...]
    tensors: Mapping[str, TensorInfo]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    model: onnx.ModelProto = field(repr=False)
    renamed_ops: Mapping[str, str] = field(default_factory=dict)  # a name given here -> the name in the file
    frozen: tuple[str, ...] = ()  # trainable parameters the user froze (`build.freeze`), which the plan file lists

    @cached_property
    def _by_name(self) -> Mapping[str, OpNode]:
        return {op.name: op for op in self.ops}

    @cached_property
    def position(self) -> Mapping[str, int]:
        """Each operator's index in `ops`."""
        return {op.name: index for index, op in enumerate(self.ops)}

    @cached_property
    def producer(self) -> Mapping[str, str]:
        """The operator writing each computed tensor."""
        return {out: op.name for op in self.ops for out in op.outputs if out}

    @cached_property
    def consumers(self) -> Mapping[str, tuple[str, ...]]:
        """The operators reading each tensor, in graph order, each once."""
        users: dict[str, list[str]] = {}
        for op in self.ops:
            for inp in op.inputs:
                if inp and op.name not in users.setdefault(inp, []):
                    users[inp].append(op.name)
        return {name: tuple(names) for name, names in users.items()}

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
        inserted = {op.outputs[0]: op.inputs[0] for op in self.ops if op.domain == INTERNAL_DOMAIN}
        for op in self.ops:
            if op.domain == INTERNAL_DOMAIN:
                continue  # the importer's own operators (forks) follow from the rest
            inputs = tuple(inserted.get(name, name) for name in op.inputs)
            attributes = sorted(
                (k, repr(v) if not isinstance(v, np.ndarray) else v.tobytes()) for k, v in op.attrs.items()
            )
            digest.update(repr((op.name, op.op_type, op.domain, inputs, op.outputs, attributes)).encode())
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
