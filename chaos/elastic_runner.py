"""Profile G on a running stack: one trial is one Chaos Toolkit run of
``chaos/experiments/elasticity/replica-join-leave.json`` (``run_experiment`` in the main thread,
rollbacks ``always``) under the profile's load, seeded for its repeat like any other trial.

Nothing stands between the load and the stack (no fault proxy): the zero-layer SDK takes its
replicas from a discovery file this module writes with the stack's replica URLs
(``chaos/replicas-<stack>-g_elasticity-r<k>.json``) and the scaling actions rewrite
(``chaos.elastic``); the baseline's load goes to its front door. Per trial: the load's records
(``requests-<stack>-g_elasticity[.r<k>].jsonl``, beside the other trials' records), the journal
and the SDK's replica-set changes under ``chaos/``, the trial's summary row (validity and the
host's CPU over the trial, as every trial's) and its figures (``chaos.elasticity``), appended to
``elasticity.json`` in the run directory.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import orjson

from chaos.elastic import restore_replicas
from chaos.elasticity import (
    ElasticityRow,
    TrialInputs,
    client_routed,
    compute,
    engine_routed,
    needless_moves,
)
from chaos.runner import EXPERIMENT_DIR, SETTINGS, stack_target
from chaos.targets import write_target
from harness import schema
from harness.elastic_settings import ElasticSettings
from harness.metrics import summarize
from harness.profile import Profile
from harness.runner.sampling import phase
from harness.runner.trials import trial_phase
from harness.schema import CHAOS_DIR, SummaryRow, requests_file
from harness.schema.files import write_json_atomic
from harness.stacks import Scaling, Stack
from harness.tables import Align, Column, fmt, text_table
from harness.telemetry import PhaseLog, cpu_speed, measure_host_cpu
from zerolayer.client.discovery import write_replicas

EXPERIMENT: Final = EXPERIMENT_DIR / "elasticity" / "replica-join-leave.json"
ELASTICITY_FILE: Final = "elasticity.json"


@dataclass(frozen=True, slots=True)
class ElasticTrial:
    """One trial of profile G: its figures and its summary row."""

    row: ElasticityRow
    summary: SummaryRow


def elastic_settings(profile: Profile) -> ElasticSettings:
    if profile.elasticity is None:
        raise ValueError(f"profile {profile.name!r} has no [elasticity] settings")
    return profile.elasticity


def skip_reason(stack: Stack) -> str:
    """Why profile G cannot run on ``stack`` ('' when it can)."""
    if stack.external:
        return "scaling needs a stack this run started"
    if stack.kind.scaling is Scaling.NONE:
        return f"the {stack.kind.summary} is not scaled by profile G"
    return ""


def _paths(stack: Stack, profile: Profile, run_dir: Path, repeat: int) -> dict[str, Path]:
    chaos_dir = run_dir / CHAOS_DIR
    tag = f"{stack.name}-{profile.name}-r{repeat}"
    return {
        "target_file": chaos_dir / f"target-{tag}.json",
        "discovery_file": chaos_dir / f"replicas-{tag}.json",
        "elastic_dir": chaos_dir / f"replicas-{tag}",
        "requests_path": run_dir / requests_file(stack.name, profile.name, repeat),
        "sdk_changes_path": chaos_dir / f"sdk-changes-{tag}.jsonl",
        "journal": chaos_dir / f"{tag}.journal.json",
    }


def configuration(
    stack: Stack, profile: Profile, paths: dict[str, Path], repeat: int
) -> dict[str, Any]:
    """The Chaos Toolkit configuration of one trial (keys of ``chaos.controls`` and
    ``chaos.elastic``)."""
    sc = elastic_settings(profile)
    conf: dict[str, Any] = {
        key: str(paths[key])
        for key in ("target_file", "elastic_dir", "requests_path", "sdk_changes_path")
    }
    if stack.kind.client_routes:
        conf["discovery_file"] = str(paths["discovery_file"])
    if stack.stats_dir is not None:
        conf["engine_log_dir"] = str(stack.stats_dir)
    return conf | {
        "experiment_tag": f"{profile.name}-r{repeat}" if repeat else profile.name,
        "profile": profile.name,
        "scale": profile.scale,
        "seed": profile.seed + repeat,
        "load_rate": profile.rate,
        "load_deadline_ms": sc.deadline_ms,
        "load_max_s": sc.load_max_s,
        "warmup_s": sc.warmup_s,
        "hold_s": sc.hold_s,
        "settle_s": sc.settle_s,
        "tail_s": sc.tail_s,
        "sli_window_s": sc.window_s,
        "slo_ttft_ms": sc.slo_ttft_ms,
        "sli_target": sc.sli_target,
        "ready_timeout_s": sc.ready_timeout_s,
        "leave_grace_s": sc.leave_grace_s,
        "discovery_interval_s": sc.discovery_interval_s,
        "health_interval_s": sc.health_interval_s,
        "health_timeout_s": sc.health_timeout_s,
    }


def _run_experiment(conf: dict[str, Any]) -> dict[str, Any]:
    from chaoslib.experiment import ensure_experiment_is_valid, run_experiment
    from chaoslib.loader import load_experiment

    experiment = load_experiment(str(EXPERIMENT), settings=SETTINGS)
    experiment["configuration"] = {**experiment.get("configuration", {}), **conf}
    ensure_experiment_is_valid(experiment)
    journal: dict[str, Any] = run_experiment(experiment, settings=SETTINGS)
    return journal


def _summary(
    stack: Stack, profile: Profile, records: Sequence[schema.RequestRecord], repeat: int
) -> SummaryRow:
    row = schema.from_data(
        SummaryRow,
        {"stack": stack.name, "profile": profile.name, "loader": "native"}
        | summarize(records, slos=profile.slos),
    )
    row.loader_protocol = "h2" if stack.protocol == "h2" else "http/1.1"
    row.repeat, row.offered_rate = repeat, profile.rate
    return row


def run_trial(
    stack: Stack, profile: Profile, run_dir: Path, repeat: int, phases: PhaseLog | None = None
) -> ElasticTrial:
    """One trial of profile G on ``stack`` (see the module docstring); its row is appended to
    ``elasticity.json``."""
    logging.getLogger("chaostoolkit").setLevel(logging.WARNING)
    sc = elastic_settings(profile)
    paths = _paths(stack, profile, run_dir, repeat)
    paths["elastic_dir"].mkdir(parents=True, exist_ok=True)
    for key in ("requests_path", "sdk_changes_path"):
        paths[key].unlink(missing_ok=True)
    write_target(paths["target_file"], stack_target(stack))
    if stack.kind.client_routes:
        write_replicas(paths["discovery_file"], stack.urls)
    conf = configuration(stack, profile, paths, repeat)
    speed = cpu_speed()
    name = trial_phase(stack.name, profile.name, repeat)
    tags = {"stack": stack.name, "profile": profile.name, "repeat": repeat}
    try:
        with phase(phases, name, **tags), measure_host_cpu() as host:
            journal = _run_experiment(conf)
    finally:  # the rollback's own step again: nothing this trial started outlives it
        restore_replicas(sc.ready_timeout_s, conf)
    paths["journal"].write_text(json.dumps(journal, indent=2, default=str))
    records = (
        schema.read_requests(paths["requests_path"]) if paths["requests_path"].exists() else []
    )
    start = min((r.intended_start_ns for r in records), default=0)
    end = max((r.end_ns for r in records), default=0)
    routed = (
        client_routed(records)
        if stack.kind.client_routes
        else engine_routed(stack.stats_dir or paths["elastic_dir"], start, end)
    )
    changes = paths["sdk_changes_path"]
    inputs = TrialInputs(stack.name, repeat, stack.spec.replicas, records, journal, routed,
                         sc.window_s, sc.band_pct,
                         schema.read_jsonl(changes) if changes.exists() else [])  # fmt: skip
    summary = _summary(stack, profile, records, repeat)
    summary.host_speed = round(speed)
    summary.records_file = paths["requests_path"].name
    for key, value in host[0].row_fields().items():
        setattr(summary, key, value)
    row = compute(inputs)
    append(run_dir, [row])
    return ElasticTrial(row, summary)


def read(run_dir: Path) -> list[ElasticityRow]:
    """``elasticity.json``: every trial's figures of profile G (none if absent)."""
    path = Path(run_dir) / ELASTICITY_FILE
    if not path.exists():
        return []
    try:
        return schema.from_data(list[ElasticityRow], orjson.loads(path.read_bytes()))
    except (ValueError, orjson.JSONDecodeError) as exc:
        raise schema.fit_error(path, ValueError(str(exc))) from exc


