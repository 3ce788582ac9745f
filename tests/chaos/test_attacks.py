"""The standing attack suite (issue 14): each attack for a second against a fresh ``zl-replica``
beside a healthy SDK client; the client's requests all complete, RSS stays under the attack's
bound and ``active`` returns to 0. Plus the judging and the command line's user mistakes."""

from __future__ import annotations

import http.server
import socket
import time
from collections import Counter
from pathlib import Path
from typing import cast

import pytest

from bench.cli import main
from chaos.attacks import connections, tenancy
from chaos.attacks.context import Context, Setup
from chaos.attacks.h2raw import HANG_S, HostileH2, Tally
from chaos.attacks.outcome import RSS_SLACK_BYTES, SETTLE_TIMEOUT_S, Observed, RssBound, judge
from chaos.attacks.runner import ATTACKS, NAMES, Attack, run_attack, select
from chaos.attacks.target import Target
from serving.wire import contract
from tests.support.httpserver import answering_url

SECONDS = 1.0


@pytest.mark.parametrize("attack", ATTACKS, ids=NAMES)
def test_attack_keeps_within_bounds(attack: Attack) -> None:
    outcome = run_attack(attack, SECONDS)
    if outcome.skipped:
        pytest.skip(outcome.skipped)
    assert outcome.passed, outcome.line()


def test_every_attack_has_a_summary_and_an_issue_item() -> None:
    for attack in ATTACKS:
        assert attack.summary and attack.item in range(1, 12), attack.name
    assert len(set(NAMES)) == len(NAMES)


def test_select_keeps_the_suite_order_and_refuses_unknown_names() -> None:
    assert [a.name for a in select(["cl-te", "rapid-reset"])] == ["rapid-reset", "cl-te"]
    assert select([]) == ATTACKS
    with pytest.raises(ValueError, match="unknown attack 'nope'"):
        select(["nope"])


def test_judge_names_every_bound_missed() -> None:
    bound = RssBound(connections=1, buffered=1, connection_buffer_bytes=1 << 20)
    grew = bound.bytes + 1
    failures = judge(
        Observed("x", ("cut",)), 3, 4, (0, grew, 0), bound, 2, healthy_errors={"no_replica": 1}
    )
    assert failures == (
        "cut",
        "healthy client: 3 of 4 requests completed (1 x no_replica)",
        f"RSS grew {grew / (1 << 20):.1f} MiB, bound {bound.bytes / (1 << 20):.1f} MiB",
        f"active is 2, not 0, {SETTLE_TIMEOUT_S:g} s after the attack",
    )
    assert judge(Observed("x"), 4, 4, (0, bound.bytes, 0), bound, 0) == ()
    assert judge(Observed("x"), 0, 0, (0, 0, 0), bound, None, replica_killed=True) == ()


class _LateAnswer(http.server.BaseHTTPRequestHandler):
    """Answers late, then closes the connection, or (``keeps``) keeps it until it is idle for
    ``timeout``, as the replica's idle timeout would close a connection it wrongly kept."""

    protocol_version = "HTTP/1.1"
    timeout = 1
    keeps = False

    def do_POST(self) -> None:
        time.sleep(0.3)
        self.send_response(400)
        self.send_header("zl-error", "bad_request")
        self.send_header("content-length", "0")
        self.end_headers()
        self.close_connection = not self.keeps

    do_GET = do_POST

    def log_message(self, *args: object) -> None:
        pass


class _LateAnswerKept(_LateAnswer):
    keeps = True


