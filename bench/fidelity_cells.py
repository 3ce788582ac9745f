"""The sim-against-vLLM comparison, pure: one cell per profile, metric and percentile, the
relative error of the sim's figure against vLLM's, the verdict and the side-by-side table that
``zl-bench fidelity --against vllm`` (``bench.fidelity_vllm``) writes."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from harness.tables import Align, Column, fmt, markdown_table

METRICS: Final = ("ttft", "itl", "e2el")
PERCENTILES: Final = (50, 90, 99)


def relative_error(reference: float | None, model: float | None) -> float | None:
    """``(model - reference) / reference``; None when either is missing or the reference is 0."""
    if reference is None or model is None or reference == 0:
        return None
    return (model - reference) / reference


@dataclass(frozen=True)
class Cell:
    """One statistic of one profile: vLLM's figure, the sim's, and the sim's relative error."""

    profile: str
    metric: str
    percentile: int
    vllm_ms: float | None
    sim_ms: float | None

    @property
    def error(self) -> float | None:
        return relative_error(self.vllm_ms, self.sim_ms)

    def within(self, tolerance: float) -> bool:
        """A cell without both figures is not within: a missing figure is no agreement."""
        error = self.error
        return error is not None and abs(error) <= tolerance

    def as_dict(self, tolerance: float) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "error": self.error, "within": self.within(tolerance)}


def compare(
    profile: str, vllm_summary: Mapping[str, Any], sim_summary: Mapping[str, Any]
) -> list[Cell]:
    """The table's cells for one profile, from two ``harness.metrics.summarize`` summaries."""
    cells = []
    for metric in METRICS:
        for p in PERCENTILES:
            key = f"p{p}_{metric}_ms"
            cells.append(Cell(profile, metric, p, vllm_summary.get(key), sim_summary.get(key)))
    return cells


def verdict(cells: Sequence[Cell], tolerance: float) -> bool:
    """True when there are cells and every one is within ``tolerance``."""
    return bool(cells) and all(c.within(tolerance) for c in cells)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:+.1f} %"


TABLE_COLUMNS: Final = (
    Column("profile", align=Align.LEFT),
    Column("metric", align=Align.LEFT),
    Column("vLLM ms"),
    Column("sim ms"),
    Column("error"),
    Column("within", align=Align.LEFT),
)


def table_markdown(cells: Sequence[Cell], tolerance: float) -> str:
    """The side-by-side table: one row per profile, metric and percentile."""
    body = [
        [c.profile, f"p{c.percentile} {c.metric.upper()}", fmt(c.vllm_ms), fmt(c.sim_ms),
         _pct(c.error), "yes" if c.within(tolerance) else "NO"]
        for c in cells
    ]  # fmt: skip
    return markdown_table(TABLE_COLUMNS, body) + "\n"
