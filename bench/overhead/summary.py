"""``zl-bench overhead``'s figures over repeats, and its verdicts.

A run measures every target at every in-flight level once per repeat, in a balanced order
(``measure``). Here each target's figures become intervals over its *valid* repeats (a level
whose loader lagged, that lost requests, or that ran on a saturated or slowed host is left out,
never averaged in), what it adds over the in-process floor is paired by repeat, and the
zero-layer stack is judged against each target it is held to (:data:`VERSUS`): per criterion,
the paired difference ``ours - theirs`` (or the ratio ``ours / theirs``) over the repeats where
both levels were valid, decided by ``bench.report.verdicts.decide`` like every claim: held only
when the whole interval lies on the held side, with at least ``MIN_TRIALS`` pairs.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from bench.overhead.model import LATENCY, Level, Role, minus
from bench.report.verdicts import Band, Status, decide
from harness.curves import Interval, interval
from harness.validity import too_few

# The CPU figures every level has (us), in the order the tables show them.
COSTS: tuple[str, ...] = (
    "client_cpu_us",
    "server_us_per_request",
    "server_us_per_token",
    "layer_us_per_token",
)
UNITS: Mapping[str, str] = {**dict.fromkeys(LATENCY, "ms"), **dict.fromkeys(COSTS, "us")}
LABELS: Mapping[str, str] = {
    "ttft_p50_ms": "ttft p50",
    "ttft_p99_ms": "ttft p99",
    "tpot_p50_ms": "tpot p50",
    "tpot_p99_ms": "tpot p99",
    "e2el_p50_ms": "e2el p50",
    "e2el_p99_ms": "e2el p99",
    "client_cpu_us": "loader CPU/request",
    "server_us_per_request": "server CPU/request",
    "server_us_per_token": "server CPU/token",
    "layer_us_per_token": "layer CPU/token",
}

Key = tuple[str, int, int]  # (target, in-flight, repeat)


def figure(level: Level, name: str) -> float | None:
    """One of a level's figures by name (``LATENCY`` or ``COSTS``)."""
    return getattr(level, name)


def reference_speed(levels: Iterable[Level]) -> float | None:
    """The median of the run's host-speed probes, which every level's speed is held to: on a
    host shared with other work, the first probe alone may be the slow one."""
    speeds = [lv.host.speed for lv in levels if lv.host.speed is not None]
    return statistics.median(speeds) if speeds else None


def valid_levels(levels: Sequence[Level]) -> dict[Key, Level]:
    """The levels that measured their target (no problem at all), by (target, in-flight,
    repeat)."""
    speed = reference_speed(levels)
    return {(lv.target, lv.in_flight, lv.repeat): lv for lv in levels if not lv.problems(speed)}


@dataclass(frozen=True, slots=True)
class Summary:
    """One target at one in-flight level over the run's repeats: how many ran and how many were
    valid, each figure over the valid ones, and what it adds over the in-process floor (paired
    by repeat, both levels valid)."""

    target: str
    in_flight: int
    role: Role
    repeats: int
    valid: int
    figures: dict[str, Interval]
    added: dict[str, Interval]


def _floor_of(levels: Sequence[Level]) -> str | None:
    return next((lv.target for lv in levels if lv.role is Role.FLOOR), None)


def summarize(levels: Sequence[Level]) -> list[Summary]:
    """A summary per (target, in-flight), in the order the levels were first measured."""
    valid = valid_levels(levels)
    floor = _floor_of(levels)
    groups: dict[tuple[str, int], list[Level]] = {}
    for lv in levels:
        groups.setdefault((lv.target, lv.in_flight), []).append(lv)
    out = []
    for (target, n), ran in groups.items():
        good = [lv for lv in ran if (target, n, lv.repeat) in valid]
        figures = {name: interval([figure(lv, name) for lv in good]) for name in LATENCY + COSTS}
        added = {
            name: paired(valid, target, floor, n, name) if floor else Interval() for name in LATENCY
        }
        out.append(Summary(target, n, ran[0].role, len(ran), len(good), figures, added))
    return out


def paired(
    valid: Mapping[Key, Level],
    ours: str,
    theirs: str,
    in_flight: int,
    name: str,
    ratio: bool = False,
) -> Interval:
    """``ours - theirs`` (or ``ours / theirs``) of one figure at one level, per repeat where
    both were valid, as an interval over those repeats."""
    values: list[float | None] = []
    for (target, n, repeat), level in valid.items():
        other = valid.get((theirs, n, repeat))
        if target != ours or n != in_flight or other is None:
            continue
        a, b = figure(level, name), figure(other, name)
        if ratio:
            values.append(a / b if a is not None and b else None)
        else:
            values.append(minus(a, b))
    return interval(values)


