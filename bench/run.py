"""``zl-bench run``: stand each stack up, run every profile on it, sample, save, report.

Stacks run one after the other on the same machine (never at once: on 2 cores they would steal
each other's CPU), each profile with the same seeded schedule on both; profile D runs the chaos
experiments on the very stack the other profiles used, before it is torn down. Everything is
written as it happens, so a run cut short by SIGINT still leaves a directory that
``zl-bench report`` renders, marked incomplete; run.json records how the run really ended.

``--auth`` is the production-like mode: the run writes a key file with one fresh key per tenant
its profiles use (each allowed the most urgent class that tenant is sent with) into the run
directory, both stacks start with it (``--api-keys``) and every loader (profile D's chaos load
too) sends each request with its tenant's key; ``config.auth`` in run.json and each stack's
``auth`` say it was on.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import signal
import subprocess
import time
import urllib.parse
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import orjson
import psutil

from baselines.rayserve.config import BASELINE_ROUTERS, BaselineRouter, parse_router
from harness import schema
from harness.capacity import Capacity, preflight
from harness.datasets import describe_workload
from harness.errors import UsageError
from harness.loaders import LOADERS, LoadResult, ProgressStyle, loader_with, needs_tls
from harness.metrics import (
    PrefixCacheStats,
    Slo,
    TurnStats,
    goodput,
    override_slos,
    parse_slo_option,
    prefix_cache_stats,
    summarize,
)
from harness.profile import (
    PROFILES,
    SCALES,
    WORKLOAD_OPTION_HELP,
    Profile,
    WorkloadChoice,
    WorkloadSource,
    load_profile,
    parse_workload_option,
    resolve_name,
)
from harness.schema import RunEnd, RunMeta, SummaryRow, SweepSection
from harness.stacks import (
    ALL_STACKS,
    STACKS,
    Credentials,
    Stack,
    StackName,
    StackSpec,
    StackUnreachable,
    check_spec,
    stand_up,
)
from harness.telemetry import (
    Component,
    EngineSource,
    EngineTarget,
    HostCpu,
    NvmlSource,
    PhaseLog,
    ProcessSource,
    Sampler,
    cpu_speed,
    measure_host_cpu,
)
from harness.telemetry.engine import named_reads, phase_rows
from harness.tokens import (
    BYTES_RULE,
    TokenRule,
    class_fits,
    context_length,
    fit_classes,
    token_rule,
)
from harness.workload import WorkloadSchedule, build_schedule
from serving.auth import write_key_file
from serving.cliargs import positive_int
from serving.engine import ENGINES
from serving.engine.options import add_engine_option, validate_engine_options
from serving.wire.contract import PRIORITIES

FAULT_PROFILE = "d_fault"
LOADER_NICE = -5
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143
WARM_TIMEOUT_S = 120.0
KEY_FILE = "api-keys.toml"
PACKAGES = ("h2", "h11", "hpack", "uvloop", "ray", "chaostoolkit-lib", "locust", "k6", "numpy")


@dataclass(frozen=True)
class RunConfig:
    """What a run was asked to do; saved verbatim in run.json."""

    scale: str = "laptop"
    profiles: tuple[str, ...] = PROFILES
    stacks: tuple[StackName, ...] = tuple(StackName(s) for s in STACKS)
    engine: str = "sim"
    engine_options: dict[str, Any] = field(default_factory=dict)
    replicas: int = 2
    loader: str = "native"
    out: str = "results"
    seed: int | None = None
    zerolayer_urls: tuple[str, ...] = ()
    baseline_url: str = ""
    ray_address: str | None = None
    baseline_router: BaselineRouter | None = None  # None: each baseline's own default
    telemetry_interval_s: float = 0.25
    slos: tuple[Slo, ...] = ()
    quiet: bool = False
    auth: bool = False
    workload: WorkloadChoice | None = None  # --workload: every profile's source replaced

    def spec(self, name: StackName, credentials: Credentials | None = None) -> StackSpec:
        """The stack to stand up for ``name``: external when URLs were given for it; with
        ``credentials`` (``--auth``) started with their key file."""
        urls = self.zerolayer_urls if name is StackName.ZEROLAYER else ()
        if name is StackName.BASELINE and self.baseline_url:
            urls = (self.baseline_url,)
        return StackSpec(
            name=name,
            engine=self.engine,
            engine_options=self.engine_options,
            replicas=self.replicas,
            tls=needs_tls(self.loader, name),
            urls=tuple(urls),
            ray_address=self.ray_address,
            baseline_router=self.baseline_router,
            credentials=credentials,
        )


def tenant_classes(profiles: Sequence[Profile]) -> dict[str, str]:
    """Each tenant the profiles send as, with the most urgent class it is sent with: the grant
    of its key under ``--auth`` (every tenant of a profile sends every class of that profile)."""
    grants: dict[str, str] = {}
    for profile in profiles:
        for tenant in profile.tenants:
            sent = [c.priority for c in profile.classes] + [grants.get(tenant, "low")]
            grants[tenant] = min(sent, key=PRIORITIES.__getitem__)
    return grants


def make_credentials(profiles: Sequence[Profile], folder: Path) -> Credentials:
    """A key file in ``folder`` with a fresh key per tenant of ``profiles`` (``--auth``)."""
    path = folder / KEY_FILE
    return Credentials(path, write_key_file(path, tenant_classes(profiles)))


def say(message: str) -> None:
    print(f"[zl-bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


def _git_revision() -> str:
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=here,
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain"], capture_output=True, text=True, check=False, cwd=here
        ).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


def _machine() -> dict[str, Any]:
    """The host, with one core's speed (``cpu_speed``) as the run starts; the run's end adds
    ``cpu_speed_end``."""
    return {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "memory_bytes": psutil.virtual_memory().total,
        "cpu_speed_start": round(cpu_speed()),
    }


class RunDir:
    """The results directory: run.json rewritten at every change of state, summary.json after
    every row and every sweep point. ``rule`` is the run's token rule (``choose_token_rule``):
    every schedule is built with it, and run.json records its name as ``token_rule``."""

    def __init__(self, config: RunConfig, kind: str = "", rule: TokenRule = BYTES_RULE) -> None:
        run_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{config.scale}" + (f"-{kind}" if kind else "")
        self.path = Path(config.out) / run_id
        self.path.mkdir(parents=True, exist_ok=False)
        self.rule = rule
        self.summary: list[SummaryRow] = []
        self.sweep: SweepSection | None = None
        # --auth: the key file in this directory and each tenant's key (see the module docstring)
        self.credentials: Credentials | None = None
        self.meta = RunMeta(
            run_id=run_id,
            scale=config.scale,
            config=orjson.loads(orjson.dumps(asdict(config), default=str)),
            engine=config.engine,
            engine_options=dict(config.engine_options),
            git_revision=_git_revision(),
            versions=_versions(),
            machine=_machine(),
            started_ns=time.time_ns(),
            other={"token_rule": rule.name},
        )
        self.save()

    def save(self) -> None:
        schema.write_run_meta(self.path, self.meta)

    def add_summary(self, row: SummaryRow) -> None:
        self.summary.append(row)
        self.meta.validity[f"{row.stack}/{row.profile}"] = row.validity
        schema.write_summary(self.path, self.summary, self.sweep)
        self.save()

    def save_sweep(self) -> None:
        """summary.json with the sweep section as it stands (after every point)."""
        schema.write_summary(self.path, self.summary, self.sweep)

    def finish(self, end: RunEnd, detail: str = "") -> None:
        self.meta.end, self.meta.end_detail = end, detail
        self.meta.finished_ns = time.time_ns()
        self.meta.machine["cpu_speed_end"] = round(cpu_speed())
        self.save()


class Telemetry:
    """The sampler and its engine and process sources, fed each stack while it is up."""

    def __init__(self, run: RunDir, interval_s: float) -> None:
        self.phases = PhaseLog(run.path / schema.PHASES)
        self.path = run.path / schema.TELEMETRY
        self.engines, self.procs = EngineSource(), ProcessSource()
        self.procs.add(Component("loader", os.getpid(), "loader"))
        self.watched: dict[str, list[EngineTarget]] = {}
        self.sampler = Sampler(
            [NvmlSource(), self.engines, self.procs],
            run.path / schema.TELEMETRY,
            interval_s,
            self.phases,
        )

    def start(self) -> dict[str, Any]:
        self.sampler.open()
        self.sampler.start()
        return self.sampler.describe()

    def watch(self, stack: Stack) -> None:
        self.watched[stack.name] = stack.engine_targets()
        for target in self.watched[stack.name]:
            self.engines.add(target)
        for role, pids in stack.pids().items():
            for i, pid in enumerate(pids):
                self.procs.add(Component(f"{stack.name}-{role}-{i}", pid, role, stack.name))

    def last_reads(self, stack: Stack) -> dict[str, dict[str, Any]]:
        """Each engine's counters read once more after the last request (the sampler's last
        tick may predate it), so per-replica totals such as ``requests_total`` are final."""
        reads: dict[str, dict[str, Any]] = {}
        for target in self.watched.get(stack.name, []):
            try:
                reads[target.name] = target.read()
            except Exception as exc:  # a replica that is gone is recorded, not fatal
                reads[target.name] = {"error": f"{type(exc).__name__}: {exc}"}
        return reads

    def prefix_cache(
        self, stack: Stack, phase: str, before: dict[str, dict[str, Any]], completed: int
    ) -> PrefixCacheStats:
        """The stack's prefix-cache counters over one phase: each replica read just before it
        (``before``), sampled during it, and read once more now, summed over replicas."""
        samples = [
            *named_reads(before),
            *phase_rows(self.path, stack.name, phase),
            *named_reads(self.last_reads(stack)),
        ]
        return prefix_cache_stats(samples, completed)

    def unwatch(self, stack: Stack) -> None:
        self.watched.pop(stack.name, None)
        self.engines.drop_stack(stack.name)

    def stop(self) -> None:
        self.sampler.stop()
        self.phases.close()


@contextlib.contextmanager
def _loader_priority() -> Iterator[None]:
    """Run the loader thread at a higher CPU priority than the stack it drives.

    The loader shares the cores with the stack under test; a load generator that the stack can
    starve measures its own lag, not the server. Niceness is per thread on Linux and inherited by
    children, so it is raised only around the loader's own run (the stacks are already up) and
    restored afterwards. Without the privilege the run goes on at normal priority and says so.
    """
    before = os.getpriority(os.PRIO_PROCESS, 0)
    try:
        os.setpriority(os.PRIO_PROCESS, 0, LOADER_NICE)
    except PermissionError:
        yield
        return
    try:
        yield
    finally:
        os.setpriority(os.PRIO_PROCESS, 0, before)


def loader_nice() -> int:
    """The niceness the loader will run at: LOADER_NICE where this process may raise its
    priority, else the niceness it already has (the run goes on and records so)."""
    before = os.getpriority(os.PRIO_PROCESS, 0)
    try:
        os.setpriority(os.PRIO_PROCESS, 0, LOADER_NICE)
    except PermissionError:
        return before
    os.setpriority(os.PRIO_PROCESS, 0, before)
    return LOADER_NICE


def summary_row(result: LoadResult, profile: Profile, offered: float, host: HostCpu) -> SummaryRow:
    """A loader's result as its summary.json row: what went on the wire and its extras, the
    profile's SLOs (goodput, ``slo_met``), the rate its schedule was built for (``offered``: the
    same for every stack and repeat at a sweep point) and the host's CPU."""
    fields = goodput(result.records, result.summary["duration"], result.summary, profile.slos)
    row = SummaryRow.from_dict(
        {**result.summary, **fields, "stack": result.stack, "profile": result.profile}
    )
    row.loader = result.loader
    row.loader_protocol = result.protocol
    row.ttft_is_first_byte = result.ttft_is_first_byte
    row.loader_extra = dict(result.extra)
    row.offered_rate = offered
    for key, value in host.row_fields().items():
        setattr(row, key, value)
    return row


