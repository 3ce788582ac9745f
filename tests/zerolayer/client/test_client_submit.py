"""``ZeroLayerClient.submit``, the callback API the native loader uses, against real replicas.

Same routing, retries and timing record as ``stream``: checked here over loopback with real
``zl-replica`` processes, including a crash before the first token and a frozen replica. No
timed assertions: waits are bounded only so that a hang fails the test.
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from tests.support.sdk import Spawn, expected_text, run, session_owned_by
from zerolayer.client import Timing, ZeroLayerClient
from zerolayer.client.timing import CLIENT_TIMEOUT


class Ends:
    """Collects ``on_done`` calls; ``wait(n)`` until n requests have ended."""

    def __init__(self) -> None:
        self.calls: list[tuple[Timing, int]] = []
        self._changed = asyncio.Event()

    def __call__(self, timing: Timing, tokens: int) -> None:
        self.calls.append((timing, tokens))
        self._changed.set()

    async def wait(self, n: int) -> list[tuple[Timing, int]]:
        while len(self.calls) < n:
            self._changed.clear()
            await self._changed.wait()
        return self.calls


def test_submit_completes_with_the_same_record_as_a_stream(spawn: Spawn) -> None:
    replica = spawn("sim")

    async def main() -> None:
        async with ZeroLayerClient([replica.url], health_interval_s=0) as client:
            ends = Ends()
            # The first one opens the connection (the slow path), the rest find it open.
            first = client.submit(ends, prompt="tell me", max_tokens=12, seed=11, session="a")
            await ends.wait(1)
            timings = [
                client.submit(ends, prompt=f"p{i}", max_tokens=5, seed=i, session=f"s{i}")
                for i in range(50)
            ]
            calls = await ends.wait(51)
            await asyncio.sleep(0.05)
            streamed = await client.complete(prompt="tell me", max_tokens=12, seed=11)
        assert len(ends.calls) == 51  # each exactly once
        assert calls[0] == (first, 12)
        # one chunk per engine step that emitted, however a loaded loop merges the steps
        assert first.output_tokens == streamed.timing.output_tokens == 12
        assert 1 <= len(first.chunk_ns) <= 12 and 1 <= len(streamed.timing.chunk_ns) <= 12
        assert first.sent_ns <= first.headers_ns <= first.first_token_ns <= first.end_ns
        assert first.outcome == "completed" and first.status == 200 and first.retries == 0
        assert {id(t) for t, _ in calls[1:]} == {id(t) for t in timings}
        assert all(tokens == 5 and t.outcome == "completed" for t, tokens in calls[1:])
        assert streamed.text == await expected_text("tell me", 12, 11)

    run(main())


def test_submit_fails_over_before_the_first_token(spawn: Spawn) -> None:
    replicas = [spawn("sim") for _ in range(3)]

    async def main() -> None:
        async with ZeroLayerClient([r.url for r in replicas], health_interval_s=0) as client:
            victim = replicas[0]
            session = session_owned_by(client, victim.url)
            order = list(client.ring.preference(session))
            await client.complete(prompt="warm", max_tokens=2, session=session)
            os.kill(victim.pid, signal.SIGSTOP)
            ends = Ends()
            for i in range(10):
                client.submit(ends, prompt=f"q{i}", max_tokens=6, session=session, seed=i)
            await asyncio.sleep(0.3)
            assert not ends.calls
            victim.kill()
            calls = await asyncio.wait_for(ends.wait(10), 20)
            assert not client.is_up(victim.url)
        for timing, tokens in calls:
            assert timing.outcome == "completed" and tokens == 6
            assert timing.tried == order[:2] and timing.replica == order[1]
            assert timing.retries == 1

    run(main())


def test_submit_to_a_frozen_replica_ends_once_as_client_timeout(spawn: Spawn) -> None:
    replica = spawn("sim")

    async def main() -> None:
        async with ZeroLayerClient([replica.url], health_interval_s=0, grace_ms=200) as client:
            await client.complete(prompt="warm", max_tokens=2)
            os.kill(replica.pid, signal.SIGSTOP)
            ends = Ends()
            try:
                client.submit(ends, prompt="frozen", max_tokens=4, deadline_ms=300)
                ((timing, tokens),) = await ends.wait(1)
                await asyncio.sleep(0.2)
            finally:
                os.kill(replica.pid, signal.SIGCONT)
        assert len(ends.calls) == 1
        assert timing.error_code == CLIENT_TIMEOUT and timing.outcome == "lost" and tokens == 0
        assert timing.end_ns > timing.sent_ns

    run(main(), limit_s=20)


def test_submit_rejects_bad_arguments_at_once(spawn: Spawn) -> None:
    replica = spawn("null")

    async def main() -> None:
        async with ZeroLayerClient([replica.url], health_interval_s=0) as client:
            ends = Ends()
            with pytest.raises(ValueError):
                client.submit(ends, prompt="x", max_tokens=4, priority="urgent")
            with pytest.raises(ValueError):
                client.submit(ends, prompt="x", headers={"zl-tenant": "someone-else"})
            assert not ends.calls

    run(main())
