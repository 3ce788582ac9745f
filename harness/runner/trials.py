"""Trials, the unit every verdict is built from: one stack driven through one seeded schedule.

Every stack of a run is up at once, so that the trials of a repeat can alternate between them:
the order is balanced across repeats (repeat 0 runs the stacks in the order asked, repeat 1 in
reverse, and so on), recorded on each row, so that a drift of the host over the run (another
tenant of the VM, thermal limits) falls on both stacks alike instead of on whichever ran last.
Each trial is preceded by the host-speed probe (its figure goes on the row, and
``harness.validity`` flags a trial whose host moved) and followed by a short settle, so that one
trial's drain does not run into the next one's start.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator, Sequence
from typing import Final, TypeVar

from harness import schema
from harness.profile import Profile
from harness.runner.cluster import check_cluster
from harness.runner.config import RunConfig
from harness.runner.console import row_outcome, say, turns_outcome
from harness.runner.drive import LoadPhase, measure, nominal_rate, schedule_for
from harness.runner.results import RunDir
from harness.runner.sampling import Telemetry
from harness.runner.stack import stack_session
from harness.schema import SummaryRow
from harness.stacks import Stack, StackName
from harness.telemetry import cpu_speed

SETTLE_S: Final = 1.0

T = TypeVar("T")


def trial_order(items: Sequence[T], repeat: int) -> list[T]:
    """``items`` in the order of repeat ``repeat``: as given on even repeats, reversed on odd
    ones (A B, B A, A B, ...), so that over any two repeats each goes first once."""
    return list(items) if repeat % 2 == 0 else list(reversed(items))


def measure_trial(
    load: LoadPhase,
    stack: Stack,
    config: RunConfig,
    tele: Telemetry,
    repeat: int,
    settle_s: float = SETTLE_S,
) -> SummaryRow:
    """One trial: the host-speed probe, the schedule through the loader, then a settle. A
    node of the cluster lost since the last trial stops the run first."""
    check_cluster()
    speed = cpu_speed()
    row = measure(load, stack, config, tele)
    row.repeat, row.host_speed = repeat, round(speed)
    time.sleep(settle_s)
    return row


@contextlib.contextmanager
def stacks_up(
    names: Sequence[StackName], config: RunConfig, run: RunDir, tele: Telemetry
) -> Iterator[list[Stack]]:
    """Every stack of ``names`` stood up (in that order) and warmed, all torn down however the
    block ends (in reverse order); a node of the cluster lost by the block's end stops the run
    (its stacks torn down all the same)."""
    with contextlib.ExitStack() as up:
        yield [up.enter_context(stack_session(name, config, run, tele)) for name in names]
        check_cluster()


def trial_phase(stack: str, profile: str, repeat: int) -> str:
    """A plain run's trial as its telemetry phase is named: ``<stack>/<profile>[#<repeat>]``."""
    return f"{stack}/{profile}" + (f"#{repeat}" if repeat else "")


def trial_load(
    profile: Profile, stack: Stack, run: RunDir, config: RunConfig, repeat: int
) -> LoadPhase:
    """Repeat ``repeat`` of a non-fault profile on ``stack``: the profile seeded for the repeat
    (seed, seed + 1, ...: every stack gets the same schedule in one repeat), its records in
    ``requests-<stack>-<profile>[.r<repeat>].jsonl``."""
    seeded = dataclasses.replace(profile, seed=profile.seed + repeat)
    tag = f"r{repeat}" if repeat else ""
    name = trial_phase(stack.name, profile.name, repeat)
    return LoadPhase(
        name=name,
        profile=seeded,
        schedule=schedule_for(seeded, run.rule, config.engine_options, run_tag=tag),
        records=run.path / schema.requests_file(stack.name, profile.name, repeat),
        workdir=run.path / "loader" / name.replace("/", "-").replace("#", "-r"),
        tags={"repeat": repeat},
    )


def run_trial(
    profile: Profile, stack: Stack, config: RunConfig, run: RunDir, tele: Telemetry, repeat: int
) -> SummaryRow:
    """One trial of a non-fault profile on one stack through the configured loader, saved."""
    load = trial_load(profile, stack, run, config, repeat)
    label = f"{stack.name} / {profile.name}" + (f" (repeat {repeat})" if repeat else "")
    say(
        f"{label}: {len(load.schedule)} requests, "
        f"{nominal_rate(load.profile, load.schedule):.3g} req/s for {profile.duration_s:g} s "
        f"({profile.workload.source.value} workload, {config.loader} loader)"
    )
    row = measure_trial(load, stack, config, tele, repeat)
    row.records_file = load.records.name
    run.add_summary(row)
    say(f"{label}: {row_outcome(row)}")
    if turns := turns_outcome(row):
        say(f"{label}: {turns}")
    return row
