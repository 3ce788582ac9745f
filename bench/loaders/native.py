"""The native loader: open-loop asyncio arrivals on a schedule fixed before the run.

Coordinated-omission free: each request has an intended send time from the schedule, and a slow
answer never delays the next send, so latency measured from the intended time includes any stall
the server caused. The dispatcher sleeps until just before each send time and yields the event
loop in a short spin for the last ``spin_s`` (loop timers have 1 ms granularity), then starts the
request's task; the task's start minus the intended time is the scheduling lag, recorded per
request. Every scheduled request ends as exactly one record: completed, error (with a code), or
lost (no answer by deadline + grace); records are written to JSONL as each request ends. The run
is bounded in request count (the schedule) and time (duration + the longest deadline + grace).
The garbage collector is paused for the run: a full collection stalls the loop for milliseconds,
which would show up as scheduling lag (a bounded run's garbage is collected afterwards).

The request itself is an async ``send(request, record)`` callable, so the core runs against any
transport: the zero-layer SDK over HTTP/2, its HTTP/1.1 client towards the baseline, or an
engine called in-process.
"""

from __future__ import annotations

import asyncio
import gc
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TextIO

from bench.loaders.base import DEFAULT_GRACE_S, LoadResult, RequestFailed, make_result, new_record
from bench.metrics import LAG_FRACTION_OF_MEDIAN
from bench.schema import JsonlWriter, RequestRecord
from bench.workload import PlannedRequest
from zerolayer.engine import Engine, EngineError, EngineRequest

SendFn = Callable[[PlannedRequest, RequestRecord], Awaitable[None]]
START_DELAY_S = 0.05
SPIN_S = 0.001
PROGRESS_EVERY_S = 10.0
BACKSTOP_S = 0.5
CONNECTION_ERROR = "connection_error"
NOT_SENT = "not_sent"


def _exception_code(exc: BaseException) -> str:
    return CONNECTION_ERROR if isinstance(exc, OSError) else f"client_{type(exc).__name__}"


async def run_schedule(
    schedule: Sequence[PlannedRequest],
    send: SendFn,
    *,
    stack: str,
    profile: str,
    records_path: str | Path,
    loader: str = "native",
    grace_s: float = DEFAULT_GRACE_S,
    spin_s: float = SPIN_S,
    progress: TextIO | None = None,
    progress_every_s: float = PROGRESS_EVERY_S,
    slos_ms: Mapping[str, float] | None = None,
    lag_fraction: float = LAG_FRACTION_OF_MEDIAN,
    max_in_flight: int | None = None,
    backstop_s: float = BACKSTOP_S,
) -> LoadResult:
    """Send ``schedule`` open-loop through ``send`` and return the summarised result.

    ``send`` fills the record (sent_ns, first_token_ns, chunk_ns, end_ns, output_tokens,
    outcome...) and raises RequestFailed for an explicit error; any other exception becomes an
    error with a client code, and no answer within the deadline plus ``grace_s`` is lost (the
    loader's own backstop fires ``backstop_s`` later, so a client's own timeout gets there first).
    ``max_in_flight`` bounds concurrent requests like wrk2's connection count: a request due
    while every slot is busy waits for one (its wait shows as client queue, sent - intended,
    and counts against its deadline; one that never got a slot ends as error ``not_sent``).
    """
    records_path = Path(records_path)
    records: list[RequestRecord] = []
    in_flight: set[asyncio.Task[None]] = set()
    perf = time.perf_counter_ns
    wall0, perf0 = time.time_ns(), perf()
    start = perf0 + int(START_DELAY_S * 1e9)
    spin_ns = int(spin_s * 1e9)
    writer = JsonlWriter(records_path)
    slots = asyncio.Semaphore(max_in_flight) if max_in_flight else None

    async def one(req: PlannedRequest, target_ns: int) -> None:
        rec = new_record(req, stack, profile, loader, wall0 + (target_ns - perf0))
        rec.dispatch_ns = wall0 + (perf() - perf0)
        got_slot = slots is None
        try:
            async with asyncio.timeout(req.deadline_ms / 1000.0 + grace_s + backstop_s):
                if slots is None:
                    await send(req, rec)
                else:
                    async with slots:
                        got_slot = True
                        await send(req, rec)
        except TimeoutError:
            if got_slot:
                rec.outcome = "lost"
            else:
                rec.outcome, rec.error_code = "error", NOT_SENT
        except RequestFailed as exc:
            rec.outcome, rec.error_code, rec.http_status = "error", exc.code, exc.status
        except asyncio.CancelledError:
            rec.outcome = "lost"
        except Exception as exc:  # every request must end as exactly one record
            rec.outcome, rec.error_code = "error", _exception_code(exc)
        finally:
            if not rec.end_ns:
                rec.end_ns = wall0 + (perf() - perf0)
            if rec.outcome == "error" and not rec.error_code:
                rec.error_code = f"http_{rec.http_status}"
            records.append(rec)
            writer.write(rec)

    async def report() -> None:
        while True:
            await asyncio.sleep(progress_every_s)
            done = len(records)
            lost = sum(1 for r in records if r.outcome == "lost")
            errors = sum(1 for r in records if r.outcome == "error")
            elapsed = (perf() - start) / 1e9
            print(
                f"[{loader}] {stack}/{profile} t={elapsed:.0f}s ended {done}/{len(schedule)} "
                f"errors {errors} lost {lost} in flight {len(in_flight)}",
                file=progress,
                flush=True,
            )

    longest_s = max((r.deadline_ms for r in schedule), default=0) / 1000.0 + grace_s + backstop_s
    span_s = schedule[len(schedule) - 1].offset_s if len(schedule) else 0.0
    reporter = (
        asyncio.create_task(report())
        if progress is not None and span_s + longest_s > progress_every_s
        else None
    )
    loop = asyncio.get_running_loop()
    gc_was_enabled = gc.isenabled()
    gc.freeze()
    gc.disable()
    try:
        for req in schedule:
            target = start + int(req.offset_s * 1e9)
            wait = target - perf() - spin_ns
            if wait > 0:
                await asyncio.sleep(wait / 1e9)
            while perf() < target:
                await asyncio.sleep(0)
            task = loop.create_task(one(req, target))
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)
        if in_flight:
            _, pending = await asyncio.wait(set(in_flight), timeout=longest_s + 1.0)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending)
    finally:
        for task in in_flight:
            task.cancel()
        if in_flight:
            await asyncio.wait(set(in_flight))
        if reporter is not None:
            reporter.cancel()
        writer.close()
        gc.unfreeze()
        if gc_was_enabled:
            gc.enable()
    return make_result(
        loader,
        stack,
        profile,
        records_path,
        records,
        slos_ms=slos_ms,
        lag_fraction=lag_fraction,
        extra={"scheduled": len(schedule)},
    )


