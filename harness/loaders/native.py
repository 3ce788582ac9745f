"""The native loader: open-loop asyncio arrivals on a schedule fixed before the run.

Coordinated-omission free: each request has an intended send time from the schedule, and a slow
answer never delays the next send, so latency measured from the intended time includes any stall
the server caused. The dispatcher sleeps until about ``spin_s`` before each send time (loop timers
have 1 ms granularity), then turns the event loop (so responses keep being read) between short
naps, spinning only the last fraction of a millisecond; a dispatcher that is already late neither
sleeps nor spins, it sends at once.
Dispatch minus the intended time is the scheduling lag, recorded per request.

Two ways to send (a ``Sender``, from ``harness.loaders.senders``): its ``submit``, when it has
one (the zero-layer SDK's callback API, see ``client_sender``), is called synchronously from the
dispatcher and reports back through a callback, so a request costs no task, timer or future of
the loader's own; otherwise its async ``send`` runs in one task per request (engines in-process,
the HTTP/1.1 client, tests, and any run with ``max_in_flight``).

Every scheduled request ends as exactly one record: completed, error (with a code), or lost (no
answer by deadline + grace); records are written to JSONL as requests end, in small batches (at
most ``WRITE_EVERY_S`` apart, preferably while the dispatcher has time before its next send), so
an interrupted run keeps what it measured. The run is bounded in
request count (the schedule) and time (duration + the longest deadline + grace). The garbage
collector is paused for the run: a full collection stalls the loop for milliseconds, which would
show up as scheduling lag (a bounded run's garbage is collected afterwards).

The loader's own CPU time, less the idle turns of its spin, is reported per request in the
result's ``extra`` (``loader_cpu_us_per_request``), so its cost can be compared across versions.

``NativeLoader`` is the ``harness.loaders.Loader`` over a whole stack: its client comes from
``Stack.open_client`` (HTTP/2 through the SDK's ring to every zero-layer replica, HTTP/1.1 to the
baseline's front door, or to vllm-serve's replicas by the same ring through ``Http1Router``).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvloop

from harness.loaders.base import (
    DEFAULT_GRACE_S,
    LoadResult,
    RequestFailed,
    make_result,
    new_record,
    replica_counts,
    wire_protocol,
)
from harness.loaders.senders import Sender, SendFn, client_sender
from harness.metrics import LAG_FRACTION_OF_MEDIAN
from harness.progress import (
    Phase,
    PhaseProgress,
    ProgressStyle,
    load_phase,
    offered_rate,
    phase_progress,
)
from harness.schema import JsonlWriter, RequestRecord
from harness.workload import PlannedRequest

if TYPE_CHECKING:
    from harness.profile import Profile
    from harness.stacks import Stack

START_DELAY_S = 0.05
SPIN_S = 0.001
PROGRESS_EVERY_S = 10.0
# A refresh waits for room before the next send (``PhaseProgress.room_ns``), at most this long.
PROGRESS_OVERDUE_NS = 1_000_000_000
PROGRESS_RETRY_S = 0.002
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


class _Records:
    """Every ended request's record: kept for the summary, written to JSONL in batches."""

    def __init__(self, path: Path, progress: PhaseProgress | None = None) -> None:
        self.all: list[RequestRecord] = []
        self.progress = progress
        self._writer = JsonlWriter(path)
        self._batch: list[RequestRecord] = []
        self._written_at = time.monotonic()

    def add(self, rec: RequestRecord) -> None:
        if not rec.end_ns:
            rec.end_ns = time.time_ns()
        if rec.outcome == "error" and not rec.error_code:
            rec.error_code = f"http_{rec.http_status}"
        self.all.append(rec)
        if self.progress is not None:
            self.progress.ended(rec)
        batch = self._batch
        batch.append(rec)
        if len(batch) >= WRITE_BATCH or time.monotonic() - self._written_at >= WRITE_EVERY_S:
            self.flush()

    @property
    def pending(self) -> bool:
        return bool(self._batch)

    def flush(self) -> None:
        if self._batch:
            self._writer.write_many(self._batch)
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


