"""A stack already running elsewhere (``StackSpec.urls``): nothing is started or stopped here,
the stand-up only checks that every URL answers. It speaks and routes as the kind it is an
instance of; it has no processes here to watch, and no faults (chaos needs a stack it started).
"""

from __future__ import annotations

from pathlib import Path

from harness.stacks.clients import check_reachable
from harness.stacks.spec import StackSpec, StackUnreachable
from harness.stacks.stack import Stack, StackKind
from harness.telemetry import EngineTarget
from serving.engine.settings import EngineSettings


class ExternalKind(StackKind):
    """``base`` running at the URLs given: its name, protocol, routing, roles and engine
    telemetry; none of its processes, faults or restarts."""

    summary = "a stack already running elsewhere (URLs given)"

    def __init__(self, base: StackKind) -> None:
        self.base = base
        self.name = base.name
        self.protocol = base.protocol
        self.client_routes = base.client_routes
        self.engine_role = base.engine_role
        self.app = base.app
        self.ready_path = base.ready_path

    def check(self, spec: StackSpec) -> None:
        """What ``base`` refuses of a running stack (a baseline router asked of it)."""
        self.base.check(spec)

    def stand_up(self, spec: StackSpec, workdir: Path) -> Stack:
        """Check every URL answers (StackUnreachable naming the stack and the URL if not)."""
        del workdir  # nothing is started here
        for url in spec.urls:
            try:
                check_reachable(url)
            except StackUnreachable as exc:
                raise StackUnreachable(f"{spec.name} stack: {exc}") from exc.__cause__
        metadata = {"impl": "external", "label": "external", "urls": list(spec.urls)}
        return Stack(spec, spec.urls, kind=self, metadata=metadata)

    def pids(self, stack: Stack) -> dict[str, list[int]]:
        """None of its processes run here."""
        return {}

    def engine_targets(self, stack: Stack) -> list[EngineTarget]:
        """What ``base`` reads over the URLs (zero-layer and vllm-serve ``/metrics``)."""
        return self.base.engine_targets(stack)

    def engine_settings(self, stack: Stack) -> dict[str, EngineSettings]:
        """What ``base`` reads over the URLs (zero-layer and vllm-serve ``/metrics``)."""
        return self.base.engine_settings(stack)
