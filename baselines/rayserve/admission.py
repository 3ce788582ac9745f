"""The ingress's admission: per-tenant token buckets and a bounded FIFO in front of the engines.

This is the part of a middle layer that decides "not now": a tenant over budget gets 429
``budget_exceeded``, a full queue 429 ``queue_full``, each with a ``retry-after-ms`` hint, and a
request that waited past its deadline 504 ``deadline_exceeded``. Time is passed in, so the
bucket is pure and testable without sleeping.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from dataclasses import dataclass

from serving.wire.contract import BUDGET_EXCEEDED, DEADLINE_EXCEEDED, QUEUE_FULL, ContractError

MIN_RETRY_AFTER_MS = 10


@dataclass(slots=True)
class _Bucket:
    rate: float
    burst: float
    tokens: float
    stamp: float


class TokenBuckets:
    """One token bucket per tenant, charged ``prompt_tokens + max_tokens`` per request."""

    def __init__(
        self, default: tuple[float, float], per_tenant: dict[str, tuple[float, float]]
    ) -> None:
        self._default = default
        self._limits = dict(per_tenant)
        self._buckets: dict[str, _Bucket] = {}

    def take(self, tenant: str, cost: float, now: float) -> None:
        """Charge ``cost`` tokens or raise ``budget_exceeded`` saying when enough will be back."""
        bucket = self._buckets.get(tenant)
        if bucket is None:
            rate, burst = self._limits.get(tenant, self._default)
            bucket = self._buckets[tenant] = _Bucket(rate, burst, burst, now)
        bucket.tokens = min(bucket.burst, bucket.tokens + (now - bucket.stamp) * bucket.rate)
        bucket.stamp = now
        if cost <= bucket.tokens:
            bucket.tokens -= cost
            return
        if cost > bucket.burst:
            raise ContractError(
                BUDGET_EXCEEDED, f"request costs {cost:.0f} tokens, over tenant {tenant!r} burst"
            )
        wait_ms = math.ceil((cost - bucket.tokens) / bucket.rate * 1000) if bucket.rate else None
        raise ContractError(
            BUDGET_EXCEEDED,
            f"tenant {tenant!r} is over its token budget",
            retry_after_ms=max(MIN_RETRY_AFTER_MS, wait_ms) if wait_ms is not None else None,
        )


class FifoGate:
    """At most ``limit`` requests pass at once; up to ``queue_limit`` more wait first-in first-out.

    The retry hint for a refusal is the expected wait: queued requests times the mean hold time
    of a slot divided by the slots, which is what a client needs to come back usefully.
    """

    def __init__(self, limit: int, queue_limit: int) -> None:
        self.limit = limit
        self.queue_limit = queue_limit
        self._free = limit
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._hold_s = 0.05

    @property
    def queued(self) -> int:
        return len(self._waiters)

    @property
    def inflight(self) -> int:
        return self.limit - self._free

    def retry_after_ms(self) -> int:
        wait = self._hold_s * (len(self._waiters) + 1) / self.limit
        return max(MIN_RETRY_AFTER_MS, math.ceil(wait * 1000))

    async def acquire(self, timeout_s: float) -> None:
        """Take a slot, waiting in line up to ``timeout_s``; refuse at once if the line is full."""
        if self._free > 0 and not self._waiters:
            self._free -= 1
            return
        if len(self._waiters) >= self.queue_limit:
            raise ContractError(
                QUEUE_FULL,
                f"{len(self._waiters)} requests queued, limit {self.queue_limit}",
                retry_after_ms=self.retry_after_ms(),
            )
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), timeout_s)
        except (TimeoutError, asyncio.CancelledError) as exc:
            if waiter.done() and not waiter.cancelled():
                self.release(0.0)
            else:
                waiter.cancel()
                self._waiters.remove(waiter)
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise ContractError(
                DEADLINE_EXCEEDED, f"deadline passed after {timeout_s * 1000:.0f} ms in the queue"
            ) from None

    def release(self, held_s: float) -> None:
        """Give a slot back (to the head of the line if anyone waits); learn the hold time."""
        if held_s > 0:
            self._hold_s = 0.9 * self._hold_s + 0.1 * held_s
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self._free += 1
