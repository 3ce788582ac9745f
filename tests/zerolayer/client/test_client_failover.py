"""The SDK's failover policy (zerolayer.client.failover), alone: outcomes in, decisions out."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from serving.wire import contract
from zerolayer.client.codec import ZeroLayerError
from zerolayer.client.failover import (
    MARK_DOWN,
    Action,
    Outcome,
    decide,
    final_error,
    next_replica,
    unreachable,
)
from zerolayer.client.timing import (
    CLIENT_TIMEOUT,
    CONNECTION_LOST,
    NO_REPLICA,
    STREAM_RESET,
    Timing,
)


@dataclass
class Url:
    url: str


def error(code: str, retryable: bool = False) -> ZeroLayerError:
    return ZeroLayerError(code, "x", retryable=retryable)


def test_a_delivered_attempt_is_handed_to_the_caller() -> None:
    decision = decide(Outcome(None))
    assert decision.action is Action.DELIVER and not decision.mark_down


def test_a_lost_connection_before_the_first_token_moves_on_and_marks_down() -> None:
    decision = decide(unreachable("http://a:1", OSError("refused"), timed_out=False))
    assert decision.action is Action.RETRY and decision.mark_down
    assert decision.error is not None and decision.error.code == CONNECTION_LOST


@pytest.mark.parametrize("code", sorted(MARK_DOWN))
def test_draining_and_engine_down_mark_the_replica_down(code: str) -> None:
    decision = decide(Outcome(error(code, retryable=True)))
    assert decision.action is Action.RETRY and decision.mark_down


def test_a_retryable_refusal_moves_on_without_marking_down() -> None:
    refused = error(contract.QUEUE_FULL.code, retryable=True)
    decision = decide(Outcome(refused))
    assert decision.action is Action.RETRY and not decision.mark_down
    assert decision.error is refused


def test_nothing_is_retried_after_the_first_token() -> None:
    lost = error(CONNECTION_LOST, retryable=True)
    decision = decide(Outcome(lost, committed=True))
    assert decision.action is Action.GIVE_UP and decision.error is lost


def test_a_caller_error_is_not_retried() -> None:
    bad = error(contract.BAD_REQUEST.code)
    decision = decide(Outcome(bad))
    assert decision.action is Action.GIVE_UP and decision.error is bad


def test_past_the_deadline_the_request_ends_client_timeout() -> None:
    decision = decide(Outcome(error(STREAM_RESET, retryable=True), timed_out=True))
    assert decision.action is Action.GIVE_UP
    assert decision.error is not None and decision.error.code == CLIENT_TIMEOUT
    unreached = decide(unreachable("http://a:1", TimeoutError(), timed_out=True))
    assert unreached.mark_down and unreached.action is Action.GIVE_UP


def test_the_final_error() -> None:
    assert final_error(None, timed_out=False).code == NO_REPLICA
    last = error(contract.QUEUE_FULL.code, retryable=True)
    assert final_error(last, timed_out=False) is last
    assert final_error(last, timed_out=True).code == CLIENT_TIMEOUT
    own = ZeroLayerError(CLIENT_TIMEOUT, "no answer within 1.000 s")
    assert final_error(own, timed_out=True) is own  # the timeout's own message is kept


def test_next_replica_walks_the_candidates_within_the_retry_budget() -> None:
    timing = Timing()
    candidates = iter([Url("a"), Url("b"), Url("c"), Url("d")])
    picked = [next_replica(candidates, timing, max_retries=2) for _ in range(4)]
    assert [p.url if p else None for p in picked] == ["a", "b", "c", None]
    assert timing.tried == ["a", "b", "c"] and timing.retries == 2 and timing.replica == "c"
    assert next_replica(iter([]), Timing(), max_retries=2) is None


@given(
    code=st.sampled_from([CONNECTION_LOST, STREAM_RESET, *sorted(MARK_DOWN), "queue_full"]),
    retryable=st.booleans(),
    committed=st.booleans(),
    timed_out=st.booleans(),
)
def test_a_retry_happens_only_before_the_first_token_and_the_deadline(
    code: str, retryable: bool, committed: bool, timed_out: bool
) -> None:
    decision = decide(Outcome(error(code, retryable), committed, timed_out))
    assert (decision.action is Action.RETRY) == (retryable and not committed and not timed_out)
    assert decision.mark_down == (code in MARK_DOWN)
    assert decision.error is not None
    if timed_out:
        assert decision.error.code == CLIENT_TIMEOUT
