"""What every loader shares: the result it hands back and how it is summarised.

Each loader writes one ``harness.schema.RequestRecord`` per scheduled request to a JSONL file as
it goes and returns a LoadResult whose summary comes from ``harness.metrics`` (the one home of
metric definitions), so the three loaders are compared on the same arithmetic.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from harness.metrics import LAG_FRACTION_OF_MEDIAN, summarize
from harness.schema import RequestRecord
from harness.workload import PlannedRequest, filler_text

LOADERS: Final = ("native", "k6", "locust")
DEFAULT_GRACE_S: Final = 5.0


class RequestFailed(Exception):
    """A request that ended with an explicit error: a ``zl-error`` code or a client-side code."""

    def __init__(self, code: str, status: int = 0, message: str = "") -> None:
        super().__init__(message or code)
        self.code = code
        self.status = status


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
    )


def write_plan(
    schedule: Sequence[PlannedRequest], workdir: Path, grace_s: float
) -> dict[str, Path]:
    """The schedule as JSON for a loader in another process (k6, locust): ``plan.json`` with one
    entry per request, and ``fillers.json`` with one prompt filler per prompt size, from which
    ``id + ":" + filler`` cut to ``prompt_bytes`` is exactly ``PlannedRequest.prompt()``."""
    workdir.mkdir(parents=True, exist_ok=True)
    sizes = sorted({r.prompt_bytes for r in schedule})
    filler_index = {size: i for i, size in enumerate(sizes)}
    plan = [
        {
            "i": r.index,
            "id": r.request_id,
            "offset_s": r.offset_s,
            "request_class": r.request_class,
            "filler": filler_index[r.prompt_bytes],
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
        for r in schedule
    ]
    paths = {"plan": workdir / "plan.json", "fillers": workdir / "fillers.json"}
    paths["plan"].write_text(json.dumps(plan))
    paths["fillers"].write_text(json.dumps([filler_text(size, 0) for size in sizes]))
    return paths


@dataclass
class LoadResult:
    """One loader run against one stack: where the records are and what they add up to."""

    loader: str
    stack: str
    profile: str
    records_path: Path
    records: list[RequestRecord]
    summary: dict[str, Any]
    extra: dict[str, Any] = field(default_factory=dict)

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
    slos_ms: Mapping[str, float] | None = None,
    lag_fraction: float = LAG_FRACTION_OF_MEDIAN,
    extra_reasons: Sequence[str] = (),
    extra: dict[str, Any] | None = None,
) -> LoadResult:
    """Summarise records (``harness.metrics.summarize``) and add loader-specific invalid reasons."""
    summary = summarize(records, duration_s, slos_ms, lag_fraction=lag_fraction)
    summary.update(stack=stack, profile=profile, loader=loader)
    if extra_reasons:
        summary["invalid_reasons"] = [*summary["invalid_reasons"], *extra_reasons]
        summary["valid"] = False
    return LoadResult(loader, stack, profile, records_path, list(records), summary, extra or {})
