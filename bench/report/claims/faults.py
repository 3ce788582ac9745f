"""The chaos claims, judged on trials of profile D's experiments (``chaos.runner``): how fast
each stack refuses under rising KV pressure (``refusal_speed``), what killing the component
clients talk to does to errors (``fault_errors``), and how often a retried request then succeeds
(``retry_success``).

A trial is one run of an experiment on one stack (``Recovery.trial``, the repeat); the two
stacks' runs of the same repeat are paired, and a pair counts only when neither run has a
problem (``chaos.recovery.trial_problems``, plus the claim's own). As for every claim, a verdict
needs ``MIN_TRIALS`` valid pairs and an interval over them wholly on one side of the threshold.
A figure that is only bounded in a trial (a stack that refused nothing before the pressure
ended: its notice time is at least the rest of the pressure) is used as its bound, and decides
only in the direction the bound allows; otherwise the claim is undecided and says so.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Final

from bench.report.claim_inputs import BASELINE, FAULT_PROFILE, ZEROLAYER
from bench.report.claims.common import (
    NOT_MEASURED,
    UNDECIDED,
    ClaimResult,
    Judgement,
    result,
)
from bench.report.data import RunData, read_recovery
from bench.report.verdicts import SPANS, Band, Status, combine, decide
from chaos.recovery import KV_PRESSURE, Recovery, front_kill, trial_problems
from chaos.recovery import judged as judged_on
from chaos.refusal import over_trials
from chaos.windows import WindowCounts
from harness.curves import Interval, interval
from harness.validity import MIN_TRIALS, too_few
from serving.engine.kvwatch import INTERVAL_S

CHAOS_RULE: Final = (
    f"a figure is decided only from at least {MIN_TRIALS} valid paired trials (the two stacks' "
    "runs of the same repeat of the experiment), each of which ran to its end with the steady "
    "state holding before the fault, every rollback done, nothing lost, the host below 90 % CPU "
    "(measured over the experiment) and its speed within 25 % of the run's first probe; held "
    "or not held only when the 95 % interval over trials lies wholly on one side of the "
    "threshold, else undecided with the reason"
)
RESOLUTION_MS: Final = 1000.0 * INTERVAL_S
CLAIMED_REFUSAL_MS: Final = 3.2
CLAIMED_NOTICE_RATIO: Final = 120.0 / 3.2
CLAIMED_ERROR_RISE: Final = 4.2
CLAIMED_RETRY_PP: Final = 94.7 - 62.0

Side = tuple[Recovery, ...]
Pair = tuple[Side, Side]


class Bound(StrEnum):
    """What a trial's figure is: the value, or only a bound on it."""

    EXACT = ""
    AT_LEAST = "at least"
    AT_MOST = "at most"


@dataclass(frozen=True, slots=True)
class Reading:
    value: float
    bound: Bound = Bound.EXACT


@dataclass(frozen=True, slots=True)
class ChaosTrials:
    """Each valid trial's rows of the judged experiments, (zero-layer's, baseline's), how many
    trials ran them on both stacks, and what was wrong with the others."""

    pairs: tuple[Pair, ...]
    trials: int
    problems: tuple[str, ...] = ()

    def shown(self, rows: Sequence[Recovery]) -> tuple[list[Recovery], str]:
        """The rows a claim's figures are shown over: the valid trials' when there are any
        (what the verdict is decided on), else every trial's, and which they are."""
        valid = [row for zl, base in self.pairs for row in (*zl, *base)]
        if valid:
            return valid, "over the valid trials"
        return list(rows), "over every trial, none valid"

    def firsts(self) -> list[tuple[Recovery, Recovery]]:
        """Each pair's first row a side: the row, where a side is one experiment."""
        return [(zl[0], base[0]) for zl, base in self.pairs]

    def used(self, zl_experiments: str, base_experiments: str) -> str:
        ks = ", ".join(str(zl[0].trial) for zl, _ in self.pairs)
        return (
            f"rows zerolayer/{zl_experiments} and baseline/{base_experiments}, trials [{ks}] "
            f"({len(self.pairs)} valid of {self.trials})"
        )


