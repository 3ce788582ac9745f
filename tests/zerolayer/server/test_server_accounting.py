"""Per-request accounting: the ring buffer, its JSONL file, and totals that match the clients';
a failed write loses nothing silently, fsync follows its policy off the event loop, SIGKILL loses
at most the stated bound, and the tenant totals stay bounded."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import signal
import sys
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from serving.engine import SimConfig, SimEngine
from serving.wire.tokens import count_prompt_tokens
from tests.support.server_client import H2Client, run, wait_all
from tests.support.waiting import HANG_GUARD_S, eventually
from zerolayer import accounting as accounting_module
from zerolayer.accounting import Accounting, FsyncPolicy, TenantTotals, read_jsonl
from zerolayer.server import start_replica
from zerolayer.server.cli import parser


def test_ring_flushes_to_jsonl_and_counts_drops(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    acc = Accounting(path, capacity=3, replica="r", max_tenants=10)
    for i in range(5):
        acc.record(f"id{i}", "t", "s", 10, i, 1, 2, "completed")
    assert acc.dropped == 2  # the ring kept the newest three
    assert acc.flush() == 3
    acc.record("id5", "u", "s", 1, 1, 3, 4, "error", "kv_exhausted")
    acc.close()
    rows = read_jsonl(path)
    assert [r["request_id"] for r in rows] == ["id2", "id3", "id4", "id5"]
    assert rows[-1]["error"] == "kv_exhausted" and rows[-1]["replica"] == "r"
    assert acc.totals["t"].requests == 5 and acc.totals["t"].completion_tokens == 10
    assert acc.dropped == 2


def test_in_memory_accounting_keeps_rows() -> None:
    acc = Accounting(None, capacity=10, max_tenants=10)
    acc.record("x", "t", "s", 3, 4, 5, 6, "completed")
    assert acc.flush() == 0
    assert next(acc.rows())["completion_tokens"] == 4


def tokens_received(text: str) -> int:
    """Every token of the fixed vocabulary is one word with a leading space."""
    return text.count(" ")


@run
async def test_totals_match_what_clients_received(tmp_path: Path) -> None:
    path = tmp_path / "usage.jsonl"
    engine = SimEngine(SimConfig(model_shape="llama-3.2-1b"))
    replica = await start_replica(
        engine, name="acct", accounting_path=path, accounting_flush_s=0.05
    )
    client = await H2Client.connect("127.0.0.1", replica.port)
    streams = []
    for i in range(60):
        tenant = f"tenant-{i % 3}"
        headers = [("zl-tenant", tenant), ("zl-session", f"s{i}")]
        if i % 10 == 9:  # refused: nothing delivered
            headers.append(("zl-priority", "bogus"))
        if i % 10 == 8:  # cut by its deadline mid-stream: what was streamed still counts
            headers.append(("zl-deadline-ms", "60"))
            max_tokens = 2000
        else:
            max_tokens = 1 + i % 7
        streams.append((tenant, f"prompt {i} " * (i % 5 + 1), client.completion(
            f"prompt {i} " * (i % 5 + 1), max_tokens=max_tokens, stream=i % 2 == 0,
            headers=headers,
        )))  # fmt: skip
    await wait_all([s for _, _, s in streams], 15)
    expected: Counter[tuple[str, str]] = Counter()
    for tenant, prompt, stream in streams:
        if stream.status != 200:
            continue
        if stream.reset_code is None and b"[DONE]" not in stream.data:
            text = stream.json()["choices"][0]["text"]
        else:
            text = stream.text()
        expected[tenant, "prompt"] += count_prompt_tokens(prompt)
        expected[tenant, "completion"] += tokens_received(text)
    # The periodic flush writes every row while the replica runs (none waits for the close);
    # the rows written stop changing once all 60 are, so file and metric can be compared.
    acc = replica.replica.accounting
    await until(lambda: acc.flushed == len(streams), "the periodic flush of every row")
    assert len(read_jsonl(path)) == len(streams)
    metrics = (await client.get("/metrics")).data.decode()
    assert f"zl_accounting_rows_written_total {len(streams)}\n" in metrics
    assert set(replica.replica.accounting.totals) == {"tenant-0", "tenant-1", "tenant-2", ""}
    assert "zl_accounting_tenants 4\n" in metrics  # "": the requests refused before parsing
    assert "zl_accounting_write_errors_total 0\n" in metrics
    await replica.close()
    await client.close()
    await engine.close()
    rows = read_jsonl(path)
    assert len(rows) == 60
    got: Counter[tuple[str, str]] = Counter()
    for row in rows:
        got[row["tenant"], "prompt"] += row["prompt_tokens"]
        got[row["tenant"], "completion"] += row["completion_tokens"]
        assert row["end_ns"] >= row["start_ns"] > 0
    assert +got == +expected
    outcomes = Counter((r["outcome"], r["error"]) for r in rows)
    assert outcomes[("error", "bad_request")] == 6
    assert outcomes[("error", "deadline_exceeded")] == 6
    assert outcomes[("completed", None)] == 48


# -- a failed write loses nothing silently ---------------------------------------------------------


def record_rows(acc: Accounting, first: int, count: int, tenant: str = "t") -> None:
    for i in range(first, first + count):
        acc.record(f"id{i}", tenant, "s", 1, 1, 1, 2, "completed")


async def until(condition: Callable[[], bool], what: str) -> None:
    """Wait for the writer thread and the retry timer to make ``condition`` true (bounded only
    as a hang guard: a loaded disk can hold a write up for seconds)."""
    await eventually(condition, what)


def warnings_about(caplog: pytest.LogCaptureFixture, word: str) -> int:
    return sum(1 for r in caplog.records if r.levelno == logging.WARNING and word in r.getMessage())


@run
async def test_a_failed_write_keeps_its_rows_and_the_timer_survives(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A directory where the file should be: every write fails until it is removed."""
    path = tmp_path / "a.jsonl"
    path.mkdir()
    acc = Accounting(path, flush_interval_s=0.01, replica="r", max_tenants=10)
    acc.start()
    record_rows(acc, 0, 5)
    await until(lambda: acc.write_errors >= 2, "two failed writes")  # a retry happened
    record_rows(acc, 5, 5)
    path.rmdir()
    await until(lambda: acc.flushed == 10, "the rows written once the path works")
    record_rows(acc, 10, 2)  # the periodic flush still runs after the errors
    await until(lambda: acc.flushed == 12, "the timer's next flush")
    acc.close()
    assert [r["request_id"] for r in read_jsonl(path)] == [f"id{i}" for i in range(12)]
    assert acc.dropped == 0 and acc.queued == 0
    assert warnings_about(caplog, "cannot write") == 1  # one per episode, not per retry


