"""The well-behaved client beside every attack: the SDK streaming small completions steadily.

It runs in a process of its own (``python -m chaos.attacks.healthy URL``), so the attacker's
busy loops in the suite's process cannot starve it of the GIL: a request it loses is the
replica's doing. It prints :data:`READY` once its first request has been answered (its
connection is open, so the attack starts on an event, not after a guessed warm-up), sends until
its stdin closes, waits for what is in flight (bounded by the deadline plus the SDK's grace),
and prints one JSON line: ``{"ok": n, "total": m, "errors": {code: count}}``. Its API key, when
the replica authenticates, comes in :data:`API_KEY_ENV`.

The judgement is whether its requests complete, not how fast: so no health poll (one replica,
and a ``/health`` answer slow while the replica's loop serves a flood would count against it)
and a deadline that only guards against a hang.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import select
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

import orjson

from zerolayer.client import Timing, ZeroLayerClient

RATE: Final = 20.0
MAX_TOKENS: Final = 8
DEADLINE_MS: Final = 30_000
"""Per request: a hang guard, not a latency bound (a loaded host makes the replica slow)."""
GRACE_MS: Final = 2000
READY: Final = b"ready"
READY_TIMEOUT_S: Final = 60.0
"""Hang guard on the client's start and first answer (imports alone take seconds under load)."""
API_KEY_ENV: Final = "ZL_ATTACK_API_KEY"
"""Where the client finds its API key when the replica authenticates (not on its command line,
which any local user can read)."""
STOP_TIMEOUT_S: Final = (DEADLINE_MS + GRACE_MS) / 1000 + 5.0


@dataclass(frozen=True, slots=True)
class HealthyResult:
    ok: int
    total: int
    errors: dict[str, int]


class HealthyClient:
    """The client's process, seen from the suite: started on a URL, stopped for its result."""

    def __init__(self, url: str, rate: float = RATE, api_key: str | None = None) -> None:
        env = {**os.environ, API_KEY_ENV: api_key} if api_key else None
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "chaos.attacks.healthy", url, "--rate", str(rate)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            bufsize=0,  # unbuffered: reading the ready line takes no byte of the tally
        )

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> bool:
        """Wait until its first request has been answered; False when it exited or
        ``timeout_s`` passed first (its tally then says what went wrong)."""
        stdout = self._proc.stdout
        assert stdout is not None
        readable, _, _ = select.select([stdout], [], [], timeout_s)
        return bool(readable) and stdout.readline().strip() == READY

    def stop(self) -> HealthyResult:
        """Close its stdin and read its tally; a client that died or hung counts as failing."""
        try:
            out, err = self._proc.communicate(b"", timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.communicate()
            return HealthyResult(0, 1, {"healthy_client_hung": 1})
        try:
            tally = orjson.loads(out.splitlines()[-1])
            return HealthyResult(int(tally["ok"]), int(tally["total"]), dict(tally["errors"]))
        except (IndexError, orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            reason = err.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
            return HealthyResult(0, 1, {f"healthy_client_died: {reason[0]}": 1})

    def kill(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.communicate()


async def run_client(
    url: str, rate: float, stop: asyncio.Event, ready: Callable[[], None] = lambda: None
) -> HealthyResult:
    """Submit one small streamed completion every ``1/rate`` s until ``stop``, then wait for
    those in flight; each ends by its deadline plus grace, so the wait is bounded. ``ready``
    runs when the first request ends."""
    errors: Counter[str] = Counter()
    counts = {"ok": 0, "total": 0, "in_flight": 0, "done": 0}
    all_done = asyncio.Event()

    def on_done(timing: Timing, _tokens: int) -> None:
        counts["in_flight"] -= 1
        counts["done"] += 1
        if counts["done"] == 1:
            ready()
        if timing.error_code:
            errors[timing.error_code] += 1
        else:
            counts["ok"] += 1
        if stop.is_set() and not counts["in_flight"]:
            all_done.set()

    api_key = os.environ.get(API_KEY_ENV) or None
    client = ZeroLayerClient([url], health_interval_s=0, grace_ms=GRACE_MS, api_key=api_key)
    async with client:
        while not stop.is_set():
            counts["total"] += 1
            counts["in_flight"] += 1
            client.submit(on_done, prompt="hello", max_tokens=MAX_TOKENS, deadline_ms=DEADLINE_MS)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0 / rate)
        if counts["in_flight"]:
            await asyncio.wait_for(all_done.wait(), STOP_TIMEOUT_S)
    return HealthyResult(counts["ok"], counts["total"], dict(errors))


async def _main(url: str, rate: float) -> HealthyResult:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def wait_for_eof() -> None:
        sys.stdin.buffer.read()
        loop.call_soon_threadsafe(stop.set)

    def ready() -> None:
        sys.stdout.buffer.write(READY + b"\n")
        sys.stdout.buffer.flush()

    threading.Thread(target=wait_for_eof, daemon=True).start()
    return await run_client(url, rate, stop, ready)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m chaos.attacks.healthy")
    parser.add_argument("url")
    parser.add_argument("--rate", type=float, default=RATE, help="requests per second")
    args = parser.parse_args(argv)
    result = asyncio.run(_main(args.url, args.rate))
    print(orjson.dumps({"ok": result.ok, "total": result.total, "errors": result.errors}).decode())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
