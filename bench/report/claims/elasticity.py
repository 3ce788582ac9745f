"""The elasticity claims (seed 002): a new replica takes traffic 217 ms after it is ready (3.2 s
behind an orchestrator), and 99.99 % of sessions keep their replica when one joins or leaves.

Judged on profile G's trials (``chaos.elastic_runner``: its summary rows and ``elasticity.json``),
each trial valid when its summary row is (``harness.validity``) and its experiment ran to the
end of its method with every rollback done and the figure measured. The first claim pairs the
stacks' trials by repeat; the second is the zero-layer SDK's ring alone (the baseline's figure is
shown beside it).

Each asks in addition that the trial can resolve what it claims, since a small run could not
tell a held claim from luck. A first request waits for a request to arrive for the joining
replica: at ``rate`` requests a second over ``N`` replicas, one in ``N + 1`` of them is its, so
the wait alone averages ``(N + 1) / rate``; where that exceeds the claimed 217 ms the figure
measures the arrivals, and only a verdict that holds in spite of them (held) is given. A share
of 0.01 % needs the sessions to show one move in 10 000; below ``RESOLVING_SESSIONS`` sessions
that could have stayed, only a needless move (not held) decides.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Final

from bench.report.claim_inputs import BASELINE, ZEROLAYER, reference_speed
from bench.report.claims.common import (
    HELD,
    NOT_MEASURED,
    UNDECIDED,
    VALIDITY_RULE,
    ClaimResult,
)
from bench.report.data import RunData
from bench.report.verdicts import SPANS, Band, combine, decide
from chaos.elastic_runner import read as read_elasticity
from chaos.elasticity import ElasticityRow, needless_moves, needless_share
from harness.curves import Interval, interval
from harness.schema import SummaryRow
from harness.validity import MIN_TRIALS, too_few, trial_problems

ELASTIC_PROFILE: Final = "g_elasticity"
CLAIMED_ZL_MS: Final = 217.0
CLAIMED_BASE_MS: Final = 3200.0
CLAIMED_RATIO: Final = CLAIMED_BASE_MS / CLAIMED_ZL_MS
CLAIMED_NEEDLESS_PCT: Final = 0.01  # 99.99 % keep their replica
FIRST_BAND: Final = Band(0.0, 2 * CLAIMED_ZL_MS)
RATIO_BAND: Final = Band(CLAIMED_RATIO / 2)
NEEDLESS_BAND: Final = Band(0.0, 2 * CLAIMED_NEEDLESS_PCT)
# Sessions that did not have to move, pooled over the valid trials, for one needless move to
# show at the band's edge (1 / 0.02 %).
RESOLVING_SESSIONS: Final = round(100 / NEEDLESS_BAND.high) if NEEDLESS_BAND.high else 0

Trial = tuple[SummaryRow, ElasticityRow]
Candidate = tuple[SummaryRow, ElasticityRow | None]
Figure = Callable[[ElasticityRow], float | None]
FIRST_CLAIM: Final = (
    "a new replica takes traffic 217 ms after it is ready (3.2 s behind an orchestrator)"
)
KEPT_CLAIM: Final = "99.99 % of sessions keep their replica when one joins or leaves"


def elastic_problems(row: ElasticityRow | None) -> list[str]:
    """Why a trial's experiment cannot decide (empty when it can)."""
    if row is None:
        return ["no elasticity figures (elasticity.json has no row for it)"]
    problems = []
    if row.status not in ("completed", "deviated"):
        problems.append(f"the experiment ended {row.status}")
    if not row.rollbacks_ok:
        problems.append("a rollback failed")
    if row.note:
        problems.append(row.note)
    return problems


def _trials(
    summaries: Sequence[SummaryRow], rows: Sequence[ElasticityRow]
) -> dict[str, dict[int, Candidate]]:
    """Each stack's trials of profile G by repeat: (summary row, figures or None)."""
    figures = {(r.stack, r.repeat): r for r in rows}
    out: dict[str, dict[int, Candidate]] = {}
    for s in summaries:
        if s.profile == ELASTIC_PROFILE:
            out.setdefault(s.stack, {})[s.repeat] = (s, figures.get((s.stack, s.repeat)))
    return out


def _checked(
    trial: Candidate, reference: float | None, figure: Figure
) -> tuple[Trial | None, list[str]]:
    """The trial when it may decide (its figure measured), else None; and why not."""
    summary, row = trial
    problems = trial_problems(summary, reference) + elastic_problems(row)
    if row is None or problems:
        return None, problems
    if figure(row) is None:
        return None, ["the figure was not measured"]
    return (summary, row), []


