"""The seed study's claims (docs/design.md), each checked against what this run measured.

The seeds' numbers come from a different machine and scale, so each check compares what carries
across scales: absolute overheads within a factor of two of the claimed range, and stack-to-stack
ratios in the claimed direction and at least half the claimed size. Every row states its rule,
the claimed figure, the measured one with its interval over trials, and the reason when it is
undecided; the rule for which trials count and when an interval decides is
``harness.validity``'s, printed from the same text (``VALIDITY_RULE``).

The latency claims are judged on paired trials (``bench.report.claim_inputs``): a plain run's
latency profile, paired by repeat; a sweep at stated fractions of the lower stack's knee. The
claim's figure is taken per pair and summarised as an interval over pairs
(``harness.curves.interval``). Claims measured once per stack (a chaos experiment, the whole
run's telemetry) have no interval over trials and are undecided until they are measured per
trial. The results are written to ``claims.json`` (``write``) for the report, the notebook and
``compare``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import numpy as np

from bench.report.claim_inputs import (
    BASELINE,
    ZEROLAYER,
    Inputs,
    Judged,
    plain_inputs,
    reference_speed,
    sweep_inputs,
)
from bench.report.data import RunData, read_recovery
from bench.report.verdicts import SPANS, Band, Status, combine, decide
from harness import schema
from harness.curves import Interval, interval
from harness.runner.trials import trial_phase
from harness.schema import SummaryRow
from harness.schema.files import read_json, write_json_atomic
from harness.telemetry.process import LAYER_ROLES
from harness.validity import MIN_TRIALS, too_few, trial_problems
from harness.validity import RULE as VALIDITY_RULE

CLAIMS_FILE: Final = "claims.json"
FAULT_PROFILE: Final = "d_fault"
TAIL_KEYS: Final = {
    "p50": "median_e2el_ms",
    "p95": "p95_e2el_ms",
    "p99": "p99_e2el_ms",
    "std": "std_e2el_ms",
}
HELD, NOT_HELD, NOT_MEASURED, UNDECIDED = (
    Status.HELD,
    Status.NOT_HELD,
    Status.NOT_MEASURED,
    Status.UNDECIDED,
)
ONE_SAMPLE: Final = (
    "measured once per stack in this run, so there is no interval over trials: a single "
    "sample decides nothing"
)


@dataclass(frozen=True, slots=True)
class ClaimResult:
    """One claim: what the seeds said, what we measured, the rule, the verdict and, when it is
    undecided, why; ``figures`` are the intervals it was decided on, ``trials`` their count."""

    key: str
    claim: str
    claimed: str
    measured: str
    status: Status
    rule: str
    reason: str = ""
    figures: dict[str, Interval] = field(default_factory=dict)
    trials: int = 0


def latency_inputs(run: RunData) -> list[Inputs]:
    """The paired trials the latency claims are judged on: per stated load of a sweep, or the
    plain run's latency profile."""
    rows = run.sweep.points if run.sweep is not None else run.summaries
    reference = reference_speed(rows, run.meta.machine.cpu_speed_start)
    if run.sweep is not None:
        return sweep_inputs(run.sweep, reference)
    return plain_inputs(run.summaries, reference)


def _per_pair(
    judged: Judged,
    figure: Callable[[SummaryRow, SummaryRow], float | None],
    floor: float | None = None,
) -> Interval:
    """A figure per paired trial, as an interval; ``floor`` for figures that cannot go below."""
    values = [figure(zl, base) for zl, base in judged.pairs]
    return interval(values, "not measured in a trial", floor=floor)


def _median_delta(zl: SummaryRow, base: SummaryRow) -> float | None:
    a, b = zl.stat("median_e2el_ms"), base.stat("median_e2el_ms")
    return None if a is None or b is None else b - a


def _ratio(key: str) -> Callable[[SummaryRow, SummaryRow], float | None]:
    def figure(zl: SummaryRow, base: SummaryRow) -> float | None:
        a, b = zl.stat(key), base.stat(key)
        return None if a is None or b is None or a <= 0 else b / a

    return figure


