"""Recovery metrics for one experiment, from the request log and the Chaos Toolkit journal.

Definitions (docs/design.md, "Chaos"), with the SLI of ``chaos.probes`` evaluated every ``step_s``:

- fault start: when the method's first action acted (its own ``t_ns``; else the journal start);
- time to detect: from the fault start to the first moment the rolling SLI is below target
  (None: the SLO never noticed the fault);
- time to recover: from the fault start to the last moment the rolling SLI came back within
  target and stayed there to the end of the log (None: it never came back);
- requests failed / lost: the background load's ``error`` and ``lost`` outcomes (lost must be 0);
- error-budget burn: the bad share of the requests touched by the fault window, over the error
  budget ``1 - target`` (1.0 burns exactly the budget's rate; 10 burns ten times faster);
- blast radius: the share of those requests that were bad, and the share of engine replicas
  affected: those the fault acted on (every one, when it hit a component all traffic passes
  through, such as the orchestrator or the front door) plus those that served a bad request,
  where the client can see which replica answered (where the client routes, as the zero-layer
  SDK does; behind the baseline's front door the client cannot).

What differs between stacks is asked of the target's stack kind (``Target.kind``).

The fault window of these SLI figures runs from the fault start to recovery (or, when the SLI
never broke, to the end of the method). Each row also carries the errors and retries of the
fault's window against the steady state before it (``chaos.windows``: until the rollbacks made
the stack whole again), the trial (repeat) it was, and for KV pressure the refusal figures
(``chaos.refusal``). A fault on a component the stack does not have is not run: its row says
``NO_SUCH_COMPONENT`` (:func:`absent_row`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Final

from chaos.probes import NS, SliSeries, Verdict
from chaos.refusal import RefusalTrial
from chaos.targets import Target
from chaos.windows import WindowCounts, faulted, steady
from harness.metrics import lag_reason, summarize
from harness.schema import RequestRecord, read_jsonl, read_requests
from harness.stacks.registry import stack_kind
from harness.stacks.stack import Fault
from harness.validity import host_cpu_problem, host_speed_problem

STEP_S: Final = 0.05
NO_SUCH_COMPONENT: Final = "no such component"
# The experiments the claims judge (``bench.report.claims.faults``, ``judged``).
KV_PRESSURE: Final = "kv-pressure-one-replica"
KILL_REPLICA: Final = "kill-engine-replica"
KILL_ORCHESTRATOR: Final = "kill-orchestrator"
FRONT_ROLES: Final = frozenset({"orchestrator", "proxy", "controller"})
# Faults on the network proxy: in front of a front door, they reach every replica behind it.
NETWORK_FAULTS: Final = frozenset({Fault.DELAY, Fault.PARTITION})


@dataclass
class Recovery:
    """One experiment's row in the recovery table."""

    stack: str
    experiment: str
    fault: str
    status: str
    hypothesis_before: bool | None
    hypothesis_after: bool | None
    rollbacks_ok: bool
    requests: int
    completed: int
    failed: int
    lost: int
    bad: int
    time_to_detect_s: float | None
    time_to_recover_s: float | None
    sdk_reroute_s: float | None
    error_budget_burn: float
    blast_radius_requests: float
    blast_radius_replicas: float
    replicas_affected: list[str]
    fault_start_ns: int
    fault_end_ns: int
    sli_before: float | None
    sli_min: float | None
    note: str = ""
    engine_replicas: int = 0
    trial: int = 0
    steady: WindowCounts = field(default_factory=WindowCounts)
    faulted: WindowCounts = field(default_factory=WindowCounts)
    refusal: RefusalTrial | None = None
    loader_lag: str = ""
    host_cpu_pct: float | None = None
    host_busiest_cpu_pct: float | None = None
    host_speed: float | None = None

    @property
    def absent(self) -> bool:
        """The fault had nothing to act on: the stack has no such component."""
        return self.status == NO_SUCH_COMPONENT