def chaos_trials(
    rows: Sequence[Recovery],
    experiments: tuple[Collection[str], Collection[str]],
    reference: float | None,
    own: Callable[[Side], list[str]] = lambda _: [],
    load_lag: bool = True,
) -> ChaosTrials:
    """The zero-layer's rows of ``experiments[0]`` and the baseline's of ``experiments[1]``
    (rows of a fault with nothing to act on left out), side by side per trial; a trial is valid
    when no row has a problem and neither side has one of the claim's own (``own``)."""
    sides: list[dict[int, list[Recovery]]] = [{}, {}]
    for row in rows:
        for side, stack in zip(sides, (ZEROLAYER, BASELINE), strict=True):
            wanted = experiments[0] if stack == ZEROLAYER else experiments[1]
            if row.stack == stack and row.experiment in wanted and not row.absent:
                side.setdefault(row.trial, []).append(row)
    both = sorted(sides[0].keys() & sides[1].keys())
    pairs, problems = [], []
    for k in both:
        zl, base = tuple(sides[0][k]), tuple(sides[1][k])
        flagged = [
            f"{row.stack} {row.experiment} trial {k}: {'; '.join(found)}"
            for row in (*zl, *base)
            if (found := trial_problems(row, reference, load_lag=load_lag))
        ]
        flagged += [
            f"{side[0].stack} trial {k}: {'; '.join(found)}"
            for side in (zl, base)
            if (found := own(side))
        ]
        problems += flagged
        if not flagged:
            pairs.append((zl, base))
    return ChaosTrials(tuple(pairs), len(both), tuple(problems))


def _unsound(status: Status, band: Band, bounds: set[Bound]) -> str:
    """Why a verdict reached on bounds cannot stand ('' when it can): a bound decides only a
    verdict that says the true value lies further the way the bound points."""
    high = (status is Status.HELD) == (band.high is None)
    if status not in (Status.HELD, Status.NOT_HELD):
        return ""
    if high and Bound.AT_MOST in bounds:
        return "a trial's figure is only an upper bound, which cannot show it is this high"
    if not high and Bound.AT_LEAST in bounds:
        return "a trial's figure is only a lower bound, which cannot show it is this low"
    return ""


@dataclass(frozen=True, slots=True)
class Figure:
    """One figure over the pairs, decided against its band."""

    name: str
    readings: tuple[Reading, ...]
    band: Band
    floor: float | None = None
    interval: Interval = field(init=False)
    status: Status = field(init=False)
    reason: str = field(init=False)

    def __post_init__(self) -> None:
        figure = interval([r.value for r in self.readings], floor=self.floor)
        status = decide(figure, self.band)
        reason = _unsound(status, self.band, {r.bound for r in self.readings})
        if reason:
            status = Status.UNDECIDED
        elif status is Status.UNDECIDED:
            reason = SPANS
        object.__setattr__(self, "interval", figure)
        object.__setattr__(self, "status", status)
        object.__setattr__(self, "reason", f"{self.name}: {reason}" if reason else "")


def judged(figures: Sequence[Figure], measured: str, trials: int) -> Judgement:
    status = combine([f.status for f in figures])
    reason = "; ".join(f.reason for f in figures if f.reason) if status is UNDECIDED else ""
    return Judgement(
        status,
        measured,
        reason or (SPANS if status is UNDECIDED else ""),
        {f.name: f.interval for f in figures},
        trials,
        {f.name: f.band for f in figures},
    )


def unjudged(got: ChaosTrials, measured: str, what: str) -> Judgement:
    """Too few valid pairs (or none ran): undecided with the count and what was wrong, or not
    measured when the experiment never ran on both stacks."""
    if not got.trials:
        return Judgement(NOT_MEASURED, "-", f"{what} did not run on both stacks")
    reason = "; ".join([too_few(len(got.pairs)), *got.problems])
    return Judgement(UNDECIDED, measured, reason, trials=len(got.pairs))


def _load(run: RunData) -> str:
    rate = run.meta.profiles.get(FAULT_PROFILE, {}).get("rate")
    return f"under profile D's background load of {rate:g} req/s" if rate else "under profile D"


# -- refusal speed -----------------------------------------------------------------------------


def _refusal_problems(side: Side) -> list[str]:
    refusal = side[0].refusal
    if refusal is None:
        return ["no refusal figures (the KV pressure logged no requests)"]
    return refusal.problems()


def _p99_reading(row: Recovery) -> Reading:
    """The zero-layer's p99 refusal latency; one that refused nothing is at least as slow as
    the rest of the pressure."""
    r = row.refusal
    assert r is not None and r.notice_ms is not None
    if r.p99_ms is None:
        return Reading(r.notice_ms, Bound.AT_LEAST)
    return Reading(r.p99_ms)


def _notice_ratio(zl: Recovery, base: Recovery) -> Reading | None:
    """Baseline notice / zero-layer notice (floored at the watch's resolution); bounded where a
    stack refused nothing before the pressure ended; None when neither refused."""
    a, b = zl.refusal, base.refusal
    assert a is not None and b is not None and a.notice_ms is not None
    assert b.notice_ms is not None
    if a.censored and b.censored:
        return None
    value = b.notice_ms / max(a.notice_ms, RESOLUTION_MS)
    bound = Bound.AT_MOST if a.censored else Bound.AT_LEAST if b.censored else Bound.EXACT
    return Reading(value, bound)


def _stack_text(rows: Sequence[Recovery], name: str) -> str:
    return over_trials(name, [r.refusal for r in rows if r.refusal is not None])


