"""Attacks on who pays and who goes first (issue 14 items 8 and 9): a flood labelled ``high`` by
a client whose key allows ``normal``, and accounting rows lost to a SIGKILL."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Final

import orjson

from chaos.attacks.context import Context, Setup, completion, contract_header
from chaos.attacks.h2raw import HANG_S, Header, HostileH2, request_headers
from chaos.attacks.outcome import Observed
from chaos.attacks.target import replica_flags
from serving.cpus import run_times
from serving.wire import contract

KEY_FILE: Final = "api-keys.toml"
FLOOD_TENANT: Final = "flood"
VICTIM_TENANT: Final = "victim"
HEALTHY_TENANT: Final = "healthy"
FLOOD_BATCH: Final = 50
FLOOD_MAX_TOKENS: Final = 512
VICTIM_DEADLINE_MS: Final = 6000
"""The issue's queued ``normal`` request with a 6 s deadline (it finished in 0.4 s unflooded)."""
VICTIM_DEADLINE_FACTOR: Final = 15
"""The issue's deadline over its unflooded time (6 s / 0.4 s): the victim's deadline is at least
this many times the same request's time measured alone just before the flood, so a host too
loaded to serve it in 0.4 s does not fail it. A flood let in as ``high`` queues the victim behind
thousands of 512-token requests on a few sequences: minutes, far past that."""
HELD_OFF_SHARE: Final = 0.5
"""A victim that missed its deadline while the replica's threads waited for a core for at least
this share of the deadline was held off by the host: such a miss decides nothing (a load the host
cannot carry decides nothing), and the refusals alone are judged. A flood let in as ``high`` is
a flood not refused, which fails on any host."""
QUEUE_SEQS: Final = 4
"""``max_num_seqs`` of the sim engine for the priority attack: a few, so a flood queues."""
ACCOUNTING_FILE: Final = "accounting.jsonl"
ACCOUNTING_FLUSH_ROWS: Final = 1024
"""The accounting's ``flush_rows`` (its default): a SIGKILL may lose at most twice that, the
rows waiting plus one batch being written, as ``zerolayer.accounting`` states."""
ACCOUNTING_BATCH: Final = 200
ACCOUNTING_REQUESTS_MAX: Final = 200_000


def priority_setup(workdir: Path) -> Setup:
    """A key file: the flood's and the victim's keys allow ``normal``, the healthy client's too."""
    if "--api-keys" not in replica_flags():
        return Setup(skipped="zl-replica has no --api-keys flag yet (authentication not built)")
    from serving.auth import write_key_file

    path = workdir / KEY_FILE
    tenants = {FLOOD_TENANT: "normal", VICTIM_TENANT: "normal", HEALTHY_TENANT: "normal"}
    keys = write_key_file(path, tenants)
    return Setup(
        ("--api-keys", str(path), "--engine-option", f"max_num_seqs={QUEUE_SEQS}"),
        keys[HEALTHY_TENANT],
        keys=tuple(keys.items()),
    )


def priority_spoof(ctx: Context) -> Observed:
    """A flood labelled ``high`` with a key that allows only ``normal``: refused with
    ``priority_not_allowed``, so a queued ``normal`` request still meets its deadline."""
    keys = dict(ctx.setup.keys)
    target = ctx.target
    body = completion(FLOOD_MAX_TOKENS)
    flood_headers = request_headers(
        target.port, extra=_auth(keys[FLOOD_TENANT], FLOOD_TENANT, "high"), body_len=len(body)
    )
    victim_body = completion(16)

    def victim_headers(deadline_ms: int) -> list[Header]:
        return request_headers(
            target.port,
            extra=[
                *_auth(keys[VICTIM_TENANT], VICTIM_TENANT, "normal"),
                contract_header(contract.DEADLINE_MS, str(deadline_ms)),
            ],
            body_len=len(victim_body),
        )

    flood_sids: list[int] = []
    victim = HostileH2(target.host, target.port)
    flood: HostileH2 | None = None
    try:
        unflooded_ms = _time_alone(victim, victim_headers(int(HANG_S * 1000)), victim_body)
        deadline_ms = max(VICTIM_DEADLINE_MS, round(VICTIM_DEADLINE_FACTOR * (unflooded_ms or 0)))
        # Opened only now: the replica's keepalive closes a connection left unread meanwhile.
        flood = HostileH2(target.host, target.port)
        victim_sid = -1
        waited_at_send = 0
        stop_at = ctx.deadline()
        while time.monotonic() < stop_at and not flood.tally.closed:
            flood_sids += [flood.send_request(flood_headers, body) for _ in range(FLOOD_BATCH)]
            flood.flush()
            flood.pump(0.05)
            if victim_sid < 0:
                waited_at_send = run_times([target.pid])[1]
                victim_sid = victim.send_request(victim_headers(deadline_ms), victim_body)
                victim.flush()
            victim.pump()
        # The replica ends the victim by its deadline, and the last batch went out just before
        # the attack's: read both answers, both connections (each is closed unread past the
        # keepalive). HANG_S only guards against a hang.
        victim_sids = [victim_sid] if victim_sid > 0 else []
        _wait_answered(
            (victim, victim_sids), (flood, flood_sids), timeout_s=deadline_ms / 1000 + HANG_S
        )
        held_off_ms = max(0, run_times([target.pid])[1] - waited_at_send) / 1e6
        observed = _priority_verdict(
            flood, victim, victim_sid, len(flood_sids), deadline_ms, held_off_ms
        )
        if unflooded_ms is None:
            problem = "the normal request did not complete even before the flood"
            return Observed(observed.did, (problem, *observed.problems))
        return observed
    finally:
        victim.close()
        if flood is not None:
            flood.close()


