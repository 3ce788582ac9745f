"""``zl-bench run``: stand the stacks up, run every profile on them in trials, sample, save,
report.

The trial (one stack, one seeded schedule) is the unit (``harness.runner.trials``): every stack
is up for the whole run, and each of ``--repeats`` repeats drives every non-fault profile on
every stack, the stacks in a balanced order (A B, then B A, ...), each with the repeat's seeded
schedule (seed, seed + 1, ...), so that the claims and ``compare`` can pair the stacks' trials
by repeat. Only one stack is driven at a time; the others sit idle beside it (their idle CPU
shows in the trial's host CPU). Profile G (elasticity, only when named) is a trial of each
repeat too, after the load profiles: one replica joins each stack under the load, then one
leaves (``chaos.elastic_runner``). Profile D then runs the chaos experiments, as trials too: in
each repeat on every stack in the balanced order, every experiment in the first repeat and the
ones the claims judge in the others (``chaos.runner``). Everything is written as it happens, so
a run cut short by SIGINT still leaves a directory that ``zl-bench report`` renders, marked
incomplete; run.json records how the run really ended.

``--auth`` is the production-like mode: the run writes a key file with one fresh key per tenant
its profiles use (each allowed the most urgent class that tenant is sent with) into the run
directory, both stacks start with it (``--api-keys``) and every loader (profile D's chaos load
too) sends each request with its tenant's key; ``config.auth`` in run.json and each stack's
``auth`` say it was on.

The running itself is ``harness.runner``'s; here are the profile list, profile D and the plan.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Sequence
from pathlib import Path

from bench.history import file_run
from bench.report.console import render
from bench.stack_options import add_stack_arguments, comma_separated, config_from
from harness import schema
from harness.capacity import Capacity
from harness.cluster import ClusterSession
from harness.metrics import summarize
from harness.parity import check_parity
from harness.profile import DEFAULT_PROFILES, PROFILES, Profile, resolve_name
from harness.runner.cluster import check_cluster_options, on_cluster, record_cluster
from harness.runner.config import (
    RunConfig,
    capacity_preflight,
    check_external,
    choose_token_rule,
    load_profiles,
    workload_stats,
)
from harness.runner.console import say
from harness.runner.ending import until_stopped
from harness.runner.results import RunDir, host_line, open_run
from harness.runner.sampling import Telemetry, sampling
from harness.runner.trials import run_trial, stacks_up, trial_order
from harness.schema import SummaryRow
from harness.stacks import STACKS, Stack

FAULT_PROFILE = "d_fault"


def _fault_stacks(stacks: Sequence[Stack], profile: Profile) -> list[Stack]:
    """The stacks profile D runs on: those this run started, of a kind faults are defined for."""
    out = []
    for stack in stacks:
        if stack.external:
            say(f"{stack.name} / {profile.name}: skipped, faults need a stack this run started")
        elif stack.name.value not in STACKS:
            say(
                f"{stack.name} / {profile.name}: skipped, faults are defined for the zero-layer "
                "and baseline stacks"
            )
        else:
            out.append(stack)
    return out


def _run_fault_trial(
    profile: Profile,
    stack: Stack,
    run: RunDir,
    tele: Telemetry,
    repeat: int,
    experiments: Sequence[str] = (),
) -> None:
    """Trial ``repeat`` of profile D on this very stack (same engine, options, replicas): every
    chaos experiment in the first, those the claims judge in the others."""
    from bench.report.data import append_recovery
    from chaos.runner import experiment_paths, run_profile_d, tables

    label = f"{stack.name} / {profile.name}" + (f" (repeat {repeat})" if repeat else "")
    say(f"{label}: chaos experiments under profile A's load")
    paths = experiment_paths(experiments)
    rows = run_profile_d(stack, profile, run.path, tele.phases, repeat, paths)
    print(tables(rows), flush=True)
    append_recovery(run.path, list(rows))
    say(f"{label}: {len(rows)} experiments, {sum(r.lost for r in rows)} lost")


def _fault_summary(profile: Profile, stack: Stack, run: RunDir) -> None:
    """Profile D's summary row for a stack: every experiment's background load, every trial."""
    logs = sorted(
        (run.path / schema.CHAOS_DIR).glob(f"requests-{stack.name}-{profile.name}-*.jsonl")
    )
    records = [rec for path in logs for rec in schema.read_requests(path)]
    row = schema.from_data(
        SummaryRow,
        {"stack": stack.name, "profile": profile.name, "loader": "native"}
        | summarize(records, slos=profile.slos),
    )
    row.loader_protocol = "h2" if stack.protocol == "h2" else "http/1.1"
    run.add_summary(row)
    say(f"{stack.name} / {profile.name}: {row.lost} lost, {row.errors} errors over every trial")


def _run_fault_profiles(
    profiles: Sequence[Profile], stacks: Sequence[Stack], config: RunConfig, run: RunDir,
    tele: Telemetry,
) -> None:  # fmt: skip
    """Profile D's trials, the stacks in each repeat's balanced order, then its summaries."""
    for profile in (p for p in profiles if p.fault is not None):
        chosen = _fault_stacks(stacks, profile)
        for repeat in range(config.trials):
            for stack in trial_order(chosen, repeat):
                _run_fault_trial(profile, stack, run, tele, repeat, config.experiments)
        for stack in chosen:
            _fault_summary(profile, stack, run)


def _run_elastic_profile(
    profile: Profile, stack: Stack, run: RunDir, tele: Telemetry, repeat: int
) -> None:
    """Profile G's trial of ``repeat`` on this very stack: a replica joins, then one leaves."""
    from chaos import elastic_runner

    label = f"{stack.name} / {profile.name}" + (f" (repeat {repeat})" if repeat else "")
    why = elastic_runner.skip_reason(stack)
    if why:
        say(f"{label}: skipped, {why}")
        return
    say(f"{label}: one replica joins, then one leaves, under profile A's load")
    trial = elastic_runner.run_trial(stack, profile, run.path, repeat, tele.phases)
    run.add_summary(trial.summary)
    print(elastic_runner.table([trial.row]), flush=True)


