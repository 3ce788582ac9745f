"""``zl-bench run``: stand each stack up, run every profile on it, sample, save, report.

Stacks run one after the other on the same machine (never at once: on 2 cores they would steal
each other's CPU), each profile with the same seeded schedule on both. Everything is written as it
happens, so a run cut short by SIGINT still leaves a directory that ``zl-bench report`` renders,
marked incomplete.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import orjson
import psutil

from harness import schema
from harness.capacity import preflight
from harness.loaders.base import LOADERS, LoadResult
from harness.metrics import summarize
from harness.profile import Profile, load_profile
from harness.stacks import STACKS, StackHandle, external, start_baseline_stack, start_zerolayer
from harness.telemetry import (
    Component,
    EngineSource,
    EngineTarget,
    NvmlSource,
    PhaseLog,
    ProcessSource,
    Sampler,
)
from harness.workload import build_schedule
from zerolayer.engine import SimConfig

SCALES = ("smoke", "laptop", "seed")
DEFAULT_PROFILES = ("a_latency", "b_high_concurrency", "c_mixed", "d_fault")
LOADER_NICE = -5
STATS_DIR = "engine-stats"
STATS_WAIT_S = 10.0
PACKAGES = ("h2", "h11", "uvloop", "ray", "chaostoolkit-lib", "locust", "k6", "numpy")


@dataclass
class RunConfig:
    """What a run was asked to do; saved verbatim in run.json."""

    scale: str = "laptop"
    profiles: list[str] = field(default_factory=lambda: list(DEFAULT_PROFILES))
    stacks: list[str] = field(default_factory=lambda: list(STACKS))
    engine: str = "sim"
    engine_options: dict[str, Any] = field(default_factory=dict)
    replicas: int = 2
    loader: str = "native"
    out: str = "results"
    seed: int | None = None
    zerolayer_urls: list[str] = field(default_factory=list)
    baseline_url: str = ""
    ray_address: str | None = None
    telemetry_interval_s: float = 0.25


def _say(message: str) -> None:
    print(f"[zl-bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


def _git_revision() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).resolve().parent,
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain"],
            capture_output=True,
            text=True,
            check=False,
            cwd=Path(__file__).resolve().parent,
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
    return {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "memory_bytes": psutil.virtual_memory().total,
    }


class RunDir:
    """The results directory and its run.json, rewritten at every state change."""

    def __init__(self, config: RunConfig) -> None:
        run_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{config.scale}"
        self.path = Path(config.out) / run_id
        self.path.mkdir(parents=True, exist_ok=False)
        self.summary: list[dict[str, Any]] = []
        self.meta: dict[str, Any] = {
            "schema_version": schema.SCHEMA_VERSION,
            "run_id": run_id,
            "scale": config.scale,
            "config": config.__dict__,
            "engine": {"name": config.engine, "options": config.engine_options},
            "git_revision": _git_revision(),
            "versions": _versions(),
            "machine": _machine(),
            "started_ns": time.time_ns(),
            "complete": False,
            "incomplete_reason": "running",
            "profiles": {},
            "stacks": {},
            "validity": {},
        }
        self.save()

    def save(self) -> None:
        tmp = self.path / (schema.RUN_META + ".tmp")
        tmp.write_bytes(orjson.dumps(self.meta, option=orjson.OPT_INDENT_2, default=str))
        tmp.replace(self.path / schema.RUN_META)

    def add_summary(self, stack: str, profile: str, loader: str, summary: dict[str, Any]) -> None:
        """Append one stack/profile row to summary.json (rewritten whole, atomically)."""
        self.summary.append({"stack": stack, "profile": profile, "loader": loader, **summary})
        self.meta["validity"][f"{stack}/{profile}"] = {
            "valid": summary["valid"],
            "reasons": summary["invalid_reasons"],
        }
        tmp = self.path / (schema.SUMMARY + ".tmp")
        tmp.write_bytes(orjson.dumps(self.summary, option=orjson.OPT_INDENT_2))
        tmp.replace(self.path / schema.SUMMARY)
        self.save()


def _stand_up(name: str, config: RunConfig, stats_dir: Path) -> StackHandle:
    if name == "zerolayer":
        if config.zerolayer_urls:
            return external(name, config.zerolayer_urls)
        return start_zerolayer(config.replicas, config.engine, config.engine_options)
    if config.baseline_url:
        return external(name, [config.baseline_url])
    return start_baseline_stack(
        config.replicas,
        config.engine,
        config.engine_options,
        config.ray_address,
        stats_dir=stats_dir,
    )


def _watch(
    stack: StackHandle,
    engines: EngineSource,
    procs: ProcessSource,
    config: RunConfig,
    stats_dir: Path,
) -> None:
    """Register a stack's replicas and processes with the telemetry sources."""
    if stack.name == "zerolayer":
        for i, url in enumerate(stack.urls):
            engines.add(EngineTarget.metrics(f"zl-{i}", stack.name, f"{url}/metrics"))
    elif stack.baseline is not None:
        deadline = time.monotonic() + STATS_WAIT_S
        files: list[Path] = []
        while len(files) < config.replicas and time.monotonic() < deadline:
            time.sleep(0.2)
            files = sorted(stats_dir.glob("engine-stats-*.jsonl"))
        if len(files) < config.replicas:
            _say(f"baseline: only {len(files)} of {config.replicas} engine replicas publish stats")
        for i, path in enumerate(files):
            engines.add(EngineTarget.stats_file(f"serve-{i}", stack.name, path))
    roles = {
        "replica": "replica",
        "proxy": "proxy",
        "controller": "controller",
        "ingress": "orchestrator",
        "engine": "engine",
    }
    for role, pids in stack.pids().items():
        for i, pid in enumerate(pids):
            procs.add(
                Component(f"{stack.name}-{role}-{i}", pid, roles.get(role, "other"), stack.name)
            )