def drive(
    loader: str,
    quiet: bool,
    schedule: WorkloadSchedule,
    stack: Stack,
    profile: Profile,
    records: Path,
    workdir: Path,
) -> SummaryRow:
    """One schedule through the loader at raised priority, measuring the host's CPU around it."""
    with measure_host_cpu() as host, _loader_priority():
        chosen = loader_with(loader, progress=ProgressStyle.QUIET if quiet else ProgressStyle.AUTO)
        result = chosen.run(schedule, stack, profile, records, workdir)
    return summary_row(result, profile, nominal_rate(profile, schedule), host[0])


def nominal_rate(profile: Profile, schedule: WorkloadSchedule) -> float:
    """The rate a schedule was built for: the profile's (a sweep point's) for a synthetic
    workload; for a file or generated sessions, what the schedule really offers (a trace keeps
    its own timing, and late sessions lose the turns past the end)."""
    if profile.workload.source is WorkloadSource.SYNTHETIC:
        return profile.rate
    return schedule.offered_rate()


def _fmt_ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def choose_token_rule(config: RunConfig, profiles: Sequence[Profile]) -> TokenRule:
    """The rule the run's engine counts prompts by (``harness.tokens.token_rule``), checked
    before the run starts: a tokenizer that does not load, or a class whose output leaves its
    prompt no room in the engine's context, is the user's mistake. Under a tokenizer, says how
    each synthetic class's prompt is resized to keep its token count."""
    try:
        rule = token_rule(config.engine, config.engine_options)
        if rule is not BYTES_RULE:
            context = context_length(config.engine_options)
            fits = [fit for p in profiles for fit in class_fits(p, rule, context)]
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    if rule is not BYTES_RULE:
        for fit in fits:
            say(fit.line())
    return rule


