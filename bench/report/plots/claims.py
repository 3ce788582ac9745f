"""The claims' evidence: every trial's figure beside the interval it was decided on, and the held
side of the threshold, one panel per figure; drawn from ``claims.json``, so the picture is of the
verdicts as written, not of a second evaluation."""

from __future__ import annotations

import math
from typing import Final

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from bench.report import claims
from bench.report.data import RunData
from bench.report.plots.common import empty, new_figure, run_title
from bench.report.verdicts import Band, Status
from harness.curves import Interval

COLUMNS: Final = 3
STATUS_COLORS: Final = {
    Status.HELD: "#2ca02c",
    Status.NOT_HELD: "#d62728",
    Status.UNDECIDED: "#ff7f0e",
    Status.NOT_MEASURED: "#7f7f7f",
}
NO_CLAIMS: Final = "no claims.json in this run: `zl-bench report` decides the claims and writes it"
NO_FIGURES: Final = (
    "no claim was decided on an interval over trials in this run (each claim's reason is in the "
    "report's claims table)"
)


def _panels(results: list[claims.ClaimResult]) -> list[tuple[claims.ClaimResult, str]]:
    """(claim, figure name) for every figure that has at least one trial's value."""
    return [
        (c, name)
        for c in results
        for name, figure in c.figures.items()
        if any(v is not None for v in figure.per_repeat)
    ]


def _band(ax: Axes, band: Band | None) -> None:
    """Shade the held side of the threshold."""
    if band is None:
        return
    high = band.high if band.high is not None else math.inf
    ax.axhspan(band.low, min(high, 1e12), color="#2ca02c", alpha=0.12, label=f"held: {band.text()}")
    ax.axhline(band.low, color="#2ca02c", linewidth=0.8)
    if band.high is not None:
        ax.axhline(band.high, color="#2ca02c", linewidth=0.8)


def _panel(ax: Axes, claim: claims.ClaimResult, name: str) -> None:
    figure: Interval = claim.figures[name]
    points = [v for v in figure.per_repeat if v is not None]
    color = STATUS_COLORS[claim.status]
    xs = [0.9 + 0.2 * k / max(1, len(points) - 1) for k in range(len(points))]
    ax.scatter(xs, points, s=18, color="0.3", zorder=3, label="each trial")
    if figure.value is not None and figure.low is not None and figure.high is not None:
        ax.errorbar(
            [1.4],
            [figure.value],
            yerr=[[figure.value - figure.low], [figure.high - figure.value]],
            fmt="o",
            color=color,
            capsize=4,
            zorder=3,
            label=f"mean, {figure.confidence:.0%} interval (n={figure.n})",
        )
    _band(ax, claim.bands.get(name))
    low = min([*points, figure.low if figure.low is not None else points[0]])
    high = max([*points, figure.high if figure.high is not None else points[0]])
    band = claim.bands.get(name)
    if band is not None:
        low, high = min(low, band.low), max(high, band.high if band.high is not None else high)
    pad = 0.15 * (high - low or abs(high) or 1.0)
    ax.set_ylim(low - pad, high + pad)
    ax.set_xlim(0.6, 1.7)
    ax.set_xticks([])
    ax.set_title(f"{claim.key}: {name}\n{claim.status}", fontsize=8, color=color)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=6, loc="best")


def claim_trials(run: RunData) -> Figure:
    """Each claim figure's trials, its interval over trials and the held band, from claims.json."""
    written = claims.read(run.path)
    panels = _panels(written.claims) if written is not None else []
    rows = max(1, math.ceil(len(panels) / COLUMNS))
    fig, axes = new_figure(rows, COLUMNS, figsize=(4 * COLUMNS, 3.2 * rows + 0.8), squeeze=False)
    run_title(fig, run, "Seed claims: each trial's figure, the interval over trials, the held band")
    flat = list(axes.flat)
    for ax in flat[len(panels) :]:
        ax.set_axis_off()
    if written is None:
        return empty(fig, NO_CLAIMS)
    if not panels:
        return empty(fig, NO_FIGURES)
    for ax, (claim, name) in zip(flat, panels, strict=False):
        _panel(ax, claim, name)
    fig.tight_layout()
    return fig
