"""The native loader: open-loop timing, exactly-once outcomes, and coordinated omission."""

from __future__ import annotations

import asyncio
import io
import itertools
import os
import signal
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import pytest
import uvloop
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.loaders.base import LoadResult, RequestFailed, replica_routes
from harness.loaders.native import NOT_SENT, NativeLoader, run_schedule
from harness.loaders.senders import Sender, client_sender, engine_sender
from harness.profile import Profile, load_profile
from harness.progress import LinesView, Phase, PhaseProgress
from harness.schema import OUTCOMES, RequestRecord, read_requests
from harness.stacks import StackName, StackSpec, client_for, stand_up
from harness.workload import PlannedRequest, build_schedule
from serving.engine import NullEngine, SimEngine
from tests.support.loader_checks import assert_spread, served
from zerolayer.client import ZeroLayerClient

T = TypeVar("T")


def _profile(
    rate: float, duration_s: float, max_tokens: int = 8, deadline_ms: int = 30000
) -> Profile:
    p = load_profile("a", "smoke")
    classes = tuple(replace(c, max_tokens=max_tokens, deadline_ms=deadline_ms) for c in p.classes)
    return replace(p, rate=rate, duration_s=duration_s, max_requests=10**6, classes=classes)


def _run(coro: Coroutine[Any, Any, T]) -> T:
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def test_sim_engine_run_records_every_request(tmp_path: Path) -> None:
    sched = build_schedule(_profile(rate=40.0, duration_s=1.0, max_tokens=16))
    out = tmp_path / "req.jsonl"

    async def go() -> LoadResult:
        engine = SimEngine()
        try:
            return await run_schedule(
                sched, engine_sender(engine), stack="engine", profile="a", records_path=out
            )
        finally:
            await engine.close()

    result = _run(go())
    s = result.summary
    assert s["completed"] == len(sched) == 40
    saved = read_requests(out)
    assert sorted(r.request_id for r in saved) == sorted(r.request_id for r in sched)
    for rec in saved:
        assert rec.intended_start_ns <= rec.dispatch_ns <= rec.sent_ns < rec.first_token_ns
        assert rec.first_token_ns <= rec.end_ns and rec.output_tokens == 16
        assert 1 <= len(rec.chunk_ns) <= 16  # a chunk per step, or fewer if steps merge
    # Open loop: intended send times follow the schedule's spacing exactly.
    intended = sorted(r.intended_start_ns for r in saved)
    assert intended[1] - intended[0] == pytest.approx(25_000_000, abs=1)
    assert s["median_ttft_ms"] < s["median_e2el_ms"] < s["median_e2el_intended_ms"]
    assert s["mean_tpot_ms"] > 0 and s["p99_itl_ms"] > 0


@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    behaviours=st.lists(
        st.sampled_from(["complete", "refuse", "oserror", "crash", "hang", "silent_error"]),
        min_size=1,
        max_size=12,
    ),
    in_flight=st.sampled_from([None, 1, 3]),
)
def test_every_request_ends_exactly_once(
    tmp_path: Path, behaviours: list[str], in_flight: int | None
) -> None:
    sched = build_schedule(_profile(rate=500.0, duration_s=len(behaviours) / 500.0, deadline_ms=40))
    assert len(sched) == len(behaviours)
    plan = {req.request_id: b for req, b in zip(sched, behaviours, strict=True)}

    async def send(req: PlannedRequest, rec: RequestRecord) -> None:
        what = plan[req.request_id]
        rec.sent_ns = rec.dispatch_ns
        if what == "complete":
            rec.end_ns, rec.outcome, rec.output_tokens = rec.sent_ns + 1, "completed", 1
        elif what == "refuse":
            raise RequestFailed("queue_full", 429)
        elif what == "oserror":
            raise ConnectionResetError("peer went away")
        elif what == "crash":
            raise ValueError("client bug")
        elif what == "silent_error":
            rec.outcome, rec.http_status = "error", 500
        else:
            await asyncio.sleep(3600)

    out = tmp_path / f"r{len(list(tmp_path.iterdir()))}.jsonl"
    result = _run(
        run_schedule(
            sched,
            send,
            stack="t",
            profile="a",
            records_path=out,
            grace_s=0.01,
            max_in_flight=in_flight,
        )
    )
    saved = read_requests(out)
    assert len(saved) == len(result.records) == len(sched)
    assert sorted(r.request_id for r in saved) == sorted(plan)
    for rec in saved:
        assert rec.outcome in OUTCOMES
        what = plan[rec.request_id]
        assert rec.outcome != "error" or rec.error_code  # an error always has a code
        if rec.error_code == NOT_SENT:
            # Only a request stuck behind hung ones for a slot can time out unsent.
            assert in_flight is not None and rec.outcome == "error"
        elif what == "complete":
            assert rec.outcome == "completed"
        elif what == "hang":
            assert rec.outcome == "lost"
        else:
            assert rec.outcome == "error"
    s = result.summary
    assert s["completed"] + s["errors"] + s["lost"] == len(sched)
    assert s["lost"] == sum(1 for r in saved if r.outcome == "lost")


