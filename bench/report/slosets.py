"""A run judged against a named SLO set (``harness.slosets``), per stack and profile.

Each objective's figure is measured per trial (from the summary row, or from the telemetry
sampled in the trial's window), summarised as an interval over the valid trials
(``harness.validity``), and decided as the claims are (``bench.report.verdicts.decide``): met
only when the whole interval lies on the objective's side of its bound, missed when it lies
wholly on the other, undecided otherwise; an objective whose figure needs what the host does not
have (a GPU) reads "not measured" with that reason. ``slo-<set>.json`` holds the results.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from html import escape
from pathlib import Path

import numpy as np

from bench.report.claim_inputs import STACK_CHANGING
from bench.report.data import RunData
from bench.report.verdicts import SPANS, Band, Status, decide
from harness import schema
from harness.curves import Interval, interval
from harness.schema import SummaryRow
from harness.schema.files import write_json_atomic
from harness.slosets import Figure, Needs, Objective, SloSet
from harness.validity import MIN_TRIALS, first_speed, too_few, trial_problems

NEEDS_GPU = "needs a GPU: NVML found none on this host, so the run has no GPU telemetry"


@dataclass(frozen=True, slots=True)
class ObjectiveResult:
    """One objective over one stack's trials of one profile."""

    text: str
    figure: Interval
    band: Band
    status: Status
    reason: str = ""
    unit: str = ""


@dataclass(frozen=True, slots=True)
class SetResult:
    """A stack's trials of a profile against every objective of the set."""

    slo_set: str
    stack: str
    profile: str
    trials: int
    objectives: list[ObjectiveResult] = field(default_factory=list)

    @property
    def status(self) -> Status:
        """Met when every measured objective is met; one surely missed decides alone."""
        measured = [o.status for o in self.objectives if o.status is not Status.NOT_MEASURED]
        if Status.NOT_HELD in measured:
            return Status.NOT_HELD
        if not measured:
            return Status.NOT_MEASURED
        return Status.HELD if all(s is Status.HELD for s in measured) else Status.UNDECIDED


def _mean(rows: Sequence[dict[str, object]], key: str) -> float | None:
    values = [float(v) for r in rows if isinstance(v := r.get(key), int | float)]
    return float(np.mean(values)) if values else None


def _rise(rows: Sequence[dict[str, object]], key: str) -> float | None:
    """How much a cumulative counter rose over the rows, summed over the devices that have it."""
    by_device: dict[str, list[float]] = {}
    for r in rows:
        value = r.get(key)
        if isinstance(value, int | float):
            by_device.setdefault(str(r.get("name", "")), []).append(float(value))
    if not by_device:
        return None
    return sum(max(v) - min(v) for v in by_device.values())


def _error_pct(row: SummaryRow) -> float | None:
    return 100 * row.failed / row.num_requests if row.num_requests else None


def _kv_waste_pct(run: RunData, row: SummaryRow) -> float | None:
    engine = [t for t in run.trial_telemetry(row, "engine")
              if t.get("stack") == row.stack and t.get("kv_blocks_used")]  # fmt: skip
    waste = _mean(engine, "kv_waste")
    return None if waste is None else 100 * waste


MEASURES: dict[Figure, Callable[[RunData, SummaryRow], float | None]] = {
    Figure.P99_TTFT_MS: lambda _, row: row.stat("p99_ttft_ms"),
    Figure.P99_E2EL_MS: lambda _, row: row.stat("p99_e2el_ms"),
    Figure.ERROR_PCT: lambda _, row: _error_pct(row),
    Figure.GPU_UTIL_PCT: lambda run, row: _mean(run.trial_telemetry(row, "nvml"), "gpu_util_pct"),
    Figure.KV_WASTE_PCT: _kv_waste_pct,
    Figure.NVLINK_ERRORS: lambda run, row: _rise(run.trial_telemetry(row, "nvml"), "nvlink_errors"),
}  # fmt: skip


def band(objective: Objective) -> Band:
    """The side of the bound that meets the objective (the figures are never negative)."""
    if objective.at_least:
        return Band(objective.bound)
    return Band(0.0, objective.bound)


def _has_gpu(run: RunData) -> bool:
    return any(t.get("source") == "nvml" for t in run.telemetry)


