"""The native loader: open-loop asyncio arrivals on a schedule fixed before the run.

Coordinated-omission free: each request has an intended send time from the schedule, and a slow
answer never delays the next send, so latency measured from the intended time includes any stall
the server caused. The dispatcher sleeps until about ``spin_s`` before each send time (loop timers
have 1 ms granularity), then turns the event loop (so responses keep being read) between short
naps, spinning only the last fraction of a millisecond; a dispatcher that is already late neither
sleeps nor spins, it sends at once.
Dispatch minus the intended time is the scheduling lag, recorded per request.

Two ways to send: a sender with a ``submit`` attribute (the zero-layer SDK's callback API, see
``client_sender``) is called synchronously from the dispatcher and reports back through a
callback, so a request costs no task, timer or future of the loader's own; any other ``send`` is
an async callable run in one task per request (engines in-process, the HTTP/1.1 client, tests,
and any run with ``max_in_flight``).

Every scheduled request ends as exactly one record: completed, error (with a code), or lost (no
answer by deadline + grace); records are written to JSONL as requests end, in small batches (at
most ``WRITE_EVERY_S`` apart, preferably while the dispatcher has time before its next send), so
an interrupted run keeps what it measured. The run is bounded in
request count (the schedule) and time (duration + the longest deadline + grace). The garbage
collector is paused for the run: a full collection stalls the loop for milliseconds, which would
show up as scheduling lag (a bounded run's garbage is collected afterwards).

The loader's own CPU time, less the idle turns of its spin, is reported per request in the
result's ``extra`` (``loader_cpu_us_per_request``), so its cost can be compared across versions.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TextIO

from harness.loaders.base import DEFAULT_GRACE_S, LoadResult, RequestFailed, make_result, new_record
from harness.metrics import LAG_FRACTION_OF_MEDIAN
from harness.schema import JsonlWriter, RequestRecord
from harness.workload import PlannedRequest
from zerolayer.engine import Engine, EngineError, EngineRequest

SendFn = Callable[[PlannedRequest, RequestRecord], Awaitable[None]]
# submit(request, record, done): start the request now; done(record) once it has ended.
SubmitFn = Callable[[PlannedRequest, RequestRecord, Callable[[RequestRecord], None]], None]
START_DELAY_S = 0.05
SPIN_S = 0.001
PROGRESS_EVERY_S = 10.0
BACKSTOP_S = 0.5
WRITE_EVERY_S = 0.1
# Inside the last ``spin_s`` the dispatcher naps (``time.sleep`` has microsecond resolution where
# the loop's timers have milliseconds; a nap of NAP_S lasts about 0.1 ms here) while the send is
# more than NAP_AHEAD_NS away, and spins only the rest: a loader that spins for whole
# milliseconds gets preempted for whole milliseconds when the cores are shared.
NAP_S = 20e-6
NAP_AHEAD_NS = 250_000
# A spin turn shorter than this found nothing to do: its time counts as spinning, not as work.
IDLE_TURN_NS = 25_000
WRITE_BATCH = 256
FLUSH_AHEAD_NS = 300_000
CONNECTION_ERROR = "connection_error"
NOT_SENT = "not_sent"


def _exception_code(exc: BaseException) -> str:
    return CONNECTION_ERROR if isinstance(exc, OSError) else f"client_{type(exc).__name__}"


class _Batch:
    """Records written as one JSONL chunk (one write and flush for many lines)."""

    __slots__ = ("records",)

    def __init__(self, records: list[RequestRecord]) -> None:
        self.records = records

    def to_json(self) -> bytes:
        return b"\n".join([r.to_json() for r in self.records])


class _Records:
    """Every ended request's record: kept for the summary, written to JSONL in batches."""

    def __init__(self, path: Path) -> None:
        self.all: list[RequestRecord] = []
        self._writer = JsonlWriter(path)
        self._batch: list[RequestRecord] = []
        self._written_at = time.monotonic()

    def add(self, rec: RequestRecord) -> None:
        if not rec.end_ns:
            rec.end_ns = time.time_ns()
        if rec.outcome == "error" and not rec.error_code:
            rec.error_code = f"http_{rec.http_status}"
        self.all.append(rec)
        batch = self._batch
        batch.append(rec)
        if len(batch) >= WRITE_BATCH or time.monotonic() - self._written_at >= WRITE_EVERY_S:
            self.flush()

    @property
    def pending(self) -> bool:
        return bool(self._batch)

    def flush(self) -> None:
        if self._batch:
            self._writer.write(_Batch(self._batch))
            self._batch = []
        self._written_at = time.monotonic()

    def close(self) -> None:
        self.flush()
        self._writer.close()


