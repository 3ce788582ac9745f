"""A zero-layer replica on its own event loop in a thread, for tests that drive it from
synchronous code (HTTP clients, peer tools) beside another stack."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from serving.engine import make_engine
from zerolayer.server import start_replica


@contextlib.contextmanager
def replica_in_thread(engine: str, **options: Any) -> Iterator[int]:
    """The port of a replica over ``make_engine(engine, **options)``; closed, with its engine and
    loop, on exit."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start() -> Any:
        return await start_replica(make_engine(engine, **options), port=0)

    replica = asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    try:
        yield replica.port
    finally:
        asyncio.run_coroutine_threadsafe(replica.close(timeout=5), loop).result(30)
        asyncio.run_coroutine_threadsafe(replica.engine.close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
