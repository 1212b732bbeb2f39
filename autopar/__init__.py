"""autopar: an auto-parallel strategy search compiler.

ONNX graph in; a sharding strategy per operator out, scored by a hardware cost model
(Ascend 910 by default) and found by exact elimination dynamic programming.

The package's face: `plan`, `verify`, `sweep`, `export_plan`, `candidates`, `evaluate` and `build` (in
`autopar.api`), the values they return (`Plan`, with its `Degrees`; `VerifyReport`; `Sweep`), each printable
and shown in Jupyter (`autopar.api` registers how a plan shows itself when it is imported, as it is here).
No module of the package is named like these functions, so ``import autopar.<module>`` always finds the module.
"""

from autopar.api import Sweep, build, candidates, evaluate, export_plan, plan, sweep, verify
from autopar.errors import AutoparError
from autopar.graph import Graph, load_model
from autopar.layout import Layout
from autopar.lowering import Plan, PlanFile
from autopar.lowering.decisions import Degrees
from autopar.spmd import VerifyReport

__version__ = "0.1.0"

__all__ = [
    "AutoparError",
    "Degrees",
    "Graph",
    "Layout",
    "Plan",
    "PlanFile",
    "Sweep",
    "VerifyReport",
    "__version__",
    "build",
    "candidates",
    "evaluate",
    "export_plan",
    "load_model",
    "plan",
    "sweep",
    "verify",
]