async def wait_until(target_ns: int, spin_ns: int = int(SPIN_S * 1e9)) -> int:
    """Return at ``target_ns`` (``time.perf_counter_ns``) or just after, never before.

    The loop's timers (millisecond granularity) carry the wait to about ``spin_ns`` before the
    target; then loop turns (responses keep being read), with short naps between them while the
    target is more than NAP_AHEAD_NS away, and a spin for the rest. Already late: returns at once.
    Returns the nanoseconds spent in loop turns that found nothing to do (spinning, not work).
    """
    perf = time.perf_counter_ns
    now = perf()
    if now >= target_ns:
        return 0
    if target_ns - now > spin_ns:
        await asyncio.sleep((target_ns - now - spin_ns) / 1e9)
        now = perf()
    idle = 0
    while now < target_ns:
        await asyncio.sleep(0)  # a turn of the loop: read what has arrived
        before, now = now, perf()
        if now - before < IDLE_TURN_NS:  # a turn that found no work
            idle += now - before
        if target_ns - now > NAP_AHEAD_NS:
            time.sleep(NAP_S)  # give the cores away instead of spinning
            now = perf()
    return idle


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
    A ``send.submit`` (see ``SubmitFn``) is used instead when there is one and no
    ``max_in_flight``; its client's own timeout ends each request, and any request still without
    an answer once the run's time bound has passed is recorded as lost. ``max_in_flight``
    bounds concurrent requests like wrk2's connection count: a request due while every slot is
    busy waits for one (its wait shows as client queue, sent - intended, and counts against its
    deadline; one that never got a slot ends as error ``not_sent``).
    """
    records = _Records(Path(records_path))
    in_flight: set[asyncio.Task[None]] = set()
    submitted: dict[int, RequestRecord] = {}
    perf = time.perf_counter_ns
    wall0, perf0 = time.time_ns(), perf()
    start = perf0 + int(START_DELAY_S * 1e9)
    spin_ns = int(spin_s * 1e9)
    slots = asyncio.Semaphore(max_in_flight) if max_in_flight else None
    submit: SubmitFn | None = getattr(send, "submit", None) if slots is None else None
    loop = asyncio.get_running_loop()
    all_ended = loop.create_future()
    dispatching = True

    async def one(req: PlannedRequest, rec: RequestRecord) -> None:
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
            records.add(rec)

    def ended(rec: RequestRecord) -> None:
        """A submitted request's callback: record it once (late calls after the end are ignored)."""
        if submitted.pop(id(rec), None) is None:
            return
        records.add(rec)
        if not submitted and not dispatching and not all_ended.done():
            all_ended.set_result(None)

    def dispatch(req: PlannedRequest, target_ns: int) -> None:
        rec = new_record(req, stack, profile, loader, wall0 + (target_ns - perf0))
        rec.dispatch_ns = wall0 + (perf() - perf0)
        if submit is None:
            task = loop.create_task(one(req, rec))
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)
            return
        submitted[id(rec)] = rec
        try:
            submit(req, rec, ended)
        except Exception as exc:  # a request the client refused to start (bad arguments)
            rec.outcome, rec.error_code = "error", _exception_code(exc)
            ended(rec)

    async def report() -> None:
        while True:
            await asyncio.sleep(progress_every_s)
            done = records.all
            lost = sum(1 for r in done if r.outcome == "lost")
            errors = sum(1 for r in done if r.outcome == "error")
            elapsed = (perf() - start) / 1e9
            print(
                f"[{loader}] {stack}/{profile} t={elapsed:.0f}s ended {len(done)}/{len(schedule)} "
                f"errors {errors} lost {lost} in flight {len(in_flight) + len(submitted)}",
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
    gc_was_enabled = gc.isenabled()
    gc.freeze()
    gc.disable()
    spun = 0
    cpu0 = time.process_time_ns()
    try:
        for req in schedule:
            target = start + int(req.offset_s * 1e9)
            if target - perf() > FLUSH_AHEAD_NS and records.pending:
                records.flush()  # while there is time before the next send
            spun += await wait_until(target, spin_ns)
            dispatch(req, target)
        dispatching = False
        if submitted:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(all_ended), longest_s + 1.0)
        if in_flight:
            _, pending = await asyncio.wait(set(in_flight), timeout=longest_s + 1.0)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending)
    finally:
        dispatching = False
        cpu_ns = time.process_time_ns() - cpu0
        for task in in_flight:
            task.cancel()
        if in_flight:
            await asyncio.wait(set(in_flight))
        for rec in list(submitted.values()):  # no answer, not even the client's own timeout
            submitted.pop(id(rec))
            rec.outcome = "lost"
            records.add(rec)
        if reporter is not None:
            reporter.cancel()
        records.close()
        gc.unfreeze()
        if gc_was_enabled:
            gc.enable()
    return make_result(
        loader,
        stack,
        profile,
        Path(records_path),
        records.all,
        slos_ms=slos_ms,
        lag_fraction=lag_fraction,
        extra={
            "scheduled": len(schedule),
            "loader_cpu_us_per_request": (cpu_ns - spun) / 1e3 / max(1, len(schedule)),
            "spin_s": spun / 1e9,
        },
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
    ``ZeroLayerError`` (which carries the timing) when a request does not complete. A client with
    the callback API (``ZeroLayerClient.submit``) also gets a ``submit`` on the returned sender,
    which ``run_schedule`` prefers: no task per request.
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

    client_submit = getattr(client, "submit", None)
    if client_submit is not None:

        def submit(
            req: PlannedRequest, rec: RequestRecord, done: Callable[[RequestRecord], None]
        ) -> None:
            def on_done(timing: _Timing, tokens: int) -> None:
                copy_timing(timing, rec, tokens)
                done(rec)

            client_submit(
                on_done,
                prompt=req.prompt(),
                max_tokens=req.max_tokens,
                session=req.session,
                tenant=req.tenant,
                priority=req.priority,
                deadline_ms=req.deadline_ms,
                seed=req.seed,
            )

        send.submit = submit  # type: ignore[attr-defined]
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
