"""What the loaders that run in a child process (k6, locust) share: the run as the child sees it
(each request's replica, the fields every body adds, each tenant's authorization header, its
folder and records file), resolved once from the stack, and the loader settings around it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness.loaders.base import DEFAULT_GRACE_S, LoadResult, replica_routes
from harness.progress import ProgressStyle, load_phase, report_phase
from harness.workload import PlannedRequest

if TYPE_CHECKING:
    from harness.profile import Profile
    from harness.stacks import Stack


@dataclass(frozen=True, slots=True)
class ChildRun:
    """One schedule for a child loader: request ``i`` goes to ``routes[i]`` (the SDK's ring,
    ``replica_routes``) with the stack's ``extra_body`` fields (``Stack.body_fields``) and its
    tenant's ``authorization`` header (``Credentials.headers``); the child's files go in
    ``workdir`` and its records to ``records_path``. ``lag_fraction`` None keeps the summary's
    default lag rule."""

    schedule: Sequence[PlannedRequest]
    routes: Sequence[str]
    stack: str
    profile: str
    workdir: Path
    records_path: Path
    grace_s: float = DEFAULT_GRACE_S
    lag_fraction: float | None = None
    extra_body: Mapping[str, Any] = field(default_factory=dict)
    auth_headers: Mapping[str, str] | None = None


@dataclass(frozen=True)
class ChildLoader:
    """A loader in a child process over a whole stack: every replica by the SDK's ring; the
    child runs quiet, so its progress shows once, at the end. Subclasses say how their tool
    runs (``run_child``)."""

    grace_s: float = DEFAULT_GRACE_S
    lag_fraction: float | None = None
    progress: ProgressStyle | None = ProgressStyle.AUTO

    def run(
        self,
        schedule: Sequence[PlannedRequest],
        stack: Stack,
        profile: Profile,
        records_path: Path,
        workdir: Path,
    ) -> LoadResult:
        """Drive ``stack`` with ``schedule`` through the child, then show its progress."""
        child = ChildRun(
            schedule=schedule,
            routes=replica_routes(schedule, stack),
            stack=str(stack.name),
            profile=profile.name,
            workdir=Path(workdir),
            records_path=Path(records_path),
            grace_s=self.grace_s,
            lag_fraction=self.lag_fraction,
            extra_body=stack.body_fields(),
            auth_headers=None if stack.credentials is None else stack.credentials.headers(),
        )
        result = self.run_child(child, stack, profile)
        report_phase(self.progress, load_phase(stack.name, profile, len(schedule)), result.records)
        return result

    def run_child(self, child: ChildRun, stack: Stack, profile: Profile) -> LoadResult:
        """Run the tool on ``child``; ``stack`` and ``profile`` for the tool's own settings."""
        raise NotImplementedError
