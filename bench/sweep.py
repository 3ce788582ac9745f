"""``zl-bench sweep``: one profile at a series of offered rates on every stack.

Each stack is stood up once and driven at rising rates, ``--repeats`` times per rate (seed
``s``, ``s + 1``, ...; at a given rate and repeat every stack gets the same seeded schedule).
The rates are ``--rates``, or by default a geometric grid (steps of ``GRID_STEP``) from the
lower of a tenth of the capacity preflight's prediction and half the profile's own rate (the
profiles' laptop rates sit below the slower stack's knee on two cores),
up to 1.5x the prediction; ``--adaptive`` instead bisects for the highest rate that still meets
the profile's SLOs, to ``--resolution``. A stack's sweep stops once it is past saturation (queue
growing, or requests failing; ``harness.metrics.saturation``) or its loader could not keep to the
schedule, or its goodput has collapsed under the SLOs (``collapsed``): higher rates would measure
nothing new. Every point is written as it ends, so an
interrupted sweep keeps what it measured; the headline figures (``harness.curves``) are
computed at the end of each stack and again from whatever exists when the sweep stops.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Final

from bench.history import file_run
from bench.report.console import render
from bench.stack_options import add_stack_arguments, config_from
from harness import curves, schema
from harness.capacity import Capacity
from harness.cluster import ClusterSession
from harness.errors import UsageError
from harness.metrics import Slo
from harness.parity import check_parity
from harness.profile import PROFILES, Profile, WorkloadSource, resolve_name
from harness.runner.cluster import check_cluster_options, on_cluster, record_cluster
from harness.runner.config import (
    RunConfig,
    capacity_preflight,
    check_external,
    choose_token_rule,
    load_profiles,
)
from harness.runner.console import row_outcome, say
from harness.runner.drive import LoadPhase, schedule_for
from harness.runner.ending import until_stopped
from harness.runner.results import RunDir, host_line, open_run
from harness.runner.sampling import Telemetry, sampling
from harness.runner.trials import measure_trial, stacks_up, trial_order
from harness.schema import SummaryRow, SweepSection
from harness.stacks import Stack
from harness.tables import Align, Column, fmt, text_table
from serving.cliargs import open_fraction, positive_float

GRID_STEP: Final = 1.5
MAX_POINTS: Final = 16
LOW_OF_CAPACITY: Final = 0.1
HIGH_OF_CAPACITY: Final = 1.5
LOW_OF_PROFILE_RATE: Final = 0.5
UNKNOWN_CAPACITY_SPAN: Final = 16.0
DEFAULT_RESOLUTION: Final = 0.1
DEFAULT_ADDED_LATENCY_MS: Final = 50.0


@dataclass(frozen=True)
class SweepConfig:
    """What a sweep was asked to do, beside the stacks' settings in ``run``."""

    run: RunConfig
    profile: str
    rates: tuple[float, ...] = ()
    adaptive: bool = False
    resolution: float = DEFAULT_RESOLUTION
    added_latency_ms: float = DEFAULT_ADDED_LATENCY_MS
    point_duration_s: float | None = None
    max_points: int = MAX_POINTS


@dataclass
class StackSweep:
    """One stack's progress through the sweep: its points so far and why it stopped."""

    name: str
    points: list[SummaryRow] = field(default_factory=list)
    stopped: str = ""


def default_rates(
    profile: Profile, capacity: Capacity, max_points: int = MAX_POINTS
) -> list[float]:
    """The grid when no ``--rates`` were given; see the module docstring."""
    predicted = capacity.requests_per_s
    if predicted is not None and math.isfinite(predicted) and predicted > 0:
        low = min(LOW_OF_CAPACITY * predicted, LOW_OF_PROFILE_RATE * profile.rate)
        high = HIGH_OF_CAPACITY * predicted
    else:
        low = LOW_OF_PROFILE_RATE * profile.rate
        high = UNKNOWN_CAPACITY_SPAN * low
    count = min(max_points, math.ceil(math.log(high / low) / math.log(GRID_STEP)) + 1)
    return curves.geometric_rates(low, high, count)