def _longest_s(schedule: Sequence[PlannedRequest], slack_s: float) -> float:
    """The longest any one request may take: its deadline plus the slack after it."""
    return max((r.deadline_ms for r in schedule), default=0) / 1000.0 + slack_s


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """No collections during the run: a full one stalls the loop for milliseconds (lag)."""
    was_enabled = gc.isenabled()
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        gc.unfreeze()
        if was_enabled:
            gc.enable()


class _Dispatcher:
    """One run's requests from dispatch to record: each ends as exactly one record.

    Submitted requests (callback API) are keyed by their record until their callback; requests
    sent in a task of their own are those tasks. ``all_ended`` resolves once dispatching is over
    and the last submitted request has called back.
    """

    __slots__ = ("all_ended", "dispatching", "done_callback", "in_flight", "loader", "loop",
                 "next_ns", "perf0", "profile", "records", "send", "slack_s", "slots", "spun_ns",
                 "stack", "start_ns", "submit", "submitted", "wall0")  # fmt: skip

    def __init__(
        self,
        sender: Sender,
        records: _Records,
        labels: tuple[str, str, str],
        slack_s: float,
        max_in_flight: int | None,
        start_wall_ns: int | None = None,
    ) -> None:
        self.records = records
        self.stack, self.profile, self.loader = labels
        self.slack_s = slack_s
        self.send = sender.send
        self.slots = asyncio.Semaphore(max_in_flight) if max_in_flight else None
        self.submit = sender.submit if self.slots is None else None
        self.loop = asyncio.get_running_loop()
        self.in_flight: set[asyncio.Task[None]] = set()
        self.submitted: dict[int, RequestRecord] = {}
        self.all_ended: asyncio.Future[None] = self.loop.create_future()
        self.dispatching = True
        self.wall0, self.perf0 = time.time_ns(), time.perf_counter_ns()
        delay_ns = int(START_DELAY_S * 1e9)
        if start_wall_ns is not None:  # a shared start (the sharded loader's workers)
            delay_ns = max(0, start_wall_ns - self.wall0)
        self.start_ns = self.perf0 + delay_ns
        self.next_ns = self.start_ns  # the next send's time: a progress refresh keeps clear of it
        self.spun_ns = 0
        self.done_callback = self.ended  # bound once: submit hands it over per request

    @property
    def open_count(self) -> int:
        return len(self.in_flight) + len(self.submitted)

    async def dispatch_all(self, schedule: Sequence[PlannedRequest], spin_ns: int) -> None:
        """Send each request at its intended time; flush records only while there is time."""
        perf = time.perf_counter_ns
        records, start, dispatch = self.records, self.start_ns, self.dispatch
        for req in schedule:
            target = start + int(req.offset_s * 1e9)
            self.next_ns = target
            if target - perf() > FLUSH_AHEAD_NS and records.pending:
                records.flush()
            self.spun_ns += await wait_until(target, spin_ns)
            dispatch(req, target)
        self.dispatching = False

    def dispatch(self, req: PlannedRequest, target_ns: int) -> None:
        wall0, perf0 = self.wall0, self.perf0
        rec = new_record(req, self.stack, self.profile, self.loader, wall0 + (target_ns - perf0))
        rec.dispatch_ns = wall0 + (time.perf_counter_ns() - perf0)
        submit = self.submit
        if submit is None:
            task = self.loop.create_task(self.one(req, rec))
            self.in_flight.add(task)
            task.add_done_callback(self.in_flight.discard)
            return
        self.submitted[id(rec)] = rec
        try:
            submit(req, rec, self.done_callback)
        except Exception as exc:  # a request the client refused to start (bad arguments)
            rec.outcome, rec.error_code = "error", _exception_code(exc)
            self.ended(rec)

    def ended(self, rec: RequestRecord) -> None:
        """A submitted request's callback: record it once (late calls after the end are ignored)."""
        submitted = self.submitted
        if submitted.pop(id(rec), None) is None:
            return
        self.records.add(rec)
        if not submitted and not self.dispatching and not self.all_ended.done():
            self.all_ended.set_result(None)

    async def one(self, req: PlannedRequest, rec: RequestRecord) -> None:
        """One request in a task of its own, bounded by its deadline plus the slack."""
        got_slot = self.slots is None
        try:
            async with asyncio.timeout(req.deadline_ms / 1000.0 + self.slack_s):
                if self.slots is None:
                    await self.send(req, rec)
                else:
                    async with self.slots:
                        got_slot = True
                        await self.send(req, rec)
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
            self.records.add(rec)

    async def wait_for_answers(self, bound_s: float) -> None:
        """Wait up to ``bound_s`` for what is still open; tasks still running are cancelled."""
        if self.submitted:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self.all_ended), bound_s)
        if self.in_flight:
            _, pending = await asyncio.wait(set(self.in_flight), timeout=bound_s)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending)

    async def close(self) -> None:
        """End what is left as lost (cancelled tasks record themselves) and write the records."""
        self.dispatching = False
        for task in self.in_flight:
            task.cancel()
        if self.in_flight:
            await asyncio.wait(set(self.in_flight))
        for rec in list(self.submitted.values()):  # no answer, not even the client's own timeout
            self.submitted.pop(id(rec))
            rec.outcome = "lost"
            self.records.add(rec)
        self.records.close()