def _named(stack: str, repeat: int, problems: Sequence[str]) -> str:
    return f"{stack} trial {repeat}: {'; '.join(problems)}"


def _load(summaries: Sequence[SummaryRow], used: Sequence[SummaryRow]) -> str:
    """The load a claim was judged at and the rows it used."""
    rate = next((s.offered_rate for s in used or summaries if s.offered_rate), None)
    at = f" at {rate:g} req/s" if rate else ""
    rows = ", ".join(f"{s.stack} r{s.repeat}" for s in used) or "none"
    return f"{ELASTIC_PROFILE}{at}; rows used: {rows}"


def _ratio(zl: float | None, base: float | None) -> float | None:
    return None if zl is None or base is None or zl <= 0 else base / zl


def arrival_wait_ms(trials: Sequence[Trial]) -> float | None:
    """The longest mean wait of the trials for a request to arrive for the joining replica:
    ``(N + 1) / rate`` (None where a trial's rate is unknown)."""
    waits = [
        1000.0 * (row.replicas + 1) / summary.offered_rate if summary.offered_rate else None
        for summary, row in trials
    ]
    return None if not waits or None in waits else max(w for w in waits if w is not None)


def judge_first_request(
    summaries: Sequence[SummaryRow], rows: Sequence[ElasticityRow], reference: float | None
) -> ClaimResult:
    """The first claim from profile G's summary rows and figures (see the rule's text)."""
    rule = (
        "held when, over profile G's trials paired by repeat, the zero-layer stack's time from a "
        f"new replica being ready to its first request is at most {FIRST_BAND.high:g} ms (twice "
        f"the claimed {CLAIMED_ZL_MS:g} ms) and the baseline's is at least {RATIO_BAND.low:.1f}x "
        f"it (half the claimed {CLAIMED_RATIO:.1f}x), each replica's own log timing the first "
        "request; a verdict other than held needs a load at which a request for the joining "
        f"replica arrives at least every {CLAIMED_ZL_MS:g} ms on average ((N + 1) / rate); a "
        "trial counts when its row is valid and its experiment ran its method with every "
        "rollback done; " + VALIDITY_RULE
    )
    key, claimed = "first_request", "217 ms vs 3.2 s (14.7x)"
    trials = _trials(summaries, rows)
    if not trials.get(ZEROLAYER) or not trials.get(BASELINE):
        return ClaimResult(key, FIRST_CLAIM, claimed, "-", NOT_MEASURED, rule)

    def figure(row: ElasticityRow) -> float | None:
        return row.time_to_first_request_ms

    pairs: list[tuple[Trial, Trial]] = []
    flagged: list[str] = []
    for repeat in sorted(trials[ZEROLAYER].keys() & trials[BASELINE].keys()):
        zl_trial, zl_why = _checked(trials[ZEROLAYER][repeat], reference, figure)
        base_trial, base_why = _checked(trials[BASELINE][repeat], reference, figure)
        flagged += [
            _named(s, repeat, why) for s, why in ((ZEROLAYER, zl_why), (BASELINE, base_why)) if why
        ]
        if zl_trial is not None and base_trial is not None:
            pairs.append((zl_trial, base_trial))
    zl = interval([figure(a[1]) for a, _ in pairs], floor=0.0)
    base = interval([figure(b[1]) for _, b in pairs], floor=0.0)
    ratio = interval([_ratio(figure(a[1]), figure(b[1])) for a, b in pairs], floor=0.0)
    used = [trial[0] for pair in pairs for trial in pair]
    measured = (
        f"zero-layer {zl.text('.0f', 'ms')}, baseline {base.text('.0f', 'ms')}, ratio "
        f"{ratio.text('.1f', 'x')} ({_load(summaries, used)})"
    )
    wait = arrival_wait_ms([trial for pair in pairs for trial in pair])
    figures = {"zerolayer_ms": zl, "baseline_ms": base, "ratio": ratio}
    if len(pairs) < MIN_TRIALS:
        reason = "; ".join([too_few(len(pairs)), *flagged])
        return ClaimResult(key, FIRST_CLAIM, claimed, measured, UNDECIDED, rule, reason, figures,
                           len(pairs))  # fmt: skip
    bands = {"zerolayer_ms": FIRST_BAND, "ratio": RATIO_BAND}
    status = combine([decide(zl, FIRST_BAND), decide(ratio, RATIO_BAND)])
    reason = SPANS if status is UNDECIDED else ""
    if status is not HELD and (wait is None or wait > CLAIMED_ZL_MS):
        status = UNDECIDED
        shown = "an unknown time" if wait is None else f"{wait:.0f} ms"
        reason = (
            f"the load cannot resolve it: a request for the joining replica arrives every "
            f"{shown} on average ((N + 1) / rate), more than the claimed {CLAIMED_ZL_MS:g} ms, "
            "so the figures measure the arrivals as much as the router"
        )
    return ClaimResult(key, FIRST_CLAIM, claimed, measured, status, rule, reason, figures,
                       len(pairs), bands)  # fmt: skip


