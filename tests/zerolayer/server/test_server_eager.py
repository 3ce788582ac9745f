"""``start_eager``: a coroutine runs now until it really waits, then carries on in a task."""

from __future__ import annotations

import asyncio

import pytest
import uvloop

from zerolayer.server.eager import start_eager


def test_a_coroutine_that_never_waits_finishes_without_a_task() -> None:
    seen: list[str] = []

    async def quick() -> None:
        seen.append("ran")

    async def main() -> None:
        assert start_eager(asyncio.get_running_loop(), quick()) is None
        assert seen == ["ran"]  # before the caller went on, with no loop turn in between

    uvloop.run(main())


def test_a_waiting_coroutine_resumes_in_a_task_where_it_stopped() -> None:
    seen: list[object] = []

    async def slow(fut: asyncio.Future[int]) -> None:
        seen.append("before")
        seen.append(await fut)
        await asyncio.sleep(0)
        seen.append(await asyncio.sleep(0.01, result="slept"))

    async def main() -> None:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[int] = loop.create_future()
        task = start_eager(loop, slow(fut))
        assert task is not None and seen == ["before"]
        fut.set_result(7)
        await task
        assert seen == ["before", 7, "slept"]

    uvloop.run(main())


def test_cancelling_the_task_cancels_the_coroutine_where_it_waits() -> None:
    seen: list[str] = []

    async def waits() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise

    async def main() -> None:
        task = start_eager(asyncio.get_running_loop(), waits())
        assert task is not None
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert seen == ["cancelled"]

    uvloop.run(main())


def test_an_error_before_the_first_wait_reaches_the_caller() -> None:
    async def broken() -> None:
        raise KeyError("early")

    async def main() -> None:
        with pytest.raises(KeyError):
            start_eager(asyncio.get_running_loop(), broken())

    uvloop.run(main())