async def _refresh_progress(run: _Dispatcher, progress: PhaseProgress) -> None:
    """Refresh ``progress`` every ``every_s``, each time where the dispatcher has room before its
    next send (a bar's redraw takes about a millisecond), or once it is overdue by
    PROGRESS_OVERDUE_NS: a loader that never has room still shows its progress."""
    perf = time.perf_counter_ns
    while True:
        await asyncio.sleep(progress.every_s)
        give_up = perf() + PROGRESS_OVERDUE_NS
        while run.dispatching and run.next_ns - perf() < progress.room_ns and perf() < give_up:
            await asyncio.sleep(max(0, run.next_ns - perf()) / 1e9 + PROGRESS_RETRY_S)
        progress.refresh()


def _progress_for(
    progress: ProgressStyle | PhaseProgress | None,
    schedule: Sequence[PlannedRequest],
    label: tuple[str, str, str],
    every_s: float,
) -> PhaseProgress | None:
    """The run's progress: the one given, or one in the given style for this schedule, labelled
    ``label[0]`` or else ``stack / profile @ rate``."""
    if progress is None or isinstance(progress, PhaseProgress):
        return progress
    given, stack, profile = label
    rate = offered_rate([r.offset_s for r in schedule])
    phase = Phase(given or f"{stack} / {profile} @ {rate:.3g} req/s", rate, len(schedule))
    return phase_progress(progress, phase, lines_every_s=every_s)


async def _send_all(
    run: _Dispatcher,
    schedule: Sequence[PlannedRequest],
    shown: PhaseProgress | None,
    spin_ns: int,
    bound_s: float,
) -> int:
    """Dispatch the schedule, wait up to ``bound_s`` for its answers and close the run, with
    the collector paused and the progress shown; return the loader's CPU time over it (ns)."""
    refresher = None
    if shown is not None:
        shown.start(lambda: run.open_count)
        refresher = asyncio.create_task(_refresh_progress(run, shown))
    with _gc_paused():
        cpu0 = time.process_time_ns()
        try:
            await run.dispatch_all(schedule, spin_ns)
            await run.wait_for_answers(bound_s)
        finally:
            cpu_ns = time.process_time_ns() - cpu0
            if refresher is not None:
                refresher.cancel()
            await run.close()
            if shown is not None:
                shown.finish()
    return cpu_ns


