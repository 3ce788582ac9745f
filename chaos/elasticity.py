"""Profile G's figures for one trial, from the load's request log, the Chaos Toolkit journal and
the replicas' own request logs (docs/design.md, "Elasticity").

The join and the leave are the method's two actions (``chaos.elastic``); their outputs give the
replica that joined, when it could serve (``ready_ns``) and when the stack's router was told
(``announced_ns``), and when the leave began and ended. From them:

- **time to first request**: from the joining replica being ready to the first request it
  received, as the replica itself logged it (the zero-layer replica's accounting file; the
  baseline engine replica's request log). Its lower companion, **learned after**: the last
  request, sent after the replica was ready, of a session it went on to serve that still went
  elsewhere (the router had not learned of it by then; 0 when none did). Where the client
  routes, **SDK learned**: when the SDK applied the replica set that added it (its own change
  record), which no arrival delays;
- **sessions moved**, per change: every session served both before and after it, with the
  replica of its last request before and of its first after (the client's record where the
  client routes; the engine replicas' logs behind the baseline's front door). Before a join
  means before the join began, after it means from the new replica's first request on; before a
  leave means from that first request to the leave, after it means once the leaving replica is
  gone. A session is *kept* on the same replica, *moved with the change* when it moved to the
  joining replica or away from the leaving one (what consistent hashing moves), and *moved
  needlessly* otherwise: the claim's figure is the needless share of the sessions that did not
  have to move (join and leave pooled);
- **errors** (failed and lost requests) by when they were due: before the join, from the join
  to the leave, from the leave on;
- **recovery**: the steady band is the median E2EL (from the intended start) of the requests
  that ended before the join, +/- ``band_pct``; the rolling median E2EL over ``window_s`` is
  followed on a 50 ms grid after each change (to the next change, or the end of the log), and
  the recovery time is from the change's start to the last time it came back into the band and
  stayed there (0 when it never left it; None when it ended outside it).
"""

from __future__ import annotations

import statistics
from bisect import bisect_right
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from baselines.rayserve.config import REQUESTS_PREFIX
from chaos.elastic import Change, request_times
from chaos.probes import NS
from chaos.recovery import method_actions
from harness.schema import RequestRecord

STEP_S: Final = 0.05
MS: Final = 1_000_000


@dataclass(frozen=True, slots=True)
class Routed:
    """One request as a replica served it: when, for which session, on which replica."""

    t_ns: int
    session: str
    replica: str


@dataclass
class SessionMoves:
    """The sessions served on both sides of one change, by what happened to their replica."""

    seen: int = 0
    kept: int = 0
    with_change: int = 0
    needless: int = 0


@dataclass
class ElasticityRow:
    """One trial of profile G on one stack (see the module docstring for each figure)."""

    stack: str
    repeat: int
    status: str
    rollbacks_ok: bool
    replicas: int
    joined: str = ""
    left: str = ""
    join_ns: int = 0
    ready_ns: int = 0
    announced_ns: int = 0
    first_request_ns: int = 0
    leave_ns: int = 0
    left_ns: int = 0
    time_to_first_request_ms: float | None = None
    announce_ms: float | None = None
    learned_after_ms: float | None = None
    sdk_learned_ms: float | None = None
    join_moves: SessionMoves = field(default_factory=SessionMoves)
    leave_moves: SessionMoves = field(default_factory=SessionMoves)
    requests: int = 0
    errors_steady: int = 0
    errors_join: int = 0
    errors_leave: int = 0
    lost: int = 0
    steady_e2el_ms: float | None = None
    band_low_ms: float | None = None
    band_high_ms: float | None = None
    recovery_join_s: float | None = None
    recovery_leave_s: float | None = None
    note: str = ""


def needless_moves(row: ElasticityRow) -> tuple[int, int]:
    """(sessions moved needlessly, sessions that did not have to move), join and leave pooled."""
    moves = (row.join_moves, row.leave_moves)
    return sum(m.needless for m in moves), sum(m.seen - m.with_change for m in moves)


def needless_share(row: ElasticityRow) -> float | None:
    """The claim's figure: the share of sessions that did not have to move but did."""
    moved, could_stay = needless_moves(row)
    return moved / could_stay if could_stay else None


