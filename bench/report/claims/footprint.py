"""What the middle layer costs in CPU and memory (``harness.telemetry.usage``), per trial.

- ``layer_cpu`` and ``layer_memory``: the layer's share of the baseline's serving CPU and memory
  (Serve's proxy and controller, the orchestrator's ingress and Ray's own processes, over every
  process of the stack), per valid baseline trial of the plain run's profiles.
- ``node_footprint`` (seed 002: per node, 12.4 GB and 68 % CPU orchestrated against 3.1 GB and
  12 %): each stack's CPU (share of the host) and memory per paired trial of the latency
  profile, and the baseline's over the zero-layer's. On one host, the node is the host.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from bench.report.claim_inputs import (
    BASELINE,
    STACK_CHANGING,
    Judged,
    plain_inputs,
    reference_speed,
)
from bench.report.claims.common import (
    NOT_MEASURED,
    UNDECIDED,
    VALIDITY_RULE,
    ClaimResult,
    Judgement,
    judge_all,
    result,
)
from bench.report.data import RunData
from bench.report.verdicts import SPANS, Band, combine, decide
from harness.curves import Interval, interval
from harness.schema import SummaryRow
from harness.telemetry.usage import Usage, stack_usage
from harness.validity import MIN_TRIALS, too_few, trial_problems

GB: Final = 1e9
LAYER_CPU_BAND: Final = Band(19.0, 76.0)  # "up to 38 %", within a factor of two
LAYER_MEMORY_BAND: Final = Band(20.5, 82.0)  # "41 % of its memory", within a factor of two
# Seed 002's per-node figures: orchestrated over zero-layer, each held at half its ratio.
CLAIMED_NODE: Final = {"cpu": 68 / 12, "memory": 12.4 / 3.1}
LAYER_NOTE: Final = (
    "the layer: Serve's proxy and controller, the orchestrator ingress and Ray's own processes "
    "(GCS, raylet, agents, idle workers); the stack: those and its engine replicas; the loader "
    "is no stack's; from psutil telemetry over each trial's window"
)


def trial_usage(run: RunData, row: SummaryRow) -> Usage | None:
    """What ``row``'s stack used during ``row``'s trial (None: no telemetry for it)."""
    window = run.trial_window(row)
    if window is None:
        return None
    return stack_usage(run.telemetry, row.stack, window, run.meta.machine.cpus or 1)


def _baseline_trials(run: RunData) -> tuple[list[SummaryRow], float | None]:
    rows = [r for r in run.summaries if r.stack == BASELINE and r.profile not in STACK_CHANGING]
    return rows, reference_speed(rows, run.meta.machine.cpu_speed_start)


def _share_of(usage: Usage | None, share: Callable[[Usage], float | None]) -> float | None:
    return share(usage) if usage is not None else None


def _share_claim(
    run: RunData,
    key: str,
    what: str,
    share: Callable[[Usage], float | None],
    band: Band,
) -> Judgement:
    """A layer share per valid baseline trial, as an interval, judged against ``band``."""
    rows, reference = _baseline_trials(run)
    values = {id(r): _share_of(trial_usage(run, r), share) for r in rows}
    if not any(v is not None for v in values.values()):
        return Judgement(NOT_MEASURED, "-")
    valid = [r for r in rows if not trial_problems(r, reference) and values[id(r)] is not None]
    figure = interval([100 * (values[id(r)] or 0.0) for r in valid], floor=0.0)
    profiles = ", ".join(dict.fromkeys(r.profile for r in valid)) or "none"
    measured = f"{figure.text('.1f', '%')} of {what} over {figure.n} baseline trials ({profiles})"
    if figure.n < MIN_TRIALS:
        flagged = [f"baseline {r.profile} trial {r.repeat}: "
                   + ("; ".join(trial_problems(r, reference)) or "no telemetry in its window")
                   for r in rows if r not in valid]  # fmt: skip
        reason = "; ".join([too_few(figure.n), *flagged[:3]])
        return Judgement(UNDECIDED, measured, reason, {key: figure}, figure.n, {key: band})
    status = decide(figure, band)
    return Judgement(
        status, measured, SPANS if status is UNDECIDED else "", {key: figure}, figure.n, {key: band}
    )


def layer_cpu_share(run: RunData) -> ClaimResult:
    rule = (
        "held when the layer's share of the baseline's CPU time lies within "
        f"{LAYER_CPU_BAND.text()} % (a factor of two of the claimed 38 %), per baseline trial; "
        f"{LAYER_NOTE}; " + VALIDITY_RULE
    )
    got = _share_claim(run, "share_pct", "its CPU", lambda u: u.layer_cpu_share, LAYER_CPU_BAND)
    return result(
        "layer_cpu", "the middle layer takes up to 38 % of cluster CPU", "up to 38 %", rule, got
    )


def layer_memory_share(run: RunData) -> ClaimResult:
    rule = (
        "held when the layer's share of the baseline's resident memory lies within "
        f"{LAYER_MEMORY_BAND.text()} % (a factor of two of the claimed 41 %), per baseline "
        f"trial; {LAYER_NOTE}; " + VALIDITY_RULE
    )
    got = _share_claim(
        run, "share_pct", "its memory", lambda u: u.layer_rss_share, LAYER_MEMORY_BAND
    )
    return result("layer_memory", "the middle layer takes 41 % of its memory", "41 %", rule, got)


def _per_pair(
    judged: Judged, run: RunData, figure: Callable[[Usage, Usage], float | None]
) -> Interval:
    """``figure(zero-layer usage, baseline usage)`` per pair with telemetry, as an interval."""
    values: list[float | None] = []
    for zl, base in judged.pairs:
        a, b = trial_usage(run, zl), trial_usage(run, base)
        values.append(figure(a, b) if a is not None and b is not None else None)
    return interval(values, "no process telemetry in a trial's window", floor=0.0)


def _ratio(of: Callable[[Usage], float]) -> Callable[[Usage, Usage], float | None]:
    return lambda zl, base: of(base) / of(zl) if of(zl) > 0 else None


def _node_at(run: RunData) -> Callable[[Judged], Judgement]:
    def judge(judged: Judged) -> Judgement:
        figures = {
            "zl_cpu_pct": _per_pair(judged, run, lambda zl, _: zl.cpu_pct),
            "base_cpu_pct": _per_pair(judged, run, lambda _, base: base.cpu_pct),
            "zl_memory_gb": _per_pair(judged, run, lambda zl, _: zl.rss_bytes / GB),
            "base_memory_gb": _per_pair(judged, run, lambda _, base: base.rss_bytes / GB),
            "cpu_ratio": _per_pair(judged, run, _ratio(lambda u: u.cpu_pct)),
            "memory_ratio": _per_pair(judged, run, _ratio(lambda u: u.rss_bytes)),
        }
        bands = {f"{k}_ratio": Band(v / 2) for k, v in CLAIMED_NODE.items()}
        status = combine([decide(figures[k], band) for k, band in bands.items()])
        measured = (
            f"CPU {figures['base_cpu_pct'].text('.1f', '%')} vs "
            f"{figures['zl_cpu_pct'].text('.1f', '%')} of the host, memory "
            f"{figures['base_memory_gb'].text('.2f', 'GB')} vs "
            f"{figures['zl_memory_gb'].text('.2f', 'GB')} (baseline vs zero-layer, "
            f"{judged.where()}); ratios CPU {figures['cpu_ratio'].text('.2f', 'x')}, memory "
            f"{figures['memory_ratio'].text('.2f', 'x')}"
        )
        reason = SPANS if status is UNDECIDED else ""
        return Judgement(status, measured, reason, figures, len(judged.pairs), bands)

    return judge


def node_footprint(run: RunData) -> ClaimResult:
    rule = (
        "held when the baseline's CPU (share of the host) and resident memory are each at "
        f"least half the claimed multiple of the zero-layer stack's ({CLAIMED_NODE['cpu']:.1f}x "
        f"and {CLAIMED_NODE['memory']:.1f}x), per paired trial of the latency profile; every "
        f"process of each stack counted (the zero-layer stack: its replicas; {LAYER_NOTE}); "
        + VALIDITY_RULE
    )
    reference = reference_speed(run.summaries, run.meta.machine.cpu_speed_start)
    inputs = plain_inputs(run.summaries, reference)
    return result(
        "node_footprint",
        "per node, the orchestrated stack takes 12.4 GB and 68 % CPU where the zero-layer "
        "stack takes 3.1 GB and 12 %",
        "12.4 GB / 68 % vs 3.1 GB / 12 %",
        rule,
        judge_all(inputs, _node_at(run)),
    )


__all__ = ["layer_cpu_share", "layer_memory_share", "node_footprint", "trial_usage"]
