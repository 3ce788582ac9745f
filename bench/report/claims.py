"""The seed study's claims (docs/design.md), each checked against what this run measured.

The seeds' numbers come from a different machine and scale, so each check compares what carries
across scales: absolute overheads within a factor of two of the claimed range, and stack-to-stack
ratios in the claimed direction and at least half the claimed size. Every row states its rule,
the claimed figure and the measured one; a claim whose inputs this run lacks is "not measured",
and one whose inputs were flagged (the loader lagged, requests were lost, the stack or the host
was saturated) is "not measured (invalid inputs)" with the reasons, never a verdict.

The latency claims, with a sweep in the run, are judged at one offered rate: the highest at which
both stacks' points measured the stacks (``eligible``) in every repeat. The claim's figure is
taken per repeat and summarised as an interval over repeats (``harness.curves.interval``), and
the verdict is "held" or "not held" only when the whole interval lies on one side of the rule's
threshold, so that the same configuration gives the same verdict twice. docs/design.md states no
claim about load (capacity or the knee), so the sweep's headline figures have no claim to check
here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from bench.report.data import RunData, read_recovery
from harness.curves import Interval, interval
from harness.schema import SummaryRow, SweepSection
from harness.telemetry.process import LAYER_ROLES

ZEROLAYER = "zerolayer"
BASELINE = "baseline"
LATENCY_PROFILE = "a_latency"
FAULT_PROFILE = "d_fault"
TAIL_KEYS = {
    "p50": "median_e2el_ms",
    "p95": "p95_e2el_ms",
    "p99": "p99_e2el_ms",
    "std": "std_e2el_ms",
}


class Status(StrEnum):
    """A claim's verdict; ``css`` is its class name in the HTML report."""

    HELD = "held"
    NOT_HELD = "not held"
    NOT_MEASURED = "not measured"
    INVALID_INPUTS = "not measured (invalid inputs)"
    INCONCLUSIVE = "inconclusive (interval spans the threshold)"

    @property
    def css(self) -> str:
        return self.name.lower().replace("_", "-")


HELD, NOT_HELD, NOT_MEASURED = Status.HELD, Status.NOT_HELD, Status.NOT_MEASURED
INVALID_INPUTS, INCONCLUSIVE = Status.INVALID_INPUTS, Status.INCONCLUSIVE

SWEEP_RULE = (
    "; from a sweep: at the highest offered rate at which, in every repeat, both stacks' points "
    "are valid (loader on schedule, nothing lost), below saturation and not host-CPU saturated "
    "(SLO misses do not exclude a point: the claims are about latency at any load the stacks "
    "serve), the figure per repeat, then its 95 % interval over repeats: held or not held only "
    "when the whole interval lies on that side, else inconclusive"
)

PLAIN_RULE = (
    "; not judged when either stack's row is flagged invalid (loader off its schedule, "
    "requests lost), saturated, or was measured with the host's CPU saturated"
)


@dataclass(frozen=True, slots=True)
class ClaimResult:
    """One claim: what the seeds said, what we measured, the rule, and the verdict."""

    key: str
    claim: str
    claimed: str
    measured: str
    status: Status
    rule: str


@dataclass(frozen=True, slots=True)
class Band:
    """The held side of a rule's threshold: figures from ``low`` to ``high``."""

    low: float
    high: float = math.inf


def decide(figure: Interval, band: Band) -> Status:
    """Held when the whole interval lies in the band, not held when it lies wholly outside on
    one side, inconclusive when it crosses a threshold; not measured without a figure."""
    if figure.value is None or figure.low is None or figure.high is None:
        return NOT_MEASURED
    if band.low <= figure.low and figure.high <= band.high:
        return HELD
    if figure.high < band.low or figure.low > band.high:
        return NOT_HELD
    return INCONCLUSIVE


def combine(statuses: Sequence[Status]) -> Status:
    """A rule that needs every part held: one part surely short decides it."""
    if NOT_HELD in statuses:
        return NOT_HELD
    if NOT_MEASURED in statuses:
        return NOT_MEASURED
    return HELD if all(s is HELD for s in statuses) else INCONCLUSIVE


def latency_problems(row: SummaryRow) -> list[str]:
    """Why a row's latency is not the stack's own: flagged invalid, the loader off its
    schedule, or the stack saturated; empty when it measured the stack. A host whose cores were
    all busy is not on the list: on a small machine the orchestrator's own processes are what
    fill it, which is part of what the claims are about, and the report notes it beside the
    figures."""
    problems = []
    if not row.valid:
        problems.append("INVALID: " + ("; ".join(row.invalid_reasons) or "flagged"))
    elif row.loader_limited:
        problems.append("the loader could not keep to its schedule")
    if row.saturated:
        problems.append("saturated: " + ("; ".join(row.saturation_reasons) or "flagged"))
    return problems


def eligible(row: SummaryRow) -> bool:
    """A point that measured the stack's latency, below saturation."""
    return not latency_problems(row)


