"""The seed study's claims (DESIGN.md), each checked against what this run measured.

The seeds' numbers come from a different machine and scale, so each check compares what carries
across scales: absolute overheads within a factor of two of the claimed range, and stack-to-stack
ratios in the claimed direction and at least half the claimed size. Every row states its rule,
the claimed figure and the measured one; a claim whose inputs this run lacks is "not measured".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from bench.report.data import RunData, read_recovery
from harness.schema import SummaryRow
from harness.telemetry.process import LAYER_ROLES

ZEROLAYER = "zerolayer"
BASELINE = "baseline"
LATENCY_PROFILE = "a_latency"
FAULT_PROFILE = "d_fault"
HELD, NOT_HELD, NOT_MEASURED = "held", "not held", "not measured"


@dataclass(frozen=True, slots=True)
class ClaimResult:
    """One claim: what the seeds said, what we measured, the rule, and the verdict."""

    key: str
    claim: str
    claimed: str
    measured: str
    status: str
    rule: str


def _summary_pair(run: RunData, profile: str) -> tuple[SummaryRow, SummaryRow] | None:
    zl, base = run.summary(ZEROLAYER, profile), run.summary(BASELINE, profile)
    return (zl, base) if zl is not None and base is not None else None


def _latency_profile(run: RunData) -> str:
    """Profile A when it ran on both stacks, else the first profile that did."""
    both = [p for p in run.profiles if _summary_pair(run, p)]
    return LATENCY_PROFILE if LATENCY_PROFILE in both else (both[0] if both else LATENCY_PROFILE)


def layer_overhead(run: RunData) -> ClaimResult:
    claim = "the middle layer adds 80-150 ms per request (P50 89 +/- 12 ms)"
    rule = "held when baseline P50 E2EL - zero-layer P50 E2EL lies within 40-300 ms (2x range)"
    profile = _latency_profile(run)
    pair = _summary_pair(run, profile)
    medians = [row.stat("median_e2el_ms") for row in pair] if pair else []
    zl, base = (medians[0], medians[1]) if medians else (None, None)
    if zl is None or base is None:
        return ClaimResult("layer_overhead", claim, "80-150 ms", "-", NOT_MEASURED, rule)
    delta = base - zl
    status = HELD if 40.0 <= delta <= 300.0 else NOT_HELD
    return ClaimResult(
        "layer_overhead",
        claim,
        "80-150 ms (P50 89 ms)",
        f"{delta:+.1f} ms at P50 ({profile})",
        status,
        rule,
    )


def layer_cpu_share(run: RunData) -> ClaimResult:
    claim = "the middle layer takes up to 38 % of cluster CPU"
    rule = (
        "held when proxy + controller + orchestrator CPU time is at least 19 % (half the claim) "
        "of all baseline serving processes' CPU time, from psutil telemetry"
    )
    used: dict[str, tuple[str, float, float]] = {}
    for row in run.telemetry:
        if row.get("source") != "process" or row.get("stack") != BASELINE or "cpu_s" not in row:
            continue
        if row.get("role") == "loader":
            continue
        first = used.get(row["name"], (row["role"], row["cpu_s"], row["cpu_s"]))
        used[row["name"]] = (row["role"], first[1], row["cpu_s"])
    total = sum(last - first for _, first, last in used.values())
    layer = sum(last - first for role, first, last in used.values() if role in LAYER_ROLES)
    if total <= 0 or not any(role in LAYER_ROLES for role, _, _ in used.values()):
        return ClaimResult("layer_cpu", claim, "up to 38 %", "-", NOT_MEASURED, rule)
    share = layer / total
    return ClaimResult(
        "layer_cpu",
        claim,
        "up to 38 %",
        f"{100 * share:.1f} % ({layer:.1f} of {total:.1f} CPU s)",
        HELD if share >= 0.19 else NOT_HELD,
        rule,
    )


def tail_latency(run: RunData) -> ClaimResult:
    claim = (
        "zero-layer P50/P95/P99 189/213/247 ms vs 427/1280/3850 ms orchestrated; "
        "std dev 38 vs 1420 ms"
    )
    claimed = {"p50": 427 / 189, "p95": 1280 / 213, "p99": 3850 / 247, "std": 1420 / 38}
    rule = (
        "held when baseline/zero-layer E2EL ratios at P50, P95, P99 and std dev are each at least "
        "half the claimed ratios (2.3x, 6.0x, 15.6x, 37x)"
    )
    profile = _latency_profile(run)
    pair = _summary_pair(run, profile)
    claimed_text = ", ".join(f"{k} {v:.1f}x" for k, v in claimed.items())
    if pair is None:
        return ClaimResult("tail_latency", claim, claimed_text, "-", NOT_MEASURED, rule)
    keys = {
        "p50": "median_e2el_ms",
        "p95": "p95_e2el_ms",
        "p99": "p99_e2el_ms",
        "std": "std_e2el_ms",
    }
    zl = {k: pair[0].stat(key) for k, key in keys.items()}
    base = {k: pair[1].stat(key) for k, key in keys.items()}
    zl_ok = {k: v for k, v in zl.items() if v is not None}
    base_ok = {k: v for k, v in base.items() if v is not None}
    if len(zl_ok) < len(keys) or len(base_ok) < len(keys):
        return ClaimResult("tail_latency", claim, claimed_text, "-", NOT_MEASURED, rule)
    ratios = {k: base_ok[k] / zl_ok[k] if zl_ok[k] > 0 else float("inf") for k in keys}
    figures = "/".join(f"{zl_ok[k]:.0f}" for k in ("p50", "p95", "p99"))
    base_text = "/".join(f"{base_ok[k]:.0f}" for k in ("p50", "p95", "p99"))
    measured = (
        f"{figures} vs {base_text} ms, std {zl_ok['std']:.1f} vs {base_ok['std']:.1f} ms "
        f"({profile}); ratios " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items())
    )
    held = all(ratios[k] >= claimed[k] / 2 for k in claimed)
    return ClaimResult(
        "tail_latency", claim, claimed_text, measured, HELD if held else NOT_HELD, rule
    )


def refusal_speed(run: RunData) -> ClaimResult:
    claim = (
        "the embedded scheduler refuses within about 3 ms of memory pressure; "
        "an external layer needs about 120 ms to notice"
    )
    rule = (
        "held when, for a KV-pressure fault, the baseline's time to detect is at least 20x the "
        "zero-layer's (half the claimed 40x), from the chaos recovery table"
    )
    detect = {
        row.stack: row.time_to_detect_s * 1000.0
        for row in read_recovery(run.path)
        if "kv" in row.fault.lower() and row.time_to_detect_s is not None
    }
    if ZEROLAYER not in detect or BASELINE not in detect:
        return ClaimResult("refusal_speed", claim, "3 ms vs 120 ms", "-", NOT_MEASURED, rule)
    zl, base = detect[ZEROLAYER], detect[BASELINE]
    held = base >= 20 * zl
    return ClaimResult(
        "refusal_speed",
        claim,
        "3 ms vs 120 ms",
        f"{zl:.1f} ms vs {base:.1f} ms",
        HELD if held else NOT_HELD,
        rule,
    )


def fault_errors(run: RunData) -> ClaimResult:
    claim = (
        "killing an orchestrator replica multiplies downstream errors; "
        "the zero-layer stack has no such component to lose"
    )
    rule = (
        f"held when, under profile {FAULT_PROFILE}, the baseline's failed + lost requests are "
        "more than twice the zero-layer's"
    )
    pair = _summary_pair(run, FAULT_PROFILE)
    if pair is None:
        return ClaimResult("fault_errors", claim, "errors multiply", "-", NOT_MEASURED, rule)
    zl, base = pair[0].failed, pair[1].failed
    measured = (
        f"failed+lost {zl} of {pair[0].num_requests} (zero-layer) vs "
        f"{base} of {pair[1].num_requests} (baseline)"
    )
    return ClaimResult(
        "fault_errors",
        claim,
        "errors multiply",
        measured,
        HELD if base > 2 * zl else NOT_HELD,
        rule,
    )


def fragmentation(run: RunData) -> ClaimResult:
    claim = "fixed shapes and admission control cut memory fragmentation (31 % to 4 %)"
    rule = (
        "held when the baseline's mean KV waste (engine telemetry, samples with KV in use) is at "
        "least 3.9x the zero-layer's (half the claimed 7.75x)"
    )
    waste: dict[str, list[float]] = {}
    for row in run.telemetry:
        if row.get("source") == "engine" and row.get("kv_blocks_used", 1) and "kv_waste" in row:
            waste.setdefault(row.get("stack", ""), []).append(row["kv_waste"])
    if not waste.get(ZEROLAYER) or not waste.get(BASELINE):
        return ClaimResult("fragmentation", claim, "31 % -> 4 %", "-", NOT_MEASURED, rule)
    zl, base = float(np.mean(waste[ZEROLAYER])), float(np.mean(waste[BASELINE]))
    held = base >= 3.9 * zl and base > 0
    return ClaimResult(
        "fragmentation",
        claim,
        "31 % -> 4 %",
        f"{100 * base:.1f} % -> {100 * zl:.1f} %",
        HELD if held else NOT_HELD,
        rule,
    )


CLAIMS: tuple[Callable[[RunData], ClaimResult], ...] = (
    layer_overhead,
    layer_cpu_share,
    tail_latency,
    refusal_speed,
    fault_errors,
    fragmentation,
)


def evaluate(run: RunData) -> list[ClaimResult]:
    """Every claim, in DESIGN.md's order."""
    return [check(run) for check in CLAIMS]
