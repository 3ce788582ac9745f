"""What every loader shares: the interface, the result it hands back and how it is summarised.

Each loader writes one ``harness.schema.RequestRecord`` per scheduled request to a JSONL file as
it goes and returns a LoadResult whose summary comes from ``harness.metrics`` (the one home of
metric definitions), so the three loaders are compared on the same arithmetic. Loaders in another
process (k6, locust) get the schedule as a plan in which each request already names its replica,
chosen by the SDK's own ring from its session, so they spread load as the SDK does.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Protocol

from harness.metrics import LAG_FRACTION_OF_MEDIAN, summarize
from harness.schema import RequestRecord
from harness.workload import PlannedRequest, filler_text
from zerolayer.client.ring import DEFAULT_VNODES, HashRing

if TYPE_CHECKING:
    from harness.profile import Profile
    from harness.stacks import Stack

DEFAULT_GRACE_S: Final = 5.0
# What went on the wire, by the stack's protocol name (``Stack.protocol``) or k6's ``res.proto``.
_WIRE_NAMES: Final = {
    "h2": "h2",
    "http1": "http/1.1",
    "HTTP/2.0": "h2",
    "HTTP/1.1": "http/1.1",
    "HTTP/1.0": "http/1.0",
}


class RequestFailed(Exception):
    """A request that ended with an explicit error: a ``zl-error`` code or a client-side code."""

    def __init__(self, code: str, status: int = 0, message: str = "") -> None:
        super().__init__(message or code)
        self.code = code
        self.status = status


class Loader(Protocol):
    """A load generator: sends a schedule to a whole stack and returns every request's record."""

    @property
    def name(self) -> str: ...

    def run(
        self,
        schedule: Sequence[PlannedRequest],
        stack: Stack,
        profile: Profile,
        records_path: Path,
        workdir: Path,
    ) -> LoadResult: ...


def wire_protocol(name: str) -> str:
    """``h2`` or ``http/1.1`` for a stack's protocol name or a tool's own spelling."""
    return _WIRE_NAMES.get(name, name)


def replica_routes(schedule: Sequence[PlannedRequest], stack: Stack) -> list[str]:
    """Each request's replica URL: the zero-layer SDK's ring over the stack's URLs, keyed by the
    session as the SDK keys it (a request without one, which the SDK places by its own request
    id, goes by ours: the same spread). vllm-serve's replicas are routed the same way (as its
    ``Http1Router`` does); the baseline has one front door."""
    if not stack.kind.client_routes:
        return [stack.urls[0]] * len(schedule)
    ring = HashRing(dict.fromkeys(stack.urls), DEFAULT_VNODES)
    return [ring.lookup(r.session or r.request_id) for r in schedule]


def new_record(
    req: PlannedRequest, stack: str, profile: str, loader: str, intended_ns: int
) -> RequestRecord:
    """A record for a scheduled request, filled with what the schedule knows before sending."""
    return RequestRecord(
        request_id=req.request_id,
        stack=stack,
        profile=profile,
        loader=loader,
        intended_start_ns=intended_ns,
        prompt_tokens=req.prompt_tokens,
        prompt_bytes=req.prompt_bytes,
        request_class=req.request_class,
        session=req.session,
        tenant=req.tenant,
        priority=req.priority,
        deadline_ms=req.deadline_ms,
        turn=req.turn,
    )


def write_plan(
    schedule: Sequence[PlannedRequest], routes: Sequence[str], workdir: Path, grace_s: float
) -> dict[str, Path]:
    """The schedule as JSON for a loader in another process (k6, locust): ``plan.json`` with one
    entry per request (``url``: its replica, from ``replica_routes``), and ``fillers.json`` with
    one prompt filler per synthetic prompt size, from which ``id + ":" + filler`` cut to
    ``prompt_bytes`` is exactly ``PlannedRequest.prompt()``. A request with its own text (a
    dataset, trace or session turn) carries it whole as ``prompt`` instead of a filler."""
    workdir.mkdir(parents=True, exist_ok=True)
    sizes = sorted({r.prompt_bytes for r in schedule if not r.text})
    filler_index = {size: i for i, size in enumerate(sizes)}
    plan = [
        {
            "i": r.index,
            "id": r.request_id,
            "url": url.rstrip("/"),
            "offset_s": r.offset_s,
            "request_class": r.request_class,
            **({"prompt": r.text} if r.text else {"filler": filler_index[r.prompt_bytes]}),
            "turn": r.turn,
            "prompt_bytes": r.prompt_bytes,
            "prompt_tokens": r.prompt_tokens,
            "max_tokens": r.max_tokens,
            "seed": r.seed,
            "session": r.session,
            "tenant": r.tenant,
            "priority": r.priority,
            "deadline_ms": r.deadline_ms,
            "timeout_ms": round(r.deadline_ms + grace_s * 1000),
        }
        for r, url in zip(schedule, routes, strict=True)
    ]
    paths = {"plan": workdir / "plan.json", "fillers": workdir / "fillers.json"}
    paths["plan"].write_text(json.dumps(plan))
    paths["fillers"].write_text(json.dumps([filler_text(size, 0) for size in sizes]))
    return paths


@dataclass
class LoadResult:
    """One loader run against one stack: where the records are and what they add up to.

    ``protocol`` is what went on the wire (``h2``, ``http/1.1``); ``ttft_is_first_byte`` is True
    where the tool cannot stream (k6 reads whole responses), so "TTFT" is time to first byte and
    its records carry no chunk times. ``extra`` holds everything else the loader knows: the
    arrival process actually used, dropped iterations, requests per replica, the tool's own
    statistics.
    """

    loader: str
    stack: str
    profile: str
    records_path: Path
    records: list[RequestRecord]
    summary: dict[str, Any]
    extra: dict[str, Any] = field(default_factory=dict)
    protocol: str = ""
    ttft_is_first_byte: bool = False

    @property
    def valid(self) -> bool:
        return bool(self.summary["valid"])

    @property
    def invalid_reasons(self) -> list[str]:
        return list(self.summary["invalid_reasons"])


def make_result(
    loader: str,
    stack: str,
    profile: str,
    records_path: Path,
    records: Sequence[RequestRecord],
    *,
    duration_s: float | None = None,
    lag_fraction: float | None = None,
    extra_reasons: Sequence[str] = (),
    extra: dict[str, Any] | None = None,
    protocol: str = "",
    ttft_is_first_byte: bool = False,
) -> LoadResult:
    """Summarise records (``harness.metrics.summarize``) and add loader-specific invalid reasons
    (each one a reason the loader, not the stack, set the figures: ``loader_limited``).

    ``lag_fraction`` None keeps the summary's default lag rule."""
    lag = LAG_FRACTION_OF_MEDIAN if lag_fraction is None else lag_fraction
    summary = summarize(records, duration_s, lag_fraction=lag)
    summary.update(stack=stack, profile=profile, loader=loader)
    if extra_reasons:
        summary["invalid_reasons"] = [*summary["invalid_reasons"], *extra_reasons]
        summary["valid"] = False
        summary["loader_limited"] = True
    return LoadResult(
        loader,
        stack,
        profile,
        records_path,
        list(records),
        summary,
        extra or {},
        protocol,
        ttft_is_first_byte,
    )


def replica_counts(records: Sequence[RequestRecord]) -> dict[str, int]:
    """Requests per replica URL, of those that reached one: the load's actual spread."""
    return dict(sorted(Counter(r.replica for r in records if r.replica).items()))
