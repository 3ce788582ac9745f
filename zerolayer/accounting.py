"""Per-request usage accounting: a bounded ring buffer written to JSONL by a worker thread.

Each replica records one row per request it answered (request id, tenant, session, prompt and
completion tokens, start and end wall-clock ns, outcome and error code). ``record`` is on the
request path, so it only appends a tuple to a ring and adds to the tenant's totals; a writer
thread serialises the rows and appends them to the file, one batch in flight at a time, in the
order they were recorded, and another thread fsyncs the file after them (:class:`FsyncPolicy`).

When rows are written: as soon as ``flush_rows`` rows wait, every ``flush_interval_s``, and at
:meth:`Accounting.close`. So **a SIGKILL loses at most the rows of ``flush_rows`` or
``flush_interval_s`` (whichever is fewer) plus one batch being written (at most ``flush_rows``
rows)**: 2 x 1024 by default. That holds while writes keep up with the request rate (a write is
a copy into the page cache; fsync does not hold it up); when they do not, the backlog waiting in
the ring is at risk too (``queued``; ``zl_accounting_rows_queued`` in ``/metrics``). Rows the OS
has accepted survive the process; surviving a power loss or a kernel crash is what fsync adds.

Nothing is lost silently. A failed write (a full disk, a path that became a directory) puts its
rows back at the front of the ring, truncates whatever part of the batch reached the file, and
is retried after a backoff (0.1 s doubling to 5 s); the periodic flush keeps running through any
error. Rows are lost only when the ring overflows (the oldest go first) or when the final write
at close fails too; both are counted (``dropped``, ``write_errors``) and logged once per episode.
One writer per file: the truncation of a torn write assumes no one else appends to it.

Running totals per tenant are kept in memory for ``/metrics`` and tests, bounded by
``max_tenants`` (the replica's ``Limits.max_tenants``): when a new tenant would pass the bound,
the least recently seen quarter are folded into one ``other`` row (a quarter at a time, so the
request path pays a store, not a reordering, per request); the file keeps every row regardless.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import os
import sys
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import orjson

log = logging.getLogger("zerolayer.accounting")

COMPLETED = "completed"
ERROR = "error"
CANCELLED = "cancelled"

FIELDS = (
    "request_id", "tenant", "session", "prompt_tokens", "completion_tokens", "start_ns",
    "end_ns", "outcome", "error", "priority", "replica",
)  # fmt: skip

RING_ROWS: Final = 65_536
FLUSH_ROWS: Final = 1024
FLUSH_INTERVAL_S: Final = 1.0
RETRY_FIRST_S: Final = 0.1
RETRY_MAX_S: Final = 5.0
FOLD_SHARE: Final = 4  # past max_tenants, fold the least recently seen 1/FOLD_SHARE at once
NEVER_FLUSH: Final = sys.maxsize  # a ring length ``record`` never reaches: no write by count

Row = tuple[Any, ...]


class FsyncPolicy(enum.StrEnum):
    """When the accounting file is fsync'd; the rows are written per batch whatever the policy.

    ``batch`` (the default): after every batch, in a thread of its own, batches written during
    one fsync sharing the next, so neither the event loop nor the next write waits on the disk;
    a power loss then loses the SIGKILL bound plus the batches of one fsync (a few ms of rows on
    an SSD), for one fsync per batch at most. ``close``: once, at close: a clean shutdown is
    durable, a crash of the machine may lose what the OS had not written back yet (Linux: up to
    about 30 s of rows). ``never``: the OS decides, even at close. Rows written are never lost to
    a crash of the process alone, whatever the policy.
    """

    NEVER = "never"
    CLOSE = "close"
    BATCH = "batch"


@dataclass(slots=True)
class TenantTotals:
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    last_seen: int = field(default=0, compare=False)  # ``recorded`` at its latest row

    def add(self, other: TenantTotals) -> None:
        self.requests += other.requests
        self.prompt_tokens += other.prompt_tokens
        self.completion_tokens += other.completion_tokens


class _Episode:
    """A condition logged once when it begins (a warning) and when it ends, not per event."""

    def __init__(self) -> None:
        self.active = False

    def begin(self, message: str, *args: object) -> None:
        if not self.active:
            self.active = True
            log.warning(message, *args)

    def end(self, message: str, *args: object) -> None:
        if self.active:
            self.active = False
            log.info(message, *args)


class _Syncer:
    """fsyncs the file: after each batch in a thread of its own (``start``), coalescing the
    batches written while one fsync runs, so a slow disk delays durability, never the next
    write; and once more at close (``sync_now``)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.errors = 0
        self._failing = _Episode()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: ThreadPoolExecutor | None = None
        self._running: Future[None] | None = None
        self._again = False
        self._folder_synced = False

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zl-accounting-sync")

    def request(self) -> None:
        """fsync what has been written so far: now, or once the fsync running ends."""
        if self._thread is None or self._loop is None:
            return
        if self._running is not None:
            self._again = True
            return
        self._again = False
        folder, self._folder_synced = not self._folder_synced, True
        running = self._running = self._thread.submit(_fsync_path, self.path, folder)
        loop = self._loop
        running.add_done_callback(lambda done: loop.call_soon_threadsafe(self._done, done))

    def _done(self, done: Future[None]) -> None:
        if done is not self._running:  # sync_now has waited for it already
            return
        self._running = None
        self._note(done.exception())
        if self._again:
            self.request()

    def sync_now(self) -> None:
        """After the fsync running, one more (and of the folder) in the calling thread."""
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None
        self._running = None
        if self.path.is_file():
            try:
                _fsync_path(self.path, folder=True)
            except OSError as error:
                self._note(error)

    def _note(self, error: BaseException | None) -> None:
        if error is None:
            self._failing.end("accounting: fsync of %s works again", self.path)
        else:
            self.errors += 1
            self._failing.begin("accounting: cannot fsync %s (%s)", self.path, error)


