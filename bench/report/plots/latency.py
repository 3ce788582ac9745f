"""Latency distributions of a plain run: CDFs and box plots per profile and stack, and TTFT
by turn for multi-turn profiles (all from ``harness.metrics``)."""

from __future__ import annotations

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from bench.report.data import RunData
from bench.report.plots.common import (
    empty,
    log_ms,
    new_figure,
    no_completions,
    run_title,
    stack_color,
)
from harness import metrics


def latency_cdf(run: RunData) -> Figure:
    """E2E latency (solid) and TTFT (dashed) CDF per stack, one panel per profile."""
    profiles = run.profiles
    fig, axes = new_figure(
        1, max(1, len(profiles)), figsize=(5 * max(1, len(profiles)), 4.2), squeeze=False
    )
    run_title(fig, run, "Latency CDF per stack (E2EL solid, TTFT dashed)")
    if not profiles:
        return empty(fig, "no request records in this run")
    for ax, profile in zip(axes[0], profiles, strict=True):
        ax.set_title(f"profile {profile}", fontsize=10)
        if not _cdf_panel(ax, run, profile):
            no_completions(ax, f"no completed requests in profile {profile}: no latency")
            continue
        ax.set_xscale("log")
        log_ms(ax.xaxis)
        ax.set_xlabel("latency (ms, log scale)")
        ax.set_ylabel("fraction of completed requests")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return fig


def _cdf_panel(ax: Axes, run: RunData, profile: str) -> bool:
    """Draw one profile's CDF lines; False when no stack completed a request in it."""
    drawn = False
    for stack in run.stacks:
        values = metrics.series(run.records.get((stack, profile), []))
        for name, style in (("e2el", "-"), ("ttft", "--")):
            data = np.sort(np.asarray(values[name]))
            if data.size == 0:
                continue
            frac = np.arange(1, data.size + 1) / data.size
            ax.step(
                data,
                frac,
                style,
                where="post",
                color=stack_color(run, stack),
                label=f"{stack} {name.upper()} (n={data.size})",
            )
            drawn = True
    return drawn


def latency_variance(run: RunData) -> Figure:
    """Box plots of E2EL and TTFT per profile and stack, with each group's std deviation."""
    groups = [(p, s) for p in run.profiles for s in run.stacks if run.records.get((s, p))]
    fig, axes = new_figure(2, 1, figsize=(max(6, 1.6 * len(groups) + 2), 7.5), squeeze=False)
    run_title(fig, run, "Latency variance per profile and stack (box: quartiles, whiskers 1.5 IQR)")
    if not groups:
        return empty(fig, "no request records in this run")
    for ax, name in zip(axes[:, 0], ("e2el", "ttft"), strict=True):
        data, labels, colors = [], [], []
        for profile, stack in groups:
            values = metrics.series(run.records[(stack, profile)])[name]
            std = metrics.describe(name, values)[f"std_{name}_ms"]
            if std is None:
                continue
            data.append(values)
            labels.append(f"{profile}\n{stack}\nstd {std:.1f} ms")
            colors.append(stack_color(run, stack))
        if not data:
            no_completions(ax, f"no completed requests: no {name.upper()} to show")
            continue
        box = ax.boxplot(data, patch_artist=True, showfliers=True, flierprops={"markersize": 2})
        for patch, color in zip(box["boxes"], colors, strict=True):
            patch.set_facecolor(color)
            patch.set_alpha(0.45)
        ax.set_xticks(range(1, len(labels) + 1), labels, fontsize=7)
        ax.set_yscale("log")
        log_ms(ax.yaxis)
        ax.set_ylabel(f"{name.upper()} (ms, log scale)")
        ax.grid(True, axis="y", which="both", alpha=0.3)
    fig.tight_layout()
    return fig


def ttft_by_turn(run: RunData, profile: str) -> Figure:
    """TTFT p50 (solid) and p90 (dashed) against turn number, one line per stack: with a prefix
    cache, later turns prefill only their new message when routing finds the cached history."""
    fig, ax = new_figure(figsize=(8, 4.8))
    run_title(fig, run, f"TTFT by turn, profile {profile} (p50 solid, p90 dashed)")
    drawn = False
    for stack in run.stacks:
        turns = metrics.by_turn(run.records.get((stack, profile), []))
        color = stack_color(run, stack)
        for key, label, style in (("p50_ttft_ms", "p50", "-"), ("p90_ttft_ms", "p90", "--")):
            points = [(t.turn, getattr(t, key)) for t in turns if getattr(t, key) is not None]
            if not points:
                continue
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, style, marker="o", color=color, label=f"{stack} TTFT {label}")
            drawn = True
    if not drawn:
        no_completions(ax, f"no completed requests with a turn in profile {profile}")
        return fig
    ax.set_xlabel("turn in session")
    ax.set_ylabel("TTFT (ms)")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