def test_max_in_flight_serialises_and_shows_client_queue(tmp_path: Path) -> None:
    sched = build_schedule(_profile(rate=200.0, duration_s=0.1, max_tokens=4))

    async def go() -> LoadResult:
        engine = SimEngine()
        try:
            return await run_schedule(
                sched,
                engine_sender(engine),
                stack="engine",
                profile="a",
                records_path=tmp_path / "r.jsonl",
                max_in_flight=1,
            )
        finally:
            await engine.close()

    recs = sorted(_run(go()).records, key=lambda r: r.sent_ns)
    assert len(recs) == 20
    for before, after in itertools.pairwise(recs):
        assert after.sent_ns >= before.end_ns  # one slot: each send waits for the last answer
    # A 4-token answer takes longer than the 5 ms spacing, so the queue builds up.
    assert (
        recs[-1].sent_ns - recs[-1].intended_start_ns > recs[1].sent_ns - recs[1].intended_start_ns
    )


def test_progress_lines_on_long_runs(tmp_path: Path) -> None:
    sched = build_schedule(_profile(rate=20.0, duration_s=0.5))
    out = io.StringIO()
    _run(
        run_schedule(
            sched,
            engine_sender(NullEngine()),
            stack="engine",
            profile="a",
            records_path=tmp_path / "r.jsonl",
            progress=PhaseProgress(Phase("engine / a", 20.0, len(sched)), LinesView(out, 0.1)),
        )
    )
    lines = out.getvalue().splitlines()
    assert len(lines) >= 3 and all("ended" in line for line in lines)


def test_a_sender_with_submit_is_used_without_a_task_per_request(tmp_path: Path) -> None:
    """``submit`` (the callback API) is preferred; with ``max_in_flight`` only ``send`` is used."""
    sched = build_schedule(_profile(rate=200.0, duration_s=0.05))
    used: Counter[str] = Counter()

    async def send(req: PlannedRequest, rec: RequestRecord) -> None:
        used["send"] += 1
        rec.sent_ns, rec.outcome = rec.dispatch_ns, "completed"

    def submit(
        req: PlannedRequest, rec: RequestRecord, done: Callable[[RequestRecord], None]
    ) -> None:
        used["submit"] += 1
        rec.sent_ns, rec.outcome = rec.dispatch_ns, "completed"
        asyncio.get_running_loop().call_soon(done, rec)

    for in_flight in (None, 2):
        result = _run(
            run_schedule(
                sched, Sender(send, submit), stack="t", profile="a",
                records_path=tmp_path / f"r{in_flight}.jsonl", max_in_flight=in_flight,
            )
        )  # fmt: skip
        assert result.summary["completed"] == len(sched) == 10
    assert used == {"submit": 10, "send": 10}


