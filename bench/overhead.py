"""``zl-bench overhead``: what the serving layer itself costs, over an in-process null engine.

Each target (the in-process engine; the zero-layer stack SDK -> replica -> null engine; the Ray
Serve baseline over HTTP/1.1; any plugged-in ``--target NAME=module:function``) is driven with the
same schedule by the native loader (``harness.loaders.native.run_schedule``): a fixed rate for a
bounded time with at most ``in_flight`` requests outstanding (wrk2-style; or bursts of
``in_flight`` with ``--burst``), latency measured from each request's intended send time. Stacks
are stood up the one way (``harness.stacks.stand_up``) over the null engine, so every millisecond
a request takes is the layer's own. The table gives p50/p99 per target and in-flight level, what
each adds over in-process, the loader's own CPU per request (``cpu us``, idle spin excluded) and
the target's server CPU per request (``srv us``): the figures to trust when other work shares the
machine and wall-clock percentiles do not. Then a replica's RSS is measured with 1000 concurrent
open streams (sim engine, long generations) through one SDK connection.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import uvloop

from harness.errors import UsageError
from harness.loaders.base import LoadResult
from harness.loaders.native import Sender, SendFn, client_sender, engine_sender, run_schedule
from harness.stacks import ReplicaProcess, StackName, StackSpec, stand_up
from harness.workload import PlannedRequest
from zerolayer.client import ZeroLayerClient, ZeroLayerError
from zerolayer.engine import NullEngine

DEFAULT_RATES = {1: 200.0, 64: 500.0}
DEADLINE_MS = 30_000


@dataclass(frozen=True, slots=True)
class Workload:
    """The request every target serves; the null engine answers it in one chunk."""

    prompt_bytes: int = 1024
    max_tokens: int = 128


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
class Level:
    """One target at one in-flight level: percentiles (ms) from the run's summary, CPU costs."""

    target: str
    in_flight: int
    completed: int
    errors: int
    p50_ms: float | None
    p99_ms: float | None
    lag_p99_ms: float | None
    client_cpu_us: float
    server_cpu_us: float | None
    error_codes: dict[str, int] = field(default_factory=dict)


async def inproc_target(name: str, workload: Workload, workdir: Path) -> Target:
    """The floor: the null engine called in this process, no serving layer at all."""
    engine = NullEngine()
    return Target(name, engine_sender(engine), engine.close)


def stack_target(stack_name: StackName) -> TargetFactory:
    """A stack over the null engine (one replica), stood up the one way, through its client."""

    async def factory(name: str, workload: Workload, workdir: Path) -> Target:
        spec = StackSpec(stack_name, engine="null", replicas=1)
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
        return Target(name, client_sender(client), close, pids)

    return factory


BUILTIN: dict[str, TargetFactory] = {
    "inproc": inproc_target,
    "zerolayer": stack_target(StackName.ZEROLAYER),
    "rayserve": stack_target(StackName.BASELINE),
}