@contextlib.contextmanager
def _loader_priority(run: RunDir) -> Iterator[None]:
    """Run the loader thread at a higher CPU priority than the stack it drives.

    The loader shares the cores with the stack under test; a load generator that the stack can
    starve measures its own lag, not the server. Niceness is per thread on Linux and inherited by
    children, so it is raised only around the loader's own run (the stacks are already up) and
    restored afterwards. Without the privilege the run goes on at normal priority and says so.
    """
    try:
        os.setpriority(os.PRIO_PROCESS, 0, LOADER_NICE)
    except PermissionError:
        run.meta["loader_nice"] = 0
        yield
        return
    run.meta["loader_nice"] = LOADER_NICE
    try:
        yield
    finally:
        os.setpriority(os.PRIO_PROCESS, 0, 0)


def _run_profile(
    profile: Profile, stack: StackHandle, config: RunConfig, run: RunDir, phases: PhaseLog
) -> LoadResult:
    records = run.path / schema.requests_file(stack.name, profile.name)
    schedule = build_schedule(profile)
    phases.begin(f"{stack.name}/{profile.name}", stack=stack.name, profile=profile.name)
    try:
        if config.loader == "native":
            from harness.loaders.native import run_native

            return asyncio.run(
                run_native(
                    schedule,
                    urls=stack.urls,
                    protocol=stack.protocol,
                    stack=stack.name,
                    profile=profile.name,
                    records_path=records,
                )
            )
        workdir = run.path / "loader" / f"{stack.name}-{profile.name}"
        if config.loader == "k6":
            from harness.loaders.k6 import run_k6

            return run_k6(
                schedule,
                url=stack.urls[0],
                stack=stack.name,
                profile=profile.name,
                rate=profile.rate,
                duration_s=profile.duration_s,
                workdir=workdir,
                records_path=records,
                process=profile.process,
            )
        from harness.loaders.locust import run_locust

        return run_locust(
            schedule,
            url=stack.urls[0],
            stack=stack.name,
            profile=profile.name,
            workdir=workdir,
            records_path=records,
        )
    finally:
        phases.end()


