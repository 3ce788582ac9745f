"""``zl-bench overhead``: what the serving layer itself costs, over an in-process engine.

Each target (the in-process engine; the zero-layer stack SDK -> replica -> engine; the baseline
over HTTP/1.1; with ``--engine vllm`` also ``vllm-serve``, vLLM's own OpenAI server; any
plugged-in ``--target NAME=module:function``) is driven with the same schedule by the native
loader (``harness.loaders.native.run_schedule``): a fixed rate for a bounded time with at most
``in_flight`` requests outstanding (wrk2-style; or bursts of ``in_flight`` with ``--burst``, the
default with ``--engine vllm``), latency measured from each request's intended send time. Stacks
are stood up the one way (``harness.stacks.stand_up``, one replica) and measured one at a time,
each torn down before the next starts, so they never share the cores with each other.

Over the null engine every millisecond a request takes is the layer's own. Over the real vLLM
engine (``--engine vllm --engine-option model=DIR``) the in-process floor is vLLM's ``AsyncLLM``
called through the zero-layer adapter, and the baseline is Ray Serve LLM; unless ``--rate`` is
given, each level's rate is a quarter of the in-process engine's throughput measured closed-loop
at that level just before (so no stack's engine is overloaded on a small machine), or
conservative defaults where ``inproc`` is not run.

The tables give per target and in-flight level: TTFT and E2EL p50/p99, what each adds over
in-process, the tokens each request streamed (every target must serve exactly ``max_tokens``),
the loader's own CPU per request (``cli us/req``, idle spin excluded), and the server's CPU per
completed request and per streamed token: the CPU time of every process of the stack and their
descendants read before and after the level (psutil's 10 ms ticks: run long enough). ``layer``
is that less vLLM's engine core and workers (``VLLM::*`` processes), which busy-poll while
requests come often and cost the same in every stack; what is left is the serving layer's own
(for the stacks it includes ``AsyncLLM``'s front end, which for ``inproc`` is in ``cli us/req``).
For ``inproc`` the server is the engine's child processes (none for the null engine). A level
during which the host's cores were nearly all busy is marked saturated: trust its CPU figures
over its wall-clock ones. A one-line verdict compares the zero-layer replica with vLLM's own
server (added E2EL p50 and p99, layer CPU per token). With the null engine a replica's RSS is
then measured with 1000 concurrent open streams (sim engine, long generations) through one SDK
connection.

``--auth`` measures what authentication costs: each stack that checks API keys (the zero-layer
replica; the Ray Serve baseline over the null engine) runs a second time as ``NAME+auth``,
started with a key file and every request sent with its key, right after its run without; a
line per level gives the difference (E2EL p50 and p99, server CPU per request), beside
``Authenticator.authorize``'s own cost per call, timed in this process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import importlib.util
import os
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import orjson
import psutil
import uvloop

from harness.errors import UsageError
from harness.loaders.base import LoadResult
from harness.loaders.native import Sender, SendFn, client_sender, engine_sender, run_schedule
from harness.schema import RequestRecord
from harness.stacks import Credentials, ReplicaProcess, StackName, StackSpec, stand_up
from harness.workload import PlannedRequest
from serving.auth import load_key_file, write_key_file
from serving.engine import make_engine
from serving.engine.options import add_engine_option, validate_engine_options
from serving.wire.contract import RequestMeta
from zerolayer.client import ZeroLayerClient, ZeroLayerError

DEFAULT_RATES = {1: 200.0, 64: 500.0}
DEADLINE_MS = 30_000
ENGINES = ("null", "vllm")
# A level whose host CPU was this busy (fraction of all cores) ran on a saturated machine.
SATURATED_BUSY = 0.9
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
FLOOR = "inproc"
OURS = "zerolayer"
PEER = "vllm-serve"
TENANT = "default"
AUTH_SUFFIX = "+auth"
# Calls timed to give Authenticator.authorize's cost per request (a few hundred ms in all).
AUTHORIZE_CALLS = 100_000


@dataclass(frozen=True, slots=True)
class Defaults:
    """What an option means when not given, per engine: the null engine measures the bare layer
    at high rates; the real vLLM engine a short prompt and a modest stream, in bursts of the
    in-flight count (at a modest rate, evenly spaced requests would rarely overlap)."""

    targets: str
    levels: tuple[int, ...]
    prompt_bytes: int
    max_tokens: int
    duration_s: float
    warmup_s: float
    rss_streams: int
    burst: bool


DEFAULTS: Mapping[str, Defaults] = {
    "null": Defaults("inproc,zerolayer", (1, 64), 1024, 128, 20.0, 1.0, 1000, burst=False),
    "vllm": Defaults(
        "inproc,zerolayer,vllm-serve,baseline", (1, 16), 256, 32, 20.0, 3.0, 0, burst=True
    ),
}


@dataclass(frozen=True, slots=True)
class Workload:
    """The request every target serves, and the engine (with its options) behind every target."""

    prompt_bytes: int = 1024
    max_tokens: int = 128
    engine: str = "null"
    engine_options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Settings:
    """One run's options after the engine's defaults are filled in."""

    workload: Workload
    targets: str
    levels: tuple[int, ...]
    rate: float
    duration_s: float
    warmup_s: float
    burst: bool
    rss_streams: int
    rss_max_tokens: int
    out: Path | None
    auth: bool = False


@dataclass(slots=True)
class Target:
    """One system under test: how the loader sends to it, and whose CPU is its cost."""

    name: str
    send: SendFn | Sender
    close: Callable[[], Awaitable[None]]
    server_pids: list[int] = field(default_factory=list)


# A plug-in target: ``async fn(name, workload, workdir) -> Target``.
TargetFactory = Callable[[str, Workload, Path], Awaitable[Target]]


@dataclass(frozen=True, slots=True)
class HostLoad:
    """How busy the whole host was during a level: CPU busy fraction of all cores, 1-min load."""

    busy: float
    load1: float
    cores: int

    @property
    def saturated(self) -> bool:
        return self.busy >= SATURATED_BUSY or self.load1 >= self.cores


@dataclass(frozen=True, slots=True)
class ServerCpu:
    """CPU seconds a target's server processes spent during a level: all of them, and the
    serving layer's alone (every process but the engine's own, see ENGINE_PROCESS_PREFIX)."""

    total_s: float
    layer_s: float


@dataclass(frozen=True, slots=True)
class Level:
    """One target at one in-flight level: percentiles (ms, from intended send) from the run's
    summary, tokens streamed per completed request, and CPU costs."""

    target: str
    in_flight: int
    rate: float
    completed: int
    errors: int
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    e2el_p50_ms: float | None
    e2el_p99_ms: float | None
    lag_p99_ms: float | None
    tokens: tuple[int, ...]
    client_cpu_us: float
    server_cpu: ServerCpu | None
    host: HostLoad
    error_codes: dict[str, int] = field(default_factory=dict)
    invalid_reasons: tuple[str, ...] = ()

    @property
    def tokens_total(self) -> int:
        return sum(self.tokens)

    def _per(self, seconds: float | None, count: int) -> float | None:
        return seconds / count * 1e6 if seconds is not None and count else None

    @property
    def server_us_per_request(self) -> float | None:
        total = self.server_cpu.total_s if self.server_cpu else None
        return self._per(total, self.completed)

    @property
    def server_us_per_token(self) -> float | None:
        total = self.server_cpu.total_s if self.server_cpu else None
        return self._per(total, self.tokens_total)

    @property
    def layer_us_per_token(self) -> float | None:
        layer = self.server_cpu.layer_s if self.server_cpu else None
        return self._per(layer, self.tokens_total)

    def short_streams(self, max_tokens: int) -> int:
        """Completed requests that streamed other than ``max_tokens`` tokens."""
        return sum(1 for n in self.tokens if n != max_tokens)


@dataclass(frozen=True, slots=True)
class Added:
    """What a target adds over the in-process floor at the same in-flight level (ms)."""

    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    e2el_p50_ms: float | None
    e2el_p99_ms: float | None


def _minus(a: float | None, b: float | None) -> float | None:
    return a - b if a is not None and b is not None else None


def added(level: Level, floor: Level | None) -> Added:
    """``level``'s percentiles less the floor's (None where either is missing)."""
    if floor is None:
        return Added(None, None, None, None)
    return Added(
        _minus(level.ttft_p50_ms, floor.ttft_p50_ms),
        _minus(level.ttft_p99_ms, floor.ttft_p99_ms),
        _minus(level.e2el_p50_ms, floor.e2el_p50_ms),
        _minus(level.e2el_p99_ms, floor.e2el_p99_ms),
    )


def floors(levels: Iterable[Level]) -> dict[int, Level]:
    """The in-process level per in-flight count."""
    return {lv.in_flight: lv for lv in levels if lv.target == FLOOR}


async def inproc_target(name: str, workload: Workload, workdir: Path) -> Target:
    """The floor: the engine called in this process, no serving layer at all. Its server CPU is
    its child processes' (vLLM's engine core); the null engine has none."""
    engine = make_engine(workload.engine, **workload.engine_options)
    children = [] if workload.engine == "null" else [c.pid for c in psutil.Process().children()]
    return Target(name, engine_sender(engine), engine.close, children)


def overhead_credentials(folder: Path) -> Credentials:
    """A key file in ``folder`` with one fresh key, for the tenant every request names."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "api-keys.toml"
    return Credentials(path, write_key_file(path, {TENANT: "normal"}))