def workload_stats(profile: Profile, rule: TokenRule) -> dict[str, Any]:
    """run.json's ``workload_stats`` for a profile replaying a file: the file's own input and
    output length distribution under the run's rule, so the report can set the replayed
    requests' beside it (nothing for a generated workload)."""
    try:
        stats = describe_workload(profile, rule)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    if stats is None:
        return {}
    return {
        "workload_stats": {
            "source": stats.source,
            "path": stats.path,
            "sha256": stats.sha256,
            "rule": stats.rule,
            "input": stats.input_tokens.to_dict(),
            "output": stats.output_tokens.to_dict(),
        }
    }


def schedule_for(
    profile: Profile, rule: TokenRule, engine_options: dict[str, Any], run_tag: str = ""
) -> WorkloadSchedule:
    """The profile's seeded schedule under the run's token rule; under a tokenizer, each
    synthetic class's prompt bytes are first resized to give its token count
    (``harness.tokens.fit_classes``, as ``zl-bench fidelity`` does)."""
    if rule is not BYTES_RULE:
        profile = fit_classes(profile, rule, context_length(engine_options))
    return build_schedule(profile, run_tag, rule=rule)


def _run_load_profile(
    profile: Profile, stack: Stack, config: RunConfig, run: RunDir, tele: Telemetry
) -> SummaryRow:
    """One non-fault profile on one stack through the configured loader."""
    schedule = schedule_for(profile, run.rule, config.engine_options)
    say(
        f"{stack.name} / {profile.name}: {len(schedule)} requests, "
        f"{nominal_rate(profile, schedule):.3g} req/s for {profile.duration_s:g} s "
        f"({profile.workload.source.value} workload, {config.loader} loader)"
    )
    records = run.path / schema.requests_file(stack.name, profile.name)
    workdir = run.path / "loader" / f"{stack.name}-{profile.name}"
    phase = f"{stack.name}/{profile.name}"
    before = tele.last_reads(stack)
    tele.phases.begin(phase, stack=stack.name, profile=profile.name)
    try:
        row = drive(config.loader, config.quiet, schedule, stack, profile, records, workdir)
    finally:
        tele.phases.end()
    row.prefix_cache = tele.prefix_cache(stack, phase, before, row.completed).to_dict()
    run.add_summary(row)
    say(f"{stack.name} / {profile.name}: {row_outcome(row)}")
    if turns := turns_outcome(row):
        say(f"{stack.name} / {profile.name}: {turns}")
    return row


