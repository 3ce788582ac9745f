"""CPU cost of :meth:`Accounting.record`, called once per request on the event loop.

Two tenant mixes: one hot tenant (a hit in the totals every time) and 20,000 tenants cycling
past a 10,000-tenant bound (a miss every time, and a fold of the least recently seen quarter
every 2,500: the worst case for the bound).
"""

from __future__ import annotations

import itertools

from zerolayer.accounting import Accounting
from zerolayer.server.limits import DEFAULT_LIMITS

MANY_TENANTS = 20_000


def _record_cycling(benchmark, tenants: list[str]) -> Accounting:
    acc = Accounting(None, replica="bench", max_tenants=DEFAULT_LIMITS.max_tenants)
    names = itertools.cycle(tenants)
    request_id = "r" * 36

    def one() -> None:
        acc.record(request_id, next(names), "s1", 1024, 16, 1, 2, "completed", None, 1)

    benchmark(one)
    return acc


def test_record_one_tenant(benchmark) -> None:
    acc = _record_cycling(benchmark, ["tenant-0"])
    assert acc.totals["tenant-0"].requests == acc.recorded


def test_record_tenants_past_the_bound(benchmark) -> None:
    acc = _record_cycling(benchmark, [f"tenant-{i}" for i in range(MANY_TENANTS)])
    assert len(acc.totals) <= DEFAULT_LIMITS.max_tenants < acc.folded