def _problem_text(
    rows: Sequence[SummaryRow], problems: Callable[[SummaryRow], list[str]], sweep: bool = False
) -> str:
    """Each flagged row's reasons, in a fixed order (zero-layer first, then by repeat)."""
    ordered = sorted(rows, key=lambda r: (r.stack != ZEROLAYER, r.stack, r.repeat))
    return " | ".join(
        f"{r.stack} {r.profile}{f' repeat {r.repeat}' if sweep else ''}: {'; '.join(problems(r))}"
        for r in ordered
        if problems(r)
    )


Pair = tuple[SummaryRow, SummaryRow]
PointIndex = dict[tuple[str, int, float], SummaryRow]


@dataclass(frozen=True, slots=True)
class Judged:
    """The points a latency claim is judged on: one (zero-layer, baseline) pair per repeat, at
    one offered rate (None for a plain run's rows)."""

    profile: str
    rate: float | None
    pairs: tuple[Pair, ...]

    def where(self) -> str:
        if self.rate is None:
            return self.profile
        n = len(self.pairs)
        return f"{self.profile} at {self.rate:g} req/s, {n} repeat{'s' if n != 1 else ''}"


@dataclass(frozen=True, slots=True)
class Unjudged:
    """Why a latency claim has no points to judge: ``status`` is NOT_MEASURED or
    INVALID_INPUTS, ``reason`` goes into the measured column."""

    status: Status
    reason: str


def _rate_key(rate: float) -> float:
    return round(rate, 9)


def _eligible_pair(index: PointIndex, repeat: int, rate: float) -> Pair | None:
    """Both stacks' points of one repeat at one rate, when both measured the stacks."""
    a, b = index.get((ZEROLAYER, repeat, rate)), index.get((BASELINE, repeat, rate))
    return (a, b) if a is not None and b is not None and eligible(a) and eligible(b) else None


def _highest_pair(index: PointIndex, rates: Sequence[float], repeat: int) -> str:
    """One repeat's highest rate with both stacks eligible, as text ("none" without one)."""
    found = (rate for rate in rates if _eligible_pair(index, repeat, rate))
    rate = next(found, None)
    return "none" if rate is None else f"{rate:g} req/s"


def sweep_pairs(sweep: SweepSection) -> Judged | Unjudged:
    """The highest offered rate at which every repeat has both stacks' points eligible."""
    index = {(p.stack, p.repeat, _rate_key(p.offered_rate)): p for p in sweep.points}
    reps = sorted({p.repeat for p in sweep.points})
    rates = sorted({_rate_key(p.offered_rate) for p in sweep.points}, reverse=True)
    for rate in rates:
        pairs = [_eligible_pair(index, k, rate) for k in reps]
        full = tuple(pair for pair in pairs if pair is not None)
        if len(full) == len(reps):
            return Judged(sweep.profile, rate, full)
    if not {ZEROLAYER, BASELINE} <= {p.stack for p in sweep.points}:
        return Unjudged(NOT_MEASURED, f"the sweep ({sweep.profile}) did not run both stacks")
    lowest = [p for p in sweep.points if _rate_key(p.offered_rate) == rates[-1]]
    per_repeat = ", ".join(f"repeat {k} {_highest_pair(index, rates, k)}" for k in reps)
    return Unjudged(
        INVALID_INPUTS,
        f"no offered rate at which both stacks were valid and below saturation in all "
        f"{len(reps)} repeats (highest such rate by repeat: {per_repeat}); at the lowest, "
        f"{rates[-1]:g} req/s: "
        + (_problem_text(lowest, latency_problems, sweep=True) or "a stack's point is missing"),
    )


def _summary_pair(run: RunData, profile: str) -> tuple[SummaryRow, SummaryRow] | None:
    zl, base = run.summary(ZEROLAYER, profile), run.summary(BASELINE, profile)
    return (zl, base) if zl is not None and base is not None else None


def _latency_profile(run: RunData) -> str:
    """Profile A when it ran on both stacks, else the first profile that did."""
    profiles = list(dict.fromkeys(row.profile for row in run.summaries))
    both = [p for p in profiles if _summary_pair(run, p)]
    return LATENCY_PROFILE if LATENCY_PROFILE in both else (both[0] if both else LATENCY_PROFILE)


def latency_inputs(run: RunData) -> Judged | Unjudged:
    """What the latency claims are judged on: the sweep's shared rate when the run has a sweep,
    else the plain rows of the latency profile, provided both measured the stacks."""
    if run.sweep is not None:
        return sweep_pairs(run.sweep)
    profile = _latency_profile(run)
    pair = _summary_pair(run, profile)
    if pair is None:
        return Unjudged(NOT_MEASURED, "-")
    problems = _problem_text(pair, latency_problems)
    if problems:
        return Unjudged(INVALID_INPUTS, problems)
    return Judged(profile, None, (pair,))


def _per_repeat(
    judged: Judged,
    figure: Callable[[SummaryRow, SummaryRow], float | None],
    floor: float | None = None,
) -> Interval:
    """A figure per repeat, as an interval; ``floor`` for figures that cannot go below it."""
    values = [figure(zl, base) for zl, base in judged.pairs]
    return interval(values, "not measured in a repeat", floor=floor)


