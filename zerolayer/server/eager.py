"""Start a coroutine eagerly: run it now up to its first real suspension, as a task only after.

Python 3.12 has ``asyncio.eager_task_factory``; on 3.11 this does the same for one coroutine. The
replica runs every engine request in a coroutine; an engine that answers without waiting (the
null engine, a cached answer) then finishes inside the call that received the request, with no
task, no extra loop turn, and its response written in the same socket flush. A coroutine that
does suspend continues in a task that resumes it exactly where it stopped.
"""

from __future__ import annotations

import asyncio
import types
from collections.abc import Coroutine, Generator
from typing import Any


@types.coroutine
def _resume(coro: Coroutine[Any, Any, None], yielded: Any) -> Generator[Any, Any, None]:
    """Drive ``coro`` on from the suspension that yielded ``yielded`` (what a task would do)."""
    while True:
        try:
            value = yield yielded
        except BaseException as exc:  # a cancellation (or any throw) goes to the coroutine
            try:
                yielded = coro.throw(exc)
            except StopIteration:
                return
            continue
        try:
            yielded = coro.send(value)
        except StopIteration:
            return


async def _continue(coro: Coroutine[Any, Any, None], yielded: Any) -> None:
    await _resume(coro, yielded)


def start_eager(
    loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, None]
) -> asyncio.Task[None] | None:
    """Run ``coro`` to its first suspension now; None if it finished, else the task that
    carries it on. Exceptions raised before the first suspension propagate to the caller."""
    try:
        yielded = coro.send(None)
    except StopIteration:
        return None
    return loop.create_task(_continue(coro, yielded))
