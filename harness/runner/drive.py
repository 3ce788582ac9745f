"""A profile's seeded schedule driven through the run's loader on a stack that is up: one
telemetry phase, measured into one summary row."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness import schema
from harness.loaders import Loader, LoadResult, ProgressStyle, loader_with
from harness.loaders.k6 import K6Loader
from harness.loaders.locust import LocustLoader
from harness.loaders.sharded import ShardedLoader
from harness.metrics import goodput
from harness.profile import Profile, WorkloadSource
from harness.promptfit import context_length, fit_classes
from harness.runner.config import RunConfig
from harness.runner.priority import loader_cores, loader_nice, loader_priority
from harness.runner.sampling import Telemetry, phase
from harness.schema import SummaryRow
from harness.stacks import Stack
from harness.telemetry import HostCpu, measure_host_cpu
from harness.workload import WorkloadSchedule, build_schedule
from serving.engine.tokenrules import BYTES_RULE, TokenRule


@dataclass(frozen=True)
class LoadPhase:
    """One schedule of a profile to drive on a stack: the phase telemetry marks it as (its
    ``tags`` beside the stack and profile in phases.jsonl), where its request records go and
    the loader's own working folder."""

    name: str
    profile: Profile
    schedule: WorkloadSchedule
    records: Path
    workdir: Path
    tags: dict[str, Any] = field(default_factory=dict)


def schedule_for(
    profile: Profile, rule: TokenRule, engine_options: dict[str, Any], run_tag: str = ""
) -> WorkloadSchedule:
    """The profile's seeded schedule under the run's token rule; under a tokenizer, each
    synthetic class's prompt bytes are first resized to give its token count
    (``harness.promptfit.fit_classes``, as ``zl-bench fidelity`` does)."""
    if rule is not BYTES_RULE:
        profile = fit_classes(profile, rule, context_length(engine_options))
    return build_schedule(profile, run_tag, rule=rule)


def nominal_rate(profile: Profile, schedule: WorkloadSchedule) -> float:
    """The rate a schedule was built for: the profile's (a sweep point's) for a synthetic
    workload; for a file or generated sessions, what the schedule really offers (a trace keeps
    its own timing, and late sessions lose the turns past the end)."""
    if profile.workload.source is WorkloadSource.SYNTHETIC:
        return profile.rate
    return schedule.offered_rate()


def summary_row(result: LoadResult, profile: Profile, offered: float, host: HostCpu) -> SummaryRow:
    """A loader's result as its summary.json row: what went on the wire and its extras, the
    profile's SLOs (goodput, ``slo_met``), the rate its schedule was built for (``offered``: the
    same for every stack and repeat at a sweep point) and the host's CPU."""
    fields = goodput(result.records, result.summary["duration"], result.summary, profile.slos)
    row = schema.from_data(
        SummaryRow,
        {**result.summary, **fields, "stack": result.stack, "profile": result.profile},
    )
    row.loader = result.loader
    row.loader_protocol = result.protocol
    row.ttft_is_first_byte = result.ttft_is_first_byte
    row.loader_extra = dict(result.extra)
    row.offered_rate = offered
    for key, value in host.row_fields().items():
        setattr(row, key, value)
    return row


def run_loader(config: RunConfig, style: ProgressStyle) -> Loader:
    """The run's loader: in this process, or as ``--loader-workers`` Ray actors on the cluster
    (each loader thread at the loader's priority)."""
    chosen = loader_with(config.loader, progress=style)
    if not config.loader_workers:
        return chosen
    if isinstance(chosen, K6Loader | LocustLoader):  # their own distributed modes
        return dataclasses.replace(chosen, workers=config.loader_workers)
    return ShardedLoader(config.loader_workers, progress=style, nice=loader_nice())


def measure(load: LoadPhase, stack: Stack, config: RunConfig, tele: Telemetry) -> SummaryRow:
    """The schedule through the run's loader at raised priority, inside its phase, with the
    host's CPU measured around it and the stack's prefix-cache counters over it in the row."""
    before = tele.last_reads(stack)
    style = ProgressStyle.QUIET if config.quiet else ProgressStyle.AUTO
    profile, schedule = load.profile, load.schedule
    with phase(tele.phases, load.name, stack=stack.name, profile=profile.name, **load.tags):
        with measure_host_cpu() as host, loader_priority(), loader_cores(config.cpu_layout):
            chosen = run_loader(config, style)
            result = chosen.run(schedule, stack, profile, load.records, load.workdir)
        row = summary_row(result, profile, nominal_rate(profile, schedule), host[0])
    row.prefix_cache = tele.prefix_cache(stack, load.name, before, row.completed)
    return row
