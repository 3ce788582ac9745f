"""A call's lifecycle as one transition table: where a call is, and the only ways it moves.

A call reads its body, then either runs at once or waits in the admission queue for engine
room, then runs, and ends; it can end from any of those. ``TRANSITIONS`` is the whole of it:
:meth:`Lifecycle.advance` follows the table or raises :class:`IllegalTransition`, so no code
path can put a call where the table does not lead (a queued call cannot start twice, a finished
one cannot start at all). The protocols never read the state: they ask the predicates
(``accepts_data``, ``is_open``), which name what they need to know rather than where a call is.
"""

from __future__ import annotations

from enum import Enum
from typing import Final


class CallState(Enum):
    """Where a call is: reading its body, queued for engine room, running, or over."""

    BODY = "body"
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"

    # Members are singletons compared by identity: the identity hash keeps the table's lookup
    # off Enum's own __hash__, a Python-level call (a third of the cost of a transition).
    __hash__ = object.__hash__


class CallEvent(Enum):
    """What moves a call: it waits for engine room, its engine run starts, or it ends."""

    QUEUE = "queue"
    START = "start"
    FINISH = "finish"

    __hash__ = object.__hash__  # as CallState's


# Module-level names, compared with ``is``: the predicates run for every DATA frame and every
# token chunk, and a global lookup costs a fraction of an enum attribute lookup.
BODY: Final = CallState.BODY
QUEUED: Final = CallState.QUEUED
RUNNING: Final = CallState.RUNNING
DONE: Final = CallState.DONE

TRANSITIONS: Final[dict[tuple[CallState, CallEvent], CallState]] = {
    (BODY, CallEvent.QUEUE): QUEUED,
    (BODY, CallEvent.START): RUNNING,
    (QUEUED, CallEvent.START): RUNNING,
    (BODY, CallEvent.FINISH): DONE,
    (QUEUED, CallEvent.FINISH): DONE,
    (RUNNING, CallEvent.FINISH): DONE,
}


class IllegalTransition(RuntimeError):
    """An event the table has no move for in the call's state: a bug in the caller."""

    def __init__(self, state: CallState, event: CallEvent) -> None:
        super().__init__(f"no transition from {state.value} on {event.value}")
        self.state = state
        self.event = event


class Lifecycle:
    """A call's state, changed only by :meth:`advance`; read through the predicates."""

    __slots__ = ("_state",)

    def __init__(self) -> None:
        self._state: CallState = BODY

    @property
    def state(self) -> CallState:
        return self._state

    def advance(self, event: CallEvent) -> CallState:
        """Move on ``event`` as the table says; IllegalTransition (state unchanged) if it has
        no move for it."""
        target = TRANSITIONS.get((self._state, event))
        if target is None:
            raise IllegalTransition(self._state, event)
        self._state = target
        return target

    @property
    def accepts_data(self) -> bool:
        """Whether request body bytes are still read (the body is not complete nor refused)."""
        return self._state is BODY

    @property
    def is_open(self) -> bool:
        """Whether the call has not ended yet."""
        return self._state is not DONE

    @property
    def is_queued(self) -> bool:
        """Whether the call waits in the admission queue for engine room."""
        return self._state is QUEUED

    @property
    def is_running(self) -> bool:
        """Whether the engine run is on (tokens may still come)."""
        return self._state is RUNNING
