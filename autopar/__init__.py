"""autopar: an auto-parallel strategy search compiler.

ONNX graph in; a sharding strategy per operator out, scored by a hardware cost model
(Ascend 910 by default) and found by exact elimination dynamic programming.
"""

from autopar import verify as _verify_module  # noqa: F401  (bind the submodule first; the function wins)
from autopar.api import build, candidates, evaluate, plan, verify
from autopar.errors import AutoparError
from autopar.graph import Graph, load_model
from autopar.layout import Layout
from autopar.plan import Plan

__version__ = "0.1.0"

__all__ = ["AutoparError", "Graph", "Layout", "Plan", "build", "candidates", "evaluate", "load_model", "plan", "verify",
           "__version__"]