def stack_target(stack_name: StackName, auth: bool = False) -> TargetFactory:
    """A stack over the workload's engine (one replica), stood up the one way; sent to through
    its client. ``auth``: started with a key file, every request sent with its key."""

    async def factory(name: str, workload: Workload, workdir: Path) -> Target:
        spec = StackSpec(
            stack_name,
            engine=workload.engine,
            engine_options=dict(workload.engine_options),
            replicas=1,
            credentials=overhead_credentials(workdir / name) if auth else None,
        )
        stack = await asyncio.to_thread(stand_up, spec, workdir / name)
        try:
            client = stack.open_client()
            await client.__aenter__()
        except BaseException:
            await asyncio.to_thread(stack.close)
            raise

        async def close() -> None:
            try:
                await client.close()
            finally:
                await asyncio.to_thread(stack.close)

        pids = [pid for group in stack.pids().values() for pid in group]
        return Target(name, client_sender(client, stack.credentials), close, pids)

    return factory


BUILTIN: dict[str, TargetFactory] = {
    FLOOR: inproc_target,
    OURS: stack_target(StackName.ZEROLAYER),
    "baseline": stack_target(StackName.BASELINE),
    "rayserve": stack_target(StackName.BASELINE),
    PEER: stack_target(StackName.VLLM_SERVE),
}
# Targets that only a real vLLM engine can serve.
VLLM_ONLY = frozenset({PEER})
# --auth: the stacks that check API keys, measured again with them (over vLLM the baseline is Ray
# Serve LLM, which checks none).
WITH_AUTH: dict[str, TargetFactory] = {
    OURS: stack_target(StackName.ZEROLAYER, auth=True),
    "baseline": stack_target(StackName.BASELINE, auth=True),
    "rayserve": stack_target(StackName.BASELINE, auth=True),
}


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
        tenant="default",
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


