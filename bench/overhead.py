"""What the serving layer itself costs: latency added over an in-process null-engine call.

Each target (the in-process engine, the zero-layer path SDK -> replica -> null engine, and any
plugged-in stack such as the Ray Serve baseline over HTTP/1.1) is driven with the same schedule: a
fixed rate for a bounded time with at most ``in_flight`` requests outstanding (wrk2-style; or bursts
of ``in_flight`` with ``--burst``), latency measured from each request's intended send time
(dispatch waits with the native loader's ``wait_until``, which keeps reading responses while it
waits, so neither the loop's millisecond timers nor a blocking spin are charged to the target; the
garbage collector is paused while a level runs). The table gives p50/p99 per target and in-flight
level, and what each adds over in-process. Then a replica's RSS is measured with 1000 concurrent
open streams (sim engine, long generations) through one SDK connection.

Run: ``python -m bench.overhead [--duration 20] [--targets inproc,zerolayer,rayserve]``. A target is
any ``async (in_flight) -> (send, teardown)``; add one with ``--target NAME=mod:fn``. A ``send``
with a ``server_pids`` attribute also gets its servers' CPU per request reported (``srv us``);
``cpu us`` is the loader process's own CPU per request (idle spin turns excluded), the figures to
trust when other work shares the machine and wall-clock percentiles do not.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import importlib
import itertools
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import psutil
import uvloop

from harness.loaders.native import wait_until
from harness.stacks import ReplicaProcess
from zerolayer.client import Http1Client, ZeroLayerClient, ZeroLayerError
from zerolayer.engine import EngineRequest, NullEngine
from zerolayer.wire.tokens import count_prompt_tokens

Send = Callable[[], Awaitable[None]]
Teardown = Callable[[], Awaitable[None]]
Target = Callable[[int], Awaitable[tuple[Send, Teardown]]]

DEFAULT_RATES = {1: 200.0, 64: 500.0}


@dataclass(slots=True)
class Workload:
    """The request every target serves; the null engine answers it in one chunk."""

    prompt: str = "x" * 1024
    max_tokens: int = 128

    @property
    def prompt_tokens(self) -> int:
        return count_prompt_tokens(self.prompt)


@dataclass(slots=True)
class Level:
    """Latencies (ns) of one target at one in-flight level."""

    target: str
    in_flight: int
    from_intended: list[int] = field(default_factory=list)
    from_sent: list[int] = field(default_factory=list)
    lag: list[int] = field(default_factory=list)
    errors: int = 0
    client_cpu_us: float = float("nan")
    server_cpu_us: float = float("nan")

    def pct(self, q: float, data: str = "from_intended") -> float:
        values = getattr(self, data)
        return float(np.percentile(values, q)) / 1e6 if values else float("nan")


def inproc_target(workload: Workload) -> Target:
    """The floor: the null engine called in this process, no serving layer at all."""

    async def factory(in_flight: int) -> tuple[Send, Teardown]:
        engine = NullEngine()
        ids = itertools.count()
        tokens = workload.prompt_tokens

        async def send() -> None:
            request = EngineRequest(f"r{next(ids)}", tokens, workload.max_tokens, seed=7)
            async for _ in engine.generate(request):
                pass

        return send, engine.close

    return factory


def _client_send(client: ZeroLayerClient | Http1Client, workload: Workload) -> Send:
    ids = itertools.count()

    async def send() -> None:
        async with client.stream(
            prompt=workload.prompt,
            max_tokens=workload.max_tokens,
            session=f"s{next(ids) % 1024}",
            seed=7,
        ) as s:
            async for _ in s:
                pass

    return send


def zerolayer_target(workload: Workload, replicas: int = 1) -> Target:
    """SDK -> HTTP/2 -> ``zl-replica --engine null`` in its own process(es)."""

    async def factory(in_flight: int) -> tuple[Send, Teardown]:
        procs = await asyncio.gather(
            *(asyncio.to_thread(ReplicaProcess, "null") for _ in range(replicas))
        )
        client = ZeroLayerClient([p.url for p in procs])
        await client.start()

        async def teardown() -> None:
            await client.close()
            for p in procs:
                await asyncio.to_thread(p.stop)

        send = _client_send(client, workload)
        send.server_pids = [p.pid for p in procs]  # type: ignore[attr-defined]
        return send, teardown

    return factory


def http1_target(url: str, workload: Workload, close: Teardown) -> tuple[Send, Teardown]:
    """Any HTTP/1.1 endpoint of the shared API, driven through ``Http1Client`` keep-alive."""
    client = Http1Client(url)

    async def teardown() -> None:
        await client.close()
        await close()

    return _client_send(client, workload), teardown


def rayserve_target(workload: Workload) -> Target:
    """The Ray Serve baseline with the null engine, one engine replica, over HTTP/1.1."""

    async def factory(in_flight: int) -> tuple[Send, Teardown]:
        from baselines.rayserve.standup import start_baseline

        handle = await asyncio.to_thread(start_baseline, engine="null", replicas=1)

        async def close() -> None:
            result = await asyncio.to_thread(handle.close)
            if asyncio.iscoroutine(result):
                await result

        return http1_target(handle.url, workload, close)

    return factory


async def drive(
    name: str, send: Send, in_flight: int, rate: float, duration_s: float, burst: bool = False
) -> Level:
    """Send at a fixed rate for ``duration_s``, at most ``in_flight`` at once (wrk2-style).

    Requests are evenly spaced at ``1 / rate``; with ``burst`` they leave ``in_flight`` at a
    time every ``in_flight / rate`` s instead. A request held back by the in-flight limit is
    still timed from its intended send, so a slow target cannot hide its queueing.
    """
    level = Level(name, in_flight)
    group = in_flight if burst else 1
    period = group / rate
    rounds = max(1, int(duration_s / period))
    gate = asyncio.Semaphore(in_flight)
    clock = time.perf_counter_ns

    async def one(intended: int) -> None:
        async with gate:
            start = clock()
            try:
                await send()
            except ZeroLayerError:
                level.errors += 1
                return
            end = clock()
        level.from_intended.append(end - intended)
        level.from_sent.append(end - start)
        level.lag.append(start - intended)

    server = [psutil.Process(pid) for pid in getattr(send, "server_pids", ())]
    tasks = []
    spun = 0
    gc_was_enabled = gc.isenabled()
    gc.freeze()
    gc.disable()  # a collection stalls the loop for milliseconds: not the target's latency
    cpu0 = time.process_time_ns()
    server0 = sum(sum(p.cpu_times()[:2]) for p in server)
    t0 = clock() + 50_000_000
    period_ns = int(period * 1e9)
    try:
        for j in range(rounds):
            intended = t0 + j * period_ns
            spun += await wait_until(intended)
            tasks.extend(asyncio.create_task(one(intended)) for _ in range(group))
        await asyncio.gather(*tasks)
    finally:
        gc.unfreeze()
        if gc_was_enabled:
            gc.enable()
    n = max(1, rounds * group)
    level.client_cpu_us = (time.process_time_ns() - cpu0 - spun) / n / 1e3
    if server:
        level.server_cpu_us = (sum(sum(p.cpu_times()[:2]) for p in server) - server0) / n * 1e6
    return level


async def run_target(
    name: str,
    factory: Target,
    levels: Sequence[int],
    rates: dict[int, float],
    duration_s: float,
    warmup_s: float,
    burst: bool = False,
) -> list[Level]:
    out = []
    for in_flight in levels:
        send, teardown = await factory(in_flight)
        try:
            rate = rates.get(in_flight, 10.0 * in_flight)
            await drive(name, send, in_flight, rate, warmup_s, burst)
            out.append(await drive(name, send, in_flight, rate, duration_s, burst))
        finally:
            await teardown()
    return out


async def replica_rss(streams: int, max_tokens: int, hold_s: float) -> dict[str, float]:
    """RSS of a sim replica before and with ``streams`` open streams on one SDK connection."""
    proc = await asyncio.to_thread(
        ReplicaProcess, "sim", extra_args=["--max-num-seqs", str(max(streams, 256))]
    )
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


def table(levels: list[Level]) -> str:
    """The side-by-side table: latency from intended send, and what each target adds."""
    floor = {lv.in_flight: lv for lv in levels if lv.target == "inproc"}
    rows = [
        f"{'target':<12} {'in-flight':>9} {'n':>7} {'err':>5} {'p50 ms':>9} {'p99 ms':>9} "
        f"{'+p50 ms':>9} {'+p99 ms':>9} {'lag p99':>9} {'cpu us':>7} {'srv us':>7}"
    ]
    for lv in levels:
        base = floor.get(lv.in_flight)
        p50, p99 = lv.pct(50), lv.pct(99)
        add50 = p50 - base.pct(50) if base else float("nan")
        add99 = p99 - base.pct(99) if base else float("nan")
        rows.append(
            f"{lv.target:<12} {lv.in_flight:>9} {len(lv.from_intended):>7} {lv.errors:>5} "
            f"{p50:>9.3f} {p99:>9.3f} {add50:>9.3f} {add99:>9.3f} {lv.pct(99, 'lag'):>9.3f} "
            f"{lv.client_cpu_us:>7.0f} {lv.server_cpu_us:>7.0f}"
        )
    return "\n".join(rows)


def _load_target(spec: str) -> tuple[str, Target]:
    name, _, ref = spec.partition("=")
    module, _, attr = ref.partition(":")
    if not (name and module and attr):
        raise SystemExit(f"--target wants NAME=module:function, got {spec!r}")
    return name, getattr(importlib.import_module(module), attr)


async def main_async(args: argparse.Namespace) -> None:
    workload = Workload(prompt="x" * args.prompt_bytes, max_tokens=args.max_tokens)
    builtin: dict[str, Target] = {
        "inproc": inproc_target(workload),
        "zerolayer": zerolayer_target(workload),
        "rayserve": rayserve_target(workload),
    }
    targets = [(n, builtin[n]) for n in args.targets.split(",") if n]
    targets += [_load_target(spec) for spec in args.target]
    rates = dict(DEFAULT_RATES)
    if args.rate:
        rates = {lv: args.rate for lv in args.levels}
    levels: list[Level] = []
    print(
        f"overhead: {args.duration:g} s per level, in-flight {args.levels}, "
        f"rates {[rates.get(lv, 10.0 * lv) for lv in args.levels]} req/s, "
        f"prompt {args.prompt_bytes} B, {args.max_tokens} output tokens",
        flush=True,
    )
    for name, factory in targets:
        print(f"  running {name} ...", flush=True)
        levels += await run_target(
            name, factory, args.levels, rates, args.duration, args.warmup, args.burst
        )
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


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.overhead", description=__doc__)
    parser.add_argument("--duration", type=float, default=20.0, help="seconds per level")
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds of warm-up per level")
    parser.add_argument("--levels", type=lambda s: [int(x) for x in s.split(",")], default=[1, 64])
    parser.add_argument("--rate", type=float, default=0.0, help="req/s for every level")
    parser.add_argument(
        "--burst", action="store_true", help="send each level's requests in-flight at a time"
    )
    parser.add_argument("--targets", default="inproc,zerolayer")
    parser.add_argument("--target", action="append", default=[], help="NAME=module:function")
    parser.add_argument("--prompt-bytes", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rss-streams", type=int, default=1000, help="0 skips the RSS check")
    parser.add_argument(
        "--rss-max-tokens",
        type=int,
        default=1024,
        help="long enough to stay open, short enough that 1000 fit under the KV watermarks",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    uvloop.run(main_async(parse_args(argv)))


if __name__ == "__main__":
    main()
