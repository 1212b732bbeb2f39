"""The visual report of a plan (HTML for Jupyter); reads the core, never the reverse."""

from autopar.report.html import plan_html

__all__ = ["plan_html"]
