"""The faces that read a plan: the HTML report (Jupyter) and the terminal tables.

Importing this package registers the HTML renderer as every `Plan`'s Jupyter display; the
core never imports it.
"""

from autopar.lowering import Plan
from autopar.report.html import plan_html
from autopar.report.text import inspect_summary, inspect_table, plan_table, verify_table

Plan.html_renderer = plan_html

__all__ = ["inspect_summary", "inspect_table", "plan_html", "plan_table", "verify_table"]
