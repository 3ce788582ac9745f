"""Attacks on who pays and who goes first (issue 14 items 8 and 9): a flood labelled ``high`` by
a client whose key allows ``normal``, and accounting rows lost to a SIGKILL."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Final

import orjson

from chaos.attacks.context import Context, Setup, completion, contract_header
from chaos.attacks.h2raw import Header, HostileH2, request_headers
from chaos.attacks.outcome import Observed
from chaos.attacks.target import replica_flags
from serving.wire import contract

KEY_FILE: Final = "api-keys.toml"
FLOOD_TENANT: Final = "flood"
VICTIM_TENANT: Final = "victim"
HEALTHY_TENANT: Final = "healthy"
FLOOD_BATCH: Final = 50
ANSWER_WAIT_S: Final = 5.0  # bound on reading the answers to the last batch
FLOOD_MAX_TOKENS: Final = 512
VICTIM_DEADLINE_MS: Final = 6000
"""The issue's queued ``normal`` request with a 6 s deadline (it finished in 0.4 s unflooded)."""
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
    flood = HostileH2(target.host, target.port)
    victim = HostileH2(target.host, target.port)
    body = completion(FLOOD_MAX_TOKENS)
    flood_headers = request_headers(
        target.port, extra=_auth(keys[FLOOD_TENANT], FLOOD_TENANT, "high"), body_len=len(body)
    )
    flood_sids: list[int] = []
    stop_at = ctx.deadline()
    try:
        victim_body = completion(16)
        victim_headers = request_headers(
            target.port,
            extra=[
                *_auth(keys[VICTIM_TENANT], VICTIM_TENANT, "normal"),
                contract_header(contract.DEADLINE_MS, str(VICTIM_DEADLINE_MS)),
            ],
            body_len=len(victim_body),
        )
        victim_sid = -1
        while time.monotonic() < stop_at and not flood.tally.closed:
            for _ in range(FLOOD_BATCH):
                sid = flood.open_stream(flood_headers)
                flood.h2.send_data(sid, body, end_stream=True)
                flood_sids.append(sid)
            flood.flush()
            flood.pump(0.05)
            if victim_sid < 0:
                victim_sid = victim.open_stream(victim_headers)
                victim.h2.send_data(victim_sid, victim_body, end_stream=True)
                victim.flush()
            victim.pump()
        victim.wait_answered([victim_sid], VICTIM_DEADLINE_MS / 1000 + 1)
        # The last batch went out just before the deadline: read its answers too (bounded).
        flood.wait_answered(flood_sids, ANSWER_WAIT_S)
        return _priority_verdict(flood, victim, victim_sid, len(flood_sids))
    finally:
        flood.close()
        victim.close()


def _auth(key: str, tenant: str, priority: str) -> list[Header]:
    return [
        (b"authorization", f"Bearer {key}".encode()),
        contract_header(contract.TENANT, tenant),
        contract_header(contract.PRIORITY, priority),
    ]


def _priority_verdict(flood: HostileH2, victim: HostileH2, sid: int, sent: int) -> Observed:
    refused = flood.tally.statuses[f"403 {contract.PRIORITY_NOT_ALLOWED.code}"]
    victim_status = victim.tally.responses.get(sid, "no answer")
    completed = sid in victim.tally.ended and victim_status == "200"
    said = (
        f"refused {refused:,} of {sent:,} spoofed high requests; the queued normal request "
        f"answered {victim_status}{'' if completed else ' (did not complete)'}"
    )
    problems = []
    if refused < sent:
        problems.append(f"{sent - refused} spoofed high requests not refused priority_not_allowed")
    if not completed:
        problems.append(f"the normal request missed its {VICTIM_DEADLINE_MS} ms deadline")
    return Observed(said, tuple(problems))


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
                sid = conn.open_stream(
                    request_headers(target.port, extra=extra, body_len=len(body))
                )
                conn.h2.send_data(sid, body, end_stream=True)
                batch[sid] = request_id
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