def judge_objective(
    run: RunData,
    objective: Objective,
    rows: Sequence[SummaryRow],
    valid: Sequence[SummaryRow],
    reference_speed: float | None,
) -> ObjectiveResult:
    """One objective over a stack's trials of a profile (``valid``: those that may decide,
    judged against ``reference_speed``, which the reasons for the others are judged by too)."""
    held = band(objective)
    if objective.needs is Needs.GPU and not _has_gpu(run):
        return ObjectiveResult(objective.text, Interval(), held, Status.NOT_MEASURED, NEEDS_GPU,
                               objective.unit)  # fmt: skip
    measure = MEASURES[objective.figure]
    figure = interval([measure(run, r) for r in valid], "not measured in a trial", floor=0.0)
    if valid and figure.n == 0:
        reason = f"no trial of this stack measured {objective.figure.value}"
        return ObjectiveResult(objective.text, figure, held, Status.NOT_MEASURED, reason,
                               objective.unit)  # fmt: skip
    if figure.n < MIN_TRIALS:
        problems = [f"trial {r.repeat}: {'; '.join(trial_problems(r, reference_speed))}"
                    for r in rows if r not in valid]  # fmt: skip
        reason = "; ".join([too_few(figure.n), *problems[:3]])
        return ObjectiveResult(objective.text, figure, held, Status.UNDECIDED, reason,
                               objective.unit)  # fmt: skip
    status = decide(figure, held)
    reason = SPANS if status is Status.UNDECIDED else ""
    return ObjectiveResult(objective.text, figure, held, status, reason, objective.unit)


def judge(run: RunData, slo_set: SloSet, stack: str, profile: str) -> SetResult:
    """``stack``'s trials of ``profile`` against every objective of ``slo_set``."""
    rows = [r for r in run.summaries if (r.stack, r.profile) == (stack, profile)]
    reference = run.meta.machine.cpu_speed_start or first_speed(rows)
    valid = [r for r in rows if not trial_problems(r, reference)]
    return SetResult(
        slo_set.name,
        stack,
        profile,
        len(valid),
        [judge_objective(run, o, rows, valid, reference) for o in slo_set.objectives],
    )


def judge_run(run: RunData, slo_set: SloSet) -> list[SetResult]:
    """Every stack and profile of a plain run but D and G (their faults and changes are meant
    to move the figures)."""
    keys = dict.fromkeys(
        (r.stack, r.profile) for r in run.summaries if r.profile not in STACK_CHANGING
    )
    return [judge(run, slo_set, stack, profile) for stack, profile in keys]


def results_file(run_dir: Path, name: str) -> Path:
    return run_dir / f"slo-{name}.json"


def write(run_dir: Path, results: Sequence[SetResult]) -> None:
    """``slo-<set>.json`` for each set judged."""
    for name in dict.fromkeys(r.slo_set for r in results):
        mine = [r for r in results if r.slo_set == name]
        write_json_atomic(results_file(run_dir, name), schema.to_data(mine))


def _cell(result: ObjectiveResult) -> str:
    figure = result.figure.text(".3g", result.unit) if result.figure.value is not None else "-"
    why = f"<br><small>{escape(result.reason)}</small>" if result.reason else ""
    return f"<td class='{result.status.css}'>{escape(figure)}<br><b>{result.status}</b>{why}</td>"


def html_section(results: Sequence[SetResult], slo_set: SloSet) -> str:
    """The report's table: one row per stack and profile, one column per objective."""
    if not results:
        return ""
    heads = "".join(f"<th>{escape(o.text)}</th>" for o in slo_set.objectives)
    rows = "".join(
        f"<tr><td class='l'>{escape(r.stack)}</td><td class='l'>{escape(r.profile)}</td>"
        f"<td class='{r.status.css}'>{r.status} ({r.trials} valid trials)</td>"
        + "".join(_cell(o) for o in r.objectives)
        + "</tr>"
        for r in results
    )
    return (
        f"<h2>SLO set {escape(slo_set.name)}: {escape(slo_set.source)}</h2><p>Each objective over "
        "the stack's valid trials of the profile, met only when its whole interval lies on the "
        "objective's side of the bound (slo-" + escape(slo_set.name) + ".json).</p>"
        f"<table><tr><th class='l'>stack</th><th class='l'>profile</th><th>all</th>{heads}</tr>"
        f"{rows}</table>"
    )
