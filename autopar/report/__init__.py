"""The faces that read a plan: the HTML report (Jupyter) and the terminal tables.

They read the typed plan file and what the API hands them (`Comparison`), never the search; the
API registers the report as every `Plan`'s Jupyter display, and the core never imports this package.
"""

from autopar.report.html import Comparison, plan_html
from autopar.report.text import inspect_summary, inspect_table, plan_table, verify_table

__all__ = ["Comparison", "inspect_summary", "inspect_table", "plan_html", "plan_table", "verify_table"]