def _run_faults(stack: StackHandle, config: RunConfig, run: RunDir, phases: PhaseLog) -> None:
    """Profile D: every chaos experiment under profile A's load, on a stack of its own making.

    The zero-layer stack is stood up afresh by the chaos runner (with the fault proxy in its path,
    after the bench's own replicas are gone); the baseline reuses the bench's Ray deployment.
    """
    from chaos.runner import CHAOS_SCALES, run_profile_d, table
    from chaos.runner import SCALES as CHAOS_SCALE_SETTINGS

    scale = config.scale if config.scale in CHAOS_SCALES else CHAOS_SCALES[-1]
    if scale != config.scale:
        _say(f"chaos runs at {CHAOS_SCALES}; profile D uses the {scale} chaos scale")
    phases.begin(f"{stack.name}/d_fault", stack=stack.name, profile="d_fault")
    try:
        rows = run_profile_d(stack.name, run.path, scale, baseline_handle=stack.baseline)
    finally:
        phases.end()
    print(table(rows), flush=True)
    recovery_path = run.path / schema.CHAOS_DIR / "recovery.json"
    previous = orjson.loads(recovery_path.read_bytes()) if recovery_path.exists() else []
    recovery_path.write_bytes(
        orjson.dumps(previous + [r.to_dict() for r in rows], option=orjson.OPT_INDENT_2)
    )
    logs = sorted((run.path / schema.CHAOS_DIR).glob(f"requests-{stack.name}-d_fault-*.jsonl"))
    records = [rec for path in logs for rec in schema.read_requests(path)]
    summary = summarize(records)
    summary["chaos_scale"] = asdict(CHAOS_SCALE_SETTINGS[scale])
    run.add_summary(stack.name, "d_fault", "native", summary)
    _say(
        f"{stack.name} / d_fault: {len(rows)} experiments, {summary['lost']} lost, "
        f"{summary['errors']} errors"
    )


def _fault_phase(stack: StackHandle, config: RunConfig, run: RunDir, phases: PhaseLog) -> None:
    if stack.metadata.get("impl") == "external":
        _say(f"{stack.name} / d_fault: skipped, faults need a stack this run started")
        return
    _say(f"{stack.name} / d_fault: chaos experiments under profile A's load")
    _run_faults(stack, config, run, phases)


def _summary_table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'stack':<10} {'profile':<20} {'done':>6} {'err':>5} {'lost':>5} "
        f"{'TTFT p50':>9} {'E2EL p50':>9} {'E2EL p99':>9} {'E2EL std':>9} {'req/s':>7} valid"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['stack']:<10} {r['profile']:<20} {r['completed']:>6} {r['errors']:>5} "
            f"{r['lost']:>5} {r.get('median_ttft_ms', float('nan')):>9.1f} "
            f"{r.get('median_e2el_ms', float('nan')):>9.1f} "
            f"{r.get('p99_e2el_ms', float('nan')):>9.1f} "
            f"{r.get('std_e2el_ms', float('nan')):>9.1f} {r['request_throughput']:>7.2f} "
            f"{'yes' if r['valid'] else 'NO: ' + '; '.join(r['invalid_reasons'])}"
        )
    return "\n".join(lines)


