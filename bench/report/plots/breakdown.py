"""Where a request's time and the host's CPU go: engine against layer time per stack and
profile, and CPU and memory per process over run time."""

from __future__ import annotations

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
    telemetry_rows,
)
from harness import metrics

PALETTE = {
    "engine": "#4c72b0",
    "layer": "#dd8452",
    "client queue": "#8c8c8c",
    "TTFT (layer + engine prefill)": "#c44e52",
    "generation after first token": "#55a868",
}


def time_breakdown(run: RunData) -> dict[tuple[str, str], tuple[str, dict[str, float]]]:
    """Mean per-request time split, per (stack, profile), and what the split is based on.

    With engine-side accounting (``engine_ns``) on most completed requests: engine time against
    layer time (E2EL - engine). Without it: client queue, TTFT and generation time, which does
    not separate the layer from the engine and says so.
    """
    out = {}
    for (stack, profile), recs in run.records.items():
        done = [r for r in recs if r.outcome == "completed"]
        if not done:
            continue
        values = metrics.series(done)
        accounted = [r for r in done if r.engine_ns]
        if len(accounted) >= 0.9 * len(done):
            engine_ms = [r.engine_ns / 1e6 for r in accounted]
            e2el = [metrics.series([r])["e2el"][0] for r in accounted]
            layer = [e - g for e, g in zip(e2el, engine_ms, strict=True)]
            out[(stack, profile)] = (
                "engine-side accounting",
                {"engine": float(np.mean(engine_ms)), "layer": float(np.mean(layer))},
            )
        else:
            queue, ttft = np.mean(values["client_queue"] or [0.0]), np.mean(values["ttft"] or [0.0])
            out[(stack, profile)] = (
                "TTFT decomposition",
                {
                    "client queue": float(queue),
                    "TTFT (layer + engine prefill)": float(ttft),
                    "generation after first token": float(np.mean(values["e2el"]) - ttft),
                },
            )
    return out


def where_time_goes(run: RunData) -> Figure:
    """Mean request time split into engine and layer (or TTFT parts), per stack and profile."""
    split = time_breakdown(run)
    fig, ax = new_figure(figsize=(10, max(3.5, 0.6 * len(split) + 2)))
    bases = sorted({basis for basis, _ in split.values()})
    run_title(
        fig,
        run,
        f"Where the time goes (mean per completed request; based on: "
        f"{' and '.join(bases) or 'nothing'})",
    )
    if not split:
        return empty(fig, "no completed requests in this run")
    keys = [(s, p) for p in run.profiles for s in run.stacks if (s, p) in split]
    seen: set[str] = set()
    for y, key in enumerate(keys):
        _stacked_bar(ax, y, split[key][1], seen)
    ax.set_yticks(
        range(len(keys)), [f"{s} · {p}\n({split[(s, p)][0]})" for s, p in keys], fontsize=7
    )
    ax.invert_yaxis()
    ax.set_xlabel("mean time per completed request (ms)")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    return fig


def cpu_by_component(run: RunData) -> Figure:
    """CPU (% of one core) per component over time, so the layer's own CPU share is visible."""
    fig, axes = new_figure(2, 1, figsize=(11, 6.5), sharex=True, squeeze=False)
    run_title(fig, run, "CPU and memory per component (psutil)")
    rows = [r for r in telemetry_rows(run, "process") if r.get("alive")]
    if not rows:
        return empty(fig, "no process telemetry in this run")
    ax_cpu, ax_rss = axes[:, 0]
    for name in sorted({r["name"] for r in rows}):
        mine = [r for r in rows if r["name"] == name]
        label = f"{name} ({mine[0].get('role', '?')}" + (
            f", {mine[0]['stack']})" if mine[0].get("stack") else ")"
        )
        t = [(r["t_ns"] - run.t0_ns) / NS for r in mine]
        ax_cpu.plot(t, [r.get("cpu_pct", np.nan) for r in mine], linewidth=1, label=label)
        ax_rss.plot(t, [r["rss_bytes"] / 2**20 for r in mine], linewidth=1, label=label)
    ax_cpu.set_ylabel("CPU (% of one core)")
    ax_rss.set_ylabel("RSS (MiB)")
    ax_rss.set_xlabel("time since run start (s)")
    for ax in (ax_cpu, ax_rss):
        shade_phases(ax, run, label=ax is ax_rss)
        mark_faults(ax, run, label=ax is ax_cpu)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    return fig


def _stacked_bar(ax: Axes, y: int, parts: dict[str, float], seen: set[str]) -> None:
    """One row's parts end to end, each labelled with its value where wide enough to read;
    the legend names each part once (``seen`` across rows)."""
    left = 0.0
    for part, value in parts.items():
        width = max(value, 0.0)
        ax.barh(
            y,
            width,
            left=left,
            color=PALETTE[part],
            label=None if part in seen else part,
            edgecolor="white",
        )
        if width > 0.06 * sum(max(v, 0) for v in parts.values()):
            ax.text(
                left + width / 2,
                y,
                f"{value:.1f}",
                ha="center",
                va="center",
                fontsize=7,
                color="white",
            )
        seen.add(part)
        left += width
