"""What the latency claims are judged on: paired trials that may decide (``harness.validity``).

A plain run pairs the zero-layer and baseline trials of the latency profile by repeat (same
seeded schedule). A sweep is judged at stated loads, ``JUDGED_AT`` fractions of the lower
stack's knee (or of the highest rate swept where neither stack reached a knee), each at the
highest rate swept at or below that load, its trials paired by repeat. A set of pairs decides
only when at least ``MIN_TRIALS`` pairs have both trials valid; otherwise it is undecided, and
the reason names the count and what was wrong with the others.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from bench.report.verdicts import Status
from harness.schema import SummaryRow, SweepSection
from harness.validity import MIN_TRIALS, first_speed, too_few, trial_problems

ZEROLAYER: Final = "zerolayer"
BASELINE: Final = "baseline"
LATENCY_PROFILE: Final = "a_latency"
FAULT_PROFILE: Final = "d_fault"
JUDGED_AT: Final = (0.5, 0.8)

Pair = tuple[SummaryRow, SummaryRow]

# Profiles whose trials change the stack under load (a fault; a replica joining and leaving): no
# steady-state claim (latency, the layer's CPU share) is judged on them.
STACK_CHANGING: Final = frozenset({"d_fault", "g_elasticity"})


@dataclass(frozen=True, slots=True)
class Judged:
    """Valid (zero-layer, baseline) pairs, one per repeat, of one profile at one load (``rate``
    None for a plain run); ``load`` says how a sweep's rate was chosen."""

    profile: str
    rate: float | None
    pairs: tuple[Pair, ...]
    load: str = ""

    def where(self) -> str:
        n = len(self.pairs)
        trials = f"{n} paired trial{'s' if n != 1 else ''}"
        if self.rate is None:
            return f"{self.profile}, {trials}"
        return f"{self.profile} at {self.rate:g} req/s ({self.load}), {trials}"


@dataclass(frozen=True, slots=True)
class Unjudged:
    """Why there is nothing to judge: ``status`` NOT_MEASURED or UNDECIDED, with the reason."""

    status: Status
    reason: str


Inputs = Judged | Unjudged


def _pairs_by_repeat(rows: Sequence[SummaryRow]) -> list[Pair]:
    """The zero-layer and baseline rows of each repeat that has both, in repeat order; none of a
    profile that changes the stack (``STACK_CHANGING``)."""
    steady = [r for r in rows if r.profile not in STACK_CHANGING]
    zl = {r.repeat: r for r in steady if r.stack == ZEROLAYER}
    base = {r.repeat: r for r in steady if r.stack == BASELINE}
    return [(zl[k], base[k]) for k in sorted(zl.keys() & base.keys())]


def _problems_text(pairs: Sequence[Pair], reference: float | None) -> str:
    """Each flagged trial's reasons, zero-layer first, by repeat."""
    parts = []
    for pair in pairs:
        for row in pair:
            problems = trial_problems(row, reference)
            if problems:
                parts.append(f"{row.stack} trial {row.repeat}: {'; '.join(problems)}")
    return " | ".join(sorted(parts, key=lambda p: (not p.startswith(ZEROLAYER), p)))


def judge_pairs(
    pairs: Sequence[Pair], profile: str, rate: float | None, reference: float | None, load: str = ""
) -> Inputs:
    """The valid pairs of ``pairs`` as Judged when there are enough, else why not."""
    if not pairs:
        return Unjudged(Status.NOT_MEASURED, f"{profile}: no trial ran on both stacks")
    valid = tuple(
        p for p in pairs if not trial_problems(p[0], reference) + trial_problems(p[1], reference)
    )
    if len(valid) >= MIN_TRIALS:
        return Judged(profile, rate, valid, load)
    at = f" at {rate:g} req/s ({load})" if rate is not None else ""
    problems = _problems_text(pairs, reference)
    return Unjudged(
        Status.UNDECIDED,
        f"{profile}{at}: {too_few(len(valid))}" + (f"; {problems}" if problems else ""),
    )


def latency_profile(rows: Sequence[SummaryRow]) -> str:
    """Profile A when it ran on both stacks, else the first profile that did."""
    profiles = list(dict.fromkeys(r.profile for r in rows))
    both = [p for p in profiles if _pairs_by_repeat([r for r in rows if r.profile == p])]
    return LATENCY_PROFILE if LATENCY_PROFILE in both else (both[0] if both else LATENCY_PROFILE)


def plain_inputs(rows: Sequence[SummaryRow], reference: float | None) -> list[Inputs]:
    """A plain run's latency profile, its trials paired by repeat."""
    profile = latency_profile(rows)
    pairs = _pairs_by_repeat([r for r in rows if r.profile == profile])
    return [judge_pairs(pairs, profile, None, reference)]


def _knee(sweep: SweepSection, stack: str) -> float | None:
    knee = ((sweep.stacks.get(stack) or {}).get("headline") or {}).get("knee") or {}
    value = knee.get("value")
    return float(value) if value is not None else None


def _base_rate(sweep: SweepSection) -> tuple[float, str] | None:
    """The rate the stated loads are fractions of, and what it is."""
    knees = [(k, s) for s in (ZEROLAYER, BASELINE) if (k := _knee(sweep, s)) is not None]
    if knees:
        knee, stack = min(knees)
        return knee, f"{stack}'s knee {knee:.3g} req/s"
    rates = [p.offered_rate for p in sweep.points]
    if not rates:
        return None
    return max(rates), f"the highest rate swept, {max(rates):g} req/s (no knee reached)"


def sweep_inputs(sweep: SweepSection, reference: float | None) -> list[Inputs]:
    """One Inputs per stated load of ``JUDGED_AT``."""
    if not {ZEROLAYER, BASELINE} <= {p.stack for p in sweep.points}:
        return [
            Unjudged(Status.NOT_MEASURED, f"the sweep ({sweep.profile}) did not run both stacks")
        ]
    base = _base_rate(sweep)
    assert base is not None
    rate0, what = base
    rates = sorted({p.offered_rate for p in sweep.points})
    out: list[Inputs] = []
    for fraction in JUDGED_AT:
        load = f"{fraction:.0%} of {what}"
        below = [r for r in rates if r <= fraction * rate0 * (1 + 1e-9)]
        if not below:
            out.append(Unjudged(Status.UNDECIDED, f"no rate swept at or below {load}"))
            continue
        at = [p for p in sweep.points if p.offered_rate == below[-1]]
        out.append(judge_pairs(_pairs_by_repeat(at), sweep.profile, below[-1], reference, load))
    return out


def reference_speed(rows: Sequence[SummaryRow], run_start: float | None) -> float | None:
    """The host speed trials are held to: the run's first probe, else its first trial's."""
    return run_start if run_start else first_speed(rows)
