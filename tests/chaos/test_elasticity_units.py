"""Profile G's figures from hand-built inputs: a journal with the join and the leave, the load's
records, and the replicas' request logs in both formats (the zero-layer accounting file, the
baseline engine replica's log)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chaos.elastic import (
    Change,
    _joining_command,
    _wait_first_request,
    _wait_running,
    request_times,
)
from chaos.elasticity import (
    Routed,
    TrialInputs,
    client_routed,
    compute,
    engine_routed,
    learned_after_ns,
    needless_share,
    recovery_s,
    session_moves,
)
from harness.schema import RequestRecord

S = 1_000_000_000
T0 = 1_000 * S
A, B, NEW = "http://a:1", "http://b:2", "http://new:3"


def test_each_session_is_kept_moved_with_the_change_or_moved_needlessly() -> None:
    before = {"s1": A, "s2": B, "s3": A, "s4": B}
    after = {"s1": A, "s2": NEW, "s3": B, "s5": A}  # s4 and s5 seen on one side only
    join = session_moves(before, after, Change.JOIN, NEW)
    assert (join.seen, join.kept, join.with_change, join.needless) == (3, 1, 1, 1)
    leave = session_moves({"s1": NEW, "s2": A, "s3": B}, {"s1": A, "s2": A, "s3": A},
                          Change.LEAVE, NEW)  # fmt: skip
    assert (leave.seen, leave.kept, leave.with_change, leave.needless) == (3, 1, 1, 1)


def test_the_router_learned_after_its_last_miss() -> None:
    ready, first = T0, T0 + S
    routed = [
        Routed(T0 - S, "s1", A),  # before ready: not a miss
        Routed(T0 + S // 4, "s1", A),  # s1 goes on to NEW: a miss at 250 ms
        Routed(T0 + S // 2, "s2", B),  # s2 stays on B: not the new replica's
        # sent a moment before the replica logged it: the same request, not a miss
        Routed(first - 1000, "s1", NEW),
        Routed(first, "s1", NEW),
        Routed(first + 1, "s2", B),
    ]
    assert learned_after_ns(routed, NEW, ready, first) == T0 + S // 4
    assert learned_after_ns(routed[3:], NEW, ready, first) == ready


def test_recovery_is_from_the_change_to_the_last_return_into_the_band() -> None:
    step = S // 10
    calm = [(T0 + i * step, 100.0) for i in range(40)]
    assert recovery_s(calm, (80.0, 120.0), T0, T0 + 4 * S, 0.5) == 0.0
    spike = [(t, 300.0 if T0 + S <= t < T0 + 2 * S else ms) for t, ms in calm]
    got = recovery_s(spike, (80.0, 120.0), T0, T0 + 4 * S, 0.5)
    assert got is not None and 2.0 <= got <= 2.5  # back once the window has no slow request
    stuck = [(t, 300.0 if t >= T0 + S else ms) for t, ms in calm]
    assert recovery_s(stuck, (80.0, 120.0), T0, T0 + 4 * S, 0.5) is None


def test_request_logs_of_both_stacks_are_read_alike(tmp_path: Path) -> None:
    accounting = tmp_path / "accounting-zl-2.jsonl"
    accounting.write_bytes(
        b"".join(
            orjson.dumps({"start_ns": t, "session": s}) + b"\n"
            for t, s in ((T0 + 2, "s2"), (T0 + 1, "s1"))
        )
    )
    engine = tmp_path / "engine-requests-41.jsonl"
    events = [{"event": "ready", "t_ns": T0}, {"event": "request", "t_ns": T0 + 5, "session": "s9"},
              {"event": "request", "t_ns": T0 + 10 * S, "session": "late"}]  # fmt: skip
    engine.write_bytes(b"".join(orjson.dumps(e) + b"\n" for e in events))
    assert request_times(accounting) == [(T0 + 1, "s1"), (T0 + 2, "s2")]
    assert request_times(engine) == [(T0 + 5, "s9"), (T0 + 10 * S, "late")]
    assert request_times(tmp_path / "none.jsonl") == []
    assert engine_routed(tmp_path, T0, T0 + S) == [Routed(T0 + 5, "s9", "pid41")]


def test_a_join_returns_once_the_new_replica_took_a_request(tmp_path: Path) -> None:
    """The hold before the leave counts from the joined replica's first request: the wait ends
    on that line in its log (written from another thread here), or at its bound without one."""
    log = tmp_path / "accounting-zl-2.jsonl"
    log.write_bytes(orjson.dumps({"event": "ready", "t_ns": T0}) + b"\n")
    first = orjson.dumps({"start_ns": T0 + 1, "session": "s1"}) + b"\n"
    writer = threading.Timer(0.05, lambda: log.write_bytes(log.read_bytes() + first))
    writer.start()
    _wait_first_request(str(log), timeout_s=600)
    writer.join()
    assert request_times(log) == [(T0 + 1, "s1")]
    _wait_first_request(str(tmp_path / "never.jsonl"), timeout_s=0.1)  # no request: no error


class ServeScaling:
    """A controller's answers, one per poll (the last repeats): replicas running, and how many
    it reports starting or stopping. A stand-in for Serve's controller in the wait's own logic
    only; tests/chaos/test_elasticity.py scales the real one."""

    def __init__(self, polls: list[tuple[list[int], int]]) -> None:
        self.polls = polls
        self.asked = 0

    def _poll(self) -> tuple[list[int], int]:
        self.asked += 1
        return self.polls[min(self.asked, len(self.polls)) - 1]

    def running_engines(self) -> list[int]:
        return self._poll()[0]

    def replicas_changing(self) -> int:
        return self.polls[min(self.asked, len(self.polls)) - 1][1]


class ScaledTarget:
    def __init__(self, kind: ServeScaling) -> None:
        self.kind = kind


def test_a_scale_past_its_allowance_is_waited_for_while_serve_still_starts_a_replica() -> None:
    """The allowance (``ready_timeout_s``) is spent at once here; Serve still reports a replica
    starting, so the wait goes on until it runs (tests-under-load: Serve took longer than the
    smoke profile's 60 s to start one, and the join failed while it was starting)."""
    kind = ServeScaling([([1, 2], 1), ([1, 2], 1), ([1, 2, 3], 0)])
    assert _wait_running(ScaledTarget(kind), 3, timeout_s=0) == [1, 2, 3]  # type: ignore[arg-type]
    assert kind.asked == 3


def test_a_scale_past_its_allowance_with_nothing_starting_fails_at_once() -> None:
    kind = ServeScaling([([1, 2], 0)])
    with pytest.raises(RuntimeError, match="2 engine replicas running, not 3"):
        _wait_running(ScaledTarget(kind), 3, timeout_s=0)  # type: ignore[arg-type]
    assert kind.asked == 1


def test_a_joining_replica_gets_its_own_port_name_and_accounting() -> None:
    command = ["python", "-m", "zerolayer.server", "--port", "8001", "--name", "zl-0"]
    got = _joining_command(command, "zl-2", Path("/x/acc.jsonl"))
    assert got[got.index("--port") + 1] == "0" and got[got.index("--name") + 1] == "zl-2"
    assert got[-4:] == ["--accounting", "/x/acc.jsonl", "--accounting-flush-s", "0.1"]
    assert command[4] == "8001"  # the first replica's command is left as it was


def record(i: int, session: str, replica: str, t: int, **fields: Any) -> RequestRecord:
    rec = RequestRecord(f"r{i}", "zerolayer", "g_elasticity", "native", intended_start_ns=t,
                        sent_ns=t, end_ns=t + S // 2, first_token_ns=t + S // 10,
                        outcome="completed", session=session, replica=replica)  # fmt: skip
    for key, value in fields.items():
        setattr(rec, key, value)
    return rec


def journal(log: Path, join_at: int, leave_at: int, left_at: int) -> dict[str, Any]:
    join = {"change": "join", "t_ns": join_at, "replica": NEW, "ready_ns": join_at + S // 2,
            "announced_ns": join_at + S // 2 + 1000, "request_log": str(log)}  # fmt: skip
    leave = {"change": "leave", "t_ns": leave_at, "replica": NEW, "end_ns": left_at}
    runs = [{"activity": {"type": "action"}, "output": o} for o in (join, leave)]
    return {"status": "completed", "run": runs, "rollbacks": [{"status": "succeeded"}]}


def test_a_trial_of_two_changes_gives_every_figure(tmp_path: Path) -> None:
    owner = {"s0": A, "s1": B, "s2": A, "s3": B}
    joined = {**owner, "s2": NEW}  # the ring gives s2 to the joining replica
    join_at, leave_at, left_at = T0 + 4 * S, T0 + 8 * S, T0 + 9 * S
    first = join_at + 2 * S
    records = []
    for i in range(48):  # one request every 250 ms for 12 s, sessions in turn
        t, session = T0 + i * S // 4, f"s{i % 4}"
        where = joined if first <= t < leave_at else owner
        records.append(record(i, session, where[session], t))
    records[30].outcome, records[30].error_code = "error", "draining"
    records[45].outcome = "lost"
    log = tmp_path / "accounting-zl-2.jsonl"
    log.write_bytes(orjson.dumps({"start_ns": first, "session": "s2"}) + b"\n")
    changes = [{"t_ns": join_at + S, "added": [NEW], "removed": []}]
    row = compute(TrialInputs("zerolayer", 1, 2, records, journal(log, join_at, leave_at, left_at),
                              client_routed(records), 1.0, 25.0, changes))  # fmt: skip
    assert row.status == "completed" and row.rollbacks_ok and not row.note
    assert row.time_to_first_request_ms == 1500.0 and row.sdk_learned_ms == 500.0
    assert row.learned_after_ms == 1000.0  # s2's request at join + 1.5 s went to A
    assert (row.join_moves.seen, row.join_moves.with_change, row.join_moves.needless) == (4, 1, 0)
    assert (row.leave_moves.seen, row.leave_moves.with_change, row.leave_moves.needless) == (
        4,
        1,
        0,
    )
    assert needless_share(row) == 0.0
    assert (row.errors_steady, row.errors_join, row.errors_leave, row.lost) == (0, 1, 1, 1)
    assert row.steady_e2el_ms == 500.0 and row.band_low_ms == 375.0
    assert row.recovery_join_s == 0.0


def test_a_trial_whose_replica_never_took_a_request_says_so(tmp_path: Path) -> None:
    records = [record(i, "s0", A, T0 + i * S) for i in range(10)]
    row = compute(TrialInputs("zerolayer", 0, 2, records,
                              journal(tmp_path / "empty.jsonl", T0 + S, T0 + 5 * S, T0 + 6 * S),
                              client_routed(records), 1.0, 25.0))  # fmt: skip
    assert row.time_to_first_request_ms is None and "took no request" in row.note
    half = compute(TrialInputs("zerolayer", 0, 2, records, {"status": "failed", "run": []},
                               [], 1.0, 25.0))  # fmt: skip
    assert "did not both join and leave: none" in half.note and half.status == "failed"


@settings(max_examples=50, deadline=None)
@given(
    owners=st.dictionaries(st.sampled_from([f"s{i}" for i in range(30)]),
                           st.sampled_from([A, B]), min_size=1),
    moved=st.sets(st.sampled_from([f"s{i}" for i in range(30)])),
)  # fmt: skip
def test_moves_partition_the_sessions_seen(owners: dict[str, str], moved: set[str]) -> None:
    after = {s: (NEW if s in moved else r) for s, r in owners.items()}
    got = session_moves(owners, after, Change.JOIN, NEW)
    assert got.seen == got.kept + got.with_change + got.needless == len(owners)
    assert got.needless == 0 and got.with_change == len(moved & owners.keys())