def client_routed(records: Iterable[RequestRecord]) -> list[Routed]:
    """Where the client routes: each request's replica as the client's record names it."""
    return sorted(
        (Routed(r.sent_ns, r.session, r.replica) for r in records if r.replica and r.sent_ns),
        key=lambda x: x.t_ns,
    )


def engine_routed(log_dir: str | Path, start_ns: int, end_ns: int) -> list[Routed]:
    """Behind a front door: every request the engine replicas logged within the trial, each
    replica named ``pid<N>`` as the scaling actions name it."""
    out = []
    for path in Path(log_dir).glob(f"{REQUESTS_PREFIX}*.jsonl"):
        replica = "pid" + path.stem.removeprefix(REQUESTS_PREFIX)
        out += [Routed(t, s, replica) for t, s in request_times(path) if start_ns <= t <= end_ns]
    return sorted(out, key=lambda x: x.t_ns)


def _last_before(routed: Sequence[Routed], lo: int, hi: int) -> dict[str, str]:
    """Each session's replica on its last request in ``[lo, hi)``."""
    return {r.session: r.replica for r in routed if lo <= r.t_ns < hi}


def _first_after(routed: Sequence[Routed], lo: int) -> dict[str, str]:
    out: dict[str, str] = {}
    for r in routed:
        if r.t_ns >= lo:
            out.setdefault(r.session, r.replica)
    return out


def session_moves(before: dict[str, str], after: dict[str, str], change: Change,
                  replica: str) -> SessionMoves:  # fmt: skip
    """Classify every session seen on both sides of a change of ``replica`` (which joined or
    left)."""
    moves = SessionMoves()
    for session in before.keys() & after.keys():
        was, now = before[session], after[session]
        moves.seen += 1
        if was == now:
            moves.kept += 1
        elif (change is Change.JOIN and now == replica) or (
            change is Change.LEAVE and was == replica
        ):
            moves.with_change += 1
        else:
            moves.needless += 1
    return moves


def learned_after_ns(routed: Sequence[Routed], joined: str, ready: int, first: int) -> int:
    """The lower bound on when the router learned of the joining replica: the last request sent
    after it was ready, of a session it then served, that went elsewhere (``ready`` if none)."""
    theirs = {s for s, rep in _first_after(routed, first).items() if rep == joined}
    missed = [
        r.t_ns
        for r in routed
        if ready <= r.t_ns < first and r.session in theirs and r.replica != joined
    ]
    return max(missed, default=ready)


def sdk_learned_ms(changes: Sequence[dict[str, Any]], joined: str, ready: int) -> float | None:
    """Milliseconds from ready to the SDK applying the set that added ``joined`` (None where no
    SDK recorded its changes)."""
    added = [c["t_ns"] for c in changes if joined in c.get("added", ())]
    return (min(added) - ready) / MS if added and ready else None


def _e2el(records: Iterable[RequestRecord]) -> list[tuple[int, float]]:
    """(end, E2EL in ms from the intended start) of every completed request, by end."""
    done = [r for r in records if r.outcome == "completed" and r.end_ns]
    return sorted((r.end_ns, (r.end_ns - r.intended_start_ns) / MS) for r in done)


def _rolling_medians(
    ends: Sequence[tuple[int, float]], start: int, stop: int, window_s: float
) -> Iterator[tuple[int, float]]:
    step, width = int(STEP_S * NS), int(window_s * NS)
    times = [end for end, _ in ends]
    for t in range(start, stop + 1, step):
        inside = [ms for _, ms in ends[bisect_right(times, t - width) : bisect_right(times, t)]]
        if inside:
            yield t, statistics.median(inside)


def recovery_s(
    ends: Sequence[tuple[int, float]],
    band: tuple[float, float],
    start: int,
    stop: int,
    window_s: float,
) -> float | None:
    """Seconds from ``start`` until the rolling median E2EL came back into ``band`` for good (0
    when it never left; None when it ended outside)."""
    back: int | None = start
    for t, median in _rolling_medians(ends, start, stop, window_s):
        inside = band[0] <= median <= band[1]
        if not inside:
            back = None
        elif back is None:
            back = t
    return None if back is None else (back - start) / NS


