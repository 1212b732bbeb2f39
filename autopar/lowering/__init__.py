"""Lowering: a search result becomes a `Plan`, a plan its typed plan file, and either the
`PlanProgram` the verifiers and the runtime execute (they read it, never the search)."""

from autopar.lowering.plan import Plan
from autopar.lowering.planfile import (
    GRAPH_OUTPUT,
    PLAN_FILE_FIELDS,
    SCHEMA,
    PlanFile,
    json_schema,
    load_plan_file,
    read_plan_file,
)
from autopar.lowering.program import PlannedOp, PlanProgram, program_from_file, program_of

__all__ = [
    "GRAPH_OUTPUT",
    "PLAN_FILE_FIELDS",
    "SCHEMA",
    "Plan",
    "PlanFile",
    "PlanProgram",
    "PlannedOp",
    "json_schema",
    "load_plan_file",
    "program_from_file",
    "program_of",
    "read_plan_file",
]
