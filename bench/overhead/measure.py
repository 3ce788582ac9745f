"""What the overhead benchmark measures: each target driven level by level on a fixed schedule,
the server's and the host's CPU read around each level, the rates (given, or measured on the
in-process engine), a replica's RSS under many open streams, and ``authorize``'s own cost."""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import psutil

from bench.overhead.model import (
    DEADLINE_MS,
    TENANT,
    HostLoad,
    Level,
    Role,
    ServerCpu,
    Settings,
    SystemUnderTest,
    Workload,
)
from bench.overhead.render import rates_text
from bench.overhead.targets import TargetKind, overhead_credentials
from harness.loaders.native import run_schedule
from harness.metrics import LAG_FRACTION_OF_MEDIAN
from harness.schema import RequestRecord
from harness.stacks import ReplicaProcess
from harness.telemetry.host import HostCpu, busy_pct, cpu_speed, measure_host_cpu
from harness.telemetry.process import ProcessCpu, cpu_spent, read_cpu
from harness.workload import PlannedRequest
from serving.auth import load_key_file
from serving.cpus import CpuLayout, run_times
from serving.wire.contract import RequestMeta
from zerolayer.client import ZeroLayerClient, ZeroLayerError

# The reference engine's rates per in-flight level (others: 10 req/s per slot).
DEFAULT_RATES = {1: 50.0, 16: 160.0}
DEFAULT_RATE_PER_SLOT = 10.0
# Each level offers this fraction of the in-process engine's measured closed-loop throughput.
# A quarter: each stack's own processes (and the loader) share the cores with the engine, whose
# core and worker busy-poll; at half, vLLM's own server fell behind at 16 in flight on 2 cores.
UTILIZATION = 0.25
# Closed-loop requests per in-flight slot when measuring the in-process throughput.
PROBE_ROUNDS = 4
# Per in-flight slot, req/s where nothing measured the engine (tiny model, 32 tokens, 2 cores).
VLLM_FALLBACK_RATE_PER_SLOT = 1.0
# vLLM names its engine core and worker processes ``VLLM::EngineCore``, ``VLLM::Worker``: their
# CPU is the engine's, the same in every stack; the rest of a server's is the serving layer's.
ENGINE_PROCESS_PREFIX = "VLLM::"
# Calls timed to give Authenticator.authorize's cost per request (a few hundred ms in all).
AUTHORIZE_CALLS = 100_000


def _request(workload: Workload, i: int, offset_s: float) -> PlannedRequest:
    return PlannedRequest(
        index=i,
        request_id=f"ovh-{i}",
        offset_s=offset_s,
        request_class="overhead",
        prompt_bytes=workload.prompt_bytes,
        max_tokens=workload.max_tokens,
        seed=7,
        session=f"s{i % 1024}",
        tenant=TENANT,
        priority="normal",
        deadline_ms=DEADLINE_MS,
    )