class Accounting:
    """The ring buffer and its JSONL sink. ``path=None`` keeps rows in memory only.

    Every row recorded is, at any moment, ``flushed``, ``queued`` or ``dropped``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        max_tenants: int,
        capacity: int = RING_ROWS,
        flush_interval_s: float = FLUSH_INTERVAL_S,
        flush_rows: int = FLUSH_ROWS,
        fsync: FsyncPolicy = FsyncPolicy.BATCH,
        replica: str = "",
    ) -> None:
        self.path = Path(path) if path is not None else None
        self.capacity = capacity
        self.flush_interval_s = flush_interval_s
        self.flush_rows = flush_rows
        self.fsync = FsyncPolicy(fsync)
        self.max_tenants = max_tenants
        self.replica = replica
        self._ring: deque[Row] = deque(maxlen=capacity)
        self.recorded = 0
        self.flushed = 0
        self.write_errors = 0
        self.totals: dict[str, TenantTotals] = {}
        self.other = TenantTotals()  # the tenants folded out of ``totals``
        self.folded = 0
        self._flush_at = NEVER_FLUSH  # ring length that starts a write; NEVER_FLUSH: not now
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._retry: asyncio.TimerHandle | None = None
        self._backoff_s = 0.0
        self._writer: ThreadPoolExecutor | None = None
        self._syncer = _Syncer(self.path) if self.path is not None else None
        self._write: Future[None] | None = None
        self._writing: list[Row] = []
        self._dropped_seen = 0
        self._failing = _Episode()
        self._overflowing = _Episode()
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    @property
    def queued(self) -> int:
        """Rows waiting to be written: in the ring or in the batch being written."""
        return len(self._ring) + len(self._writing)

    @property
    def fsync_errors(self) -> int:
        """Failed fsyncs: rows written but perhaps not durable (the OS keeps them)."""
        return self._syncer.errors if self._syncer is not None else 0

    @property
    def dropped(self) -> int:
        """Rows lost: pushed out of a full ring, or still unwritten when close gave up."""
        return self.recorded - self.flushed - self.queued

    def record(
        self,
        request_id: str,
        tenant: str,
        session: str,
        prompt_tokens: int,
        completion_tokens: int,
        start_ns: int,
        end_ns: int,
        outcome: str,
        error: str | None = None,
        priority: int = 1,
    ) -> None:
        """One request's row; cheap (a tuple append, a length check, the tenant's sums)."""
        ring = self._ring
        ring.append(
            (request_id, tenant, session, prompt_tokens, completion_tokens, start_ns, end_ns,
             outcome, error, priority, self.replica)
        )  # fmt: skip
        self.recorded += 1
        if len(ring) >= self._flush_at:
            self._start_write()
        totals = self.totals.get(tenant)
        if totals is None:
            totals = self._new_tenant(tenant)
        totals.requests += 1
        totals.prompt_tokens += prompt_tokens
        totals.completion_tokens += completion_tokens
        totals.last_seen = self.recorded

    def _new_tenant(self, tenant: str) -> TenantTotals:
        """Totals for a tenant not tracked now, making room past ``max_tenants`` first; with
        ``max_tenants`` 0, ``other`` itself."""
        if len(self.totals) >= self.max_tenants:
            self._fold_least_recent()
            if len(self.totals) >= self.max_tenants:
                return self.other
        totals = self.totals[tenant] = TenantTotals()
        return totals

    def _fold_least_recent(self) -> None:
        """Fold the least recently seen 1/FOLD_SHARE of the tenants (at least one) into
        ``other``: one sort per max_tenants/FOLD_SHARE new tenants."""
        by_age = sorted(self.totals, key=lambda name: self.totals[name].last_seen)
        for name in by_age[: max(1, len(by_age) // FOLD_SHARE)]:
            self.other.add(self.totals.pop(name))
            self.folded += 1

    def rows(self) -> Iterator[dict[str, Any]]:
        """The rows not flushed yet, as dicts (oldest first)."""
        for row in self._ring:
            yield dict(zip(FIELDS, row, strict=True))

    # -- writing -------------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Write from a worker thread, by count and every ``flush_interval_s``, until close."""
        if self.path is None or self._timer is not None:
            return
        self._loop = loop or asyncio.get_running_loop()
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zl-accounting")
        if self._syncer is not None and self.fsync is FsyncPolicy.BATCH:
            self._syncer.start(self._loop)
        self._flush_at = self.flush_rows
        self._timer = self._loop.call_later(self.flush_interval_s, self._tick)

    def _tick(self) -> None:
        """The periodic flush; rescheduled before anything else so no error can stop it."""
        assert self._loop is not None
        self._timer = self._loop.call_later(self.flush_interval_s, self._tick)
        self._note_overflow()
        if self._retry is None:
            self._start_write()

    def _start_write(self) -> None:
        """Hand the waiting rows (at most ``flush_rows``) to the writer thread, unless a write is
        in flight or a retry is pending; its completion comes back to the loop."""
        if self._write is not None or not self._ring or self._writer is None:
            return
        assert self.path is not None and self._loop is not None
        self._flush_at = NEVER_FLUSH
        self._writing = self._take(self.flush_rows)
        write = self._write = self._writer.submit(_append, self.path, self._writing)
        loop = self._loop
        write.add_done_callback(lambda done: loop.call_soon_threadsafe(self._written, done))

    def _take(self, limit: int) -> list[Row]:
        ring = self._ring
        return [ring.popleft() for _ in range(min(limit, len(ring)))]

    def _written(self, write: Future[None]) -> None:
        """A batch's write finished (on the loop); close may have handled it already."""
        if write is not self._write:
            return
        self._write = None
        rows, self._writing = self._writing, []
        error = write.exception()
        if error is None:
            self._succeeded(rows)
            if len(self._ring) >= self.flush_rows:
                self._start_write()
        else:
            self._failed(rows, error)
            if self._writer is not None:  # not closing
                self._retry_later()

    def _succeeded(self, rows: list[Row]) -> None:
        self.flushed += len(rows)
        running = self._writer is not None  # not closing: close fsyncs once, itself
        if running and self._syncer is not None:
            self._syncer.request()
        self._backoff_s = 0.0
        self._flush_at = self.flush_rows if running else NEVER_FLUSH
        self._failing.end("accounting: writing %s again", self.path)
        self._overflowing.end("accounting: %d rows dropped in all", self.dropped)

    def _failed(self, rows: list[Row], error: BaseException) -> None:
        """Put the rows back in front of the newer ones; a full ring drops the oldest."""
        self.write_errors += 1
        self._failing.begin("accounting: cannot write %s (%s); retrying", self.path, error)
        self._ring = deque(itertools.chain(rows, self._ring), maxlen=self.capacity)
        self._note_overflow()

    def _retry_later(self) -> None:
        assert self._loop is not None
        self._backoff_s = min(RETRY_MAX_S, max(RETRY_FIRST_S, 2 * self._backoff_s))
        self._retry = self._loop.call_later(self._backoff_s, self._retry_now)

    def _retry_now(self) -> None:
        self._retry = None
        self._start_write()

    def _note_overflow(self) -> None:
        """Log rows pushed out of the ring once per episode (until a write succeeds again)."""
        dropped = self.dropped
        if dropped > self._dropped_seen:
            self._overflowing.begin(
                "accounting: ring of %d rows full, %d rows dropped so far", self.capacity, dropped
            )
        self._dropped_seen = dropped

    def flush(self) -> int:
        """Write every waiting row now, in the calling thread (after any write in flight);
        returns how many were written, 0 if the write failed (the rows stay queued)."""
        self._finish_write_in_flight()
        if not self._ring or self.path is None:
            return 0
        rows = self._take(len(self._ring))
        try:
            _append(self.path, rows)
        except OSError as error:
            self._failed(rows, error)
            return 0
        self._succeeded(rows)
        return len(rows)

    def _finish_write_in_flight(self) -> None:
        write = self._write
        if write is not None:
            write.exception()  # waits for the worker thread
            self._written(write)

    def close(self) -> None:
        """Stop the timers, write what waits (one last try), stop the threads, fsync unless the
        policy is ``never``. Rows a failed last write leaves are counted in ``dropped``."""
        for timer in (self._timer, self._retry):
            if timer is not None:
                timer.cancel()
        self._timer = self._retry = None
        self._flush_at = NEVER_FLUSH
        writer, self._writer = self._writer, None
        self.flush()
        if writer is not None:
            writer.shutdown(wait=True)
        self._give_up()
        if self._syncer is not None and self.fsync is not FsyncPolicy.NEVER:
            self._syncer.sync_now()

    def _give_up(self) -> None:
        if self.path is None or not self._ring:
            return
        lost = len(self._ring)
        self._ring.clear()
        log.warning("accounting: gave up on %d rows that could not be written to %s", lost,
                    self.path)  # fmt: skip


def _append(path: Path, rows: list[Row]) -> None:
    """Append ``rows`` as JSONL (in the writer thread); on an error, cut the file back to its
    length before, so the retry leaves no torn or duplicated row."""
    data = b"".join(orjson.dumps(dict(zip(FIELDS, row, strict=True))) + b"\n" for row in rows)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        start = os.fstat(fd).st_size
        try:
            _write_all(fd, data)
        except OSError:
            os.ftruncate(fd, start)
            raise
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    """``os.write`` until all of ``data`` is written (a write may take only part of it)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _fsync_path(path: Path, folder: bool) -> None:
    """fsync a file, and its folder when asked: a new file's directory entry is durable only
    once its folder is fsync'd too (POSIX fsync covers only the file it is given)."""
    for target in (path, path.parent) if folder else (path,):
        fd = os.open(target, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every row of an accounting file."""
    with open(path, "rb") as f:
        return [orjson.loads(line) for line in f if line.strip()]