def refusal_speed(run: RunData) -> ClaimResult:
    claim = (
        "the embedded scheduler refuses a stream within 3.2 ms of memory pressure; "
        "an external layer needs about 120 ms to notice"
    )
    rule = (
        "under rising KV pressure on one replica (the same ramp on each stack), held when the "
        f"zero-layer's p99 refusal latency (send to the refusal its client saw) is at most "
        f"{2 * CLAIMED_REFUSAL_MS:g} ms (2x the claim) and the baseline's notice time (from its "
        "engine's KV crossing the refusal threshold, stamped by the engine's host, to the first "
        "refusal a client saw) is at least "
        f"{CLAIMED_NOTICE_RATIO / 2:g}x the zero-layer's (half the claimed "
        f"{CLAIMED_NOTICE_RATIO:g}x; a notice under the {RESOLUTION_MS:g} ms watch counts as "
        f"{RESOLUTION_MS:g} ms; no refusal before the pressure ended counts as the rest of the "
        "pressure, a bound), per paired trial of " + KV_PRESSURE + "; " + CHAOS_RULE
    )
    rows = read_recovery(run.path)
    got = chaos_trials(
        rows, ({KV_PRESSURE}, {KV_PRESSURE}), _reference(run), _refusal_problems, load_lag=False
    )
    kv, over = got.shown([r for r in rows if r.experiment == KV_PRESSURE])
    measured = "; ".join(
        [
            over,
            _stack_text([r for r in kv if r.stack == ZEROLAYER], "zero-layer"),
            _stack_text([r for r in kv if r.stack == BASELINE], "baseline"),
            f"{_load(run)}; {got.used(KV_PRESSURE, KV_PRESSURE)}",
        ]
    )
    claimed = f"{CLAIMED_REFUSAL_MS:g} ms vs 120 ms"
    if len(got.pairs) < MIN_TRIALS:
        return result("refusal_speed", claim, claimed, rule, unjudged(got, measured, KV_PRESSURE))
    ratios = [x for x in (_notice_ratio(zl, base) for zl, base in got.firsts()) if x is not None]
    figures = [
        Figure("zl_p99_ms", tuple(_p99_reading(zl) for zl, _ in got.firsts()), Band(0.0, 6.4)),
        Figure("notice_ratio", tuple(ratios), Band(CLAIMED_NOTICE_RATIO / 2), floor=0.0),
    ]
    if len(ratios) < len(got.pairs):
        measured += f"; {len(got.pairs) - len(ratios)} trial(s) where neither stack refused"
    return result("refusal_speed", claim, claimed, rule, judged(figures, measured, len(got.pairs)))


def _reference(run: RunData) -> float | None:
    return run.meta.machine.cpu_speed_start


# -- errors when what clients talk to dies ----------------------------------------------------


def _rise(row: Recovery) -> float:
    """The fault window's error rate over the steady state's, floored at one request's share
    of the window: a rise below one request cannot be told from none."""
    fault, before = row.faulted, row.steady
    assert fault.error_rate is not None and before.error_rate is not None
    return max(fault.error_rate - before.error_rate, 1.0 / fault.requests)


def _windows_problems(side: Side) -> list[str]:
    row, problems = side[0], []
    if not row.steady.requests:
        problems.append("no request ran wholly before the fault (no steady state to compare)")
    if not row.faulted.requests:
        problems.append("no request in the fault's window")
    return problems


def _rise_text(rows: Sequence[Recovery], name: str, experiment: str) -> str:
    ok = [r for r in rows if r.steady.error_rate is not None and r.faulted.error_rate is not None]
    steady = interval([100 * (r.steady.error_rate or 0.0) for r in ok], floor=0.0)
    fault = interval([100 * (r.faulted.error_rate or 0.0) for r in ok], floor=0.0)
    return (
        f"{name} ({experiment}): errors {steady.text('.1f', '%')} steady -> "
        f"{fault.text('.1f', '%')} in the fault window"
    )


