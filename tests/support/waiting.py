"""Waiting on events, not on time, for tests on shared and loaded hosts.

``eventually`` polls a condition until it holds, bounded only by a hang guard far above any
pass; ``HandClock`` stands in for the timer methods of an event loop and fires what falls due
only when a test winds it, so a timer's verdict cannot depend on how busy the host is.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Final

import pytest

HANG_GUARD_S: Final = 60.0  # no pass comes near it; it only turns a hang into a failure
STACK_IN_A_FIXTURE: Final = pytest.mark.timeout(func_only=True)
"""The hang guard (pytest-timeout) of a module whose fixture stands a stack up holds each test's
own call: counted in the first test, as pytest-timeout counts a fixture's set-up by default, a
stand-up slow under load (guarded by its own ``STAND_UP_GUARD_S`` and ``START_GUARD_S``) took
a chaos experiment past 900 s."""


async def eventually(
    condition: Callable[[], object], what: str, cap_s: float = HANG_GUARD_S, pause_s: float = 0.01
) -> None:
    """Return once ``condition()`` is true; AssertionError naming ``what`` after ``cap_s``."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + cap_s
    while not condition():
        if loop.time() > give_up:
            raise AssertionError(f"not true after {cap_s:g} s: {what}")
        await asyncio.sleep(pause_s)


class Handle:
    """A timer of :class:`HandClock` (``asyncio.TimerHandle``'s ``cancel`` and ``when``)."""

    def __init__(self, when: float, callback: Callable[..., None], args: tuple[Any, ...]) -> None:
        self.due = when
        self.callback = callback
        self.args = args
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True

    def when(self) -> float:
        return self.due


class HandClock:
    """The loop methods a timer owner uses (``time``, ``call_at``, ``call_later``); ``advance``
    fires what falls due, in order."""

    def __init__(self) -> None:
        self.now = 0.0
        self.handles: list[Handle] = []

    def time(self) -> float:
        return self.now

    def call_at(self, when: float, callback: Callable[..., None], *args: Any) -> Handle:
        handle = Handle(when, callback, args)
        self.handles.append(handle)
        return handle

    def call_later(self, delay: float, callback: Callable[..., None], *args: Any) -> Handle:
        return self.call_at(self.now + delay, callback, *args)

    def advance(self, seconds: float) -> None:
        end = self.now + seconds
        while True:
            due = [h for h in self.handles if not h.cancelled and h.due <= end]
            if not due:
                break
            handle = min(due, key=lambda h: h.due)
            self.handles.remove(handle)
            self.now = max(self.now, handle.due)
            handle.callback(*handle.args)
        self.now = end
