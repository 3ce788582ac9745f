"""The baseline as a target of the null-engine overhead benchmark (``bench/overhead.py``).

``start_null_baseline`` stands the baseline up over the null engine, so every millisecond a
request takes is the middle layer's own cost, and returns its URL and teardown. ``target`` plugs
it into the benchmark::

    python -m bench.overhead --target rs=bench.overhead_target:target
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from baselines.rayserve.standup import start_baseline


def start_null_baseline(
    replicas: int = 1, **settings: Any
) -> tuple[str, Callable[[], None], list[int]]:
    """The baseline over the null engine: its URL, a (blocking) teardown, and the pids of the
    proxy, controller, ingress and engine replicas (whose CPU is the layer's cost)."""
    handle = start_baseline(engine="null", replicas=replicas, **settings)
    pids = [pid for group in handle.pids().values() for pid in group]
    return handle.url, handle.close, pids


async def target(in_flight: int) -> tuple[Any, Any]:
    """``bench.overhead`` target: HTTP/1.1 keep-alive through ``Http1Client`` to the baseline."""
    from bench.overhead import Workload, http1_target

    url, close, pids = await asyncio.to_thread(start_null_baseline)

    async def teardown() -> None:
        await asyncio.to_thread(close)

    send, stop = http1_target(url, Workload(), teardown)
    send.server_pids = pids  # type: ignore[attr-defined]
    return send, stop