@dataclass(frozen=True, slots=True)
class Judgement:
    """One load's part of a latency claim: its verdict, text and figures."""

    status: Status
    measured: str
    reason: str = ""
    figures: dict[str, Interval] = field(default_factory=dict)
    trials: int = 0


JudgeFn = Callable[[Judged], Judgement]


def _judge_all(inputs: Sequence[Inputs], judge: JudgeFn) -> Judgement:
    """Every load's judgement, combined (each must hold), with each load's text and reason."""
    parts = [
        judge(i) if isinstance(i, Judged) else Judgement(i.status, "-", i.reason) for i in inputs
    ]
    status = combine([p.status for p in parts])
    measured = " | ".join(p.measured for p in parts if p.measured != "-") or "-"
    reason = "; ".join(p.reason for p in parts if p.reason) if status is UNDECIDED else ""
    figures = {
        (f"{name}@{k}" if len(parts) > 1 else name): fig
        for k, p in enumerate(parts)
        for name, fig in p.figures.items()
    }
    return Judgement(status, measured, reason, figures, min((p.trials for p in parts), default=0))


def _result(key: str, claim: str, claimed: str, rule: str, got: Judgement) -> ClaimResult:
    return ClaimResult(
        key, claim, claimed, got.measured, got.status, rule, got.reason, got.figures, got.trials
    )


def _overhead_at(judged: Judged) -> Judgement:
    delta = _per_pair(judged, _median_delta)
    status = decide(delta, Band(40.0, 300.0))
    return Judgement(
        status,
        f"{delta.text('+.1f', 'ms')} at P50 ({judged.where()})",
        SPANS if status is UNDECIDED else "",
        {"p50_delta_ms": delta},
        len(judged.pairs),
    )


def layer_overhead(run: RunData) -> ClaimResult:
    rule = (
        "held when baseline P50 E2EL - zero-layer P50 E2EL lies within 40-300 ms (2x range); "
        + VALIDITY_RULE
    )
    return _result(
        "layer_overhead",
        "the middle layer adds 80-150 ms per request (P50 89 +/- 12 ms)",
        "80-150 ms (P50 89 ms)",
        rule,
        _judge_all(latency_inputs(run), _overhead_at),
    )


def _phase_windows(run: RunData) -> dict[str, tuple[int, int]]:
    """Each telemetry phase's (start, end) in wall-clock ns, by name."""
    starts: dict[str, int] = {}
    out: dict[str, tuple[int, int]] = {}
    for p in run.phases:
        if p.get("kind") != "phase":
            continue
        name = str(p.get("name", ""))
        if p.get("event") == "start":
            starts[name] = int(p["t_ns"])
        elif p.get("event") == "end" and name in starts:
            out[name] = (starts[name], int(p["t_ns"]))
    return out


def _layer_share(run: RunData, window: tuple[int, int]) -> float | None:
    """The middle layer's share of the baseline's serving CPU time within ``window``."""
    used: dict[str, tuple[str, float, float]] = {}
    for row in run.telemetry:
        if row.get("source") != "process" or row.get("stack") != BASELINE or "cpu_s" not in row:
            continue
        if row.get("role") == "loader" or not window[0] <= row.get("t_ns", 0) <= window[1]:
            continue
        first = used.get(row["name"], (row["role"], row["cpu_s"], row["cpu_s"]))
        used[row["name"]] = (row["role"], first[1], row["cpu_s"])
    total = sum(last - first for _, first, last in used.values())
    layer = sum(last - first for role, first, last in used.values() if role in LAYER_ROLES)
    if total <= 0 or not any(role in LAYER_ROLES for role, _, _ in used.values()):
        return None
    return layer / total


def _trial_phase(row: SummaryRow) -> str:
    return trial_phase(row.stack, row.profile, row.repeat)


