"""A run's progress at the console: timestamped lines, and one line per measured row."""

from __future__ import annotations

import time

from harness.schema import SummaryRow
from harness.tables import fmt


def say(message: str) -> None:
    print(f"[zl-bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


def row_outcome(row: SummaryRow) -> str:
    """One line on what a row measured, and what makes it doubtful."""
    text = (
        f"{row.completed} completed, {row.errors} errors, {row.lost} lost, E2EL p50 "
        f"{fmt(row.stat('median_e2el_ms'))} ms, goodput {row.request_goodput:.2f} req/s"
    )
    if row.slo_met is not None:
        text += ", within SLOs" if row.slo_met else ", SLOs missed"
    if row.host_cpu_pct is not None:
        text += f", host CPU {row.host_cpu_pct:.0f} %"
    if row.host_saturated:
        text += " (HOST SATURATED)"
    if row.saturated:
        text += f" SATURATED: {'; '.join(row.saturation_reasons)}"
    if not row.valid:
        text += f" INVALID: {'; '.join(row.invalid_reasons)}"
    return text


def turns_outcome(row: SummaryRow) -> str:
    """For a multi-turn profile, one line: TTFT p50 by turn and the prefix cache's hit rate
    and prefilled tokens per request ("n/a" where the engines reported none); else empty."""
    turns = row.by_turn
    if not turns:
        return ""
    cache = row.prefix_cache
    ttft = ", ".join(f"{t.turn}: {fmt(t.p50_ttft_ms)}" for t in turns)
    rate = "n/a" if cache.hit_rate is None else f"{cache.hit_rate:.1%}"
    prefilled = cache.prefilled_per_request
    return (
        f"TTFT p50 by turn (ms) {ttft}; prefix-cache hit rate {rate}, prefilled tokens per "
        f"request {'n/a' if prefilled is None else f'{prefilled:.0f}'}"
    )