def test_coordinated_omission_stall_is_seen_from_intended_send(tmp_path: Path) -> None:
    """A real replica stalls once for 1 s (SIGSTOP/SIGCONT) during a 10 s, 100 req/s run.

    One connection slot, as a closed-loop client would have: only the request in flight when
    the stall starts waits through it from its actual send, while the ~100 requests the stall
    held back show it from their intended send times. Judged as counts of the two series past
    the stall as measured above the run's own median, not against the host's speed.
    """
    # The deadline only guards a hang: a request's wait for the one slot counts against it, and
    # a loaded host held requests 35 s (tests-under-load: 691 lost, 20 never sent at 30 s).
    sched = build_schedule(_profile(rate=100.0, duration_s=10.0, max_tokens=4, deadline_ms=600_000))
    assert len(sched) == 1000
    stalled_s: list[float] = []

    async def go(client: ZeroLayerClient, pid: int) -> LoadResult:
        async def stall() -> None:
            await asyncio.sleep(4.0)
            os.kill(pid, signal.SIGSTOP)
            start = time.monotonic()
            await asyncio.sleep(1.0)
            os.kill(pid, signal.SIGCONT)
            stalled_s.append(time.monotonic() - start)

        staller = asyncio.create_task(stall())
        async with client:
            result = await run_schedule(
                sched, client_sender(client), stack="zerolayer", profile="a",
                records_path=tmp_path / "r.jsonl", max_in_flight=1,
            )  # fmt: skip
        await staller
        return result

    spec = StackSpec(StackName.ZEROLAYER, engine="null", replicas=1)
    with stand_up(spec, tmp_path / "stack") as stack:
        client = stack.open_client(health_interval_s=0)
        assert isinstance(client, ZeroLayerClient)
        result = _run(go(client, stack.pids()["replica"][0]))
    s = result.summary
    stall_ms = stalled_s[0] * 1000
    keys = ("median_e2el_ms", "p99.9_e2el_intended_ms", "p99.9_e2el_ms", "p99_client_queue_ms")
    print("coordinated omission:", {k: round(s[k], 1) for k in keys}, "stall", round(stall_ms))
    assert s["completed"] == 1000, s["errors_by_code"]
    # Half the stall above the median: only a request that waited through the stall gets there.
    waited = s["median_e2el_ms"] + 0.5 * stall_ms
    from_sent = [r for r in result.records if (r.end_ns - r.sent_ns) / 1e6 > waited]
    from_intended = [r for r in result.records if (r.end_ns - r.intended_start_ns) / 1e6 > waited]
    # A loaded host may stall the loader itself and hold requests past the bar from their
    # actual send (CI saw one; tests-under-load more than 1 %, a p99 of 635 ms against a bar of
    # 509 ms): what is judged is which series shows the stall, ten times over.
    assert len(from_intended) >= 20, "the requests the stall held back show it"
    assert 10 * len(from_sent) <= len(from_intended), (len(from_sent), len(from_intended))
    assert waited < s["p99.9_e2el_intended_ms"]  # the summary's own figure shows it too
    assert s["p99_client_queue_ms"] > 0.25 * stall_ms  # the held-back requests waited in the client


def test_native_loader_routes_over_every_replica(tmp_path: Path) -> None:
    """HTTP/2 through the SDK from ``Stack.open_client``: every replica gets its ring share."""
    profile = _profile(rate=100.0, duration_s=2.0, max_tokens=5)
    sched = build_schedule(profile)
    spec = StackSpec(StackName.ZEROLAYER, engine="sim", replicas=2)
    loader = NativeLoader(progress=None, client_options={"health_interval_s": 0})
    with stand_up(spec, tmp_path / "stack") as stack:
        result = loader.run(sched, stack, profile, tmp_path / "r.jsonl", tmp_path)
        counts = served(stack)
        planned = Counter(replica_routes(sched, stack))
    assert result.summary["completed"] == len(sched) == 200
    assert result.protocol == "h2" and not result.ttft_is_first_byte
    assert result.extra["arrival"] == "constant" and result.extra["scheduled"] == 200
    assert counts == planned == result.extra["per_replica"]
    assert_spread(counts, replicas=2)
    for rec in result.records:
        assert rec.output_tokens == 5 and rec.chunk_ns and rec.http_status == 200
        assert rec.intended_start_ns <= rec.dispatch_ns <= rec.sent_ns < rec.first_token_ns


def test_native_over_http1(tmp_path: Path) -> None:
    """The HTTP/1.1 keep-alive client (the baseline's front door) against a replica."""
    sched = build_schedule(_profile(rate=50.0, duration_s=0.6, max_tokens=5))
    spec = StackSpec(StackName.ZEROLAYER, engine="sim", replicas=1)

    async def go(url: str) -> LoadResult:
        async with client_for("http1", [url]) as client:
            return await run_schedule(
                sched, client_sender(client), stack="zerolayer", profile="a",
                records_path=tmp_path / "r.jsonl",
            )  # fmt: skip

    with stand_up(spec, tmp_path / "stack") as stack:
        result = _run(go(stack.urls[0]))
    assert result.summary["completed"] == len(sched) == 30
    for rec in result.records:
        assert rec.output_tokens == 5 and rec.chunk_ns and rec.http_status == 200
        assert rec.intended_start_ns <= rec.dispatch_ns <= rec.sent_ns < rec.first_token_ns