def run(config: RunConfig) -> int:
    """Run the bench; returns the exit status (130 when interrupted)."""
    profiles = [load_profile(name, config.scale, config.seed) for name in config.profiles]
    run = RunDir(config)
    _say(f"run {run.meta['run_id']} -> {run.path}")
    sim_config = SimConfig(**config.engine_options) if config.engine == "sim" else None
    for profile in profiles:
        capacity = preflight(profile, config.engine, config.replicas, sim_config)
        run.meta["profiles"][profile.name] = {**profile.as_dict(), "capacity": capacity.as_dict()}
    run.save()
    phases = PhaseLog(run.path / schema.PHASES)
    engines, procs = EngineSource(), ProcessSource()
    procs.add(Component("loader", os.getpid(), "loader"))
    sampler = Sampler(
        [NvmlSource(), engines, procs],
        run.path / schema.TELEMETRY,
        config.telemetry_interval_s,
        phases,
    )
    status = 0
    try:
        sampler.open()
        run.meta["telemetry"] = sampler.describe()
        sampler.start()
        for name in config.stacks:
            _say(f"standing up {name} ({config.engine} engine, {config.replicas} replicas)")
            with ExitStack() as stack_scope:
                stack = stack_scope.enter_context(_stand_up(name, config, run.path / STATS_DIR))
                run.meta["stacks"][name] = {**stack.metadata, "urls": stack.urls}
                run.save()
                _watch(stack, engines, procs, config, run.path / STATS_DIR)
                for profile in profiles:
                    if profile.fault is not None:
                        continue
                    _say(
                        f"{name} / {profile.name}: {profile.rate:g} req/s for "
                        f"{profile.duration_s:g} s ({config.loader} loader)"
                    )
                    with _loader_priority(run):
                        result = _run_profile(profile, stack, config, run, phases)
                    run.add_summary(name, profile.name, result.loader, result.summary)
                    s = result.summary
                    _say(
                        f"{name} / {profile.name}: {s['completed']} completed, {s['errors']} "
                        f"errors, {s['lost']} lost, E2EL p50 "
                        f"{s.get('median_e2el_ms', float('nan')):.1f} ms"
                        + ("" if result.valid else f" INVALID: {result.invalid_reasons}")
                    )
                if any(p.fault is not None for p in profiles) and name == "baseline":
                    _fault_phase(stack, config, run, phases)
                _say(f"tearing down {name}")
                engines.drop_stack(name)
            if any(p.fault is not None for p in profiles) and name == "zerolayer":
                _fault_phase(stack, config, run, phases)
        run.meta["complete"] = True
        run.meta.pop("incomplete_reason", None)
    except KeyboardInterrupt:
        _say("interrupted: keeping what was measured")
        run.meta["incomplete_reason"] = "interrupted by SIGINT"
        status = 130
    finally:
        sampler.stop()
        phases.close()
        run.meta["finished_ns"] = time.time_ns()
        run.save()
    _say("rendering report")
    from bench.report import html

    report = html.render(run.path)
    if run.summary:
        print(_summary_table(run.summary), flush=True)
    _say(f"report: {report}")
    return status


def _csv(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def _kv(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        value = raw
    return key.replace("-", "_"), value


def register(sub: Any) -> None:
    """Add ``zl-bench run`` to the command line (bench.cli discovers this)."""
    p = sub.add_parser("run", help="stand up the stacks, run the profiles, write results/")
    p.add_argument("--scale", choices=SCALES, default="laptop")
    p.add_argument(
        "--profiles",
        type=_csv,
        default=list(DEFAULT_PROFILES),
        help="comma-separated: a_latency,b_high_concurrency,c_mixed,d_fault (or a,b,c,d)",
    )
    p.add_argument("--stacks", type=_csv, default=list(STACKS), help="zerolayer,baseline")
    p.add_argument("--engine", default="sim", help="sim (default), null, torch, vllm")
    p.add_argument(
        "--engine-option",
        type=_kv,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="engine option, e.g. model_shape=llama-3.2-1b (repeatable)",
    )
    p.add_argument("--replicas", type=int, default=2, help="engine replicas per stack")
    p.add_argument("--loader", choices=LOADERS, default="native")
    p.add_argument("--out", default="results", help="parent of results/<run-id>/")
    p.add_argument("--seed", type=int, help="override every profile's seed")
    p.add_argument(
        "--zerolayer-urls",
        type=_csv,
        default=[],
        help="replica URLs of a zero-layer stack already running (nothing started)",
    )
    p.add_argument("--baseline-url", default="", help="front door of a baseline already running")
    p.add_argument("--ray-address", help="attach the baseline to this Ray cluster")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    unknown = [s for s in args.stacks if s not in STACKS]
    if unknown:
        raise SystemExit(f"zl-bench run: unknown stack(s) {unknown}; choose from {STACKS}")
    config = RunConfig(
        scale=args.scale,
        profiles=args.profiles,
        stacks=args.stacks,
        engine=args.engine,
        engine_options=dict(args.engine_option),
        replicas=args.replicas,
        loader=args.loader,
        out=args.out,
        seed=args.seed,
        zerolayer_urls=args.zerolayer_urls,
        baseline_url=args.baseline_url,
        ray_address=args.ray_address,
    )
    return run(config)


def main(argv: Sequence[str] | None = None) -> int:
    from bench.cli import main as cli_main

    return cli_main(["run", *(argv or sys.argv[1:])])