def append(run_dir: Path, rows: Sequence[ElasticityRow]) -> None:
    """Add trials' rows to ``elasticity.json`` (rewritten whole, atomically)."""
    path = Path(run_dir) / ELASTICITY_FILE
    write_json_atomic(path, schema.to_data([*read(run_dir), *rows]))


def _moves(row: ElasticityRow) -> str:
    j, lv = row.join_moves, row.leave_moves
    join = f"{j.kept}/{j.seen} +{j.with_change} !{j.needless}"
    return f"{join} | {lv.kept}/{lv.seen} -{lv.with_change} !{lv.needless}"


def table(rows: Sequence[ElasticityRow]) -> str:
    """Profile G's trials as aligned text: time to first request (and the lower bound on when
    the router learned), sessions kept/seen with the moves the change caused (+ to the joining
    replica, - from the leaving one) and the needless ones (!), errors and recovery per change."""
    head = ("stack", "trial", "first req ms", "learned >= ms", "SDK learned ms", "announce ms",
            "sessions join | leave", "needless", "errors j/l", "recovery j/l s",
            "status")  # fmt: skip
    lines = []
    for r in rows:
        moved, could = needless_moves(r)
        status = r.status + ("" if r.rollbacks_ok else " ROLLBACK FAILED")
        lines.append((
            r.stack, str(r.repeat), fmt(r.time_to_first_request_ms, ".0f"),
            fmt(r.learned_after_ms, ".0f"), fmt(r.sdk_learned_ms, ".0f"),
            fmt(r.announce_ms, ".0f"), _moves(r),
            f"{moved}/{could}", f"{r.errors_join}/{r.errors_leave}",
            f"{fmt(r.recovery_join_s, '.2f')}/{fmt(r.recovery_leave_s, '.2f')}",
            status + (f" ({r.note})" if r.note else ""),
        ))  # fmt: skip
    return text_table([Column(h, align=Align.LEFT) for h in head], lines, gap=2)