def schedule(
    workload: Workload, in_flight: int, rate: float, duration_s: float, burst: bool
) -> list[PlannedRequest]:
    """Evenly spaced at ``1 / rate``; with ``burst``, ``in_flight`` at a time every
    ``in_flight / rate`` s."""
    group = in_flight if burst else 1
    period = group / rate
    rounds = max(1, int(duration_s / period))
    return [_request(workload, i, (i // group) * period) for i in range(rounds * group)]


def server_cpu(before: Mapping[int, ProcessCpu], after: Mapping[int, ProcessCpu]) -> ServerCpu:
    """CPU seconds the server's processes spent between two readings, all and the layer's (every
    process but the engine's own, see ENGINE_PROCESS_PREFIX)."""
    spent = cpu_spent(before, after).values()
    layer = [p.seconds for p in spent if not p.name.startswith(ENGINE_PROCESS_PREFIX)]
    return ServerCpu(sum(p.seconds for p in spent), sum(layer))


def _load1() -> float:
    return os.getloadavg()[0]


def rest_busiest(
    before: Sequence[Any], after: Sequence[Any], layout: CpuLayout | None
) -> float | None:
    """The busiest of the cores a CPU layout leaves to the loader and the layers, as a fraction,
    between two per-core readings; None without a layout (or one leaving them no core)."""
    if layout is None or not layout.rest:
        return None
    busy = [busy_pct(before[c], after[c]) for c in layout.rest if c < len(after)]
    return max(busy) / 100 if busy else None


def layer_pids(target: SystemUnderTest) -> list[int]:
    """The loader (this process) and the target's layer processes: every server process but
    vLLM's own engine processes (for the in-process floor, the loader alone)."""
    pids = [os.getpid()]
    for pid in target.server_pids:
        with contextlib.suppress(psutil.Error):
            if not psutil.Process(pid).name().startswith(ENGINE_PROCESS_PREFIX):
                pids.append(pid)
    return pids


@dataclass
class HostWatch:
    """The host readings taken around a level: one core's speed just before (``cpu_speed``,
    half a second), the load average, each core's times, and how long the loader's and the
    layer processes' threads ran and waited for a core."""

    pids: list[int]
    layout: CpuLayout | None
    speed: float
    load: float
    cores: Sequence[Any]
    times: tuple[int, int]

    @classmethod
    async def start(cls, pids: list[int], layout: CpuLayout | None) -> HostWatch:
        speed = await asyncio.to_thread(cpu_speed)
        cores = psutil.cpu_times(percpu=True)
        return cls(pids, layout, speed, _load1(), cores, run_times(pids))

    def finish(self, cpu: HostCpu) -> HostLoad:
        """The level's ``HostLoad`` from the readings now and at the start."""
        ran_now, waited_now = run_times(self.pids)
        ran = max(0, ran_now - self.times[0])
        waited = max(0, waited_now - self.times[1])
        wait = waited / (ran + waited) if ran + waited > 0 else None
        return HostLoad(
            busy=cpu.cpu_pct / 100,
            load1=max(self.load, _load1()),
            cores=cpu.cpus,
            busiest=cpu.busiest_cpu_pct / 100,
            speed=self.speed,
            rest_busiest=rest_busiest(self.cores, psutil.cpu_times(percpu=True), self.layout),
            wait_share=wait if self.layout is not None else None,
        )


async def drive(
    target: SystemUnderTest,
    plan: Sequence[PlannedRequest],
    in_flight: int,
    rate: float,
    records: Path,
    repeat: int = 0,
    layout: CpuLayout | None = None,
    reference: bool = False,
) -> Level:
    """One level through the native loader's ``run_schedule``; server CPU and host load measured
    around it, one core's speed probed just before (``cpu_speed``, half a second). Over the
    reference engine (``reference``) the loader's lag is held to the absolute 1 ms, not to 1 %
    of a median E2EL of a few milliseconds (the design's rule for null-engine runs).

    Not ``NativeLoader``: that drives a whole ``Stack`` through a client it opens for each run,
    in an event loop of its own, with no bound on requests in flight. Here the floor is an
    engine in this process (no stack at all), each stack's client stays open from its warm-up
    through every level (so no connection set-up lands in a measured level), and each level
    holds at most ``in_flight`` requests outstanding (wrk2-style).
    """
    watch = await HostWatch.start(layer_pids(target), layout)
    server0 = read_cpu(target.server_pids)
    with measure_host_cpu() as host_cpu:
        result = await run_schedule(
            plan,
            target.send,
            stack=target.name,
            profile=f"overhead-{in_flight}",
            records_path=records,
            max_in_flight=in_flight,
            lag_fraction=0.0 if reference else LAG_FRACTION_OF_MEDIAN,
        )
    host = watch.finish(host_cpu[0])
    server = server_cpu(server0, read_cpu(target.server_pids)) if target.server_pids else None
    s = result.summary
    return Level(
        target=target.name,
        in_flight=in_flight,
        rate=rate,
        completed=int(s["completed"]),
        errors=int(s["errors"]) + int(s["lost"]),
        ttft_p50_ms=s.get("median_ttft_intended_ms"),
        ttft_p99_ms=s.get("p99_ttft_intended_ms"),
        e2el_p50_ms=s.get("median_e2el_intended_ms"),
        e2el_p99_ms=s.get("p99_e2el_intended_ms"),
        tpot_p50_ms=s.get("median_tpot_ms"),
        tpot_p99_ms=s.get("p99_tpot_ms"),
        lag_p99_ms=s.get("p99_lag_ms"),
        tokens=tuple(r.output_tokens for r in result.records if r.outcome == "completed"),
        client_cpu_us=float(result.extra["loader_cpu_us_per_request"]),
        server_cpu=server,
        host=host,
        error_codes=dict(s["errors_by_code"]),
        invalid_reasons=tuple(s.get("invalid_reasons", ())),
        repeat=repeat,
    )


def closed_loop_rate(completed: int, first_sent_ns: int, last_end_ns: int) -> float:
    """Requests per second a closed loop completed between its first send and its last answer."""
    span_s = (last_end_ns - first_sent_ns) / 1e9
    return completed / span_s if completed and span_s > 0 else 0.0


async def probe_rate(
    target: SystemUnderTest, workload: Workload, in_flight: int, workdir: Path
) -> float:
    """The rate to offer at ``in_flight``: UTILIZATION of the target's closed-loop throughput
    (PROBE_ROUNDS requests per slot, all due at once, at most ``in_flight`` outstanding), after
    one untimed round (a fresh engine's first requests are slow)."""
    done: list[RequestRecord] = []
    for rounds, name in ((1, "warm"), (PROBE_ROUNDS, "probe")):
        plan = [_request(workload, i, 0.0) for i in range(rounds * in_flight)]
        result = await run_schedule(
            plan,
            target.send,
            stack=target.name,
            profile=f"{name}-{in_flight}",
            records_path=workdir / f"{name}-{in_flight}.jsonl",
            max_in_flight=in_flight,
        )
        done = [r for r in result.records if r.outcome == "completed"]
    if not done:
        raise RuntimeError(f"the in-process engine completed nothing at {in_flight} in flight")
    throughput = closed_loop_rate(
        len(done), min(r.sent_ns for r in done), max(r.end_ns for r in done)
    )
    return UTILIZATION * throughput


def fixed_rates(settings: Settings, floor_runs: bool) -> dict[int, float] | None:
    """Each level's rate when nothing is measured: ``--rate``, the reference engine's defaults,
    or (vLLM without the floor to measure) conservative ones; None when the floor will measure
    (``floor_runs``)."""
    if settings.rate:
        return dict.fromkeys(settings.levels, settings.rate)
    if settings.workload.kind.is_reference:
        return {lv: DEFAULT_RATES.get(lv, DEFAULT_RATE_PER_SLOT * lv) for lv in settings.levels}
    if floor_runs:
        return None
    return {lv: VLLM_FALLBACK_RATE_PER_SLOT * lv for lv in settings.levels}


def fixed_source(settings: Settings) -> str:
    return "given" if settings.rate else f"{settings.workload.engine} engine defaults"


async def run_levels(
    target: SystemUnderTest,
    settings: Settings,
    rates: Mapping[int, float],
    workdir: Path,
    repeat: int = 0,
) -> list[Level]:
    """Every in-flight level of one stood-up target: a warm-up, then the measured run."""
    out = []
    workload = settings.workload
    for in_flight in settings.levels:
        rate = rates[in_flight]
        print(
            f"    {target.name}: {in_flight} in flight at {rate:.3g} req/s (load {_load1():.2f})",
            flush=True,
        )
        warm = schedule(workload, in_flight, rate, settings.warmup_s, settings.burst)
        base = workdir / f"{target.name}-{in_flight}"
        await drive(target, warm, in_flight, rate, base.with_suffix(".warmup.jsonl"))
        plan = schedule(workload, in_flight, rate, settings.duration_s, settings.burst)
        records = base.with_suffix(".jsonl")
        out.append(
            await drive(
                target,
                plan,
                in_flight,
                rate,
                records,
                repeat,
                workload.cpu_layout,
                workload.kind.is_reference,
            )
        )
    return out


async def _probe_rates(
    target: SystemUnderTest, settings: Settings, workdir: Path
) -> dict[int, float]:
    rates = {lv: await probe_rate(target, settings.workload, lv, workdir) for lv in settings.levels}
    print(f"  rates ({measured_source()}): {rates_text(rates)}", flush=True)
    return rates


def measured_source() -> str:
    return f"{UTILIZATION:g} x in-process closed-loop throughput"


def balanced_order(kinds: Sequence[TargetKind], repeat: int) -> list[TargetKind]:
    """The targets in the order a repeat measures them: the floor first in the first repeat
    (where it measures the rates), reversed every other repeat (A B C, C B A, A B C ...), so a
    slow minute of the host falls on every target alike."""
    floor_first = sorted(kinds, key=lambda kind: kind.role is not Role.FLOOR)
    return floor_first if repeat % 2 == 0 else floor_first[::-1]


async def measure(
    settings: Settings, chosen: Sequence[TargetKind], workdir: Path
) -> tuple[list[Level], dict[int, float], str]:
    """Each repeat stands up every target, measures it at every level and tears it down, one
    target at a time (they never share the cores), in :func:`balanced_order`. Returns the
    levels, the rates used and where they came from."""
    rates = fixed_rates(settings, any(kind.role is Role.FLOOR for kind in chosen))
    source = fixed_source(settings)
    levels: list[Level] = []
    for repeat in range(settings.repeats):
        folder = workdir / f"repeat-{repeat + 1}"
        for kind in balanced_order(chosen, repeat):
            print(f"  repeat {repeat + 1} of {settings.repeats}: standing up {kind.name} ...",
                  flush=True)  # fmt: skip
            target = await kind.factory(kind.name, settings.workload, folder)
            try:
                if rates is None:
                    rates, source = await _probe_rates(target, settings, folder), measured_source()
                measured = await run_levels(target, settings, rates, folder, repeat)
                levels += [replace(lv, role=kind.role) for lv in measured]
            finally:
                await target.close()
    return levels, rates or {}, source


async def replica_rss(streams: int, max_tokens: int, hold_s: float) -> dict[str, float]:
    """RSS of a sim replica before and with ``streams`` open streams on one SDK connection."""
    proc = await asyncio.to_thread(ReplicaProcess, "sim", {"max_num_seqs": max(streams, 256)})
    ps = psutil.Process(proc.pid)
    idle = ps.memory_info().rss
    opened = 0
    failed = 0
    all_open = asyncio.Event()
    release = asyncio.Event()
    client = ZeroLayerClient([proc.url], health_interval_s=0, max_retries=0)

    async def hold(i: int) -> None:
        nonlocal opened, failed
        try:
            async with client.stream(prompt=f"stream {i} " * 8, max_tokens=max_tokens) as s:
                opened += 1
                if opened + failed == streams:
                    all_open.set()
                async for _ in s:
                    if release.is_set():
                        break
        except ZeroLayerError:
            failed += 1
            if opened + failed == streams:
                all_open.set()

    try:
        tasks = [asyncio.create_task(hold(i)) for i in range(streams)]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(all_open.wait(), 120)
        peak = ps.memory_info().rss
        await asyncio.sleep(hold_s)
        held = ps.memory_info().rss
        release.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 60)
    finally:
        await client.close()
        await asyncio.to_thread(proc.stop)
    return {
        "streams_open": opened,
        "streams_refused": failed,
        "rss_idle_mb": idle / 2**20,
        "rss_open_mb": peak / 2**20,
        "rss_held_mb": held / 2**20,
    }


def authorize_us(calls: int = AUTHORIZE_CALLS) -> float:
    """``Authenticator.authorize``'s own cost per request in microseconds: a key file with one
    key, a request naming its tenant, timed over ``calls`` calls in this process."""
    with tempfile.TemporaryDirectory(prefix="zl-auth-") as folder:
        credentials = overhead_credentials(Path(folder))
        auth = load_key_file(credentials.key_file)
    header = f"Bearer {credentials.default_key}".encode()
    meta = RequestMeta("", TENANT, 1, DEADLINE_MS, None, None)
    authorize = auth.authorize
    started = time.perf_counter()
    for _ in range(calls):
        authorize(meta, header, None)
    return (time.perf_counter() - started) / calls * 1e6
