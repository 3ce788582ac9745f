"""Which trials may decide a verdict, and why the others may not.

A trial is one stack driven through one seeded schedule: a plain run's (profile, repeat) or a
sweep's (rate, repeat). A verdict (a seed claim held or not, a regression or not) is decided only
from trials that measured the stack: the loader kept to its schedule, nothing was lost, the stack
was below saturation, the host's cores were not full (their mean or any one of them), the host's
speed stayed near the run's first probe, and every one of those was measured (a row with no host
measurement is not valid: missing never reads as fine). It is decided only with at least
``MIN_TRIALS`` such paired trials and an interval that lies wholly on one side of its threshold.

``compare`` asks only for the harness's part (``harness_problems``): a stack saturating or losing
requests is the very regression it looks for. The claims report, ``compare`` and the notebook
all ask this module, and print its ``RULE`` and
reasons, so that the rule printed and the rule applied are one text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from harness.schema import SummaryRow
from harness.telemetry.host import SATURATED_PCT, SPEED_DIFFERS

MIN_TRIALS: Final = 3

RULE: Final = (
    f"a figure is decided only from at least {MIN_TRIALS} valid trials (paired by repeat when "
    "two stacks are compared), each with its loader on schedule, nothing lost, the stack below "
    f"saturation, the host below {SATURATED_PCT:g} % CPU (the mean of its cores and each single "
    f"core), the host's speed within {SPEED_DIFFERS:.0%} of the run's first probe, and all of "
    "these measured; held or not held only when the 95 % interval over trials lies wholly on "
    "one side of the threshold, else undecided with the reason"
)


def host_problem(row: SummaryRow) -> str:
    """Why the host's CPU makes a trial the host's ('' when it does not): not measured, or
    every core or a single core at or above the bound."""
    return host_cpu_problem(row.host_cpu_pct, row.host_busiest_cpu_pct, row.host_saturated)


def host_cpu_problem(mean: float | None, busiest: float | None, saturated: bool = False) -> str:
    """``host_problem`` from the figures themselves (a chaos trial has no summary row)."""
    if mean is None:
        return "the host's CPU was not measured"
    if saturated or mean >= SATURATED_PCT or (busiest or 0.0) >= SATURATED_PCT:
        shown = f", busiest core {busiest:.0f} %" if busiest is not None else ""
        return f"host saturated (CPU {mean:.0f} %{shown})"
    return ""


def speed_problem(row: SummaryRow, reference: float | None) -> str:
    """Why the host's speed makes a trial incomparable ('' when it does not): not probed, or
    moved beyond ``SPEED_DIFFERS`` from ``reference`` (the run's first probe)."""
    return host_speed_problem(row.host_speed, reference)


def host_speed_problem(speed: float | None, reference: float | None) -> str:
    """``speed_problem`` from the probe's figure itself."""
    if speed is None:
        return "the host's speed was not probed before the trial"
    if reference is None or reference <= 0:
        return ""
    moved = speed / reference - 1.0
    if abs(moved) > SPEED_DIFFERS:
        return f"host speed moved {moved:+.0%} from the run's first probe"
    return ""


def harness_problems(row: SummaryRow, reference_speed: float | None = None) -> list[str]:
    """Why the harness, not the stack, set a trial's figures: the loader off its schedule, the
    host saturated or not measured, its speed moved or not probed. What ``compare`` excludes:
    a stack that saturates or loses requests in B is the regression it looks for."""
    problems = []
    if row.loader_limited:
        lag = [r for r in row.invalid_reasons if r.startswith("loader")]
        problems.append("; ".join(lag) or "the loader could not keep to its schedule")
    for problem in (host_problem(row), speed_problem(row, reference_speed)):
        if problem:
            problems.append(problem)
    return problems


def trial_problems(row: SummaryRow, reference_speed: float | None = None) -> list[str]:
    """Every reason ``row`` may not decide a claim (the harness's, and the stack's own
    saturation or losses, at which a latency is queueing, not the stack's); empty when it may."""
    problems = []
    if not row.valid:
        problems.append("invalid: " + ("; ".join(row.invalid_reasons) or "flagged"))
    elif row.loader_limited:
        problems.append("the loader could not keep to its schedule")
    if row.saturated:
        problems.append("saturated: " + ("; ".join(row.saturation_reasons) or "flagged"))
    for problem in (host_problem(row), speed_problem(row, reference_speed)):
        if problem:
            problems.append(problem)
    return problems


def too_few(valid: int, needed: int = MIN_TRIALS) -> str:
    """The undecided reason for ``valid`` trials where ``needed`` are required ('' if enough)."""
    if valid >= needed:
        return ""
    return f"too few valid trials: {valid} of the {needed} needed"


def first_speed(rows: Sequence[SummaryRow]) -> float | None:
    """The earliest trial's host speed: the reference the others are held to."""
    return next((r.host_speed for r in rows if r.host_speed is not None), None)