def _auth(key: str, tenant: str, priority: str) -> list[Header]:
    return [
        (b"authorization", f"Bearer {key}".encode()),
        contract_header(contract.TENANT, tenant),
        contract_header(contract.PRIORITY, priority),
    ]


def _wait_answered(*waits: tuple[HostileH2, list[int]], timeout_s: float) -> None:
    """Pump every connection until each of its streams has ended or been reset, or it closed,
    or ``timeout_s`` passed."""
    give_up_at = time.monotonic() + timeout_s
    pending = list(waits)
    while pending and time.monotonic() < give_up_at:
        for conn, _ in pending:
            conn.pump(0.05)
        pending = [(c, sids) for c, sids in pending if not (c.tally.closed or _done(c, sids))]


def _done(conn: HostileH2, sids: list[int]) -> bool:
    tally = conn.tally
    return all(s in tally.ended or s in tally.reset_ids for s in sids)


def _time_alone(conn: HostileH2, headers: list[Header], body: bytes) -> float | None:
    """One request alone on ``conn``: ms until it completed with a 200 (None if it did not)."""
    started = time.monotonic()
    sid = conn.send_request(headers, body)
    conn.flush()
    conn.wait_answered([sid], HANG_S)
    if sid in conn.tally.ended and conn.tally.responses.get(sid) == "200":
        return (time.monotonic() - started) * 1000
    return None


def _priority_verdict(
    flood: HostileH2,
    victim: HostileH2,
    sid: int,
    sent: int,
    deadline_ms: int,
    held_off_ms: float,
) -> Observed:
    """Every spoofed request refused, and the victim served by its deadline unless the host
    held the replica off a core for :data:`HELD_OFF_SHARE` of it (``held_off_ms``: how long
    the replica's threads waited on a run queue while the victim was out)."""
    refused = flood.tally.statuses[f"403 {contract.PRIORITY_NOT_ALLOWED.code}"]
    victim_status = victim.tally.responses.get(sid, "no answer")
    ended = sid in victim.tally.ended
    said = (
        f"refused {refused:,} of {sent:,} spoofed high requests; the queued normal request "
        f"(deadline {deadline_ms:,} ms) answered {victim_status}"
        f"{'' if ended else f' (did not complete: {_why_unfinished(victim, sid)})'}"
    )
    problems = []
    if refused < sent:
        problems.append(f"{sent - refused} spoofed high requests not refused priority_not_allowed")
    timed_out = ended and victim_status == f"504 {contract.DEADLINE_EXCEEDED.code}"
    if timed_out and held_off_ms >= HELD_OFF_SHARE * deadline_ms:
        said += (
            f"; not judged: the host held the replica off a core for {held_off_ms:,.0f} ms "
            f"of its deadline"
        )
    elif not (ended and victim_status == "200"):
        problems.append(f"the normal request missed its {deadline_ms:,} ms deadline")
    return Observed(said, tuple(problems))


def _why_unfinished(conn: HostileH2, sid: int) -> str:
    """How a stream that did not complete ended: its reset, its connection's end, or none."""
    tally = conn.tally
    if sid in tally.reset_ids:
        return f"reset {', '.join(tally.resets)}"
    if tally.goaway:
        return f"GOAWAY {tally.goaway}"
    if tally.closed:
        return "the replica closed the connection"
    return "no end before the wait gave up"


def accounting_setup(workdir: Path) -> Setup:
    return Setup(("--accounting", str(workdir / ACCOUNTING_FILE)))


def accounting_sigkill(ctx: Context) -> Observed:
    """Requests answered as fast as one connection can, then SIGKILL: rows lost (answered
    requests missing from the accounting file) must stay within the stated bound."""
    target = ctx.target
    conn = HostileH2(target.host, target.port)
    answered: set[str] = set()
    stop_at = ctx.deadline()
    sent = 0
    body = completion(1, stream=False)
    try:
        while sent < ACCOUNTING_REQUESTS_MAX and time.monotonic() < stop_at:
            batch = {}
            for _ in range(ACCOUNTING_BATCH):
                request_id = f"acct-{sent}"
                extra = [contract_header(contract.REQUEST_ID, request_id)]
                headers = request_headers(target.port, extra=extra, body_len=len(body))
                batch[conn.send_request(headers, body)] = request_id
                sent += 1
            if not conn.flush():
                break
            conn.wait_answered(list(batch), 2.0)
            tally = conn.tally
            answered |= {r for s, r in batch.items() if tally.responses.get(s) == "200"}
        target.kill()
    finally:
        conn.close()
    return _accounting_verdict(ctx.workdir / ACCOUNTING_FILE, answered)


def _accounting_verdict(path: Path, answered: set[str]) -> Observed:
    written = set()
    if path.exists():
        for line in path.read_bytes().splitlines():
            with contextlib.suppress(orjson.JSONDecodeError):  # a line torn by the kill
                row = orjson.loads(line)
                if isinstance(row, dict):
                    written.add(str(row.get("request_id")))
    lost = len(answered - written)
    bound = 2 * ACCOUNTING_FLUSH_ROWS
    said = (
        f"SIGKILL after {len(answered):,} answered requests: {lost:,} rows lost (bound {bound:,})"
    )
    if lost > bound:
        return Observed(said, (f"{lost:,} accounting rows lost, past the bound {bound:,}",))
    return Observed(said)