def _process_tree(pids: Sequence[int]) -> dict[int, psutil.Process]:
    """The processes and all their descendants, by pid (gone ones left out)."""
    found: dict[int, psutil.Process] = {}
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            for p in [proc, *proc.children(recursive=True)]:
                found[p.pid] = p
    return found


# A pid's process name and its user + system CPU seconds.
CpuReading = Mapping[int, tuple[str, float]]


def cpu_by_pid(pids: Sequence[int]) -> dict[int, tuple[str, float]]:
    """Name and user + system CPU seconds of each process in the trees under ``pids``."""
    out: dict[int, tuple[str, float]] = {}
    for pid, proc in _process_tree(pids).items():
        with contextlib.suppress(psutil.Error):
            out[pid] = (proc.name(), sum(proc.cpu_times()[:2]))
    return out


def cpu_spent(before: CpuReading, after: CpuReading) -> ServerCpu:
    """CPU seconds spent between two readings, all and the layer's (not the engine's): a process
    new in ``after`` counts whole (it started in between); one gone from ``after`` is left out
    (its last interval is unknown)."""
    total = layer = 0.0
    for pid, (name, seconds) in after.items():
        spent = max(0.0, seconds - before.get(pid, (name, 0.0))[1])
        total += spent
        if not name.startswith(ENGINE_PROCESS_PREFIX):
            layer += spent
    return ServerCpu(total, layer)


def host_busy(before: Any, after: Any) -> float:
    """Busy fraction of all cores between two ``psutil.cpu_times()`` readings."""
    total = sum(after) - sum(before)
    idle = (after.idle - before.idle) + (
        getattr(after, "iowait", 0.0) - getattr(before, "iowait", 0.0)
    )
    return 1.0 - idle / total if total > 0 else 0.0


async def drive(
    target: Target, plan: Sequence[PlannedRequest], in_flight: int, rate: float, records: Path
) -> Level:
    """One level through the native loader; server CPU and host load measured around it."""
    server0 = cpu_by_pid(target.server_pids)
    host0 = psutil.cpu_times()
    result: LoadResult = await run_schedule(
        plan,
        target.send,
        stack=target.name,
        profile=f"overhead-{in_flight}",
        records_path=records,
        max_in_flight=in_flight,
    )
    host = HostLoad(host_busy(host0, psutil.cpu_times()), os.getloadavg()[0], _cores())
    server = cpu_spent(server0, cpu_by_pid(target.server_pids)) if target.server_pids else None
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
        lag_p99_ms=s.get("p99_lag_ms"),
        tokens=tuple(r.output_tokens for r in result.records if r.outcome == "completed"),
        client_cpu_us=float(result.extra["loader_cpu_us_per_request"]),
        server_cpu=server,
        host=host,
        error_codes=dict(s["errors_by_code"]),
        invalid_reasons=tuple(s.get("invalid_reasons", ())),
    )