def layer_cpu_share(run: RunData) -> ClaimResult:
    claim = "the middle layer takes up to 38 % of cluster CPU"
    rule = (
        "held when proxy + controller + orchestrator CPU time is at least 19 % (half the claim) "
        "of all baseline serving processes' CPU time, from psutil telemetry, per baseline trial; "
        + VALIDITY_RULE
    )
    rows = [r for r in run.summaries if r.stack == BASELINE and r.profile != FAULT_PROFILE]
    reference = reference_speed(rows, run.meta.machine.cpu_speed_start)
    windows = _phase_windows(run)
    shares = {
        id(r): _layer_share(run, windows[_trial_phase(r)])
        for r in rows
        if _trial_phase(r) in windows
    }
    if not any(v is not None for v in shares.values()):
        return ClaimResult("layer_cpu", claim, "up to 38 %", "-", NOT_MEASURED, rule)
    valid = [r for r in rows if not trial_problems(r, reference) and shares.get(id(r)) is not None]
    figure = interval([100 * (shares[id(r)] or 0.0) for r in valid], floor=0.0)
    measured = f"{figure.text('.1f', '%')} over {figure.n} baseline trials"
    if figure.n < MIN_TRIALS:
        flagged = [
            f"baseline {r.profile} trial {r.repeat}: " + "; ".join(trial_problems(r, reference))
            for r in rows
            if r not in valid
        ]
        reason = "; ".join([too_few(figure.n), *flagged[:3]])
        return ClaimResult("layer_cpu", claim, "up to 38 %", measured, UNDECIDED, rule, reason)
    status = decide(figure, Band(19.0))
    reason = SPANS if status is UNDECIDED else ""
    return ClaimResult(
        "layer_cpu",
        claim,
        "up to 38 %",
        measured,
        status,
        rule,
        reason,
        {"share_pct": figure},
        figure.n,
    )


def _mean_stat(rows: Sequence[SummaryRow], key: str) -> str:
    values = [v for v in (row.stat(key) for row in rows) if v is not None]
    return f"{np.mean(values):.0f}" if values else "-"


CLAIMED_TAILS: Final = {"p50": 427 / 189, "p95": 1280 / 213, "p99": 3850 / 247, "std": 1420 / 38}


def _tails_at(judged: Judged) -> Judgement:
    ratios = {k: _per_pair(judged, _ratio(key), floor=0.0) for k, key in TAIL_KEYS.items()}
    status = combine([decide(ratios[k], Band(v / 2)) for k, v in CLAIMED_TAILS.items()])
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
    return Judgement(status, measured, reason, {f"{k}_ratio": v for k, v in ratios.items()},
                     len(judged.pairs))  # fmt: skip


def tail_latency(run: RunData) -> ClaimResult:
    rule = (
        "held when baseline/zero-layer E2EL ratios at P50, P95, P99 and std dev are each at least "
        "half the claimed ratios (2.3x, 6.0x, 15.6x, 37x); " + VALIDITY_RULE
    )
    return _result(
        "tail_latency",
        "zero-layer P50/P95/P99 189/213/247 ms vs 427/1280/3850 ms orchestrated; "
        "std dev 38 vs 1420 ms",
        ", ".join(f"{k} {v:.1f}x" for k, v in CLAIMED_TAILS.items()),
        rule,
        _judge_all(latency_inputs(run), _tails_at),
    )


def _once(key: str, claim: str, claimed: str, measured: str, held: bool, rule: str) -> ClaimResult:
    """A claim measured once per stack: its figure shown, undecided (``ONE_SAMPLE``); the
    single sample's reading is kept in the reason so that nothing measured is hidden."""
    reading = "it would read held" if held else "it would read not held"
    return ClaimResult(key, claim, claimed, measured, UNDECIDED, rule, f"{ONE_SAMPLE} ({reading})")