# Chaos Toolkit's statuses of an experiment that ran to its end: ``failed`` says the stack had
# not recovered when the after-hypothesis was checked, a finding about the stack.
RAN: Final = frozenset({"completed", "failed"})


def trial_problems(
    row: Recovery, reference_speed: float | None = None, *, load_lag: bool = True
) -> list[str]:
    """Why one run of an experiment may not decide a claim (empty when it may): it did not run
    to its end, the stack was not steady before the fault, a rollback failed, requests were
    lost, the background load lagged its schedule (unless ``load_lag`` is False: a figure the
    background load does not measure), the host was saturated before the fault (from the load's
    start to the fault: a stack already starved, not the fault's own cost) or not measured, or
    its speed moved (``harness.validity``'s host checks, on the experiment's own figures)."""
    if row.absent:
        return [row.note]
    problems = []
    if row.status not in RAN:
        problems.append(f"the experiment ended {row.status}")
    if row.hypothesis_before is not True:
        problems.append("the steady state did not hold before the fault")
    if not row.rollbacks_ok:
        problems.append("a rollback failed")
    if row.lost:
        problems.append(f"{row.lost} requests lost (no answer by deadline + grace)")
    return problems + load_problems(row, reference_speed, load_lag=load_lag)


def load_problems(
    row: Recovery, reference_speed: float | None = None, *, load_lag: bool = True
) -> list[str]:
    """What ``trial_problems`` says of the load and the host alone: the background load lagged
    (unless ``load_lag`` is False), the host was saturated before the fault or not measured, or
    its speed moved."""
    lag = row.loader_lag if load_lag else ""
    host = host_cpu_problem(row.host_cpu_pct, row.host_busiest_cpu_pct)
    speed = host_speed_problem(row.host_speed, reference_speed)
    return [p for p in (lag, host, speed) if p]


def absent_row(stack: str, experiment: str, role: str, trial: int = 0) -> Recovery:
    """The row of an experiment whose fault targets a component ``stack`` does not have: not
    run, every figure empty, said so (never a silent zero)."""
    return Recovery(
        stack=stack, experiment=experiment, fault="absent", status=NO_SUCH_COMPONENT,
        hypothesis_before=None, hypothesis_after=None, rollbacks_ok=True, requests=0,
        completed=0, failed=0, lost=0, bad=0, time_to_detect_s=None, time_to_recover_s=None,
        sdk_reroute_s=None, error_budget_burn=0.0, blast_radius_requests=0.0,
        blast_radius_replicas=0.0, replicas_affected=[], fault_start_ns=0, fault_end_ns=0,
        sli_before=None, sli_min=None, trial=trial,
        note=f"the {stack} stack has no {role}: the fault has nothing to act on, not run",
    )  # fmt: skip


def _iso_ns(value: str | None) -> int:
    return int(datetime.fromisoformat(value).timestamp() * NS) if value else 0


def method_actions(journal: dict[str, Any]) -> list[dict[str, Any]]:
    """The method's action runs, in order (probes and pauses left out)."""
    return [r for r in journal.get("run", []) if r.get("activity", {}).get("type") == "action"]


def fault_window(journal: dict[str, Any]) -> tuple[int, int, str, list[dict[str, Any]]]:
    """(start_ns, end_ns, fault kind, action outputs) of the method's faults."""
    runs = method_actions(journal)
    outputs = [r["output"] for r in runs if isinstance(r.get("output"), dict)]
    if not runs:
        return 0, 0, "none", []
    starts = [o["t_ns"] for o in outputs if "t_ns" in o] or [_iso_ns(runs[0].get("start"))]
    ends = [o.get("end_ns") or o.get("t_ns", 0) for o in outputs] + [_iso_ns(runs[-1].get("end"))]
    kinds = [str(o.get("fault", "")) for o in outputs if o.get("fault")]
    return min(starts), max(ends), "+".join(kinds) or "none", outputs


