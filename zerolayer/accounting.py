"""Per-request usage accounting: a bounded ring buffer flushed to JSONL.

Each replica records one row per request it answered (request id, tenant, session, prompt and
completion tokens, start and end wall-clock ns, outcome and error code). Rows wait in a ring of
bounded size and are appended to a JSONL file periodically and at close; if the ring fills
between flushes the oldest unflushed rows are dropped and counted (``dropped``), never blocking
the request path. Running totals per tenant are kept in memory for ``/metrics`` and tests.
"""

from __future__ import annotations

import asyncio
import os
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

COMPLETED = "completed"
ERROR = "error"
CANCELLED = "cancelled"

FIELDS = (
    "request_id", "tenant", "session", "prompt_tokens", "completion_tokens", "start_ns",
    "end_ns", "outcome", "error", "priority", "replica",
)  # fmt: skip


@dataclass(slots=True)
class TenantTotals:
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0


class Accounting:
    """The ring buffer and its JSONL sink. ``path=None`` keeps rows in memory only."""

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        capacity: int = 65_536,
        flush_interval_s: float = 1.0,
        replica: str = "",
    ) -> None:
        self.path = Path(path) if path is not None else None
        self.capacity = capacity
        self.flush_interval_s = flush_interval_s
        self.replica = replica
        self._ring: deque[tuple[Any, ...]] = deque(maxlen=capacity)
        self.recorded = 0
        self.flushed = 0
        self.totals: dict[str, TenantTotals] = {}
        self._timer: asyncio.TimerHandle | None = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    @property
    def dropped(self) -> int:
        """Rows lost because the ring overflowed between flushes."""
        return self.recorded - self.flushed - len(self._ring)

    def record(
        self,
        request_id: str,
        tenant: str,
        session: str,
        prompt_tokens: int,
        completion_tokens: int,
        start_ns: int,
        end_ns: int,
        outcome: str,
        error: str | None = None,
        priority: int = 1,
    ) -> None:
        """One request's row; cheap (a tuple append and three additions)."""
        self._ring.append(
            (request_id, tenant, session, prompt_tokens, completion_tokens, start_ns, end_ns,
             outcome, error, priority, self.replica)
        )  # fmt: skip
        self.recorded += 1
        totals = self.totals.get(tenant)
        if totals is None:
            totals = self.totals[tenant] = TenantTotals()
        totals.requests += 1
        totals.prompt_tokens += prompt_tokens
        totals.completion_tokens += completion_tokens

    def rows(self) -> Iterator[dict[str, Any]]:
        """The rows not flushed yet, as dicts (oldest first)."""
        for row in self._ring:
            yield dict(zip(FIELDS, row, strict=True))

    def flush(self) -> int:
        """Append the waiting rows to the JSONL file; returns how many were written."""
        ring = self._ring
        if not ring or self.path is None:
            return 0
        rows = list(ring)
        ring.clear()
        data = b"".join(orjson.dumps(dict(zip(FIELDS, row, strict=True))) + b"\n" for row in rows)
        with self.path.open("ab") as f:
            f.write(data)
        self.flushed += len(rows)
        return len(rows)

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Flush every ``flush_interval_s`` on the running loop until :meth:`close`."""
        if self.path is None or self._timer is not None:
            return
        loop = loop or asyncio.get_running_loop()

        def tick() -> None:
            self.flush()
            self._timer = loop.call_later(self.flush_interval_s, tick)

        self._timer = loop.call_later(self.flush_interval_s, tick)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.flush()


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every row of an accounting file."""
    with open(path, "rb") as f:
        return [orjson.loads(line) for line in f if line.strip()]