@pytest.mark.parametrize("keeps", [False, True])
def test_the_close_after_an_answer_is_waited_for_and_told_from_a_later_idle_close(
    keeps: bool,
) -> None:
    """cl-te's verdict ends on an event: the close, or the answer to a probe sent behind the
    request (a fixed read window would see the idle timeout's close and call it kept)."""
    with answering_url(_LateAnswerKept if keeps else _LateAnswer) as url:
        port = int(url.rsplit(":", 1)[1])
        target = cast(Target, type("FakeTarget", (), {"host": "127.0.0.1", "port": port}))
        ctx = Context(target, 1.0, Path("."))
        status, closed = connections._one_request(ctx, b"POST / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert (status, closed) == ("400 bad_request", not keeps)


def test_a_failed_attack_keeps_the_replica_log_and_a_passed_one_does_not() -> None:
    """Why a connection went is in the replica's log (INFO: a PING unanswered, a preface
    late), which the replica's stop removes: a failure keeps its last lines, shown in its line."""

    def preface_late(ctx: Context) -> Observed:
        with socket.create_connection((ctx.target.host, ctx.target.port)) as sock:
            sock.settimeout(HANG_S)
            closed = sock.recv(1) == b""  # nothing sent: the header timeout closes it
        return Observed("x", ("a problem",) if closed else ())

    failed = run_attack(Attack("x", 8, preface_late, healthy=False), SECONDS)
    assert failed.failures == ("a problem",), failed.line()
    assert any("header_timeout_s" in line for line in failed.replica_log), failed.replica_log
    assert "header_timeout_s" in failed.line()
    passed = run_attack(Attack("x", 8, lambda ctx: Observed("x"), healthy=False), SECONDS)
    assert passed.passed and passed.replica_log == ()


@pytest.mark.parametrize(
    ("tally", "says"),
    [
        (Tally(resets=Counter({"CANCEL": 1}), reset_ids={1}), "reset CANCEL"),
        (Tally(goaway="NO_ERROR", closed=True), "GOAWAY NO_ERROR"),
        (Tally(closed=True), "the replica closed the connection"),
        (Tally(), "no end before the wait gave up"),
    ],
)
def test_an_unfinished_victim_says_how_its_stream_ended(tally: Tally, says: str) -> None:
    conn = HostileH2("127.0.0.1", 1, connect=False)
    conn.tally = tally
    assert tenancy._why_unfinished(conn, 1) == says


def _answered(status: str) -> HostileH2:
    conn = HostileH2("127.0.0.1", 1, connect=False)
    conn.tally = Tally(statuses=Counter({status: 10}), responses={1: status}, ended={1})
    return conn


TIMED_OUT = f"504 {contract.DEADLINE_EXCEEDED.code}"


@pytest.mark.parametrize(
    ("victim", "held_off_ms", "problems", "says"),
    [
        ("200", 0.0, [], "answered 200"),
        (TIMED_OUT, 100.0, ["the normal request missed its 6,000 ms deadline"], TIMED_OUT),
        (TIMED_OUT, 3000.0, [], "not judged: the host held the replica off a core for 3,000 ms"),
        ("500 internal", 5000.0, ["the normal request missed its 6,000 ms deadline"], "500"),
    ],
)
def test_a_victim_late_only_because_the_host_held_the_replica_off_a_core_is_not_judged(
    victim: str, held_off_ms: float, problems: list[str], says: str
) -> None:
    flood = _answered(f"403 {contract.PRIORITY_NOT_ALLOWED.code}")
    observed = tenancy._priority_verdict(flood, _answered(victim), 1, 10, 6000, held_off_ms)
    assert list(observed.problems) == problems and says in observed.did, observed


def test_a_spoofed_request_let_in_fails_the_attack_however_loaded_the_host() -> None:
    flood = _answered("200")
    observed = tenancy._priority_verdict(flood, _answered(TIMED_OUT), 1, 10, 6000, 6000.0)
    assert observed.problems == ("10 spoofed high requests not refused priority_not_allowed",)


def test_rss_bound_counts_connections_and_their_budgets() -> None:
    bound = RssBound(connections=300, buffered=2, connection_buffer_bytes=2 << 20)
    assert bound.bytes == RSS_SLACK_BYTES + 300 * (64 << 10) + 2 * (2 << 20)


def test_a_setup_that_cannot_run_skips_with_its_reason() -> None:
    attack = Attack("x", 8, lambda ctx: Observed(""), setup=lambda _: Setup(skipped="no flag"))
    outcome = run_attack(attack, SECONDS)
    assert outcome.skipped == "no flag" and outcome.verdict == "skip" and not outcome.passed


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--only", "nope"], "unknown attack 'nope'"),
        (["--seconds", "0"], "must be a positive number"),
        (["--engine", "vllm"], "invalid choice"),
        (["--out", "{file}/out.json"], "is a file, not a directory"),
    ],
)
def test_user_mistakes_are_one_line_and_exit_2(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Refused before any attack runs (root may write anywhere, so the folder under a file)."""
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    with pytest.raises(SystemExit) as exited:
        main(["attack", *(arg.format(file=a_file) for arg in argv)])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("zl-bench: error: ") and err.count("\n") == 1 and says in err, err