def front_kill(stack: str) -> str:
    """The experiment that kills the component a stack's clients talk to: the replica the SDK
    talks to where clients route themselves (zero-layer), else the orchestrator behind the
    front door."""
    return KILL_REPLICA if stack_kind(stack).client_routes else KILL_ORCHESTRATOR


def judged(stack: str) -> frozenset[str]:
    """The experiments the claims judge a stack on, run in every trial: KV pressure, and the
    kill of what its clients talk to (:func:`front_kill`)."""
    return frozenset({KV_PRESSURE, front_kill(stack)})


def whole_again_ns(journal: dict[str, Any], fault_end_ns: int) -> int:
    """When the stack was whole again: the end of the last rollback (they run always, the last
    waits for the stack), else the fault's end."""
    ends = [_iso_ns(r.get("end")) for r in journal.get("rollbacks", [])]
    return max([fault_end_ns, *ends])


def _replica_key(url: str, target: Target) -> str:
    """The load URL a client saw, mapped to the replica behind it (the proxy's upstream, where
    the client routes: the proxy then stands in front of one replica)."""
    if target.netproxy_url and url == target.netproxy_url and target.kind.client_routes:
        return target.netproxy_front
    return url


def affected_replicas(
    target: Target, outputs: Iterable[dict[str, Any]], bad: Iterable[Verdict]
) -> tuple[set[str], int]:
    """The replicas a fault reached, as keys, and how many engine replicas there are."""
    total = max(1, target.engine_replicas)
    routes = target.kind.client_routes  # replicas are known by URL, and seen by the client
    everyone = {f"{target.engine_role}-{i}" for i in range(total)}
    if routes:
        everyone = {s.url for s in target.replicas}
    hit: set[str] = set()
    for out in outputs:
        fault, role = out.get("fault"), out.get("role", "")
        if fault in (None, "absent", Fault.CPU_STRESS):
            continue
        if role in FRONT_ROLES or (fault in NETWORK_FAULTS and not routes):
            return everyone, total
        urls = [_replica_key(u, target) for u in out.get("urls", [])]
        if urls:
            hit.update(urls)
        else:
            hit.update(f"{target.engine_role}-pid{p}" for p in out.get("pids", [])[:1])
            if fault == Fault.KV_PRESSURE:
                hit.add(f"{target.engine_role}-session-{out.get('session', '')}")
    if routes:
        hit.update(_replica_key(v.replica, target) for v in bad if v.replica)
    return hit, total


def _detect_and_recover(
    series: SliSeries, start_ns: int, end_ns: int, window_s: float, target: float
) -> tuple[int | None, int | None, float | None]:
    """(detected_ns, recovered_ns, minimum SLI) on the grid from the fault to the log's end."""
    detected = recovered = None
    low: float | None = None
    below = False
    for t, value in series.grid(start_ns, end_ns, STEP_S, window_s):
        if value is None:
            continue
        low = value if low is None else min(low, value)
        if value < target:
            if detected is None:
                detected = t
            below, recovered = True, None
        elif below and recovered is None:
            recovered = t
    return detected, recovered, low


def sdk_reroute_s(
    health: Sequence[dict[str, Any]], urls: Iterable[str], start_ns: int
) -> float | None:
    """Seconds from the fault to the zero-layer SDK marking a faulted replica down."""
    wanted = set(urls)
    downs = [
        h["t_ns"] for h in health if h["url"] in wanted and not h["up"] and h["t_ns"] >= start_ns
    ]
    return (min(downs) - start_ns) / NS if downs else None