def _cores() -> int:
    return psutil.cpu_count() or 1


def closed_loop_rate(completed: int, first_sent_ns: int, last_end_ns: int) -> float:
    """Requests per second a closed loop completed between its first send and its last answer."""
    span_s = (last_end_ns - first_sent_ns) / 1e9
    return completed / span_s if completed and span_s > 0 else 0.0


async def probe_rate(target: Target, workload: Workload, in_flight: int, workdir: Path) -> float:
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


def fixed_rates(settings: Settings) -> dict[int, float] | None:
    """Each level's rate when nothing is measured: ``--rate``, the null engine's defaults, or
    (vLLM without ``inproc`` to measure) conservative ones; None when ``inproc`` will measure."""
    if settings.rate:
        return dict.fromkeys(settings.levels, settings.rate)
    if settings.workload.engine == "null":
        return {lv: DEFAULT_RATES.get(lv, 10.0 * lv) for lv in settings.levels}
    if FLOOR in settings.targets.split(","):
        return None
    return {lv: VLLM_FALLBACK_RATE_PER_SLOT * lv for lv in settings.levels}


def _fixed_source(settings: Settings) -> str:
    return "given" if settings.rate else f"{settings.workload.engine} engine defaults"


async def run_levels(
    target: Target, settings: Settings, rates: Mapping[int, float], workdir: Path
) -> list[Level]:
    """Every in-flight level of one stood-up target: a warm-up, then the measured run."""
    out = []
    workload = settings.workload
    for in_flight in settings.levels:
        rate = rates[in_flight]
        print(f"    {target.name}: {in_flight} in flight at {rate:.3g} req/s", flush=True)
        warm = schedule(workload, in_flight, rate, settings.warmup_s, settings.burst)
        base = workdir / f"{target.name}-{in_flight}"
        await drive(target, warm, in_flight, rate, base.with_suffix(".warmup.jsonl"))
        plan = schedule(workload, in_flight, rate, settings.duration_s, settings.burst)
        out.append(await drive(target, plan, in_flight, rate, base.with_suffix(".jsonl")))
    return out


async def measure(
    settings: Settings, chosen: Sequence[tuple[str, TargetFactory]], workdir: Path
) -> tuple[list[Level], dict[int, float], str]:
    """Each target stood up, measured at every level and torn down in turn (``inproc`` first,
    where it measures the rates). Returns the levels, the rates used and where they came from."""
    rates = fixed_rates(settings)
    source = _fixed_source(settings)
    levels: list[Level] = []
    for name, factory in sorted(chosen, key=lambda c: c[0] != FLOOR):
        print(f"  standing up {name} ...", flush=True)
        target = await factory(name, settings.workload, workdir)
        try:
            if rates is None:
                rates = {
                    lv: await probe_rate(target, settings.workload, lv, workdir)
                    for lv in settings.levels
                }
                source = f"{UTILIZATION:g} x in-process closed-loop throughput"
                print(f"  rates ({source}): {_rates_text(rates)}", flush=True)
            levels += await run_levels(target, settings, rates, workdir)
        finally:
            await target.close()
    return levels, rates or {}, source


def _rates_text(rates: Mapping[int, float]) -> str:
    return ", ".join(f"{lv} in flight {r:.3g} req/s" for lv, r in rates.items())


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


@dataclass(frozen=True, slots=True)
class Column:
    """One table column: its header, the row key it shows, and decimals for a number."""

    header: str
    key: str
    digits: int = 0


LATENCY_COLUMNS = (
    Column("target", "target"),
    Column("in-flight", "in_flight"),
    Column("req/s", "rate", 2),
    Column("n", "completed"),
    Column("err", "errors"),
    Column("ttft p50", "ttft_p50_ms", 3),
    Column("ttft p99", "ttft_p99_ms", 3),
    Column("e2el p50", "e2el_p50_ms", 3),
    Column("e2el p99", "e2el_p99_ms", 3),
    Column("+ttft p50", "added_ttft_p50_ms", 3),
    Column("+ttft p99", "added_ttft_p99_ms", 3),
    Column("+e2el p50", "added_e2el_p50_ms", 3),
    Column("+e2el p99", "added_e2el_p99_ms", 3),
    Column("lag p99", "lag_p99_ms", 3),
)
COST_COLUMNS = (
    Column("target", "target"),
    Column("in-flight", "in_flight"),
    Column("tok/req", "tokens_per_request"),
    Column("short", "short_streams"),
    Column("cli us/req", "client_cpu_us_per_request"),
    Column("srv us/req", "server_cpu_us_per_request"),
    Column("srv us/tok", "server_cpu_us_per_token", 1),
    Column("layer us/tok", "layer_cpu_us_per_token", 1),
    Column("host busy %", "host_busy_pct"),
    Column("load1", "load1", 2),
    Column("saturated", "saturated"),
)