def row_outcome(row: SummaryRow) -> str:
    """One line on what a row measured, and what makes it doubtful."""
    text = (
        f"{row.completed} completed, {row.errors} errors, {row.lost} lost, E2EL p50 "
        f"{_fmt_ms(row.stat('median_e2el_ms'))} ms, goodput {row.request_goodput:.2f} req/s"
    )
    if row.slo_met is not None:
        text += ", within SLOs" if row.slo_met else ", SLOs missed"
    if row.host_cpu_pct is not None:
        text += f", host CPU {row.host_cpu_pct:.0f} %"
    if row.host_saturated:
        text += " (HOST SATURATED)"
    if row.saturated:
        text += f" SATURATED: {'; '.join(row.saturation_reasons)}"
    if not row.valid:
        text += f" INVALID: {'; '.join(row.invalid_reasons)}"
    return text


def turns_outcome(row: SummaryRow) -> str:
    """For a multi-turn profile, one line: TTFT p50 by turn and the prefix cache's hit rate
    and prefilled tokens per request ("n/a" where the engines reported none); else empty."""
    turns = [TurnStats.from_dict(t) for t in row.by_turn]
    if not turns:
        return ""
    cache = PrefixCacheStats.from_dict(row.prefix_cache)
    ttft = ", ".join(f"{t.turn}: {_fmt_ms(t.p50_ttft_ms)}" for t in turns)
    rate = "n/a" if cache.hit_rate is None else f"{cache.hit_rate:.1%}"
    prefilled = cache.prefilled_per_request
    return (
        f"TTFT p50 by turn (ms) {ttft}; prefix-cache hit rate {rate}, prefilled tokens per "
        f"request {'n/a' if prefilled is None else f'{prefilled:.0f}'}"
    )