async def run_schedule(
    schedule: Sequence[PlannedRequest],
    send: SendFn | Sender,
    *,
    stack: str,
    profile: str,
    records_path: str | Path,
    loader: str = "native",
    grace_s: float = DEFAULT_GRACE_S,
    spin_s: float = SPIN_S,
    progress: ProgressStyle | PhaseProgress | None = None,
    progress_every_s: float = PROGRESS_EVERY_S,
    label: str = "",
    lag_fraction: float = LAG_FRACTION_OF_MEDIAN,
    max_in_flight: int | None = None,
    backstop_s: float = BACKSTOP_S,
    start_wall_ns: int | None = None,
) -> LoadResult:
    """Send ``schedule`` open-loop through ``send`` and return the summarised result.

    ``send`` (a ``SendFn``, or a ``Sender``) fills the record (sent_ns, first_token_ns, chunk_ns,
    end_ns, output_tokens, outcome...) and raises RequestFailed for an explicit error; any other
    exception becomes an error with a client code, and no answer within the deadline plus
    ``grace_s`` is lost (the loader's own backstop fires ``backstop_s`` later, so a client's own
    timeout gets there first). A Sender's ``submit`` is used instead when there is one and no
    ``max_in_flight``; its client's own timeout ends each request, and any request still without
    an answer once the run's time bound has passed is recorded as lost. ``max_in_flight``
    bounds concurrent requests like wrk2's connection count: a request due while every slot is
    busy waits for one (its wait shows as client queue, sent - intended, and counts against its
    deadline; one that never got a slot ends as error ``not_sent``).

    ``progress``: a style (None is quiet) for a display labelled ``label`` (``stack / profile @
    rate`` by default), lines every ``progress_every_s``; or a ``PhaseProgress`` of the caller's.
    ``start_wall_ns``: the wall-clock time the schedule's offset 0 falls on (several loaders
    anchored to one start); by default ``START_DELAY_S`` from now.
    """
    sender = send if isinstance(send, Sender) else Sender(send)
    slack_s = grace_s + backstop_s
    shown = _progress_for(progress, schedule, (label, stack, profile), progress_every_s)
    records = _Records(Path(records_path), shown)
    run = _Dispatcher(
        sender, records, (stack, profile, loader), slack_s, max_in_flight, start_wall_ns
    )
    bound_s = _longest_s(schedule, slack_s) + 1.0
    cpu_ns = await _send_all(run, schedule, shown, int(spin_s * 1e9), bound_s)
    return make_result(
        loader,
        stack,
        profile,
        Path(records_path),
        run.records.all,
        lag_fraction=lag_fraction,
        extra={
            "scheduled": len(schedule),
            "loader_cpu_us_per_request": (cpu_ns - run.spun_ns) / 1e3 / max(1, len(schedule)),
            "spin_s": run.spun_ns / 1e9,
        },
    )


@dataclass(frozen=True)
class NativeLoader:
    """The native loader over a whole stack, its client from ``Stack.open_client``.

    ``client_options`` go to ``open_client`` (``grace_ms`` defaults to ``grace_s``); ``None``
    for ``lag_fraction`` keeps the summary's default rule; ``progress`` None is quiet. The loop
    is uvloop's, as deployed.
    """

    name: str = field(default="native", init=False)
    grace_s: float = DEFAULT_GRACE_S
    progress: ProgressStyle | None = ProgressStyle.AUTO
    lag_fraction: float | None = None
    client_options: Mapping[str, Any] = field(default_factory=dict)

    def run(
        self,
        schedule: Sequence[PlannedRequest],
        stack: Stack,
        profile: Profile,
        records_path: Path,
        workdir: Path,
    ) -> LoadResult:
        """Drive ``stack`` with ``schedule``; ``workdir`` is unused (nothing to hand a child)."""
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            result = runner.run(self._drive(schedule, stack, profile, records_path))
        result.protocol = wire_protocol(stack.protocol)
        result.extra.update(arrival=profile.process, per_replica=replica_counts(result.records))
        return result

    async def _drive(
        self, schedule: Sequence[PlannedRequest], stack: Stack, profile: Profile, records: Path
    ) -> LoadResult:
        options = {"grace_ms": int(self.grace_s * 1000), **self.client_options}
        async with stack.open_client(**options) as client:
            return await run_schedule(
                schedule,
                client_sender(client, stack.credentials),
                stack=str(stack.name),
                profile=profile.name,
                records_path=records,
                grace_s=self.grace_s,
                progress=phase_progress(
                    self.progress, load_phase(stack.name, profile, len(schedule))
                ),
                lag_fraction=LAG_FRACTION_OF_MEDIAN
                if self.lag_fraction is None
                else self.lag_fraction,
            )