def compute(
    records: Sequence[RequestRecord],
    journal: dict[str, Any],
    target: Target,
    *,
    experiment: str,
    slo_ttft_ms: float,
    window_s: float,
    sli_target: float,
    sdk_health: Sequence[dict[str, Any]] = (),
) -> Recovery:
    """One experiment's recovery row (the module docstring); its trial and refusal: the caller's."""
    series = SliSeries.from_records(records, slo_ttft_ms)
    start, end, fault, outputs = fault_window(journal)
    log_end = series.known[-1] if series.known else end
    detected, recovered, low = (None, None, None)
    if start:
        detected, recovered, low = _detect_and_recover(
            series, start, max(log_end, start), window_s, sli_target
        )
    window_end = recovered if recovered is not None else (log_end if detected else end)
    touched = [
        v
        for v in series.verdicts
        if start and v.intended_ns <= window_end and (v.end_ns or log_end) >= start
    ]
    bad = [v for v in touched if not v.good]
    share = len(bad) / len(touched) if touched else 0.0
    hit, total = affected_replicas(target, outputs, bad)
    rollbacks = journal.get("rollbacks", [])
    reroute_urls = [u for o in outputs for u in o.get("urls", [])]
    note = "; ".join(str(o["note"]) for o in outputs if o.get("note"))
    row = Recovery(
        stack=target.stack,
        experiment=experiment,
        fault=fault,
        status=str(journal.get("status")),
        hypothesis_before=_before(journal),
        hypothesis_after=_after(journal),
        rollbacks_ok=all(r.get("status") == "succeeded" for r in rollbacks),
        requests=len(records),
        completed=sum(r.outcome == "completed" for r in records),
        failed=sum(r.outcome == "error" for r in records),
        lost=sum(r.outcome == "lost" for r in records),
        bad=len(bad),
        time_to_detect_s=(detected - start) / NS if detected is not None else None,
        time_to_recover_s=(recovered - start) / NS if recovered is not None and detected else None,
        sdk_reroute_s=sdk_reroute_s(sdk_health, reroute_urls, start) if start else None,
        error_budget_burn=share / (1.0 - sli_target) if sli_target < 1 else float("inf"),
        blast_radius_requests=share,
        blast_radius_replicas=min(1.0, len(hit) / total),
        replicas_affected=sorted(hit),
        fault_start_ns=start,
        fault_end_ns=end,
        engine_replicas=target.engine_replicas,
        sli_before=series.sli(start, window_s) if start else None,
        sli_min=low,
        note=note,
    )
    return _with_trial_figures(row, records, journal)


def _with_trial_figures(
    row: Recovery, records: Sequence[RequestRecord], journal: dict[str, Any]
) -> Recovery:
    """The row with what a trial of it needs: errors and retries in the fault's window against
    the steady state, the background load's lag, and the host's CPU before the fault."""
    start = row.fault_start_ns
    if start:
        row.steady = steady(records, start)
        row.faulted = faulted(records, start, whole_again_ns(journal, row.fault_end_ns))
    row.loader_lag = (lag_reason(summarize(records)) or "") if records else ""
    host = journal.get("zl_host_steady") or {}
    row.host_cpu_pct = host.get("cpu_pct")
    row.host_busiest_cpu_pct = host.get("busiest_cpu_pct")
    return row


def _before(journal: dict[str, Any]) -> bool | None:
    block = journal.get("steady_states", {}).get("before")
    return None if not block else bool(block.get("steady_state_met"))


def _after(journal: dict[str, Any]) -> bool | None:
    block = journal.get("steady_states", {}).get("after")
    return None if not block else bool(block.get("steady_state_met"))


def compute_from_files(
    requests_path: str | Path,
    journal: dict[str, Any],
    target: Target,
    *,
    experiment: str,
    slo_ttft_ms: float,
    window_s: float,
    sli_target: float,
    sdk_health_path: str | Path | None = None,
) -> Recovery:
    records = read_requests(requests_path) if Path(requests_path).exists() else []
    health = (
        read_jsonl(sdk_health_path) if sdk_health_path and Path(sdk_health_path).exists() else []
    )
    return compute(
        records,
        journal,
        target,
        experiment=experiment,
        slo_ttft_ms=slo_ttft_ms,
        window_s=window_s,
        sli_target=sli_target,
        sdk_health=health,
    )