def stop_reason(rows: Sequence[SummaryRow]) -> str:
    """Why a stack's sweep should not go higher after the repeats of one rate ('' to go on):
    most of them past saturation, or most of them the loader's rather than the stack's."""
    half = len(rows) / 2
    limited = [r for r in rows if r.loader_limited]
    if len(limited) > half:
        return f"the loader could not keep up at {rows[0].offered_rate:.4g} req/s: " + "; ".join(
            limited[0].invalid_reasons
        )
    saturated = [r for r in rows if r.saturated]
    if len(saturated) > half:
        return f"past saturation at {rows[0].offered_rate:.4g} req/s: " + "; ".join(
            saturated[0].saturation_reasons
        )
    return ""


def collapsed(points: Sequence[SummaryRow]) -> str:
    """Why the curve is clearly past its peak ('' if not): the last two rates both missed the
    SLOs (most repeats) and the last one's goodput is under half the best seen."""
    rates = sorted({p.offered_rate for p in points})
    if len(rates) < 2:
        return ""
    by_rate = {r: [p for p in points if p.offered_rate == r] for r in rates[-2:]}
    missed = all(sum(p.slo_met is False for p in rows) > len(rows) / 2 for rows in by_rate.values())
    usable = [p.request_goodput for p in points if curves.usable(p)]
    last = [p.request_goodput for p in by_rate[rates[-1]]]
    best, now = max(usable, default=0.0), sum(last) / len(last)
    if missed and best > 0 and now < best / 2:
        return (
            f"past its peak at {rates[-1]:.4g} req/s: SLOs missed at two rates running and "
            f"goodput {now:.2f} req/s, under half the best {best:.2f} req/s"
        )
    return ""


def meets(rows: Sequence[SummaryRow]) -> bool:
    """Whether a rate held: most repeats measured the stack, within its SLOs, not saturated."""
    good = [r for r in rows if not r.loader_limited and r.slo_met is not False and not r.saturated]
    return len(good) > len(rows) / 2


class Sweeper:
    """Runs the points of one stack and keeps the sweep section on disk up to date."""

    def __init__(self, config: SweepConfig, profile: Profile, run: RunDir, tele: Telemetry) -> None:
        self.config, self.profile, self.run, self.tele = config, profile, run, tele
        self.base_seed = profile.seed

    def load(self, stack: Stack, rate: float, repeat: int, records: str) -> LoadPhase:
        """Repeat ``repeat`` at ``rate``: the profile at that rate, seeded for the repeat, its
        requests into ``records`` (relative to the run directory)."""
        profile = self.profile.at_rate(rate, seed=self.base_seed + repeat)
        name = f"{stack.name}/{profile.name}@{rate:g}#{repeat}"
        return LoadPhase(
            name=name,
            profile=profile,
            schedule=schedule_for(
                profile, self.run.rule, self.config.run.engine_options, run_tag=f"r{repeat}"
            ),
            records=self.run.path / records,
            workdir=self.run.path / "loader" / name.replace("/", "-"),
            tags={"rate": rate},
        )

    def trial(self, stack: Stack, state: StackSweep, rate: float, repeat: int) -> SummaryRow:
        """Repeat ``repeat`` at ``rate`` on one stack, saved as soon as it is measured."""
        section = self.run.sweep
        assert section is not None
        index = len({p.offered_rate for p in state.points if p.offered_rate != rate})
        records = schema.point_file(stack.name, self.profile.name, rate, repeat)
        load = self.load(stack, rate, repeat, records)
        row = measure_trial(load, stack, self.config.run, self.tele, repeat)
        row.point, row.records_file = index, records
        state.points.append(row)
        section.points.append(row)
        self.run.save_sweep()
        say(f"{stack.name} @ {rate:g} req/s (repeat {repeat}): {row_outcome(row)}")
        return row

    def point(self, stack: Stack, state: StackSweep, rate: float) -> list[SummaryRow]:
        """Every repeat at ``rate`` on one stack (the adaptive search's probe)."""
        return [self.trial(stack, state, rate, k) for k in range(self.profile.sweep_repeats)]

    def grid(
        self, stacks: Sequence[Stack], states: Sequence[StackSweep], rates: Sequence[float]
    ) -> None:
        """Every rate in turn; at each, every repeat on every stack still going, the stacks in
        a balanced order (``trial_order``); a stack stops on its own rows."""
        pairs = list(zip(stacks, states, strict=True))
        for index, rate in enumerate(rates):
            going = [(stack, state) for stack, state in pairs if not state.stopped]
            if not going:
                return
            rows: dict[str, list[SummaryRow]] = {state.name: [] for _, state in going}
            for repeat in range(self.profile.sweep_repeats):
                for stack, state in trial_order(going, index + repeat):
                    rows[state.name].append(self.trial(stack, state, rate, repeat))
            for stack, state in going:
                state.stopped = stop_reason(rows[state.name]) or collapsed(state.points)
                if state.stopped:
                    say(f"{stack.name}: sweep stopped, {state.stopped}")

    def adaptive(self, stack: Stack, state: StackSweep, low: float, high: float) -> None:
        found = curves.bisect_rate(
            lambda rate: meets(self.point(stack, state, rate)),
            low,
            high,
            self.config.resolution,
        )
        state.stopped = _bisection_text(found, self.config.resolution)
        say(f"{stack.name}: {state.stopped}")


