"""GPU utilisation and KV/allocator fragmentation over run time (NVML, engine telemetry)."""

from __future__ import annotations

from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from bench.report.data import RunData
from bench.report.plots.common import (
    NS,
    empty,
    mark_faults,
    new_figure,
    run_title,
    shade_phases,
    stack_color,
    telemetry_rows,
)

SERIES_STYLES = (
    ("kv_usage", "-", "KV occupancy"),
    ("kv_waste", "--", "KV waste"),
    ("alloc_split_ratio", ":", "allocator split ratio"),
)
Row = dict[str, Any]


def gpu_fragmentation(run: RunData) -> Figure:
    """GPU utilisation (NVML, else the sim engine's busy share) and KV/allocator fragmentation."""
    fig, axes = new_figure(2, 1, figsize=(11, 7), sharex=True, squeeze=False)
    run_title(fig, run, "GPU utilisation and memory fragmentation over time")
    ax_util, ax_frag = axes[:, 0]
    nvml = [r for r in telemetry_rows(run, "nvml") if r.get("gpu_util_pct") is not None]
    engine = telemetry_rows(run, "engine")
    if not nvml and not engine:
        return empty(fig, "no GPU or engine telemetry in this run")
    if nvml:
        _nvml_util(ax_util, run, nvml)
    else:
        ax_util.set_ylabel("engine busy (% of wall time)\nsim engine: no NVML GPU")
    for stack in run.stacks or sorted({r.get("stack", "") for r in engine}):
        color = stack_color(run, stack)
        for replica in sorted({r["name"] for r in engine if r.get("stack") == stack}):
            rows = [r for r in engine if r.get("stack") == stack and r["name"] == replica]
            if not nvml:
                _engine_busy(ax_util, run, rows, color, f"{stack}/{replica}")
            _fragmentation(ax_frag, run, rows, color, f"{stack}/{replica}")
    ax_frag.set_ylabel("% (occupancy: of KV blocks;\nwaste: of allocated KV slots)")
    ax_frag.set_xlabel("time since run start (s)")
    for ax in (ax_util, ax_frag):
        shade_phases(ax, run, label=ax is ax_frag)
        mark_faults(ax, run, label=ax is ax_util)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6, loc="upper right", ncol=2)
    fig.tight_layout()
    return fig


def _nvml_util(ax: Axes, run: RunData, nvml: list[Row]) -> None:
    """One utilisation line per GPU, as NVML sampled it."""
    for gpu in sorted({r["name"] for r in nvml}):
        rows = [r for r in nvml if r["name"] == gpu]
        ax.plot(
            [(r["t_ns"] - run.t0_ns) / NS for r in rows],
            [r["gpu_util_pct"] for r in rows],
            label=f"{gpu} (NVML)",
        )
    ax.set_ylabel("GPU utilisation (%, NVML samples)")


def _engine_busy(ax: Axes, run: RunData, rows: list[Row], color: str, label: str) -> None:
    """A replica's engine busy share, in place of the NVML utilisation the sim engine lacks."""
    busy = [(r["t_ns"], r["engine_busy"]) for r in rows if "engine_busy" in r]
    if busy:
        ax.plot(
            [(b[0] - run.t0_ns) / NS for b in busy],
            [100 * b[1] for b in busy],
            color=color,
            linewidth=1,
            label=label,
        )


def _fragmentation(ax: Axes, run: RunData, rows: list[Row], color: str, label: str) -> None:
    """A replica's KV occupancy, KV waste and allocator split ratio, those it reported."""
    t = np.asarray([(r["t_ns"] - run.t0_ns) / NS for r in rows])
    for key, style, what in SERIES_STYLES:
        vals = [100 * r[key] if key in r else np.nan for r in rows]
        if not np.all(np.isnan(vals)):
            ax.plot(t, vals, style, color=color, linewidth=1, label=f"{label} {what}")