def engine_sender(engine: Engine) -> SendFn:
    """Send straight into an engine in-process: the no-network reference for 'where time goes'."""

    async def send(req: PlannedRequest, rec: RequestRecord) -> None:
        now = time.time_ns
        rec.sent_ns = now()
        ereq = EngineRequest(req.request_id, req.prompt_tokens, req.max_tokens, req.seed)
        try:
            async for chunk in engine.generate(ereq):
                if chunk.token_ids:
                    t = now()
                    if not rec.first_token_ns:
                        rec.first_token_ns = t
                    rec.chunk_ns.append(t)
                    rec.output_tokens += len(chunk.token_ids)
        except EngineError as exc:
            raise RequestFailed(exc.code) from exc
        rec.end_ns = now()
        rec.outcome = "completed"

    return send


class _Timing(Protocol):
    sent_ns: int
    first_token_ns: int
    end_ns: int
    chunk_ns: list[int]
    status: int
    error_code: str
    retries: int
    replica: str
    output_tokens: int

    @property
    def outcome(self) -> str: ...


def copy_timing(timing: _Timing, rec: RequestRecord, tokens: int) -> None:
    """Move an SDK timing record into our RequestRecord (the SDK and the schema share names)."""
    rec.sent_ns = timing.sent_ns
    rec.first_token_ns = timing.first_token_ns
    rec.end_ns = timing.end_ns
    rec.chunk_ns = list(timing.chunk_ns)
    rec.http_status = timing.status
    rec.retries = timing.retries
    rec.replica = timing.replica
    rec.output_tokens = timing.output_tokens or tokens
    rec.error_code = timing.error_code
    rec.outcome = timing.outcome  # type: ignore[assignment]


def client_sender(client: Any) -> SendFn:
    """Send through a zero-layer client (``ZeroLayerClient`` over HTTP/2 or ``Http1Client``).

    Both clients expose ``stream(prompt=..., ...)`` with a ``timing`` record and raise
    ``ZeroLayerError`` (which carries the timing) when a request does not complete.
    """
    from zerolayer.client import ZeroLayerError

    async def send(req: PlannedRequest, rec: RequestRecord) -> None:
        stream = client.stream(
            prompt=req.prompt(),
            max_tokens=req.max_tokens,
            session=req.session,
            tenant=req.tenant,
            priority=req.priority,
            deadline_ms=req.deadline_ms,
            seed=req.seed,
        )
        tokens = 0
        try:
            async with stream as s:
                async for chunk in s:
                    tokens += chunk.tokens
        except ZeroLayerError:
            pass
        copy_timing(stream.timing, rec, tokens)

    return send


async def run_native(
    schedule: Sequence[PlannedRequest],
    *,
    urls: Sequence[str],
    protocol: str = "h2",
    stack: str,
    profile: str,
    records_path: str | Path,
    grace_s: float = DEFAULT_GRACE_S,
    progress: TextIO | None = sys.stdout,
    client_options: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> LoadResult:
    """Drive a stack over the network: ``h2`` through the zero-layer SDK (routing over every
    URL), ``http1`` through its HTTP/1.1 keep-alive client (one URL: the baseline's proxy).
    ``client_options`` go to the client's constructor; ``kwargs`` to ``run_schedule``."""
    from zerolayer.client import Http1Client, ZeroLayerClient

    options = dict(client_options or {})
    options.setdefault("grace_ms", int(grace_s * 1000))
    if protocol == "h2":
        client: Any = ZeroLayerClient(urls, **options)
    elif protocol == "http1":
        if len(urls) != 1:
            raise ValueError("the HTTP/1.1 loader takes exactly one URL (the front door)")
        client = Http1Client(urls[0], **options)
    else:
        raise ValueError(f"protocol must be h2 or http1, got {protocol!r}")
    async with client:
        return await run_schedule(
            schedule,
            client_sender(client),
            stack=stack,
            profile=profile,
            records_path=records_path,
            grace_s=grace_s,
            progress=progress,
            **kwargs,
        )
