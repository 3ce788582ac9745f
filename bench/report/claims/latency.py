"""The latency claims: what the middle layer adds at P50, and the tails of each stack, judged on
paired trials (``bench.report.claim_inputs``) at the latency profile or a sweep's stated loads."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Final

import numpy as np

from bench.report.claim_inputs import Inputs, Judged, plain_inputs, reference_speed, sweep_inputs
from bench.report.claims.common import (
    UNDECIDED,
    VALIDITY_RULE,
    ClaimResult,
    Judgement,
    judge_all,
    per_pair,
    result,
)
from bench.report.data import RunData
from bench.report.verdicts import SPANS, Band, combine, decide
from harness.schema import SummaryRow

TAIL_KEYS: Final = {
    "p50": "median_e2el_ms",
    "p95": "p95_e2el_ms",
    "p99": "p99_e2el_ms",
    "std": "std_e2el_ms",
}


def latency_inputs(run: RunData) -> list[Inputs]:
    """The paired trials the latency claims are judged on: per stated load of a sweep, or the
    plain run's latency profile."""
    rows = run.sweep.points if run.sweep is not None else run.summaries
    reference = reference_speed(rows, run.meta.machine.cpu_speed_start)
    if run.sweep is not None:
        return sweep_inputs(run.sweep, reference)
    return plain_inputs(run.summaries, reference)


def _median_delta(zl: SummaryRow, base: SummaryRow) -> float | None:
    a, b = zl.stat("median_e2el_ms"), base.stat("median_e2el_ms")
    return None if a is None or b is None else b - a


def _ratio(key: str) -> Callable[[SummaryRow, SummaryRow], float | None]:
    def figure(zl: SummaryRow, base: SummaryRow) -> float | None:
        a, b = zl.stat(key), base.stat(key)
        return None if a is None or b is None or a <= 0 else b / a

    return figure


def _overhead_at(judged: Judged) -> Judgement:
    delta = per_pair(judged, _median_delta)
    band = Band(40.0, 300.0)
    status = decide(delta, band)
    return Judgement(
        status,
        f"{delta.text('+.1f', 'ms')} at P50 ({judged.where()})",
        SPANS if status is UNDECIDED else "",
        {"p50_delta_ms": delta},
        len(judged.pairs),
        {"p50_delta_ms": band},
    )


def layer_overhead(run: RunData) -> ClaimResult:
    rule = (
        "held when baseline P50 E2EL - zero-layer P50 E2EL lies within 40-300 ms (2x range); "
        + VALIDITY_RULE
    )
    return result(
        "layer_overhead",
        "the middle layer adds 80-150 ms per request (P50 89 +/- 12 ms)",
        "80-150 ms (P50 89 ms)",
        rule,
        judge_all(latency_inputs(run), _overhead_at),
    )


def _mean_stat(rows: Sequence[SummaryRow], key: str) -> str:
    values = [v for v in (row.stat(key) for row in rows) if v is not None]
    return f"{np.mean(values):.0f}" if values else "-"


CLAIMED_TAILS: Final = {"p50": 427 / 189, "p95": 1280 / 213, "p99": 3850 / 247, "std": 1420 / 38}


def _tails_at(judged: Judged) -> Judgement:
    ratios = {k: per_pair(judged, _ratio(key), floor=0.0) for k, key in TAIL_KEYS.items()}
    bands = {k: Band(v / 2) for k, v in CLAIMED_TAILS.items()}
    status = combine([decide(ratios[k], bands[k]) for k in CLAIMED_TAILS])
    zl = [zl for zl, _ in judged.pairs]
    base = [base for _, base in judged.pairs]
    figures = {
        name: "/".join(_mean_stat(rows, TAIL_KEYS[k]) for k in ("p50", "p95", "p99"))
        for name, rows in (("zl", zl), ("base", base))
    }
    measured = (
        f"{figures['zl']} vs {figures['base']} ms, std {_mean_stat(zl, TAIL_KEYS['std'])} vs "
        f"{_mean_stat(base, TAIL_KEYS['std'])} ms ({judged.where()}); ratios "
        + ", ".join(f"{k} {v.text('.2f', 'x')}" for k, v in ratios.items())
    )
    reason = SPANS if status is UNDECIDED else ""
    return Judgement(
        status,
        measured,
        reason,
        {f"{k}_ratio": v for k, v in ratios.items()},
        len(judged.pairs),
        {f"{k}_ratio": v for k, v in bands.items()},
    )


def tail_latency(run: RunData) -> ClaimResult:
    rule = (
        "held when baseline/zero-layer E2EL ratios at P50, P95, P99 and std dev are each at least "
        "half the claimed ratios (2.3x, 6.0x, 15.6x, 37x); " + VALIDITY_RULE
    )
    return result(
        "tail_latency",
        "zero-layer P50/P95/P99 189/213/247 ms vs 427/1280/3850 ms orchestrated; "
        "std dev 38 vs 1420 ms",
        ", ".join(f"{k} {v:.1f}x" for k, v in CLAIMED_TAILS.items()),
        rule,
        judge_all(latency_inputs(run), _tails_at),
    )