def schedule(
    workload: Workload, in_flight: int, rate: float, duration_s: float, burst: bool
) -> list[PlannedRequest]:
    """Evenly spaced at ``1 / rate``; with ``burst``, ``in_flight`` at a time every
    ``in_flight / rate`` s."""
    group = in_flight if burst else 1
    period = group / rate
    rounds = max(1, int(duration_s / period))
    return [
        PlannedRequest(
            index=i,
            request_id=f"ovh-{i}",
            offset_s=(i // group) * period,
            request_class="overhead",
            prompt_bytes=workload.prompt_bytes,
            max_tokens=workload.max_tokens,
            seed=7,
            session=f"s{i % 1024}",
            tenant="default",
            priority="normal",
            deadline_ms=DEADLINE_MS,
        )
        for i in range(rounds * group)
    ]


def _cpu_s(pids: Sequence[int]) -> float:
    total = 0.0
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            total += sum(psutil.Process(pid).cpu_times()[:2])
    return total


async def drive(
    target: Target, plan: Sequence[PlannedRequest], in_flight: int, records: Path
) -> Level:
    """One level through the native loader; server CPU measured around it."""
    server0 = _cpu_s(target.server_pids)
    result: LoadResult = await run_schedule(
        plan,
        target.send,
        stack=target.name,
        profile=f"overhead-{in_flight}",
        records_path=records,
        max_in_flight=in_flight,
    )
    server = _cpu_s(target.server_pids) - server0
    s = result.summary
    n = max(1, len(plan))
    return Level(
        target=target.name,
        in_flight=in_flight,
        completed=int(s["completed"]),
        errors=int(s["errors"]) + int(s["lost"]),
        p50_ms=s.get("median_e2el_intended_ms"),
        p99_ms=s.get("p99_e2el_intended_ms"),
        lag_p99_ms=s.get("p99_lag_ms"),
        client_cpu_us=float(result.extra["loader_cpu_us_per_request"]),
        server_cpu_us=server / n * 1e6 if target.server_pids else None,
        error_codes=dict(s["errors_by_code"]),
    )


async def run_target(
    name: str, factory: TargetFactory, args: argparse.Namespace, workdir: Path
) -> list[Level]:
    """Every in-flight level of one target: a warm-up, then the measured run."""
    workload = Workload(args.prompt_bytes, args.max_tokens)
    out = []
    for in_flight in args.levels:
        rate = args.rate or DEFAULT_RATES.get(in_flight, 10.0 * in_flight)
        target = await factory(name, workload, workdir)
        try:
            warm = schedule(workload, in_flight, rate, args.warmup, args.burst)
            await drive(target, warm, in_flight, workdir / f"{name}-{in_flight}-warmup.jsonl")
            plan = schedule(workload, in_flight, rate, args.duration, args.burst)
            out.append(await drive(target, plan, in_flight, workdir / f"{name}-{in_flight}.jsonl"))
        finally:
            await target.close()
    return out


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


def _ms(value: float | None) -> str:
    return f"{value:>9.3f}" if value is not None else f"{'-':>9}"


def _minus(a: float | None, b: float | None) -> float | None:
    return a - b if a is not None and b is not None else None


def table(levels: Sequence[Level]) -> str:
    """The side-by-side table: latency from intended send, and what each target adds."""
    floor = {lv.in_flight: lv for lv in levels if lv.target == "inproc"}
    rows = [
        f"{'target':<12} {'in-flight':>9} {'n':>7} {'err':>5} {'p50 ms':>9} {'p99 ms':>9} "
        f"{'+p50 ms':>9} {'+p99 ms':>9} {'lag p99':>9} {'cpu us':>7} {'srv us':>7}"
    ]
    for lv in levels:
        base = floor.get(lv.in_flight)
        add50 = _minus(lv.p50_ms, base.p50_ms) if base else None
        add99 = _minus(lv.p99_ms, base.p99_ms) if base else None
        srv = f"{lv.server_cpu_us:>7.0f}" if lv.server_cpu_us is not None else f"{'-':>7}"
        rows.append(
            f"{lv.target:<12} {lv.in_flight:>9} {lv.completed:>7} {lv.errors:>5} "
            f"{_ms(lv.p50_ms)} {_ms(lv.p99_ms)} {_ms(add50)} {_ms(add99)} {_ms(lv.lag_p99_ms)} "
            f"{lv.client_cpu_us:>7.0f} {srv}"
        )
    rows += [f"{lv.target} at {lv.in_flight} in flight: errors {lv.error_codes}"
             for lv in levels if lv.error_codes]  # fmt: skip
    return "\n".join(rows)


def _plugin(spec: str) -> tuple[str, TargetFactory]:
    name, _, ref = spec.partition("=")
    module, _, attr = ref.partition(":")
    if not (name and module and attr):
        raise UsageError(f"--target wants NAME=module:function, got {spec!r}")
    try:
        return name, getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise UsageError(f"--target {spec!r}: {exc}") from exc


def targets(args: argparse.Namespace) -> list[tuple[str, TargetFactory]]:
    """The built-in targets named by ``--targets`` and the plug-ins of ``--target``."""
    names = [n for n in args.targets.split(",") if n]
    unknown = [n for n in names if n not in BUILTIN]
    if unknown:
        raise UsageError(f"unknown targets {unknown}; built in: {', '.join(BUILTIN)}")
    return [(n, BUILTIN[n]) for n in names] + [_plugin(spec) for spec in args.target]


async def main_async(args: argparse.Namespace, chosen: Sequence[tuple[str, TargetFactory]]) -> None:
    rates = [args.rate or DEFAULT_RATES.get(lv, 10.0 * lv) for lv in args.levels]
    print(
        f"overhead: {args.duration:g} s per level, in-flight {args.levels}, rates {rates} req/s, "
        f"prompt {args.prompt_bytes} B, {args.max_tokens} output tokens",
        flush=True,
    )
    levels: list[Level] = []
    with tempfile.TemporaryDirectory(prefix="zl-overhead-") as tmp:
        for name, factory in chosen:
            print(f"  running {name} ...", flush=True)
            levels += await run_target(name, factory, args, Path(tmp))
    if levels:
        print()
        print(table(levels))
    if args.rss_streams:
        rss = await replica_rss(args.rss_streams, args.rss_max_tokens, hold_s=1.0)
        print()
        print(
            f"replica RSS (sim engine): idle {rss['rss_idle_mb']:.1f} MB; with "
            f"{rss['streams_open']} open streams {rss['rss_open_mb']:.1f} MB "
            f"({rss['rss_held_mb']:.1f} MB after 1 s held); refused {rss['streams_refused']}"
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``zl-bench overhead``'s options."""
    parser.add_argument("--duration", type=_positive, default=20.0, help="seconds per level")
    parser.add_argument("--warmup", type=_positive, default=1.0, help="warm-up seconds per level")
    parser.add_argument("--levels", type=_levels, default=[1, 64], help="in-flight levels")
    parser.add_argument(
        "--rate",
        type=_number(float, 0.0),
        default=0.0,
        help="req/s for every level (0: 200 at 1, 500 at 64)",
    )
    parser.add_argument(
        "--burst", action="store_true", help="send each level's requests in-flight at a time"
    )
    parser.add_argument(
        "--targets", default="inproc,zerolayer", help=f"built in: {','.join(BUILTIN)}"
    )
    parser.add_argument(
        "--target", action="append", default=[], help="plug-in NAME=module:function, repeatable"
    )
    parser.add_argument("--prompt-bytes", type=_count, default=1024, help="prompt size")
    parser.add_argument("--max-tokens", type=_count, default=128, help="output tokens")
    parser.add_argument(
        "--rss-streams", type=_number(int, 0), default=1000, help="0 skips the RSS check"
    )
    parser.add_argument(
        "--rss-max-tokens",
        type=_count,
        default=1024,
        help="long enough to stay open, short enough that 1000 fit under the KV watermarks",
    )


def run_command(args: argparse.Namespace) -> int:
    """Run the benchmark and print its table; mistakes in the arguments are UsageErrors."""
    chosen = targets(args)
    uvloop.run(main_async(args, chosen))
    return 0