def _share_pct(row: ElasticityRow) -> float | None:
    share = needless_share(row)
    return None if share is None else 100.0 * share


def _stack_share(
    trials: dict[int, Candidate], reference: float | None
) -> tuple[Interval, list[Trial], list[str]]:
    """A stack's needless-move share per valid trial as an interval, its valid trials, and
    what was wrong with the others."""
    valid: list[Trial] = []
    flagged = []
    for repeat, candidate in sorted(trials.items()):
        trial, problems = _checked(candidate, reference, _share_pct)
        if trial is None:
            flagged.append(_named(candidate[0].stack, repeat, problems))
        else:
            valid.append(trial)
    return interval([_share_pct(row) for _, row in valid], floor=0.0), valid, flagged


def judge_sessions_kept(
    summaries: Sequence[SummaryRow], rows: Sequence[ElasticityRow], reference: float | None
) -> ClaimResult:
    """The second claim from profile G's summary rows and figures (see the rule's text)."""
    rule = (
        "held when, over the zero-layer stack's profile G trials, the share of sessions that "
        "changed replica though neither their replica left nor they moved to the joining one "
        f"(join and leave pooled) is at most {NEEDLESS_BAND.high:g} % (twice the claimed "
        f"{CLAIMED_NEEDLESS_PCT:g} %), and its valid trials saw at least {RESOLVING_SESSIONS} "
        "such sessions (else one needless move would be more than the bound: undecided); "
        "sessions moving to a joining replica or off a leaving one are the design, counted "
        "apart; a trial counts when its row is valid and its experiment ran its method with "
        "every rollback done; " + VALIDITY_RULE
    )
    key, claimed = "sessions_kept", "99.99 % keep their replica (0.01 % moved)"
    trials = _trials(summaries, rows)
    if not trials.get(ZEROLAYER):
        return ClaimResult(key, KEPT_CLAIM, claimed, "-", NOT_MEASURED, rule)
    share, valid, flagged = _stack_share(trials[ZEROLAYER], reference)
    base, _, _ = _stack_share(trials.get(BASELINE, {}), reference)
    moved = sum(needless_moves(row)[0] for _, row in valid)
    could = sum(needless_moves(row)[1] for _, row in valid)
    measured = (
        f"zero-layer {share.text('.3f', '%')} moved needlessly ({moved} of {could} sessions); "
        f"baseline {base.text('.3f', '%')} ({_load(summaries, [s for s, _ in valid])})"
    )
    figures = {"zerolayer_needless_pct": share, "baseline_needless_pct": base}
    if len(valid) < MIN_TRIALS:
        reason = "; ".join([too_few(len(valid)), *flagged])
        return ClaimResult(key, KEPT_CLAIM, claimed, measured, UNDECIDED, rule, reason, figures,
                           len(valid))  # fmt: skip
    bands = {"zerolayer_needless_pct": NEEDLESS_BAND}
    status = decide(share, NEEDLESS_BAND)
    reason = SPANS if status is UNDECIDED else ""
    if status is HELD and could < RESOLVING_SESSIONS:
        status = UNDECIDED
        reason = (
            f"{could} sessions that did not have to move cannot resolve "
            f"{NEEDLESS_BAND.high:g} %: one needless move would be {100 / max(could, 1):.2g} %, "
            f"and {RESOLVING_SESSIONS} are needed"
        )
    return ClaimResult(key, KEPT_CLAIM, claimed, measured, status, rule, reason, figures,
                       len(valid), bands)  # fmt: skip


def _inputs(run: RunData) -> tuple[list[SummaryRow], list[ElasticityRow], float | None]:
    summaries = [s for s in run.summaries if s.profile == ELASTIC_PROFILE]
    return (
        summaries,
        read_elasticity(run.path),
        reference_speed(run.summaries, run.meta.machine.cpu_speed_start),
    )


def elastic_first_request(run: RunData) -> ClaimResult:
    return judge_first_request(*_inputs(run))


def elastic_sessions_kept(run: RunData) -> ClaimResult:
    return judge_sessions_kept(*_inputs(run))