def _run_stacks(
    profiles: Sequence[Profile], config: RunConfig, run: RunDir, tele: Telemetry
) -> None:
    """Stand every stack up, run the repeats of every load profile on them in a balanced
    order, then profile D's; tear them all down."""
    with stacks_up(config.stacks, config, run, tele) as stacks:
        check_parity(stacks, config.allow_mismatch, run)  # every stack up, before any load
        for stack in stacks:
            run.meta.stacks[stack.name.value]["request_body_fields"] = stack.body_fields()
        try:
            for repeat in range(config.trials):
                for profile in (p for p in profiles if p.fault is None and p.elasticity is None):
                    for stack in trial_order(stacks, repeat):
                        run_trial(profile, stack, config, run, tele, repeat)
                for profile in (p for p in profiles if p.elasticity is not None):
                    for stack in trial_order(stacks, repeat):
                        _run_elastic_profile(profile, stack, run, tele, repeat)
            _run_fault_profiles(profiles, stacks, config, run, tele)
        finally:
            for stack in stacks:
                run.meta.stacks[stack.name.value]["engines_at_teardown"] = tele.last_reads(stack)
            run.save()


def _describe_profiles(
    run: RunDir, profiles: Sequence[Profile], capacities: dict[str, Capacity]
) -> None:
    """Each profile in run.json, with its capacity preflight and a replayed file's lengths."""
    for profile in profiles:
        run.meta.profiles[profile.name] = {
            **profile.as_dict(),
            "capacity": capacities[profile.name].as_dict(),
            **workload_stats(profile, run.rule),
        }
    run.save()


def run(config: RunConfig) -> int:
    """Run the bench; returns the exit status (130 when interrupted).

    Everything a user can get wrong (profiles, engine options, unreachable URLs) is checked
    before the results directory is made. A crash is recorded in run.json and re-raised.
    """
    profiles = load_profiles(config)
    check_external(config)
    placement = check_cluster_options(
        config.ray_address, config.placement, config.loader_workers, config.loader
    )
    capacities = capacity_preflight(profiles, config)
    with on_cluster(config.ray_address, placement) as cluster:
        return _run_on(config, profiles, capacities, cluster)


def _run_on(
    config: RunConfig,
    profiles: Sequence[Profile],
    capacities: dict[str, Capacity],
    cluster: ClusterSession | None,
) -> int:
    """The run itself, on this host or placed on ``cluster``."""
    run = open_run(config, profiles, choose_token_rule(config, profiles))
    say(f"run {run.meta.run_id} -> {run.path}; {host_line(run)}")
    record_cluster(cluster, run)
    _describe_profiles(run, profiles, capacities)
    try:
        with until_stopped(run) as ending, sampling(run, config.telemetry_interval_s) as tele:
            _run_stacks(profiles, config, run, tele)
    except BaseException:
        with contextlib.suppress(Exception):
            render(run)
        raise
    if ending.stopped:
        say(f"{ending.detail}: keeping what was measured")
    render(run)
    file_run(run.path)
    return ending.status


def _profile_name(item: str) -> str:
    """A profile by name (``a``, ``a_latency``), or a profile TOML of the user's own by path
    (it may ``extends`` a shipped one)."""
    if item.endswith(".toml"):
        path = Path(item).expanduser()
        if not path.is_file():
            raise ValueError(f"profile file {item!r} does not exist")
        return str(path.resolve())
    return resolve_name(item)


def profile_list(text: str) -> tuple[str, ...]:
    """``--profiles``: names or TOML paths, comma-separated (shared with ``zl-bench aa``)."""
    try:
        names = [_profile_name(item) for item in comma_separated(text)]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not names:
        raise argparse.ArgumentTypeError("no profile given")
    return tuple(dict.fromkeys(names))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``zl-bench run``'s arguments."""
    parser.add_argument(
        "--profiles",
        type=profile_list,
        default=",".join(DEFAULT_PROFILES),
        help=f"comma-separated, from {', '.join(PROFILES)} (or a-g), or profile TOML paths; "
        "G (elasticity) only when named",
    )
    add_stack_arguments(parser)


def run_command(args: argparse.Namespace) -> int:
    """Build the RunConfig from the command line and run it."""
    return run(config_from(args, tuple(args.profiles)))