def _token_range(tokens: Sequence[int]) -> str | None:
    if not tokens:
        return None
    low, high = min(tokens), max(tokens)
    return str(low) if low == high else f"{low}-{high}"


def row(level: Level, floor: Level | None, max_tokens: int) -> dict[str, Any]:
    """Everything known about one level, keyed as the JSON output and the tables name it."""
    plus = added(level, floor)
    return {
        "target": level.target,
        "in_flight": level.in_flight,
        "rate": level.rate,
        "completed": level.completed,
        "errors": level.errors,
        "error_codes": level.error_codes,
        "ttft_p50_ms": level.ttft_p50_ms,
        "ttft_p99_ms": level.ttft_p99_ms,
        "e2el_p50_ms": level.e2el_p50_ms,
        "e2el_p99_ms": level.e2el_p99_ms,
        **{f"added_{k}": v for k, v in asdict(plus).items()},
        "lag_p99_ms": level.lag_p99_ms,
        "tokens_per_request": _token_range(level.tokens),
        "tokens_total": level.tokens_total,
        "short_streams": level.short_streams(max_tokens),
        "client_cpu_us_per_request": level.client_cpu_us,
        "server_cpu_s": level.server_cpu.total_s if level.server_cpu else None,
        "layer_cpu_s": level.server_cpu.layer_s if level.server_cpu else None,
        "server_cpu_us_per_request": level.server_us_per_request,
        "server_cpu_us_per_token": level.server_us_per_token,
        "layer_cpu_us_per_token": level.layer_us_per_token,
        "host_busy_pct": 100.0 * level.host.busy,
        "load1": level.host.load1,
        "saturated": "yes" if level.host.saturated else "no",
        "invalid_reasons": list(level.invalid_reasons),
    }


def rows(levels: Sequence[Level], max_tokens: int) -> list[dict[str, Any]]:
    """One row per level, each with what it adds over the in-process level of its in-flight."""
    floor = floors(levels)
    return [row(lv, floor.get(lv.in_flight), max_tokens) for lv in levels]