def _bisection_text(found: curves.Bisection, resolution: float) -> str:
    if found.low is None:
        return f"no rate met the SLOs (lowest tried {found.high:g} req/s)"
    if found.high is None:
        return f"every rate tried met the SLOs, up to {found.low:g} req/s"
    return (
        f"bisection: {found.low:g} req/s met the SLOs, {found.high:g} did not "
        f"(resolution {resolution:.0%}, {found.probes} probes)"
    )


def summarise(section: SweepSection, states: Sequence[StackSweep], slos: Sequence[Slo]) -> None:
    """The headline figures per stack and the added-latency rate, into the section."""
    for state in states:
        section.stacks[state.name] = {
            "stopped": state.stopped,
            "headline": schema.to_data(curves.headline(state.points, slos)),
            "host_saturated_rates": host_saturated_rates(state.points),
        }
    section.added_latency = schema.to_data(
        curves.added_latency(section.points, section.added_latency_bound_ms)
    )


def host_saturated_rates(points: Sequence[SummaryRow]) -> list[float]:
    """The rates at which most repeats ran with every core of the host near full."""
    rates = sorted({p.offered_rate for p in points})
    return [
        r
        for r in rates
        if sum(p.host_saturated for p in points if p.offered_rate == r)
        > sum(p.offered_rate == r for p in points) / 2
    ]


def headline_table(section: SweepSection) -> str:
    """The headline figures as text, one stack per block."""
    lines = [
        f"sweep of {section.profile} ({section.mode}, {section.repeats} repeat(s) per rate); "
        f"SLOs: {', '.join(str(schema.from_data(Slo, s)) for s in section.slos) or 'none'}"
    ]
    for name, data in section.stacks.items():
        figures = schema.from_data(dict[str, curves.Interval], data["headline"])
        lines.append(
            f"{name:<10} max goodput {figures['max_goodput'].text('.2f', 'req/s')}; "
            f"knee {figures['knee'].text('.2f', 'req/s')}; "
            f"highest within SLOs {figures['highest_within_slos'].text('.4g', 'req/s')}"
        )
        if data.get("stopped"):
            lines.append(f"{'':<10} stopped: {data['stopped']}")
        busy = data.get("host_saturated_rates") or []
        if busy:
            lines.append(
                f"{'':<10} host CPU saturated at {', '.join(f'{r:.4g}' for r in busy)} req/s: "
                "there the latency measures the stacks and the loader fighting for the cores"
            )
    added = section.added_latency
    if added and {curves.ZEROLAYER, curves.BASELINE} <= set(section.stacks):
        rate = schema.from_data(curves.Interval, added["rate"])
        lines.append(
            f"baseline's median E2EL passes the zero-layer's + {added['bound_ms']:g} ms at "
            f"{rate.text('.2f', 'req/s')}"
        )
    return "\n".join(lines)