@run
async def test_a_torn_write_is_undone_before_the_retry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk mid-write: the half-written rows are cut off, then the batch written whole."""
    path = tmp_path / "a.jsonl"
    real_write_all = accounting_module._write_all
    failures = [1]

    def half_then_enospc(fd: int, data: bytes) -> None:
        if failures:
            failures.pop()
            real_write_all(fd, data[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write_all(fd, data)

    monkeypatch.setattr(accounting_module, "_write_all", half_then_enospc)
    acc = Accounting(path, flush_interval_s=0.01, max_tenants=10)
    acc.start()
    record_rows(acc, 0, 6)
    await until(lambda: acc.flushed == 6, "the retried batch")
    acc.close()
    assert [r["request_id"] for r in read_jsonl(path)] == [f"id{i}" for i in range(6)]
    assert acc.write_errors == 1 and acc.dropped == 0


@run
async def test_rows_past_the_ring_while_failing_are_counted_and_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "a.jsonl"
    path.mkdir()
    acc = Accounting(path, capacity=4, flush_interval_s=0.01, max_tenants=10)
    acc.start()
    record_rows(acc, 0, 6)
    await until(lambda: acc.write_errors >= 1, "a failed write")
    record_rows(acc, 6, 6)
    await until(lambda: acc.write_errors >= 3, "more failed writes")
    assert acc.queued == 4 and acc.dropped == 8  # the failed rows stayed queued, in the ring
    path.rmdir()
    acc.close()
    assert [r["request_id"] for r in read_jsonl(path)] == ["id8", "id9", "id10", "id11"]
    assert acc.recorded == acc.flushed + acc.dropped
    assert warnings_about(caplog, "dropped") == 1


def test_close_gives_up_on_a_write_that_still_fails_and_counts_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "a.jsonl"
    path.mkdir()
    acc = Accounting(path, max_tenants=10)
    record_rows(acc, 0, 3)
    acc.close()
    assert acc.dropped == 3 and acc.write_errors == 1 and acc.queued == 0
    assert warnings_about(caplog, "gave up") == 1


# -- fsync ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "while_running", "at_close"),
    [(FsyncPolicy.BATCH, (1, 2), 1), (FsyncPolicy.CLOSE, (0, 0), 1),
     (FsyncPolicy.NEVER, (0, 0), 0)],
)  # fmt: skip
@run
async def test_fsync_follows_its_policy_off_the_event_loop(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    policy: FsyncPolicy,
    while_running: tuple[int, int],
    at_close: int,
) -> None:
    path = tmp_path / "a.jsonl"
    synced: list[tuple[int, str]] = []  # (st_ino, thread name) of each fsync'd file
    real_fsync = os.fsync

    def spy(fd: int) -> None:
        synced.append((os.fstat(fd).st_ino, threading.current_thread().name))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    acc = Accounting(path, flush_interval_s=3600, flush_rows=4, fsync=policy, max_tenants=10)
    acc.start()
    record_rows(acc, 0, 8)  # two batches by count; the second may share the first's fsync
    await until(lambda: acc.flushed == 8, "two batches")
    record_rows(acc, 8, 1)
    acc.close()
    inode = path.stat().st_ino
    loop_thread = threading.current_thread().name
    running = [thread for ino, thread in synced if ino == inode and thread != loop_thread]
    closing = [thread for ino, thread in synced if ino == inode and thread == loop_thread]
    assert while_running[0] <= len(running) <= while_running[1], running
    assert len(closing) == at_close  # at close only: the loop is not serving any more
    assert len(read_jsonl(path)) == 9 and acc.fsync_errors == 0


# -- the SIGKILL bound --------------------------------------------------------------------------


@run
async def test_rows_are_flushed_by_count_in_order(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    acc = Accounting(path, flush_interval_s=3600, flush_rows=10, max_tenants=10)
    acc.start()
    for wave in range(30):
        record_rows(acc, wave * 7, 7)
        await asyncio.sleep(0)
    await until(lambda: acc.queued < 10, "the writer to catch up")
    assert acc.flushed >= 200  # the timer never fired: the count did it
    acc.close()
    assert [r["request_id"] for r in read_jsonl(path)] == [f"id{i}" for i in range(210)]


def test_help_states_the_sigkill_bound() -> None:
    text = " ".join(parser().format_help().split())
    assert "--accounting-flush-rows" in text and "--accounting-fsync" in text
    assert "SIGKILL loses at most" in text


@run
async def test_sigkill_loses_at_most_the_stated_bound(tmp_path: Path) -> None:
    path = tmp_path / "usage.jsonl"
    flush_rows = 16
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "zerolayer.server", "--engine", "null", "--port", "0",
        "--accounting", str(path), "--accounting-flush-rows", str(flush_rows),
        "--accounting-flush-s", "3600",  # the timer never fires: only the count flushes
        "--accounting-fsync", "batch",  # the default, slowest policy: fsync must not hold it up
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 30)
        assert line.startswith(b"zl-replica listening on http://127.0.0.1:"), line
        client = await H2Client.connect("127.0.0.1", int(line.rsplit(b":", 1)[1]))
        answered = 0
        for _ in range(50):
            wave = [client.completion("p", max_tokens=2) for _ in range(7)]
            await wait_all(wave, 10)
            answered += sum(s.status == 200 for s in wave)
        # The bound holds while the writer keeps up with the requests: on a loaded machine its
        # thread can lag, and /metrics shows that backlog. Once it has caught up, only the rows
        # under flush_rows may wait: the timer (an hour) never fires, so the count alone wrote
        # the rest. The wait is bounded only to turn a hang into a failure (a loaded disk's
        # fsyncs can keep the writer seconds behind).
        loop = asyncio.get_running_loop()
        give_up = loop.time() + HANG_GUARD_S
        queued = await metric(client, "zl_accounting_rows_queued")
        while queued >= flush_rows and loop.time() < give_up:
            await asyncio.sleep(0.05)
            queued = await metric(client, "zl_accounting_rows_queued")
        proc.send_signal(signal.SIGKILL)
        await asyncio.wait_for(proc.wait(), 10)
        await client.close()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert answered == 350  # 21 batches of 16 and 14 rows: the ring is left part full
    assert queued < flush_rows, f"{queued} rows still waiting: the count did not trigger writes"
    lost = answered - len(read_jsonl(path))
    # What SIGKILL loses is what was waiting: under flush_rows rows in the ring.
    assert 0 <= lost <= queued, (lost, queued)


async def metric(client: H2Client, name: str) -> int:
    """One unlabelled gauge or counter from the replica's /metrics."""
    stream = await client.get("/metrics")
    for line in stream.data.decode().splitlines():
        if line.startswith(name + " "):
            return int(float(line.split()[1]))
    raise AssertionError(f"{name} not in /metrics")