def _cell(value: Any, digits: int) -> str:
    """A missing figure is a dash, never 0."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _cells(table_rows: Sequence[Mapping[str, Any]], columns: Sequence[Column]) -> list[list[str]]:
    return [[c.header for c in columns]] + [
        [_cell(r[c.key], c.digits) for c in columns] for r in table_rows
    ]


def text_table(table_rows: Sequence[Mapping[str, Any]], columns: Sequence[Column]) -> str:
    """Aligned columns, the first left-aligned."""
    cells = _cells(table_rows, columns)
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    return "\n".join(
        " ".join(
            v.ljust(w) if i == 0 else v.rjust(w)
            for i, (v, w) in enumerate(zip(line, widths, strict=True))
        )
        for line in cells
    )


def markdown_table(table_rows: Sequence[Mapping[str, Any]], columns: Sequence[Column]) -> str:
    cells = _cells(table_rows, columns)
    head, body = cells[0], cells[1:]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(line) + " |" for line in body])


def table(levels: Sequence[Level], max_tokens: int = 0) -> str:
    """The side-by-side tables (latency, then costs) and any errors by code."""
    table_rows = rows(levels, max_tokens)
    notes = [f"{lv.target} at {lv.in_flight} in flight: errors {lv.error_codes}"
             for lv in levels if lv.error_codes]  # fmt: skip
    parts = [text_table(table_rows, LATENCY_COLUMNS), "", text_table(table_rows, COST_COLUMNS)]
    return "\n".join(parts + notes)


def warnings(levels: Sequence[Level], max_tokens: int) -> list[str]:
    """Levels where a request streamed other than ``max_tokens`` tokens, whose summary says
    their latencies are invalid (the loader lagged, requests were lost), or the host saturated."""
    out = []
    for lv in levels:
        short = lv.short_streams(max_tokens)
        if short:
            out.append(
                f"WARNING: {lv.target} at {lv.in_flight} in flight: {short} of {lv.completed} "
                f"requests streamed other than {max_tokens} tokens ({_token_range(lv.tokens)})"
            )
        if lv.invalid_reasons:
            out.append(
                f"NOTE: {lv.target} at {lv.in_flight} in flight is no valid latency measurement: "
                + "; ".join(lv.invalid_reasons)
            )
        if lv.host.saturated:
            out.append(
                f"NOTE: host saturated during {lv.target} at {lv.in_flight} in flight "
                f"(CPU {100 * lv.host.busy:.0f}% of {lv.host.cores} cores, "
                f"load {lv.host.load1:.2f}): trust its CPU figures over its latencies"
            )
    return out


def _signed(value: float | None, unit: str) -> str:
    return f"{value:+.2f} {unit}" if value is not None else "-"


def _us(value: float | None) -> str:
    return f"{value:.0f} us" if value is not None else "-"


def _less(a: float | None, b: float | None) -> bool | None:
    return None if a is None or b is None else a < b


def verdict(levels: Sequence[Level], ours: str = OURS, peer: str = PEER) -> str | None:
    """One line: does ``ours`` add less than ``peer`` (added E2EL p50 and p99 over in-process,
    and the layer's CPU per streamed token) at every in-flight level both ran? None if they did
    not both run beside ``inproc``."""
    floor = floors(levels)
    by = {(lv.target, lv.in_flight): lv for lv in levels}
    shared = [n for (t, n) in by if t == ours and (peer, n) in by and n in floor]
    if not shared:
        return None
    latency: list[bool | None] = []
    cpu: list[bool | None] = []
    details = []
    for n in sorted(shared):
        a, b = by[ours, n], by[peer, n]
        plus_a, plus_b = added(a, floor[n]), added(b, floor[n])
        latency += [_less(plus_a.e2el_p50_ms, plus_b.e2el_p50_ms),
                    _less(plus_a.e2el_p99_ms, plus_b.e2el_p99_ms)]  # fmt: skip
        cpu.append(_less(a.layer_us_per_token, b.layer_us_per_token))
        details.append(
            f"{n} in flight: +e2el p50 {_signed(plus_a.e2el_p50_ms, 'ms')} vs "
            f"{_signed(plus_b.e2el_p50_ms, 'ms')}, p99 {_signed(plus_a.e2el_p99_ms, 'ms')} vs "
            f"{_signed(plus_b.e2el_p99_ms, 'ms')}, layer CPU/token "
            f"{_us(a.layer_us_per_token)} vs {_us(b.layer_us_per_token)}"
        )
    return f"verdict: {ours} {_judge(latency, cpu)} {peer} ({'; '.join(details)})"


def auth_costs(levels: Sequence[Level]) -> list[str]:
    """A line per stack run both ways (``NAME`` and ``NAME+auth``) and in-flight level: what
    authentication added to E2EL p50 and p99 and to the server's CPU per completed request."""
    by = {(lv.target, lv.in_flight): lv for lv in levels}
    lines = []
    for (target, n), on in by.items():
        off = by.get((target.removesuffix(AUTH_SUFFIX), n))
        if not target.endswith(AUTH_SUFFIX) or off is None:
            continue
        cpu = _minus(on.server_us_per_request, off.server_us_per_request)
        lines.append(
            f"auth cost, {off.target} at {n} in flight: E2EL p50 "
            f"{_signed(_minus(on.e2el_p50_ms, off.e2el_p50_ms), 'ms')}, p99 "
            f"{_signed(_minus(on.e2el_p99_ms, off.e2el_p99_ms), 'ms')}, server CPU "
            f"{_signed(cpu, 'us')} per request ({_us(off.server_us_per_request)} -> "
            f"{_us(on.server_us_per_request)})"
        )
    return lines


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


def _word(results: Sequence[bool | None]) -> str:
    """``less`` when every comparison came out less, ``more`` when none did, else ``mixed``."""
    if all(results):
        return "less"
    return "more" if not any(results) else "mixed"


def _judge(latency: Sequence[bool | None], cpu: Sequence[bool | None]) -> str:
    """The verdict's words: added latency and CPU per token, each less, more or mixed."""
    if None in latency or None in cpu:
        return "cannot be compared (figures missing) with"
    return f"adds {_word(latency)} latency and {_word(cpu)} layer CPU per token than"


def write_out(
    out: Path, settings: Settings, levels: Sequence[Level], rates: Mapping[int, float], source: str
) -> None:
    """``overhead.json`` (settings, rates, every row, the verdict) and ``overhead.md``."""
    out.mkdir(parents=True, exist_ok=True)
    max_tokens = settings.workload.max_tokens
    table_rows = rows(levels, max_tokens)
    line = verdict(levels)
    notes = warnings(levels, max_tokens)
    costs = auth_costs(levels)
    doc = {
        "workload": asdict(settings.workload),
        "levels": list(settings.levels),
        "duration_s": settings.duration_s,
        "warmup_s": settings.warmup_s,
        "burst": settings.burst,
        "rates": {str(k): v for k, v in rates.items()},
        "rate_source": source,
        "cores": _cores(),
        "rows": table_rows,
        "verdict": line,
        "warnings": notes,
        "auth": settings.auth,
        "auth_cost": costs,
    }
    (out / "overhead.json").write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    md = [
        f"# zl-bench overhead ({settings.workload.engine} engine)",
        "",
        _header(settings, rates, source),
        "",
        "Latency (ms from intended send; + is added over in-process):",
        "",
        markdown_table(table_rows, LATENCY_COLUMNS),
        "",
        "Tokens and CPU:",
        "",
        markdown_table(table_rows, COST_COLUMNS),
    ]
    md += [""] + [f"- {n}" for n in notes] if notes else []
    md += ["", line] if line else []
    md += [""] + [f"- {c}" for c in costs] if costs else []
    (out / "overhead.md").write_text("\n".join(md) + "\n")


def _header(settings: Settings, rates: Mapping[int, float], source: str) -> str:
    w = settings.workload
    return (
        f"overhead: {w.engine} engine, {settings.duration_s:g} s per level, "
        f"in-flight {list(settings.levels)}, rates: "
        f"{f'{_rates_text(rates)} ({source})' if rates else source}, "
        f"prompt {w.prompt_bytes} B, {w.max_tokens} output tokens, streamed"
        + (", in bursts of the in-flight count" if settings.burst else "")
    )


def _workdir(out: Path | None) -> contextlib.AbstractContextManager[str]:
    """Where records and stack logs go: kept under ``out/work`` when there is an ``out``."""
    if out is None:
        return tempfile.TemporaryDirectory(prefix="zl-overhead-")
    (out / "work").mkdir(parents=True, exist_ok=True)
    return contextlib.nullcontext(str(out / "work"))


async def main_async(settings: Settings, chosen: Sequence[tuple[str, TargetFactory]]) -> None:
    rates = fixed_rates(settings)
    source = _fixed_source(settings) if rates else "measured in-process first"
    print(_header(settings, rates or {}, source), flush=True)
    with _workdir(settings.out) as work:
        levels, rates, source = await measure(settings, chosen, Path(work))
    if levels:
        max_tokens = settings.workload.max_tokens
        print()
        print(table(levels, max_tokens))
        for line in [*warnings(levels, max_tokens), verdict(levels), *auth_costs(levels)]:
            if line:
                print(line)
    if settings.auth:
        print(f"authorize(): {authorize_us():.2f} us per request in-process ({AUTHORIZE_CALLS} "
              "calls: one SHA-256 of the key, one dict lookup)", flush=True)  # fmt: skip
    if settings.out is not None:
        write_out(settings.out, settings, levels, rates, source)
        print(f"wrote {settings.out / 'overhead.json'} and overhead.md", flush=True)
    if settings.rss_streams:
        rss = await replica_rss(settings.rss_streams, settings.rss_max_tokens, hold_s=1.0)
        print()
        print(
            f"replica RSS (sim engine): idle {rss['rss_idle_mb']:.1f} MB; with "
            f"{rss['streams_open']} open streams {rss['rss_open_mb']:.1f} MB "
            f"({rss['rss_held_mb']:.1f} MB after 1 s held); refused {rss['streams_refused']}"
        )


def _plugin(spec: str) -> tuple[str, TargetFactory]:
    name, _, ref = spec.partition("=")
    module, _, attr = ref.partition(":")
    if not (name and module and attr):
        raise UsageError(f"--target wants NAME=module:function, got {spec!r}")
    try:
        return name, getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise UsageError(f"--target {spec!r}: {exc}") from exc


def targets(settings: Settings, plugins: Sequence[str] = ()) -> list[tuple[str, TargetFactory]]:
    """The built-in targets ``settings`` names and the plug-ins of ``--target``."""
    names = [n for n in settings.targets.split(",") if n]
    unknown = [n for n in names if n not in BUILTIN]
    if unknown:
        raise UsageError(f"unknown targets {unknown}; built in: {', '.join(BUILTIN)}")
    if settings.workload.engine != "vllm" and VLLM_ONLY.intersection(names):
        raise UsageError(f"target {PEER} is vLLM's own server: it needs --engine vllm")
    checks_keys = _checks_keys(settings, names)
    chosen: list[tuple[str, TargetFactory]] = []
    for n in names:
        chosen.append((n, BUILTIN[n]))
        if n in checks_keys:  # measured right after its run without authentication
            chosen.append((n + AUTH_SUFFIX, WITH_AUTH[n]))
    return chosen + [_plugin(spec) for spec in plugins]


def _checks_keys(settings: Settings, names: Sequence[str]) -> set[str]:
    """The targets ``--auth`` runs again with authentication on (none without ``--auth``)."""
    if not settings.auth:
        return set()
    found = {n for n in names if n in WITH_AUTH}
    if settings.workload.engine == "vllm":
        found &= {OURS}
    if not found:
        raise UsageError("--auth needs a target that checks API keys: zerolayer (or baseline)")
    return found


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The ``--engine-option``s, checked against the engine's config."""
    options = dict(args.engine_options)
    if args.engine == "null":
        if options:
            raise UsageError(f"the null engine takes no options, got {', '.join(options)}")
        return options
    if importlib.util.find_spec(args.engine) is None:
        raise UsageError(f"--engine {args.engine} needs vLLM installed (see nox -s vllm)")
    if not options.get("model"):
        raise UsageError(
            f"--engine {args.engine} needs --engine-option model=DIR (see zl-bench tiny-model)"
        )
    if not Path(options["model"]).is_dir():
        raise UsageError(f"--engine-option model={options['model']}: not a directory")
    try:
        return validate_engine_options(args.engine, options)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def resolve(args: argparse.Namespace) -> Settings:
    """The run's settings: what the command line gave, the engine's defaults for the rest."""
    d = DEFAULTS[args.engine]

    def given(value: Any, default: Any) -> Any:
        return default if value is None else value

    workload = Workload(
        given(args.prompt_bytes, d.prompt_bytes),
        given(args.max_tokens, d.max_tokens),
        args.engine,
        engine_options(args),
    )
    return Settings(
        workload=workload,
        targets=given(args.targets, d.targets),
        levels=tuple(given(args.levels, d.levels)),
        rate=args.rate,
        duration_s=given(args.duration, d.duration_s),
        warmup_s=given(args.warmup, d.warmup_s),
        burst=given(args.burst, d.burst),
        rss_streams=given(args.rss_streams, d.rss_streams),
        rss_max_tokens=args.rss_max_tokens,
        out=args.out,
        auth=args.auth,
    )


def _levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected counts like 1,64, got {text!r}") from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"in-flight counts must be >= 1, got {text!r}")
    return levels


def _number(kind: type[float] | type[int], least: float) -> Callable[[str], float]:
    """An argparse type: a number of ``kind`` at least ``least``."""

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be at least {least}, got {text}")
        return value

    return parse


_positive = _number(float, 1e-9)
_count = _number(int, 1)


def _default_help(what: Callable[[Defaults], Any]) -> str:
    return "default: " + "; ".join(f"{what(d)} ({e})" for e, d in DEFAULTS.items())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``zl-bench overhead``'s options; those left unset take the engine's defaults."""
    parser.add_argument("--engine", choices=ENGINES, default="null", help="engine behind all")
    add_engine_option(parser)
    parser.add_argument(
        "--duration",
        type=_positive,
        help="seconds per level; " + _default_help(lambda d: d.duration_s),
    )
    parser.add_argument(
        "--warmup",
        type=_positive,
        help="warm-up seconds per level; " + _default_help(lambda d: d.warmup_s),
    )
    parser.add_argument(
        "--levels",
        type=_levels,
        help="in-flight levels; " + _default_help(lambda d: ",".join(map(str, d.levels))),
    )
    parser.add_argument(
        "--rate",
        type=_number(float, 0.0),
        default=0.0,
        help="req/s for every level (0: 200 at 1, 500 at 64 for null; for vllm a quarter of "
        "the in-process throughput measured at each level)",
    )
    parser.add_argument(
        "--burst",
        action=argparse.BooleanOptionalAction,
        help="send each level's requests in-flight at a time (so 16 in flight are 16 open "
        "streams, not a rate); " + _default_help(lambda d: d.burst),
    )
    parser.add_argument(
        "--targets",
        help=f"built in: {','.join(BUILTIN)}; " + _default_help(lambda d: d.targets),
    )
    parser.add_argument(
        "--target", action="append", default=[], help="plug-in NAME=module:function, repeatable"
    )
    parser.add_argument(
        "--prompt-bytes",
        type=_count,
        help="prompt size; " + _default_help(lambda d: d.prompt_bytes),
    )
    parser.add_argument(
        "--max-tokens", type=_count, help="output tokens; " + _default_help(lambda d: d.max_tokens)
    )
    parser.add_argument(
        "--out", type=Path, help="write overhead.json, overhead.md and work/ (records, logs) here"
    )
    parser.add_argument(
        "--rss-streams",
        type=_number(int, 0),
        help="0 skips the RSS check; " + _default_help(lambda d: d.rss_streams),
    )
    parser.add_argument(
        "--auth",
        action="store_true",
        help="also run each stack that checks API keys with authentication on (NAME+auth) and "
        "report what it costs per request",
    )
    parser.add_argument(
        "--rss-max-tokens",
        type=_count,
        default=1024,
        help="long enough to stay open, short enough that 1000 fit under the KV watermarks",
    )


def run_command(args: argparse.Namespace) -> int:
    """Run the benchmark and print its tables; mistakes in the arguments are UsageErrors."""
    settings = resolve(args)
    chosen = targets(settings, args.target)
    uvloop.run(main_async(settings, chosen))
    return 0
