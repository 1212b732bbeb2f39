"""What an operator's rule and kernels read of the imported graph, as protocols.

The importer (`autopar.graph`) consults the registry (FLOPs, foldability, which constants are
weights), so `autopar.ops` must not import the graph back: it names only what it reads here.
`autopar.graph`'s `Graph`, `OpNode` and `TensorInfo` satisfy these protocols as they are.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol


class TensorView(Protocol):
    """A tensor's static shape and, for a constant, its value."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def value(self) -> Any: ...


class NodeView(Protocol):
    """One operator: its type, wiring and attributes."""

    @property
    def name(self) -> str: ...

    @property
    def op_type(self) -> str: ...

    @property
    def domain(self) -> str: ...

    @property
    def inputs(self) -> tuple[str, ...]: ...

    @property
    def outputs(self) -> tuple[str, ...]: ...

    @property
    def attrs(self) -> Mapping[str, Any]: ...


class GraphView(Protocol):
    """The model around an operator: its tensors and its opset."""

    @property
    def tensors(self) -> Mapping[str, TensorView]: ...

    @property
    def opset(self) -> int: ...

    def tensor(self, name: str) -> TensorView: ...
