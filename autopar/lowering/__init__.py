"""Lowering: a search result becomes a `Plan`, and a plan its typed plan file."""

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

__all__ = [
    "GRAPH_OUTPUT",
    "PLAN_FILE_FIELDS",
    "SCHEMA",
    "Plan",
    "PlanFile",
    "json_schema",
    "load_plan_file",
    "read_plan_file",
]