def _outputs(journal: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The method's action outputs by change (``join``, ``leave``)."""
    outs = [r.get("output") for r in method_actions(journal)]
    return {str(o["change"]): o for o in outs if isinstance(o, dict) and o.get("change")}


def _errors(records: Sequence[RequestRecord], lo: int, hi: int) -> int:
    return sum(1 for r in records if r.outcome != "completed" and lo <= r.intended_start_ns < hi)


@dataclass(frozen=True, slots=True)
class TrialInputs:
    """What one trial's figures are computed from."""

    stack: str
    repeat: int
    replicas: int
    records: Sequence[RequestRecord]
    journal: dict[str, Any]
    routed: Sequence[Routed]
    window_s: float
    band_pct: float
    sdk_changes: Sequence[dict[str, Any]] = ()


def compute(inputs: TrialInputs) -> ElasticityRow:
    """The trial's row (see the module docstring)."""
    journal, records, routed = inputs.journal, inputs.records, inputs.routed
    row = ElasticityRow(
        inputs.stack,
        inputs.repeat,
        str(journal.get("status")),
        all(r.get("status") == "succeeded" for r in journal.get("rollbacks", [])),
        inputs.replicas,
        requests=len(records),
        lost=sum(r.outcome == "lost" for r in records),
    )
    outs = _outputs(journal)
    join, leave = outs.get(Change.JOIN), outs.get(Change.LEAVE)
    if join is None or leave is None:
        row.note = "the replica did not both join and leave: " + (", ".join(outs) or "none")
        return row
    _join_figures(row, join, leave, routed)
    row.sdk_learned_ms = sdk_learned_ms(inputs.sdk_changes, row.joined, row.ready_ns)
    _leave_figures(row, leave, routed)
    _errors_and_recovery(row, records, inputs.window_s, inputs.band_pct)
    return row


def _join_figures(
    row: ElasticityRow, join: dict[str, Any], leave: dict[str, Any], routed: Sequence[Routed]
) -> None:
    row.joined, row.join_ns, row.leave_ns = str(join["replica"]), join["t_ns"], leave["t_ns"]
    row.ready_ns, row.announced_ns = int(join.get("ready_ns") or 0), int(join["announced_ns"])
    firsts = [t for t, _ in request_times(join["request_log"]) if t < row.leave_ns]
    row.first_request_ns = firsts[0] if firsts else 0
    if row.ready_ns:
        row.announce_ms = (row.announced_ns - row.ready_ns) / MS
    if not (row.ready_ns and row.first_request_ns):
        row.note = "the joining replica took no request before the leave began"
        return
    row.time_to_first_request_ms = (row.first_request_ns - row.ready_ns) / MS
    learned = learned_after_ns(routed, row.joined, row.ready_ns, row.first_request_ns)
    row.learned_after_ms = (learned - row.ready_ns) / MS
    before = _last_before(routed, 0, row.join_ns)
    after = _first_after([r for r in routed if r.t_ns < row.leave_ns], row.first_request_ns)
    row.join_moves = session_moves(before, after, Change.JOIN, row.joined)


def _leave_figures(row: ElasticityRow, leave: dict[str, Any], routed: Sequence[Routed]) -> None:
    row.left, row.left_ns = str(leave["replica"]), int(leave["end_ns"])
    if not row.first_request_ns:
        return
    before = _last_before(routed, row.first_request_ns, row.leave_ns)
    row.leave_moves = session_moves(before, _first_after(routed, row.left_ns), Change.LEAVE,
                                    row.left)  # fmt: skip


def _errors_and_recovery(
    row: ElasticityRow, records: Sequence[RequestRecord], window_s: float, band_pct: float
) -> None:
    end = max((r.end_ns or r.intended_start_ns for r in records), default=row.left_ns)
    row.errors_steady = _errors(records, 0, row.join_ns)
    row.errors_join = _errors(records, row.join_ns, row.leave_ns)
    row.errors_leave = _errors(records, row.leave_ns, end + 1)
    ends = _e2el(records)
    steady = [ms for t, ms in ends if t < row.join_ns]
    if not steady:
        return
    row.steady_e2el_ms = statistics.median(steady)
    band = (row.steady_e2el_ms * (1 - band_pct / 100), row.steady_e2el_ms * (1 + band_pct / 100))
    row.band_low_ms, row.band_high_ms = band
    row.recovery_join_s = recovery_s(ends, band, row.join_ns, row.leave_ns, window_s)
    row.recovery_leave_s = recovery_s(ends, band, row.leave_ns, max(end, row.leave_ns), window_s)
