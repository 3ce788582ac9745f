"""The report's sections on the workload's shape: lengths in and out, multi-turn sessions by
turn, and the prefix cache."""

from __future__ import annotations

from html import escape

from bench.report.data import RunData
from bench.report.htmlparts import cell as _cell
from bench.report.htmlparts import table as _table
from harness import metrics, schema

NOT_AVAILABLE = "n/a"
LENGTH_KEYS: tuple[str, ...] = ("mean", "p10", "p50", "p90", "p99")


def _or_na(value: float | None, fmt: str) -> str:
    """A figure, or "n/a" where the stack did not report it (never a misleading 0)."""
    return NOT_AVAILABLE if value is None else fmt.format(value)


def _length_cells(stats: schema.LengthStats) -> list[str]:
    return [f"{stats.count}", *(_or_na(getattr(stats, k), "{:.1f}") for k in LENGTH_KEYS)]


def lengths_section(run: RunData) -> str:
    """Every profile's prompt and output lengths in tokens as sent and answered, beside the
    workload file's own distribution where the run recorded it."""
    rows = []
    for profile in run.profiles:
        workload = run.workload_lengths(profile)
        for which, lengths in (
            ("input", metrics.input_lengths),
            ("output", metrics.output_lengths),
        ):
            for stack in run.stacks:
                recs = run.records.get((stack, profile))
                if recs:
                    rows.append(
                        [escape(profile), which, escape(stack), *_length_cells(lengths(recs))]
                    )
            if which in workload:
                rows.append(
                    [escape(profile), which, "workload file", *_length_cells(workload[which])]
                )
    if not rows:
        return ""
    headers = ["profile", "tokens", "source", "count", "mean", "p10", "p50", "p90", "p99"]
    note = (
        "<p>Input: prompt tokens of every request sent; output: tokens of completed requests; "
        "the workload file's rows are its own distribution.</p>"
    )
    return "<h2>Input and output lengths (tokens)</h2>" + note + _table(headers, rows, left=3)


def turns_section(run: RunData) -> str:
    """Per multi-turn profile, per stack and turn: requests, completions, TTFT percentiles and
    mean prompt tokens (the history grows turn by turn)."""
    parts = []
    for profile in run.turn_profiles:
        rows = [
            [
                escape(stack),
                f"{t.turn}",
                f"{t.count}",
                f"{t.completed}",
                _cell(t.p50_ttft_ms, "{:.2f}"),
                _cell(t.p90_ttft_ms, "{:.2f}"),
                _cell(t.p99_ttft_ms, "{:.2f}"),
                f"{t.mean_prompt_tokens:.1f}",
            ]
            for stack in run.stacks
            for t in metrics.by_turn(run.records.get((stack, profile), []))
        ]
        headers = [
            "stack",
            "turn",
            "requests",
            "completed",
            "TTFT p50 (ms)",
            "TTFT p90 (ms)",
            "TTFT p99 (ms)",
            "mean prompt tokens",
        ]
        parts.append(f"<h3>By turn: {escape(profile)}</h3>" + _table(headers, rows, left=1))
    return "<h2>Multi-turn sessions</h2>" + "".join(parts) if parts else ""


def _prefix_cache_profiles(run: RunData) -> list[str]:
    """Multi-turn profiles, and any other whose stacks reported prefix-cache lookups."""
    turned = set(run.turn_profiles)
    return [
        p
        for p in run.profiles
        if p in turned or any(run.prefix_cache(s, p).queries for s in run.stacks)
    ]


def prefix_cache_section(run: RunData) -> str:
    """Per stack: the engines' prefix-cache hit rate and prefilled tokens per request."""
    rows = []
    for profile in _prefix_cache_profiles(run):
        for stack in run.stacks:
            cache = run.prefix_cache(stack, profile)
            rate = None if cache.hit_rate is None else 100 * cache.hit_rate
            rows.append(
                [
                    escape(stack),
                    escape(profile),
                    _or_na(cache.queries, "{:.0f}"),
                    _or_na(cache.hits, "{:.0f}"),
                    _or_na(rate, "{:.1f} %"),
                    _or_na(cache.prefilled_per_request, "{:.1f}"),
                ]
            )
    if not rows:
        return ""
    headers = [
        "stack",
        "profile",
        "prompt tokens looked up",
        "cache hits (tokens)",
        "hit rate",
        "prefilled tokens / request",
    ]
    note = (
        "<p>From the engines' <code>vllm:prefix_cache_queries</code> and "
        "<code>vllm:prefix_cache_hits</code> over the profile, summed over replicas; n/a where "
        "the stack's engines reported no lookups (no engine telemetry, or no prefix cache).</p>"
    )
    return "<h2>Prefix cache</h2>" + note + _table(headers, rows, left=2)
