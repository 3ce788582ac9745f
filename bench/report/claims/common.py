"""What every claim check shares: the result a claim gives (``ClaimResult``, as ``claims.json``
holds it), one load's judgement of it, and the ways a figure becomes a verdict (per paired
trial, combined over loads, or a single sample that decides nothing)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final

from bench.report.claim_inputs import Inputs, Judged
from bench.report.verdicts import Band, Status, combine
from harness.curves import Interval, interval
from harness.schema import SummaryRow
from harness.validity import RULE as VALIDITY_RULE

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
    undecided, why; ``figures`` are the intervals it was decided on (each trial's own figure in
    ``per_repeat``), ``bands`` the held side of each figure's threshold, ``trials`` their count."""

    key: str
    claim: str
    claimed: str
    measured: str
    status: Status
    rule: str
    reason: str = ""
    figures: dict[str, Interval] = field(default_factory=dict)
    trials: int = 0
    bands: dict[str, Band] = field(default_factory=dict)


def per_pair(
    judged: Judged,
    figure: Callable[[SummaryRow, SummaryRow], float | None],
    floor: float | None = None,
) -> Interval:
    """A figure per paired trial, as an interval; ``floor`` for figures that cannot go below."""
    values = [figure(zl, base) for zl, base in judged.pairs]
    return interval(values, "not measured in a trial", floor=floor)


@dataclass(frozen=True, slots=True)
class Judgement:
    """One load's part of a latency claim: its verdict, text and figures."""

    status: Status
    measured: str
    reason: str = ""
    figures: dict[str, Interval] = field(default_factory=dict)
    trials: int = 0
    bands: dict[str, Band] = field(default_factory=dict)


JudgeFn = Callable[[Judged], Judgement]


def judge_all(inputs: Sequence[Inputs], judge: JudgeFn) -> Judgement:
    """Every load's judgement, combined (each must hold), with each load's text and reason."""
    parts = [
        judge(i) if isinstance(i, Judged) else Judgement(i.status, "-", i.reason) for i in inputs
    ]
    status = combine([p.status for p in parts])
    measured = " | ".join(p.measured for p in parts if p.measured != "-") or "-"
    reason = "; ".join(p.reason for p in parts if p.reason) if status is UNDECIDED else ""

    def named(k: int, name: str) -> str:
        return f"{name}@{k}" if len(parts) > 1 else name

    figures = {named(k, n): fig for k, p in enumerate(parts) for n, fig in p.figures.items()}
    bands = {named(k, n): band for k, p in enumerate(parts) for n, band in p.bands.items()}
    trials = min((p.trials for p in parts), default=0)
    return Judgement(status, measured, reason, figures, trials, bands)


def result(key: str, claim: str, claimed: str, rule: str, got: Judgement) -> ClaimResult:
    return ClaimResult(
        key,
        claim,
        claimed,
        got.measured,
        got.status,
        rule,
        got.reason,
        got.figures,
        got.trials,
        got.bands,
    )


def once(key: str, claim: str, claimed: str, measured: str, held: bool, rule: str) -> ClaimResult:
    """A claim measured once per stack: its figure shown, undecided (``ONE_SAMPLE``); the
    single sample's reading is kept in the reason so that nothing measured is hidden."""
    reading = "it would read held" if held else "it would read not held"
    return ClaimResult(key, claim, claimed, measured, UNDECIDED, rule, f"{ONE_SAMPLE} ({reading})")


__all__ = ["VALIDITY_RULE", "Band"]