POINT_COLUMNS: Final = (
    Column("stack", align=Align.LEFT, width=10),
    *(Column(h, width=w) for h, w in (("rate", 7), ("rep", 3), ("done", 5), ("err", 4),
      ("lost", 4), ("TTFT p99", 9), ("E2EL p50", 9), ("E2EL p99", 9), ("good/s", 7),
      ("req/s", 7), ("SLO", 4), ("host%", 5))),
    Column("note", align=Align.LEFT),
)  # fmt: skip


def points_table(section: SweepSection) -> str:
    """Every point as text, stack by stack, in rate order."""
    body = [
        [p.stack, f"{p.offered_rate:.2f}", str(p.repeat), str(p.completed), str(p.errors),
         str(p.lost), fmt(p.stat("p99_ttft_ms")), fmt(p.stat("median_e2el_ms")),
         fmt(p.stat("p99_e2el_ms")), f"{p.request_goodput:.2f}", f"{p.request_throughput:.2f}",
         _slo_cell(p), fmt(p.host_cpu_pct, ".0f"), _note(p)]
        for name in dict.fromkeys(p.stack for p in section.points)
        for p in section.stack_points(name)
    ]  # fmt: skip
    return text_table(POINT_COLUMNS, body, rule=True)


def _slo_cell(row: SummaryRow) -> str:
    return "-" if row.slo_met is None else ("yes" if row.slo_met else "NO")


def _note(row: SummaryRow) -> str:
    notes = []
    if row.loader_limited:
        notes.append("INVALID (loader lagged)")
    elif not row.valid:
        notes.append("invalid: " + "; ".join(row.invalid_reasons))
    if row.saturated:
        notes.append("saturated")
    if row.host_saturated:
        notes.append("host CPU saturated")
    return ", ".join(notes)


def _rates(config: SweepConfig, profile: Profile, capacity: Capacity) -> list[float]:
    if config.rates:
        return sorted(set(config.rates))
    return default_rates(profile, capacity, config.max_points)


def _run_stacks(sweeper: Sweeper, rates: Sequence[float], states: list[StackSweep]) -> None:
    """Stand every stack up and sweep them: the grid with the stacks interleaved, or one
    stack's bisection after another (its rates depend on its own answers); tear them down."""
    config = sweeper.config
    with stacks_up(config.run.stacks, config.run, sweeper.run, sweeper.tele) as stacks:
        check_parity(stacks, config.run.allow_mismatch, sweeper.run)  # before any load
        states.extend(StackSweep(stack.name.value) for stack in stacks)
        if not config.adaptive:
            sweeper.grid(stacks, states, rates)
            return
        for stack, state in zip(stacks, states, strict=True):
            sweeper.adaptive(stack, state, rates[0], rates[-1])


def _finish(
    run: RunDir, section: SweepSection, states: list[StackSweep], slos: Sequence[Slo]
) -> None:
    summarise(section, states, slos)
    run.save_sweep()
    if section.points:
        print(points_table(section), flush=True)
        print(headline_table(section), flush=True)


def sweep(config: SweepConfig) -> int:
    """Run the sweep; returns the exit status (130 when interrupted, 143 on SIGTERM)."""
    profile = load_profiles(config.run)[0]
    if profile.fault is not None:
        raise UsageError(f"{profile.name} injects faults; sweep a load profile instead")
    if profile.elasticity is not None:
        raise UsageError(
            f"{profile.name} scales the stacks under load; sweep a load profile instead"
        )
    if profile.workload.source is WorkloadSource.TRACE:
        raise UsageError(
            "a trace replays at its own timing, so every rate would send the same requests; "
            "run it with zl-bench run (trace:PATH@SCALE to speed it up or slow it down)"
        )
    if config.point_duration_s is not None:
        profile = replace(profile, sweep_duration_s=config.point_duration_s)
    if config.run.repeats is not None:
        profile = replace(profile, sweep_repeats=config.run.repeats)
    check_external(config.run)
    placement = check_cluster_options(
        config.run.ray_address, config.run.placement, config.run.loader_workers, config.run.loader
    )
    capacity = capacity_preflight([profile], config.run)[profile.name]
    rates = _rates(config, profile, capacity)
    with on_cluster(config.run.ray_address, placement) as cluster:
        return _sweep_on(config, profile, capacity, rates, cluster)