# -- bounded tenant totals ----------------------------------------------------------------------

RECORDS = st.lists(
    st.tuples(st.sampled_from("abcdefghijklmnopqrst"), st.integers(0, 1000), st.integers(0, 1000)),
    max_size=80,
)


@given(records=RECORDS, max_tenants=st.integers(0, 12))
def test_totals_add_up_and_stay_bounded(
    records: list[tuple[str, int, int]], max_tenants: int
) -> None:
    acc = Accounting(None, capacity=100, max_tenants=max_tenants)
    for i, (tenant, prompt, completion) in enumerate(records):
        acc.record(f"id{i}", tenant, "s", prompt, completion, 1, 2, "completed")
    assert len(acc.totals) <= max_tenants
    summed = TenantTotals()
    for totals in [*acc.totals.values(), acc.other]:
        summed.requests += totals.requests
        summed.prompt_tokens += totals.prompt_tokens
        summed.completion_tokens += totals.completion_tokens
    assert summed == TenantTotals(len(records), sum(r[1] for r in records),
                                  sum(r[2] for r in records))  # fmt: skip
    last_seen = {tenant: i for i, (tenant, _, _) in enumerate(records)}
    kept, gone = set(acc.totals), set(last_seen) - set(acc.totals)
    assert all(last_seen[k] > last_seen[g] for k in kept for g in gone)  # least recent folded
    if records and max_tenants:
        assert records[-1][0] in kept and acc.folded >= len(gone)
