"""The report: loads a saved results directory, draws the plots, checks the claims, writes HTML.

Nothing here runs a benchmark; everything starts again from the files in ``results/<run-id>/``.
"""

from bench.report.data import RunData, load_run

__all__ = ["RunData", "load_run"]