@dataclass(frozen=True, slots=True)
class Criterion:
    """One figure the zero-layer stack is held to: ``ours - theirs <= limit`` (with ``ratio``,
    ``ours / theirs <= limit``); ``at``: the in-flight levels it applies at (empty: all)."""

    name: str
    limit: float = 0.0
    ratio: bool = False
    at: tuple[int, ...] = ()

    def text(self) -> str:
        if self.ratio:
            return f"{LABELS[self.name]} within {self.limit - 1:.0%} of"
        return f"{LABELS[self.name]} no larger than"


@dataclass(frozen=True, slots=True)
class Versus:
    """What the zero-layer stack is judged against: the target of ``role``, in words, its
    criteria; ``judged`` False: reported beside the verdicts (what the stack adds over a floor
    it cannot reach), not a verdict; ``over_reference``: applies over the reference (null)
    engine too, not only over a real one."""

    role: Role
    what: str
    criteria: tuple[Criterion, ...]
    judged: bool = True
    over_reference: bool = True


VERSUS: tuple[Versus, ...] = (
    Versus(
        Role.PEER,
        "vLLM's own server",
        (*(Criterion(name) for name in LATENCY), Criterion("layer_us_per_token")),
    ),
    Versus(
        Role.FLOOR,
        "the in-process engine",
        (Criterion("tpot_p50_ms", 1.05, ratio=True, at=(1,)),),
        over_reference=False,
    ),
    Versus(
        Role.HTTP1,
        "the same replica over HTTP/1.1",
        (*(Criterion(name) for name in LATENCY), Criterion("server_us_per_token")),
    ),
    Versus(
        Role.ECHO,
        "a bare h2 echo (the h2 library's floor)",
        tuple(Criterion(name) for name in LATENCY),
        judged=False,
    ),
)


@dataclass(frozen=True, slots=True)
class Judged:
    """One criterion at one in-flight level: the paired figure over repeats and its status
    (``reason`` says why it is undecided or not measured)."""

    versus: Versus
    theirs: str
    criterion: Criterion
    in_flight: int
    figure: Interval
    status: Status
    reason: str = ""


def _decide(figure_: Interval, criterion: Criterion) -> tuple[Status, str]:
    if figure_.value is None:
        return Status.NOT_MEASURED, "no repeat valid on both sides"
    short = too_few(figure_.n)
    if short:
        return Status.UNDECIDED, short
    status = decide(figure_, Band(-math.inf, criterion.limit))
    return status, "the interval spans the limit" if status is Status.UNDECIDED else ""


def judge(levels: Sequence[Level], over_reference: bool) -> list[Judged]:
    """Every criterion of every :data:`VERSUS` whose targets both ran, at every level both ran
    at (``over_reference``: the run's engine is the reference engine)."""
    by_role: dict[Role, str] = {}
    for lv in levels:
        by_role.setdefault(lv.role, lv.target)
    ours = by_role.get(Role.OURS)
    if ours is None:
        return []
    valid = valid_levels(levels)
    shared = sorted({lv.in_flight for lv in levels})
    out = []
    for versus in VERSUS:
        theirs = by_role.get(versus.role)
        if theirs is None or (over_reference and not versus.over_reference):
            continue
        for criterion in versus.criteria:
            for n in shared:
                if criterion.at and n not in criterion.at:
                    continue
                got = paired(valid, ours, theirs, n, criterion.name, criterion.ratio)
                status, reason = _decide(got, criterion)
                out.append(Judged(versus, theirs, criterion, n, got, status, reason))
    return out


def _counts(judged: Sequence[Judged]) -> str:
    counts = {s: sum(1 for j in judged if j.status is s) for s in Status}
    return ", ".join(f"{counts[s]} {s.value}" for s in Status if counts[s])


def verdicts(judged: Sequence[Judged], ours: str) -> list[str]:
    """One line per target judged against: how many criteria-levels held, were not held or are
    undecided, naming every one that did not hold."""
    lines = []
    for versus in dict.fromkeys(j.versus for j in judged):
        mine = [j for j in judged if j.versus is versus]
        head = f"{ours} against {mine[0].theirs}, {versus.what} (paired by repeat, valid levels)"
        if not versus.judged:
            shown = [f"{LABELS[j.criterion.name]} at {j.in_flight} in flight {_figure(j)}"
                     for j in mine]  # fmt: skip
            lines.append(f"what {head} adds: {'; '.join(shown)}")
            continue
        missed = [
            f"{j.criterion.text()} at {j.in_flight} in flight: {_figure(j)} {j.status.value}"
            + (f", {j.reason}" if j.reason else "")
            for j in mine
            if j.status is not Status.HELD
        ]
        tail = f" ({'; '.join(missed)})" if missed else ""
        lines.append(f"verdict: {head}: {_counts(mine)} of {len(mine)}{tail}")
    return lines


def _figure(j: Judged) -> str:
    """The paired figure as ``+0.120 [0.050, 0.190] ms (n=3)`` (a ratio as ``1.012 [...] x``)."""
    unit = "x" if j.criterion.ratio else UNITS[j.criterion.name]
    spec = ".3f" if j.criterion.ratio else ("+.3f" if unit == "ms" else "+.1f")
    return j.figure.text(spec, unit)