def _run_fault_profile(profile: Profile, stack: Stack, run: RunDir, tele: Telemetry) -> None:
    """Profile D: every chaos experiment on this very stack (same engine, options, replicas)."""
    from bench.report.data import append_recovery
    from chaos.runner import run_profile_d, table

    if stack.external:
        say(f"{stack.name} / {profile.name}: skipped, faults need a stack this run started")
        return
    if stack.name.value not in STACKS:
        say(
            f"{stack.name} / {profile.name}: skipped, faults are defined for the zero-layer and "
            "baseline stacks"
        )
        return
    say(f"{stack.name} / {profile.name}: chaos experiments under profile A's load")
    rows = run_profile_d(stack, profile, run.path, tele.phases)
    print(table(rows), flush=True)
    append_recovery(run.path, list(rows))
    logs = sorted(
        (run.path / schema.CHAOS_DIR).glob(f"requests-{stack.name}-{profile.name}-*.jsonl")
    )
    records = [rec for path in logs for rec in schema.read_requests(path)]
    row = SummaryRow.from_dict(
        {"stack": stack.name, "profile": profile.name, "loader": "native"}
        | summarize(records, slos=profile.slos)
    )
    row.loader_protocol = "h2" if stack.protocol == "h2" else "http/1.1"
    run.add_summary(row)
    say(
        f"{stack.name} / {profile.name}: {len(rows)} experiments, {row.lost} lost, "
        f"{row.errors} errors"
    )


async def _warm_requests(stack: Stack, count: int) -> list[bool]:
    async with stack.open_client() as client:
        done = await asyncio.gather(
            *(
                client.complete(prompt=f"warm-up {i}", max_tokens=2, session=f"warm-{i}")
                for i in range(count)
            ),
            return_exceptions=True,
        )
    return [not isinstance(d, BaseException) and d.timing.status == 200 for d in done]


def warm(stack: Stack) -> None:
    """A few short requests before any profile (two per engine replica, spread by session), so
    that no stack's lazy start-up (first connections, an engine's first steps) is measured as
    its latency. Bounded; a stack that cannot answer them is reported, and the run goes on."""
    started = time.monotonic()
    count = 2 * stack.spec.replicas
    try:
        ok = asyncio.run(asyncio.wait_for(_warm_requests(stack, count), WARM_TIMEOUT_S))
    except TimeoutError:
        say(f"{stack.name}: warm-up requests unanswered after {WARM_TIMEOUT_S:g} s")
        return
    failed = f", {ok.count(False)} failed" if not all(ok) else ""
    took = time.monotonic() - started
    say(f"{stack.name}: warmed up with {count} requests in {took:.1f} s{failed}")


def _run_stack(
    name: StackName, profiles: Sequence[Profile], config: RunConfig, run: RunDir, tele: Telemetry
) -> None:
    """Stand one stack up, run every profile on it (profile D last), tear it down."""
    spec = config.spec(name, run.credentials)
    say(f"standing up {name} ({config.engine} engine, {config.replicas} replicas)")
    with stand_up(spec, run.path / f"stack-{name}") as stack:
        run.meta.stacks[name.value] = {
            **stack.metadata,
            "urls": stack.urls,
            "request_body_fields": stack.body_fields(),
        }
        run.save()
        if not stack.external:
            warm(stack)
        tele.watch(stack)
        try:
            for profile in profiles:
                if profile.fault is None:
                    _run_load_profile(profile, stack, config, run, tele)
            for profile in profiles:
                if profile.fault is not None:
                    _run_fault_profile(profile, stack, run, tele)
        finally:
            say(f"tearing down {name}")
            run.meta.stacks[name.value]["engines_at_teardown"] = tele.last_reads(stack)
            run.save()
            tele.unwatch(stack)


