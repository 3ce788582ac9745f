"""``zl-bench fragmentation``: seed 003's fixed shapes against the engine's defaults, on one stack.

Seed 003 compared engine configurations, not stacks: the same mixed workload through the
zero-layer stack with its fixed-shape setting (``harness.variants.FIXED_SHAPES``) and with the
engine's defaults, in paired trials: repeat k runs both, seeded alike, in a balanced order (A B,
then B A), each on a stack stood up with that configuration and torn down after it (the sim and
the zero-layer replica stand up in about a second; vLLM in tens of seconds). Each trial is a
row of ``summary.json`` whose ``stack`` names the configuration; the engine telemetry in its
window gives its KV tail waste. The report's ``fragmentation`` claim judges the pairs.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from pathlib import Path

from bench.history import file_run
from bench.report.console import render
from harness import schema
from harness.errors import UsageError
from harness.outputs import output_dir
from harness.profile import SCALES, Profile
from harness.runner.config import (
    RunConfig,
    choose_token_rule,
    cpu_layout,
    fit_engine_to_model,
    load_profiles,
)
from harness.runner.console import say
from harness.runner.drive import LoadPhase, schedule_for
from harness.runner.ending import until_stopped
from harness.runner.results import RunDir, host_line, open_run
from harness.runner.sampling import Telemetry, sampling
from harness.runner.stack import stack_session
from harness.runner.trials import measure_trial, trial_order, trial_phase
from harness.stacks import StackName
from harness.variants import VARIANTS, EngineVariant
from serving.cliargs import positive_int
from serving.engine import ENGINES
from serving.engine.options import add_engine_option, validate_engine_options

KIND = "fragmentation"
PROFILE = "c_mixed"


def _trial(
    variant: EngineVariant,
    profile: Profile,
    config: RunConfig,
    run: RunDir,
    tele: Telemetry,
    repeat: int,
) -> None:
    """One trial of ``variant``: a zero-layer stack stood up with its options, the profile as its
    client sends it, the row saved under the variant's name."""
    options = variant.options(config.engine_options)
    mine = dataclasses.replace(config, engine_options=options)
    seeded = dataclasses.replace(variant.profile(profile, run.rule, config.engine_options),
                                 seed=profile.seed + repeat)  # fmt: skip
    name = trial_phase(variant.name, profile.name, repeat)
    load = LoadPhase(
        name=name,
        profile=seeded,
        schedule=schedule_for(seeded, run.rule, options, run_tag=f"r{repeat}"),
        records=run.path / schema.requests_file(variant.name, profile.name, repeat),
        workdir=run.path / "loader" / f"{variant.name}-r{repeat}",
        tags={"repeat": repeat, "variant": variant.name},
    )
    with stack_session(StackName.ZEROLAYER, mine, run, tele) as stack:
        row = measure_trial(load, stack, mine, tele, repeat)
    _relabel(load.records, variant.name)
    row.stack = variant.name
    row.records_file = load.records.name
    run.add_summary(row)
    say(f"{variant.name} / {profile.name} (repeat {repeat}): {row.completed} completed, "
        f"E2EL p95 {row.stat('p95_e2el_ms') or 0:.1f} ms")  # fmt: skip


def _relabel(path: Path, name: str) -> None:
    """The trial's records under the variant's name (the loader names them after the stack it
    drove, the same zero-layer stack for every variant), rewritten whole."""
    records = schema.read_requests(path)
    for record in records:
        record.stack = name
    fresh = path.with_suffix(".relabel")
    with schema.JsonlWriter(fresh) as out:
        out.write_many(records)
    fresh.replace(path)


def run(config: RunConfig, variants: Sequence[EngineVariant] = VARIANTS) -> int:
    """The paired trials of every variant; the report (and its claims) at the end."""
    (profile,) = load_profiles(config)
    rule = choose_token_rule(config, [profile])
    run_dir = open_run(config, [profile], rule, kind=KIND)
    run_dir.meta.other[KIND] = {
        v.name: {"description": v.description, "engine_options": v.options(config.engine_options),
                 "classes": [dataclasses.asdict(c)
                             for c in v.profile(profile, rule, config.engine_options).classes]}
        for v in variants
    }  # fmt: skip
    run_dir.meta.profiles[profile.name] = profile.as_dict()
    run_dir.save()
    say(f"run {run_dir.meta.run_id} -> {run_dir.path}; {host_line(run_dir)}")
    with until_stopped(run_dir) as ending, sampling(run_dir, config.telemetry_interval_s) as tele:
        for repeat in range(config.trials):
            for variant in trial_order(variants, repeat):
                _trial(variant, profile, config, run_dir, tele, repeat)
    if ending.stopped:
        say(f"{ending.detail}: keeping what was measured")
    render(run_dir)
    file_run(run_dir.path)
    return ending.status


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``zl-bench fragmentation``'s arguments."""
    parser.add_argument("--scale", choices=SCALES, default="laptop", help="load scale")
    parser.add_argument("--engine", choices=ENGINES, default="sim", help="engine of the stack")
    add_engine_option(parser)
    parser.add_argument("--replicas", type=positive_int, default=1, help="engine replicas")
    parser.add_argument("--repeats", type=positive_int, default=3, help="paired trials")
    parser.add_argument("--out", default="results", help="parent of results/<run-id>/")
    parser.add_argument("--quiet", action="store_true", help="no progress bars or lines")


def run_command(args: argparse.Namespace) -> int:
    try:
        options = validate_engine_options(args.engine, dict(args.engine_options))
    except ValueError as exc:
        raise UsageError(f"--engine-option: {exc}") from exc
    config = RunConfig(
        scale=args.scale,
        profiles=(PROFILE,),
        stacks=(StackName.ZEROLAYER,),
        engine=args.engine,
        engine_options=options,
        replicas=args.replicas,
        out=str(output_dir(args.out)),
        quiet=args.quiet,
        repeats=args.repeats,
        cpu_layout=cpu_layout(args.engine, args.replicas, None),
    )
    return run(fit_engine_to_model(config))
