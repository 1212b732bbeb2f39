"""Each operator's test cases, kept next to its registration: tiny models built from a declarative spec.

Every family module lists its ``CASES`` (`named`); the operator tests gather them from the
registered families (`all_cases(FAMILIES, check)`), so adding an operator is its module, cases included. A case
is checked one way or both: ``"kernel"`` — the operator alone, its torch kernel equal to
onnxruntime on one device (small odd shapes, every attribute and opset variant);
``"strategies"`` — the operator verified on virtual devices under its candidate strategies,
forward and backward (shapes that split). The operator under test is named ``op``; ``before``
nodes feed it where a case needs more than graph inputs and constants.

>>> spec = one("Relu", ["X"], [("X", F, [2, 3])])
>>> (case,) = named(kernel={"relu": spec})
>>> case.name, case.checks, [n.name for n in case.model().graph.node]
('relu', frozenset({'kernel'}), ['op'])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

F, I64, B, U8 = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL, TensorProto.UINT8
X2, X4 = [("X", F, [3, 4])], [("X", F, [2, 3, 5, 6])]
XZ = [("X", F, [3, 4]), ("Z", F, [1, 4])]
BOOLS = [("A", B, [3, 4]), ("Z", B, [4])]
Data = tuple[str, int, tuple[int, ...]]
KERNEL, STRATEGIES = "kernel", "strategies"


@dataclass(frozen=True)
class Node:
    """One ONNX node of a case."""

    op_type: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    name: str = "op"
    attrs: Mapping[str, Any] = field(default_factory=dict)

    def proto(self) -> onnx.NodeProto:
        return helper.make_node(self.op_type, list(self.inputs), list(self.outputs), name=self.name, **self.attrs)


@dataclass(frozen=True)
class OpCase:
    """A tiny model around one operator: graph inputs ``data`` (name, element type, shape), constant
    initializers, the nodes ``before`` it, and the opset. ``declared`` types outputs that ONNX's
    shape inference leaves untyped (function operators without an inference rule, such as
    GroupNormalization)."""

    op: Node
    data: tuple[Data, ...]
    constants: tuple[tuple[str, np.ndarray], ...] = ()
    opset: int = 17
    before: tuple[Node, ...] = ()
    name: str = ""
    checks: frozenset[str] = frozenset({KERNEL, STRATEGIES})
    declared: tuple[Data, ...] = ()

    @property
    def op_type(self) -> str:
        return self.op.op_type

    def model(self) -> onnx.ModelProto:
        """The checked model, its outputs typed by ONNX shape inference."""
        nodes = [node.proto() for node in (*self.before, self.op)]
        inputs = [helper.make_tensor_value_info(n, t, list(s)) for n, t, s in self.data]
        initializers = [numpy_helper.from_array(value, name) for name, value in self.constants]
        graph = helper.make_graph(nodes, "tiny", inputs, [], initializer=initializers)
        model = helper.make_model(
            graph, opset_imports=[helper.make_opsetid("", self.opset)], ir_version=8 if self.opset <= 17 else 9
        )
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
        known = {n: helper.make_tensor_value_info(n, t, list(s)) for n, t, s in self.declared}
        known.update({vi.name: vi for vi in inferred.graph.value_info})
        model.graph.output.extend(known[n] for n in self.op.outputs if n)  # '' skips an optional output
        onnx.checker.check_model(model)
        return model


def one(
    op_type: str,
    inputs: Sequence[str],
    data: Iterable[tuple[str, int, Sequence[int]]],
    consts: Iterable[tuple[str, np.ndarray]] = (),
    outputs: Sequence[str] = ("Y",),
    opset: int = 17,
    before: Iterable[Node] = (),
    declared: Iterable[tuple[str, int, Sequence[int]]] = (),
    **attrs: Any,
) -> OpCase:
    """A case of ``op_type`` reading ``inputs`` (graph inputs ``data`` and constants ``consts``)."""
    return OpCase(
        Node(op_type, tuple(inputs), tuple(outputs), attrs=attrs),
        tuple((n, t, tuple(s)) for n, t, s in data),
        tuple(consts),
        opset,
        tuple(before),
        declared=tuple((n, t, tuple(s)) for n, t, s in declared),
    )


def node(op_type: str, inputs: Sequence[str], outputs: Sequence[str], name: str, **attrs: Any) -> Node:
    """A node feeding the operator under test."""
    return Node(op_type, tuple(inputs), tuple(outputs), name, attrs)


def named(
    kernel: Mapping[str, OpCase] | None = None,
    strategies: Mapping[str, OpCase] | None = None,
    both: Mapping[str, OpCase] | None = None,
) -> tuple[OpCase, ...]:
    """A module's cases, each named and checked as the table it is listed in says."""
    tables = (({KERNEL}, kernel), ({STRATEGIES}, strategies), ({KERNEL, STRATEGIES}, both))
    return tuple(
        dataclasses.replace(spec, name=name, checks=frozenset(checks))
        for checks, table in tables
        for name, spec in (table or {}).items()
    )


def all_cases(families: Iterable[ModuleType], check: str) -> dict[str, OpCase]:
    """The families' cases that are checked as ``check``, by name (the caller passes
    ``autopar.ops.FAMILIES``: this module is imported by each family, so it cannot import them)."""
    found: dict[str, OpCase] = {}
    for family in families:
        for case in getattr(family, "CASES", ()):
            if check in case.checks:
                if case.name in found:
                    raise ValueError(f"two {check} cases are named {case.name!r}")
                found[case.name] = case
    return found


# --- constants ----------------------------------------------------------------------------------


def const(name: str, values: Any, dtype: Any = np.int64) -> tuple[str, np.ndarray]:
    return name, np.asarray(values, dtype=dtype)


def ints(name: str, values: Any) -> tuple[str, np.ndarray]:
    return const(name, values, np.int64)


def floats(name: str, values: Any) -> tuple[str, np.ndarray]:
    return const(name, values, np.float32)


def ones(name: str, shape: Sequence[int]) -> tuple[str, np.ndarray]:
    """Smooth values from 0.5 to 1.5 (a weight whose products stay well scaled)."""
    return const(name, np.linspace(0.5, 1.5, int(np.prod(shape))).reshape(shape), np.float32)


def weight(name: str, shape: Sequence[int], seed: int = 0) -> tuple[str, np.ndarray]:
    """Standard normal values, reproducible by ``seed``."""
    return name, np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