def fault_errors(run: RunData) -> ClaimResult:
    claim = (
        "killing the component clients talk to raises downstream errors by 320 % behind an "
        "orchestrator; the zero-layer stack has no such component to lose"
    )
    zl_exp, base_exp = front_kill(ZEROLAYER), front_kill(BASELINE)
    rule = (
        "each stack's rise in error rate from the steady state before the fault to the fault's "
        "window (until the rollbacks made it whole), floored at one request's share of the "
        f"window, in the experiment that kills what its clients talk to (baseline: {base_exp}, "
        f"zero-layer: {zl_exp}, the replica the SDK talks to); held when the baseline's rise is "
        f"at least {CLAIMED_ERROR_RISE / 2:g}x the zero-layer's (half the claimed "
        f"{CLAIMED_ERROR_RISE:g}x, +320 %), per paired trial; " + CHAOS_RULE
    )
    rows = read_recovery(run.path)
    got = chaos_trials(rows, ({zl_exp}, {base_exp}), _reference(run), _windows_problems)
    shown, over = got.shown(rows)
    measured = "; ".join(
        [
            over,
            _rise_text([r for r in shown if (r.stack, r.experiment) == (BASELINE, base_exp)],
                       "baseline", base_exp),
            _rise_text([r for r in shown if (r.stack, r.experiment) == (ZEROLAYER, zl_exp)],
                       "zero-layer", zl_exp),
            f"judged on {base_exp} (baseline) against {zl_exp} (zero-layer) {_load(run)}; "
            + got.used(zl_exp, base_exp),
        ]
    )  # fmt: skip
    claimed = f"errors x{CLAIMED_ERROR_RISE:g} (+320 %)"
    if len(got.pairs) < MIN_TRIALS:
        return result("fault_errors", claim, claimed, rule, unjudged(got, measured, base_exp))
    readings = tuple(Reading(_rise(base) / _rise(zl)) for zl, base in got.firsts())
    figure = Figure("error_rise_ratio", readings, Band(CLAIMED_ERROR_RISE / 2), floor=0.0)
    measured += f"; baseline rise / zero-layer rise {figure.interval.text('.2f', 'x')}"
    return result("fault_errors", claim, claimed, rule, judged([figure], measured, len(got.pairs)))


# -- retry success ----------------------------------------------------------------------------


def _retried(side: Side) -> WindowCounts:
    """A side's fault windows pooled: every judged experiment of the trial on one stack."""
    return WindowCounts(
        retried=sum(r.faulted.retried for r in side),
        retried_ok=sum(r.faulted.retried_ok for r in side),
    )


def _retried_problems(side: Side) -> list[str]:
    if _retried(side).retried:
        return []
    return ["no request was retried in the fault windows of " + _names(side)]


def _names(side: Side) -> str:
    return ", ".join(sorted(r.experiment for r in side))


def _retry_text(rows: Sequence[Recovery], name: str) -> str:
    trials = sorted({r.trial for r in rows})
    pooled = [_retried(tuple(r for r in rows if r.trial == k)) for k in trials]
    pct = interval(
        [None if w.retry_success is None else 100 * w.retry_success for w in pooled],
        "none retried",
    )
    per_experiment = ", ".join(
        f"{r.experiment}#{r.trial} {r.faulted.retried_ok}/{r.faulted.retried}"
        for r in rows
        if r.faulted.retried
    )
    return (
        f"{name}: {pct.text('.1f', '%')} of retried requests completed "
        f"(completed/retried: {per_experiment or 'none retried'})"
    )


def retry_success(run: RunData) -> ClaimResult:
    claim = "retries succeed 62 % of the time behind the layer against 94.7 % without it"
    zl_set, base_set = judged_on(ZEROLAYER), judged_on(BASELINE)
    zl_names, base_names = ("{" + ",".join(sorted(x)) + "}" for x in (zl_set, base_set))
    rule = (
        "the share of retried requests (the SDK's retries; the orchestrator's, from its "
        "zl-attempts) that completed, pooled over the fault windows of the experiments each "
        f"stack runs in every trial (zero-layer {zl_names}, baseline {base_names}: the KV "
        "pressure and the loss of what its clients talk to); held when the zero-layer's exceeds "
        f"the baseline's by at least {CLAIMED_RETRY_PP / 2:g} percentage points (half the "
        f"claimed {CLAIMED_RETRY_PP:g}), per paired trial with retried requests on both stacks; "
        + CHAOS_RULE
    )
    rows = read_recovery(run.path)
    got = chaos_trials(rows, (zl_set, base_set), _reference(run), _retried_problems)
    wanted = [r for r in rows if r.experiment in judged_on(r.stack) and not r.absent]
    mine, over = got.shown(wanted)
    measured = "; ".join(
        [
            over,
            _retry_text([r for r in mine if r.stack == ZEROLAYER], "zero-layer"),
            _retry_text([r for r in mine if r.stack == BASELINE], "baseline"),
            f"{_load(run)}; {got.used(zl_names, base_names)}",
        ]
    )
    claimed = "94.7 % vs 62 %"
    if len(got.pairs) < MIN_TRIALS:
        return result("retry_success", claim, claimed, rule, unjudged(got, measured, "they"))
    readings = tuple(
        Reading(100 * ((_retried(zl).retry_success or 0.0) - (_retried(base).retry_success or 0.0)))
        for zl, base in got.pairs
    )
    figure = Figure("retry_success_pp", readings, Band(CLAIMED_RETRY_PP / 2))
    measured += f"; zero-layer - baseline {figure.interval.text('+.1f', 'pp')}"
    return result("retry_success", claim, claimed, rule, judged([figure], measured, len(got.pairs)))
