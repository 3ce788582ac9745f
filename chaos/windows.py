"""Errors and retries in a fault's window against the steady state before it (docs/design.md,
"Chaos"), from one experiment's background-load log.

- **steady state**: the requests that ran wholly before the fault (ended before it started);
- **fault window**: the requests the fault could touch: sent before the stack was whole again
  (the end of the experiment's rollbacks) and still running, or not yet sent, when the fault
  started;
- in each: requests, errors (``error`` and ``lost`` outcomes), retried requests, retries (the
  client's own and those the serving layer reports, ``harness.schema.retries_of``) and the
  retried requests that completed: the retry success rate is ``retried_ok / retried``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from harness.schema import RequestRecord, retries_of


@dataclass(frozen=True, slots=True)
class WindowCounts:
    """Requests, errors and retries of one window, ``[start_ns, end_ns)``."""

    start_ns: int = 0
    end_ns: int = 0
    requests: int = 0
    errors: int = 0
    retried: int = 0
    retries: int = 0
    retried_ok: int = 0

    @property
    def error_rate(self) -> float | None:
        return self.errors / self.requests if self.requests else None

    @property
    def retry_success(self) -> float | None:
        """Retried requests that completed, over retried requests (None: nothing retried)."""
        return self.retried_ok / self.retried if self.retried else None


def count(records: Sequence[RequestRecord], start_ns: int, end_ns: int) -> WindowCounts:
    """The window's figures over ``records``."""
    retried = [r for r in records if retries_of(r)]
    return WindowCounts(
        start_ns=start_ns,
        end_ns=end_ns,
        requests=len(records),
        errors=sum(r.outcome != "completed" for r in records),
        retried=len(retried),
        retries=sum(retries_of(r) for r in records),
        retried_ok=sum(r.outcome == "completed" for r in retried),
    )


def steady(records: Sequence[RequestRecord], fault_ns: int) -> WindowCounts:
    """The requests that ended before the fault started."""
    first = min((r.intended_start_ns for r in records), default=fault_ns)
    before = [r for r in records if r.outcome != "lost" and 0 < r.end_ns < fault_ns]
    return count(before, first, fault_ns)


def faulted(records: Sequence[RequestRecord], fault_ns: int, whole_ns: int) -> WindowCounts:
    """The requests sent before ``whole_ns`` that had not ended when the fault started (a lost
    request never ended)."""
    touched = [
        r
        for r in records
        if r.intended_start_ns < whole_ns and (r.outcome == "lost" or r.end_ns >= fault_ns)
    ]
    return count(touched, fault_ns, whole_ns)
