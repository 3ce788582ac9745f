"""The call lifecycle's transition table (zerolayer.server.lifecycle): the only moves a call has."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from zerolayer.server.lifecycle import (
    BODY,
    DONE,
    QUEUED,
    RUNNING,
    TRANSITIONS,
    CallEvent,
    CallState,
    IllegalTransition,
    Lifecycle,
)


def test_a_call_starts_reading_its_body() -> None:
    call = Lifecycle()
    assert call.state is BODY
    assert call.accepts_data and call.is_open
    assert not call.is_queued and not call.is_running


@pytest.mark.parametrize(
    ("events", "end"),
    [
        ([CallEvent.START, CallEvent.FINISH], DONE),
        ([CallEvent.QUEUE, CallEvent.START, CallEvent.FINISH], DONE),
        ([CallEvent.QUEUE, CallEvent.FINISH], DONE),
        ([CallEvent.FINISH], DONE),
        ([CallEvent.QUEUE, CallEvent.START], RUNNING),
    ],
)
def test_the_paths_a_call_takes(events: list[CallEvent], end: CallState) -> None:
    call = Lifecycle()
    for event in events:
        call.advance(event)
    assert call.state is end


@pytest.mark.parametrize(
    ("events", "refused"),
    [
        ([CallEvent.START], CallEvent.START),  # a running call cannot start twice
        ([CallEvent.START], CallEvent.QUEUE),  # nor go back to the queue
        ([CallEvent.QUEUE], CallEvent.QUEUE),
        ([CallEvent.FINISH], CallEvent.FINISH),  # a call ends once
        ([CallEvent.FINISH], CallEvent.START),  # and never runs after
    ],
)
def test_a_move_the_table_lacks_is_refused_and_changes_nothing(
    events: list[CallEvent], refused: CallEvent
) -> None:
    call = Lifecycle()
    for event in events:
        call.advance(event)
    before = call.state
    with pytest.raises(IllegalTransition) as caught:
        call.advance(refused)
    assert call.state is before
    assert caught.value.state is before and caught.value.event is refused


def test_the_predicates_name_each_state() -> None:
    expected = {
        BODY: (True, True, False, False),
        QUEUED: (False, True, True, False),
        RUNNING: (False, True, False, True),
        DONE: (False, False, False, False),
    }
    paths = {
        BODY: [],
        QUEUED: [CallEvent.QUEUE],
        RUNNING: [CallEvent.START],
        DONE: [CallEvent.FINISH],
    }
    for state, path in paths.items():
        call = Lifecycle()
        for event in path:
            call.advance(event)
        assert call.state is state
        got = (call.accepts_data, call.is_open, call.is_queued, call.is_running)
        assert got == expected[state], state


def test_every_state_is_reachable_and_done_is_final() -> None:
    targets = set(TRANSITIONS.values())
    assert targets | {BODY} == set(CallState)
    assert not any(state is DONE for state, _ in TRANSITIONS)
    assert all((state, CallEvent.FINISH) in TRANSITIONS for state in CallState if state is not DONE)


@given(st.lists(st.sampled_from(list(CallEvent)), max_size=20))
def test_any_sequence_of_events_follows_the_table_or_is_refused(events: list[CallEvent]) -> None:
    call = Lifecycle()
    for event in events:
        before = call.state
        target = TRANSITIONS.get((before, event))
        if target is None:
            with pytest.raises(IllegalTransition):
                call.advance(event)
            assert call.state is before
        else:
            assert call.advance(event) is target
            assert call.state is target
        assert call.state in CallState
        assert call.is_open == (call.state is not DONE)
