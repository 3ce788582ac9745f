"""The SDK's failover rules, sans-IO: one attempt's outcome in, what to do next out.

Both ways of sending a request, the task path (``ZeroLayerClient.stream``) and the callback path
(``ZeroLayerClient.submit``), follow these rules and only these:

- the candidates are the session's ring order, up replicas only, or every replica when none is
  up (panic routing); each attempt takes one, and past ``max_retries`` retries no more are
  taken (:func:`next_replica`);
- a replica that could not be reached, or that answered ``draining`` or ``engine_down``, is
  marked down at once (its hysteresis governs coming back);
- a retryable error before the first token moves the request to the next candidate; after the
  first token nothing is retried, the caller gets the error;
- once the deadline plus grace has passed the request ends ``client_timeout``; when no candidate
  is left it ends with the last attempt's error, or ``no_replica`` if there was none (every
  replica left the set while the request walked the ring).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum
from typing import Final, Protocol, TypeVar

from serving.wire import contract
from zerolayer.client.codec import ZeroLayerError
from zerolayer.client.timing import CLIENT_TIMEOUT, CONNECTION_LOST, NO_REPLICA, Timing

TIMED_OUT_MESSAGE: Final = "no answer by deadline plus grace"
# Refusals that say the replica itself is going away: the client marks it down at once.
MARK_DOWN: Final = frozenset({contract.DRAINING.code, contract.ENGINE_DOWN.code})


class Endpoint(Protocol):
    """What the policy reads of a replica: the URL an attempt is recorded under."""

    @property
    def url(self) -> str: ...


E = TypeVar("E", bound=Endpoint)


class Action(Enum):
    """What follows an attempt: hand the response to the caller, try the next replica, or end
    the request with an error."""

    DELIVER = "deliver"
    RETRY = "retry"
    GIVE_UP = "give_up"


@dataclass(frozen=True, slots=True)
class Outcome:
    """How one attempt went.

    ``error`` is None when the attempt delivered (a first token, or the whole answer);
    ``unreachable`` when no connection to the replica could be opened; ``committed`` once a
    first token reached the caller; ``timed_out`` once the deadline plus grace has passed.
    """

    error: ZeroLayerError | None
    committed: bool = False
    timed_out: bool = False
    unreachable: bool = False


@dataclass(frozen=True, slots=True)
class Decision:
    """What to do after an attempt. ``error`` is the error the request ends with if it ends now
    (for RETRY: should no candidate be left); ``mark_down``: take the replica out at once."""

    action: Action
    mark_down: bool = False
    error: ZeroLayerError | None = None


DELIVERED: Final = Decision(Action.DELIVER)


def decide(outcome: Outcome) -> Decision:
    """The rules of the module docstring, for one attempt."""
    error = outcome.error
    if error is None:
        return DELIVERED
    mark_down = outcome.unreachable or error.code in MARK_DOWN
    if outcome.timed_out:
        return Decision(Action.GIVE_UP, mark_down, final_error(error, timed_out=True))
    if error.retryable and not outcome.committed:
        return Decision(Action.RETRY, mark_down, error)
    return Decision(Action.GIVE_UP, mark_down, error)


def unreachable(url: str, exc: BaseException, timed_out: bool) -> Outcome:
    """The outcome of an attempt whose connection could not be opened (refused, reset, or hung
    past the connect timeout): retryable, and the replica is marked down."""
    error = ZeroLayerError(CONNECTION_LOST, f"{url}: {exc}", retryable=True)
    return Outcome(error, timed_out=timed_out, unreachable=True)


def final_error(last: ZeroLayerError | None, timed_out: bool) -> ZeroLayerError:
    """The error a request ends with when no attempt is left to make: ``client_timeout`` past
    the deadline (a timeout's own error is kept), else the last attempt's, else ``no_replica``."""
    if timed_out and (last is None or last.code != CLIENT_TIMEOUT):
        return ZeroLayerError(CLIENT_TIMEOUT, TIMED_OUT_MESSAGE)
    if last is None:
        return ZeroLayerError(NO_REPLICA, "no replica is up")
    return last


def next_replica(candidates: Iterator[E], timing: Timing, max_retries: int) -> E | None:
    """The replica for the next attempt, recorded in ``timing``; None when no candidate is left
    or the retry budget is spent."""
    replica = next(candidates, None)
    if replica is None:
        return None
    if timing.tried:
        if timing.retries >= max_retries:
            return None
        timing.retries += 1
    timing.tried.append(replica.url)
    timing.replica = replica.url
    timing.refused_ns = 0  # a refusal is the attempt's, not the request's
    return replica