def _median_delta(zl: SummaryRow, base: SummaryRow) -> float | None:
    a, b = zl.stat("median_e2el_ms"), base.stat("median_e2el_ms")
    return None if a is None or b is None else b - a


def _ratio(key: str) -> Callable[[SummaryRow, SummaryRow], float | None]:
    def figure(zl: SummaryRow, base: SummaryRow) -> float | None:
        a, b = zl.stat(key), base.stat(key)
        return None if a is None or b is None or a <= 0 else b / a

    return figure


def _rule(base_rule: str, run: RunData) -> str:
    return base_rule + (SWEEP_RULE if run.sweep is not None else PLAIN_RULE)


def _text(figure: Interval, judged: Judged, spec: str, unit: str = "") -> str:
    """A plain run's single figure bare; a sweep's with its interval and repeats."""
    if judged.rate is None and figure.value is not None:
        return f"{figure.value:{spec}}{unit and ' ' + unit}"
    return figure.text(spec, unit)


def layer_overhead(run: RunData) -> ClaimResult:
    claim = "the middle layer adds 80-150 ms per request (P50 89 +/- 12 ms)"
    inputs = latency_inputs(run)
    rule = _rule(
        "held when baseline P50 E2EL - zero-layer P50 E2EL lies within 40-300 ms (2x range)", run
    )
    claimed = "80-150 ms (P50 89 ms)"
    if isinstance(inputs, Unjudged):
        return ClaimResult("layer_overhead", claim, claimed, inputs.reason, inputs.status, rule)
    delta = _per_repeat(inputs, _median_delta)
    return ClaimResult(
        "layer_overhead",
        claim,
        claimed,
        f"{_text(delta, inputs, '+.1f', 'ms')} at P50 ({inputs.where()})",
        decide(delta, Band(40.0, 300.0)),
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


def _mean_stat(rows: Sequence[SummaryRow], key: str) -> str:
    values = [v for v in (row.stat(key) for row in rows) if v is not None]
    return f"{np.mean(values):.0f}" if values else "-"


def tail_latency(run: RunData) -> ClaimResult:
    claim = (
        "zero-layer P50/P95/P99 189/213/247 ms vs 427/1280/3850 ms orchestrated; "
        "std dev 38 vs 1420 ms"
    )
    claimed = {"p50": 427 / 189, "p95": 1280 / 213, "p99": 3850 / 247, "std": 1420 / 38}
    rule = _rule(
        "held when baseline/zero-layer E2EL ratios at P50, P95, P99 and std dev are each at least "
        "half the claimed ratios (2.3x, 6.0x, 15.6x, 37x)",
        run,
    )
    claimed_text = ", ".join(f"{k} {v:.1f}x" for k, v in claimed.items())
    inputs = latency_inputs(run)
    if isinstance(inputs, Unjudged):
        return ClaimResult("tail_latency", claim, claimed_text, inputs.reason, inputs.status, rule)
    ratios = {k: _per_repeat(inputs, _ratio(key), floor=0.0) for k, key in TAIL_KEYS.items()}
    status = combine([decide(ratios[k], Band(claimed[k] / 2)) for k in claimed])
    zl = [zl for zl, _ in inputs.pairs]
    base = [base for _, base in inputs.pairs]
    figures = {
        name: "/".join(_mean_stat(rows, TAIL_KEYS[k]) for k in ("p50", "p95", "p99"))
        for name, rows in (("zl", zl), ("base", base))
    }
    measured = (
        f"{figures['zl']} vs {figures['base']} ms, std {_mean_stat(zl, TAIL_KEYS['std'])} vs "
        f"{_mean_stat(base, TAIL_KEYS['std'])} ms ({inputs.where()}); ratios "
        + ", ".join(f"{k} {_text(v, inputs, '.2f', 'x')}" for k, v in ratios.items())
    )
    return ClaimResult("tail_latency", claim, claimed_text, measured, status, rule)


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


def _loader_problems(row: SummaryRow) -> list[str]:
    """A fault row counts the stack's failures, lost ones included; only the loader falling
    off its schedule makes those counts the loader's."""
    return ["the loader could not keep to its schedule"] if row.loader_limited else []


def fault_errors(run: RunData) -> ClaimResult:
    claim = (
        "killing an orchestrator replica multiplies downstream errors; "
        "the zero-layer stack has no such component to lose"
    )
    rule = (
        f"held when, under profile {FAULT_PROFILE}, the baseline's failed + lost requests are "
        "more than twice the zero-layer's; lost requests count as failures (the fault's "
        "effect), but a row whose loader could not keep to its schedule is not judged"
    )
    pair = _summary_pair(run, FAULT_PROFILE)
    if pair is None:
        return ClaimResult("fault_errors", claim, "errors multiply", "-", NOT_MEASURED, rule)
    limited = _problem_text(pair, _loader_problems)
    if limited:
        return ClaimResult("fault_errors", claim, "errors multiply", limited, INVALID_INPUTS, rule)
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
    """Every claim, in docs/design.md's order."""
    return [check(run) for check in CLAIMS]
