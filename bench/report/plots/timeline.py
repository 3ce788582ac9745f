"""TTFT per request and ITL per chunk over run time, with faults and phases marked."""

from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure

from bench.report.data import RunData
from bench.report.plots.common import (
    NS,
    empty,
    mark_faults,
    new_figure,
    note,
    run_title,
    shade_phases,
    stack_color,
)
from harness import metrics, schema


def _per_record(recs: list[schema.RequestRecord], name: str) -> tuple[np.ndarray, np.ndarray]:
    """(send time in ns, value in ms) for each record that has the series ``name``."""
    times, values = [], []
    for rec in recs:
        for value in metrics.series([rec])[name]:
            times.append(rec.intended_start_ns)
            values.append(value)
    return np.asarray(times, dtype=float), np.asarray(values, dtype=float)


def _itl_points(recs: list[schema.RequestRecord]) -> tuple[np.ndarray, np.ndarray]:
    """(chunk time in ns, gap to the previous chunk in ms) for every pooled ITL sample."""
    times, values = [], []
    for rec in recs:
        gaps = metrics.series([rec])["itl"]
        times.extend(rec.chunk_ns[1 : 1 + len(gaps)])
        values.extend(gaps)
    return np.asarray(times, dtype=float), np.asarray(values, dtype=float)


def ttft_itl_timeline(run: RunData) -> Figure:
    """TTFT per request (at its intended send) and ITL per chunk over run time, with faults."""
    fig, axes = new_figure(2, 1, figsize=(11, 7), sharex=True, squeeze=False)
    run_title(fig, run, "TTFT and ITL over time (dashed lines: faults; grey spans: phases)")
    if not run.records:
        return empty(fig, "no request records in this run")
    ax_ttft, ax_itl = axes[:, 0]
    shown = {ax_ttft: 0, ax_itl: 0}
    for (stack, profile), recs in sorted(run.records.items()):
        color = stack_color(run, stack)
        label = stack if profile == run.profiles[0] else None
        t, v = _per_record(recs, "ttft")
        shown[ax_ttft] += v.size
        ax_ttft.scatter(
            (t - run.t0_ns) / NS, v, s=6, color=color, alpha=0.7, label=label, rasterized=True
        )
        t, v = _itl_points(recs)
        shown[ax_itl] += v.size
        ax_itl.scatter(
            (t - run.t0_ns) / NS, v, s=2, color=color, alpha=0.3, label=label, rasterized=True
        )
        errors = [r for r in recs if r.outcome != "completed"]
        if errors:
            ax_ttft.scatter(
                [(r.intended_start_ns - run.t0_ns) / NS for r in errors],
                [0.0] * len(errors),
                marker="x",
                color=color,
                s=18,
                label=f"{stack} {profile}: error/lost ({len(errors)})",
            )
    missing = {ax_ttft: "no request got a first token", ax_itl: "no request streamed 2 chunks"}
    for ax, ylabel in ((ax_ttft, "TTFT (ms)"), (ax_itl, "ITL (ms, per chunk)")):
        if not shown[ax]:
            note(ax, f"{missing[ax]}: no {ylabel.split()[0]} to show")
        shade_phases(ax, run, label=ax is ax_itl)
        mark_faults(ax, run, label=ax is ax_ttft)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", markerscale=2)
    ax_itl.set_xlabel("time since run start (s)")
    fig.tight_layout()
    return fig