def _summary_table(rows: Sequence[SummaryRow]) -> str:
    head = (
        f"{'stack':<10} {'profile':<20} {'done':>6} {'err':>5} {'lost':>5} "
        f"{'TTFT p50':>9} {'E2EL p50':>9} {'E2EL p99':>9} {'E2EL std':>9} {'req/s':>7} "
        f"{'good/s':>7} {'host%':>5} valid"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        ttft = _fmt_ms(r.stat("median_ttft_ms")) + ("*" if r.ttft_is_first_byte else "")
        stats = (r.stat(k) for k in ("median_e2el_ms", "p99_e2el_ms", "std_e2el_ms"))
        cells = " ".join(f"{_fmt_ms(v):>9}" for v in stats)
        lines.append(
            f"{r.stack:<10} {r.profile:<20} {r.completed:>6} {r.errors:>5} {r.lost:>5} "
            f"{ttft:>9} {cells} {r.request_throughput:>7.2f} {r.request_goodput:>7.2f} "
            f"{_fmt_pct(r.host_cpu_pct):>5} "
            f"{'yes' if r.valid else 'NO: ' + '; '.join(r.invalid_reasons)}"
        )
    if any(r.ttft_is_first_byte for r in rows):
        lines.append("* time to first byte: this loader cannot see tokens as they stream")
    lines.extend(_host_note(rows))
    return "\n".join(lines)


def _fmt_pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _host_note(rows: Sequence[SummaryRow]) -> list[str]:
    """The warning under a table where the host's cores were all near full in some phase."""
    busy = [f"{r.stack}/{r.profile}" for r in rows if r.host_saturated]
    if not busy:
        return []
    return [
        f"host CPU saturated during {', '.join(busy)}: these latencies measure the stacks' "
        "processes and the loader fighting for the cores, not the stacks' design"
    ]


def check_external(config: RunConfig) -> None:
    """Every stack's spec must be one it can serve (vllm-serve needs the vllm engine) and every
    external stack must answer, before anything is started or any load is sent."""
    if config.auth and (config.zerolayer_urls or config.baseline_url):
        raise UsageError("--auth starts the stacks with a fresh key file: not for running stacks")
    for name in config.stacks:
        spec = config.spec(name)
        try:
            check_spec(spec)
        except ValueError as exc:
            raise UsageError(str(exc)) from exc
        if not spec.urls:
            continue
        try:
            stand_up(spec, Path(config.out)).close()
        except StackUnreachable as exc:
            raise UsageError(str(exc)) from exc


def capacity_preflight(profiles: Sequence[Profile], config: RunConfig) -> dict[str, Capacity]:
    """The capacity preflight per profile; external stacks' capacity is unknown."""
    external = bool(config.zerolayer_urls or config.baseline_url)
    return {
        p.name: preflight(p, config.engine, config.replicas, config.engine_options, external)
        for p in profiles
    }


def render(run: RunDir) -> None:
    from bench.report import html

    say("rendering report")
    report = html.render(run.path)
    if run.summary:
        print(_summary_table(run.summary), flush=True)
        for name, label in run.meta.stack_labels().items():
            print(f"{name}: {label}", flush=True)
    say(f"report: {report}")


def _execute(config: RunConfig, profiles: Sequence[Profile], run: RunDir) -> None:
    tele = Telemetry(run, config.telemetry_interval_s)
    try:
        run.meta.telemetry = tele.start()
        run.save()
        for name in config.stacks:
            _run_stack(name, profiles, config, run, tele)
    finally:
        tele.stop()


@contextlib.contextmanager
def stop_signals(seen: list[int]) -> Iterator[None]:
    """SIGINT and SIGTERM both stop the run cleanly: its stacks are stopped and what it measured
    is kept. SIGINT gets Python's own handler even where it was inherited ignored (a shell starts
    background jobs so); SIGTERM (whose default would leave the stacks running) is noted in
    ``seen`` and turned into SIGINT, which asyncio's runner and the loaders handle."""

    def on_sigterm(signum: int, frame: object) -> None:
        seen.append(signum)
        signal.raise_signal(signal.SIGINT)

    previous = {
        signal.SIGINT: signal.signal(signal.SIGINT, signal.default_int_handler),
        signal.SIGTERM: signal.signal(signal.SIGTERM, on_sigterm),
    }
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def host_line(run: RunDir) -> str:
    """The host in a few words: cores and one core's speed (``cpu_speed``) as the run starts."""
    machine = run.meta.machine
    return (
        f"host: {machine.get('cpus')} CPUs, one core at {machine.get('cpu_speed_start', 0):,} "
        "SHA-256 digests/s"
    )


def load_profiles(config: RunConfig) -> list[Profile]:
    """The profiles asked for, at the run's scale and seed, with the command line's SLOs over
    each profile's own."""
    try:
        profiles = [load_profile(name, config.scale, config.seed) for name in config.profiles]
        if config.workload is not None:
            profiles = [p.with_workload(config.workload) for p in profiles]
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    return [p.with_slos(override_slos(p.slos, config.slos)) for p in profiles]


def run(config: RunConfig) -> int:
    """Run the bench; returns the exit status (130 when interrupted).

    Everything a user can get wrong (profiles, engine options, unreachable URLs) is checked
    before the results directory is made. A crash is recorded in run.json and re-raised.
    """
    profiles = load_profiles(config)
    check_external(config)
    capacities = capacity_preflight(profiles, config)
    rule = choose_token_rule(config, profiles)
    run = RunDir(config, rule=rule)
    if config.auth:
        run.credentials = make_credentials(profiles, run.path)
    run.meta.loader_nice = loader_nice()
    say(f"run {run.meta.run_id} -> {run.path}; {host_line(run)}")
    for profile in profiles:
        run.meta.profiles[profile.name] = {
            **profile.as_dict(),
            "capacity": capacities[profile.name].as_dict(),
            **workload_stats(profile, rule),
        }
    run.save()
    status = 0
    terminated: list[int] = []
    try:
        with stop_signals(terminated):
            _execute(config, profiles, run)
        run.finish(RunEnd.COMPLETE)
    except KeyboardInterrupt:
        end, status = (
            (RunEnd.SIGTERM, EXIT_TERMINATED) if terminated else (RunEnd.SIGINT, EXIT_INTERRUPTED)
        )
        detail = f"{'stopped' if terminated else 'interrupted'} by {end.value.upper()}"
        say(f"{detail}: keeping what was measured")
        run.finish(end, detail)
    except BaseException as exc:
        run.finish(RunEnd.ERROR, f"{type(exc).__name__}: {exc}")
        with contextlib.suppress(Exception):
            render(run)
        raise
    render(run)
    return status


def _csv(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def _profile_name(item: str) -> str:
    """A profile by name (``a``, ``a_latency``), or a profile TOML of the user's own by path
    (it may ``extends`` a shipped one)."""
    if item.endswith(".toml"):
        path = Path(item).expanduser()
        if not path.is_file():
            raise ValueError(f"profile file {item!r} does not exist")
        return str(path.resolve())
    return resolve_name(item)


def _profiles(text: str) -> tuple[str, ...]:
    try:
        names = [_profile_name(item) for item in _csv(text)]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not names:
        raise argparse.ArgumentTypeError("no profile given")
    return tuple(dict.fromkeys(names))


def _stacks(text: str) -> tuple[StackName, ...]:
    names = _csv(text)
    unknown = [n for n in names if n not in ALL_STACKS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown stack(s) {', '.join(unknown) or '(none given)'}; choose from "
            f"{', '.join(ALL_STACKS)}"
        )
    return tuple(dict.fromkeys(StackName(n) for n in names))


def check_url(text: str) -> str:
    """An http(s) URL with a host and, if given, a port in 1-65535; the text without a
    trailing slash. Raises argparse.ArgumentTypeError naming what is wrong."""
    parts = urllib.parse.urlsplit(text.strip())
    if parts.scheme not in ("http", "https"):
        raise argparse.ArgumentTypeError(f"{text!r}: the scheme must be http or https")
    if not parts.hostname:
        raise argparse.ArgumentTypeError(f"{text!r}: no host")
    try:
        port = parts.port
    except ValueError:
        port = -1
    if port is not None and not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r}: the port must lie in 1-65535")
    return text.strip().rstrip("/")


def _urls(text: str) -> tuple[str, ...]:
    return tuple(check_url(item) for item in _csv(text))


def _slo(text: str) -> Slo:
    try:
        return parse_slo_option(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _workload(text: str) -> WorkloadChoice:
    try:
        return parse_workload_option(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _router(text: str) -> BaselineRouter:
    try:
        return parse_router(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_stack_arguments(parser: argparse.ArgumentParser) -> None:
    """What stands the stacks up and drives them: shared by ``run`` and ``sweep``."""
    parser.add_argument("--scale", choices=SCALES, default="laptop", help="load scale")
    parser.add_argument(
        "--stacks",
        type=_stacks,
        default=",".join(STACKS),
        help=f"comma-separated, from {', '.join(ALL_STACKS)} (vllm-serve: vLLM's own server, "
        "--engine vllm only)",
    )
    parser.add_argument("--engine", choices=ENGINES, default="sim", help="engine of every replica")
    add_engine_option(parser)
    parser.add_argument(
        "--replicas", type=positive_int, default=2, help="engine replicas per stack"
    )
    parser.add_argument("--loader", choices=tuple(LOADERS), default="native", help="load tool")
    parser.add_argument("--out", default="results", help="parent of results/<run-id>/")
    parser.add_argument("--seed", type=int, help="override every profile's seed")
    parser.add_argument(
        "--slo",
        type=_slo,
        action="append",
        default=[],
        metavar="NAME:MS",
        help="an SLO over the profile's own for that series, as vLLM's --goodput spells it: "
        "ttft:500, tpot:50, e2el:2000 (p99), or ttft_p90:300 for another percentile; repeatable",
    )
    parser.add_argument(
        "--zerolayer-urls",
        type=_urls,
        default="",
        help="comma-separated replica URLs of a zero-layer stack already running",
    )
    parser.add_argument(
        "--baseline-url", type=check_url, default=None, help="front door of a running baseline"
    )
    parser.add_argument("--ray-address", help="attach the baseline to this Ray cluster")
    parser.add_argument(
        "--baseline-router",
        type=_router,
        metavar="{" + ",".join(BASELINE_ROUTERS) + "}",
        help="the baseline's request router: pow2 (power of two choices), consistent-hash (on "
        "zl-session) or prefix-aware (Ray Serve LLM's, --engine vllm only); default: "
        "consistent-hash for our orchestrator, pow2 (Serve's default) for Ray Serve LLM",
    )
    parser.add_argument(
        "--auth",
        action="store_true",
        help="production-like: the stacks authenticate tenants (a fresh key file in the run "
        "directory, one key per tenant of the profiles) and every loader sends each tenant's key",
    )
    parser.add_argument(
        "--workload", type=_workload, metavar="SOURCE[:PATH]", help=WORKLOAD_OPTION_HELP
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bars or lines (CI logs)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``zl-bench run``'s arguments."""
    parser.add_argument(
        "--profiles",
        type=_profiles,
        default=",".join(PROFILES),
        help=f"comma-separated, from {', '.join(PROFILES)} (or a-f), or profile TOML paths",
    )
    add_stack_arguments(parser)


def config_from(args: argparse.Namespace, profiles: tuple[str, ...]) -> RunConfig:
    """The RunConfig of a command line (``run`` or ``sweep``), engine options validated."""
    try:
        options = validate_engine_options(args.engine, dict(args.engine_options))
    except ValueError as exc:
        raise UsageError(f"--engine-option: {exc}") from exc
    return RunConfig(
        scale=args.scale,
        profiles=profiles,
        stacks=tuple(args.stacks),
        engine=args.engine,
        engine_options=options,
        replicas=args.replicas,
        loader=args.loader,
        out=args.out,
        seed=args.seed,
        zerolayer_urls=tuple(args.zerolayer_urls),
        baseline_url=args.baseline_url or "",
        ray_address=args.ray_address,
        baseline_router=args.baseline_router,
        slos=tuple(args.slo),
        quiet=args.quiet,
        auth=args.auth,
        workload=args.workload,
    )


def run_command(args: argparse.Namespace) -> int:
    """Build the RunConfig from the command line and run it."""
    return run(config_from(args, tuple(args.profiles)))