def _sweep_on(
    config: SweepConfig,
    profile: Profile,
    capacity: Capacity,
    rates: Sequence[float],
    cluster: ClusterSession | None,
) -> int:
    """The sweep itself, on this host or placed on ``cluster``."""
    run = open_run(config.run, [profile], choose_token_rule(config.run, [profile]), kind="sweep")
    record_cluster(cluster, run)
    run.sweep = SweepSection(
        profile=profile.name,
        scale=config.run.scale,
        mode="adaptive" if config.adaptive else "grid",
        slos=schema.to_data(list(profile.slos)),
        rates=list(rates),
        repeats=profile.sweep_repeats,
        resolution=config.resolution if config.adaptive else None,
        added_latency_bound_ms=config.added_latency_ms,
        capacity_rps=capacity.requests_per_s,
    )
    run.meta.profiles[profile.name] = {**profile.as_dict(), "capacity": capacity.as_dict()}
    run.save_sweep()
    run.save()
    say(f"sweep {run.meta.run_id} -> {run.path}; {host_line(run)}")
    say(f"rates {', '.join(f'{r:g}' for r in rates)} req/s, {profile.sweep_repeats} repeat(s) each")
    return _execute(config, profile, rates, run)


def _execute(config: SweepConfig, profile: Profile, rates: Sequence[float], run: RunDir) -> int:
    assert run.sweep is not None
    states: list[StackSweep] = []
    started = time.monotonic()
    try:
        with until_stopped(run) as ending, sampling(run, config.run.telemetry_interval_s) as tele:
            _run_stacks(Sweeper(config, profile, run, tele), rates, states)
    except BaseException:
        _finish(run, run.sweep, states, profile.slos)
        raise
    if ending.stopped:
        say(f"{ending.verb}: keeping the points measured")
    _finish(run, run.sweep, states, profile.slos)
    say(f"sweep took {time.monotonic() - started:.0f} s")
    render(run)
    file_run(run.path)
    return ending.status


def _rate_list(text: str) -> tuple[float, ...]:
    try:
        rates = tuple(float(item) for item in text.split(",") if item.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated rates, got {text!r}") from None
    if not rates or any(not (r > 0 and math.isfinite(r)) for r in rates):
        raise argparse.ArgumentTypeError(f"rates must be positive req/s, got {text!r}")
    return rates


def _profile(text: str) -> str:
    try:
        return resolve_name(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``zl-bench sweep``'s arguments: the profile and the rates, then those of ``run``."""
    parser.add_argument(
        "--profile",
        type=_profile,
        default=PROFILES[0],
        help="the load profile to sweep, from "
        + ", ".join(p for p in PROFILES if p not in ("d_fault", "g_elasticity")),
    )
    parser.add_argument(
        "--rates",
        type=_rate_list,
        default=(),
        help="comma-separated offered rates (req/s); default: placed from the capacity preflight",
    )
    parser.add_argument(
        "--adaptive",
        action="store_true",
        help="bisect for the highest rate within the SLOs instead of running a grid",
    )
    parser.add_argument(
        "--resolution",
        type=open_fraction,
        default=DEFAULT_RESOLUTION,
        help="--adaptive stops when the bracket is this fraction of the rate",
    )
    parser.add_argument(
        "--added-latency-ms",
        type=positive_float,
        default=DEFAULT_ADDED_LATENCY_MS,
        help="report the rate at which the baseline's median E2EL passes the zero-layer's by this",
    )
    parser.add_argument(
        "--point-duration-s",
        type=positive_float,
        default=None,
        help="seconds of load per point (default: the profile's sweep_duration_s at the scale)",
    )
    add_stack_arguments(parser)


def run_command(args: argparse.Namespace) -> int:
    """Build the SweepConfig from the command line and sweep."""
    config = SweepConfig(
        run=config_from(args, (args.profile,)),
        profile=args.profile,
        rates=tuple(args.rates),
        adaptive=args.adaptive,
        resolution=args.resolution,
        added_latency_ms=args.added_latency_ms,
        point_duration_s=args.point_duration_s,
    )
    return sweep(config)