def refusal_speed(run: RunData) -> ClaimResult:
    claim = (
        "the embedded scheduler refuses within about 3 ms of memory pressure; "
        "an external layer needs about 120 ms to notice"
    )
    rule = (
        "held when, for a KV-pressure fault, the baseline's time to detect is at least 20x the "
        "zero-layer's (half the claimed 40x), from the chaos recovery table; " + VALIDITY_RULE
    )
    detect = {
        row.stack: row.time_to_detect_s * 1000.0
        for row in read_recovery(run.path)
        if "kv" in row.fault.lower() and row.time_to_detect_s is not None
    }
    if ZEROLAYER not in detect or BASELINE not in detect:
        return ClaimResult("refusal_speed", claim, "3 ms vs 120 ms", "-", NOT_MEASURED, rule)
    zl, base = detect[ZEROLAYER], detect[BASELINE]
    measured = f"{zl:.1f} ms vs {base:.1f} ms"
    return _once("refusal_speed", claim, "3 ms vs 120 ms", measured, base >= 20 * zl, rule)


def fault_errors(run: RunData) -> ClaimResult:
    claim = (
        "killing an orchestrator replica multiplies downstream errors; "
        "the zero-layer stack has no such component to lose"
    )
    rule = (
        f"held when, under profile {FAULT_PROFILE}, the baseline's failed + lost requests are "
        "more than twice the zero-layer's; lost requests count as failures (the fault's "
        "effect), but a row whose loader could not keep to its schedule is not judged; "
        + VALIDITY_RULE
    )
    zl_row, base_row = run.summary(ZEROLAYER, FAULT_PROFILE), run.summary(BASELINE, FAULT_PROFILE)
    if zl_row is None or base_row is None:
        return ClaimResult("fault_errors", claim, "errors multiply", "-", NOT_MEASURED, rule)
    limited = [f"{r.stack} {r.profile}: the loader could not keep to its schedule"
               for r in (zl_row, base_row) if r.loader_limited]  # fmt: skip
    measured = (
        f"failed+lost {zl_row.failed} of {zl_row.num_requests} (zero-layer) vs "
        f"{base_row.failed} of {base_row.num_requests} (baseline)"
    )
    if limited:
        reason = " | ".join(limited)
        return ClaimResult(
            "fault_errors", claim, "errors multiply", measured, UNDECIDED, rule, reason
        )
    held = base_row.failed > 2 * zl_row.failed
    return _once("fault_errors", claim, "errors multiply", measured, held, rule)


def fragmentation(run: RunData) -> ClaimResult:
    claim = "fixed shapes and admission control cut memory fragmentation (31 % to 4 %)"
    rule = (
        "held when the baseline's mean KV waste (engine telemetry, samples with KV in use) is at "
        "least 3.9x the zero-layer's (half the claimed 7.75x); " + VALIDITY_RULE
    )
    waste: dict[str, list[float]] = {}
    for row in run.telemetry:
        if row.get("source") == "engine" and row.get("kv_blocks_used", 1) and "kv_waste" in row:
            waste.setdefault(row.get("stack", ""), []).append(row["kv_waste"])
    if not waste.get(ZEROLAYER) or not waste.get(BASELINE):
        return ClaimResult("fragmentation", claim, "31 % -> 4 %", "-", NOT_MEASURED, rule)
    zl, base = float(np.mean(waste[ZEROLAYER])), float(np.mean(waste[BASELINE]))
    measured = f"{100 * base:.1f} % -> {100 * zl:.1f} %"
    held = base >= 3.9 * zl and base > 0
    return _once("fragmentation", claim, "31 % -> 4 %", measured, held, rule)


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


def write(run_dir: Path, results: Sequence[ClaimResult]) -> Path:
    """``claims.json``: every claim with its verdict, figures, intervals, trial count and
    reason, and the validity rule it was decided under."""
    path = run_dir / CLAIMS_FILE
    data = {"validity_rule": VALIDITY_RULE, "claims": schema.to_data(list(results))}
    write_json_atomic(path, data)
    return path


def read(run_dir: Path) -> list[ClaimResult]:
    """The claims a run's report wrote (none when it has no ``claims.json``)."""
    path = run_dir / CLAIMS_FILE
    if not path.exists():
        return []
    raw = read_json(path)
    return [schema.from_data(ClaimResult, c) for c in raw.get("claims", [])]
