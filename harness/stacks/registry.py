"""The registry of stack kinds: the one place that maps a stack's name (and spec) to its kind.

``stack_kind`` answers for a name (a target file's stack, with the Ray Serve app it names);
``kind_for`` for a spec (an external stack, the baseline the engine kind calls for);
``stand_up`` is the one way any stack is stood up.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Final

from harness.errors import StartFailed
from harness.stacks.external import ExternalKind
from harness.stacks.rayserve import ORCHESTRATOR, RAY_SERVE_LLM, baseline_kind
from harness.stacks.spec import StackName, StackSpec
from harness.stacks.stack import Stack, StackKind
from harness.stacks.vllm_serve import VllmServeKind
from harness.stacks.zerolayer import ZeroLayerKind

# Each name's kind; the baseline's is the orchestrator unless its engine serves vLLM.
STACK_KINDS: Final[dict[StackName, StackKind]] = {
    StackName.ZEROLAYER: ZeroLayerKind(),
    StackName.BASELINE: ORCHESTRATOR,
    StackName.VLLM_SERVE: VllmServeKind(),
}
# Every kind a name may stand for, by (name, Ray Serve app) as a target file records them.
_BY_APP: Final = {(kind.name, kind.app): kind for kind in (*STACK_KINDS.values(), RAY_SERVE_LLM)}
# The stacks a run compares by default and chaos knows faults for; vllm-serve is asked for by name.
STACKS: Final = tuple(name.value for name, kind in STACK_KINDS.items() if kind.faults)
ALL_STACKS: Final = tuple(name.value for name in StackName)


def stack_kind(name: str, app: str = "") -> StackKind:
    """The kind of the stack named ``name``; ``app`` (a target file's ``baseline_app``) picks
    the baseline's (``llm``: Ray Serve LLM). ValueError naming the stacks for any other name."""
    try:
        stack = StackName(name)
    except ValueError:
        raise ValueError(f"unknown stack {name!r}; choose from {', '.join(ALL_STACKS)}") from None
    kind = _BY_APP.get((stack, app)) if app else STACK_KINDS[stack]
    if kind is None:
        raise ValueError(f"the {stack} stack has no kind running the Ray Serve app {app!r}")
    return kind


def kind_for(spec: StackSpec) -> StackKind:
    """The kind that serves ``spec``: the baseline's by its engine kind; external with URLs."""
    kind = baseline_kind(spec.engine) if spec.name is StackName.BASELINE else stack_kind(spec.name)
    return ExternalKind(kind) if spec.urls else kind


def check_spec(spec: StackSpec) -> None:
    """Raise ValueError (one line) for a spec no stack can serve: too few replicas, a baseline
    router that baseline cannot run, or ``vllm-serve`` over an engine that does not serve vLLM.
    ``stand_up`` checks this first."""
    if spec.replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {spec.replicas}")
    kind_for(spec).check(spec)


def stand_up(spec: StackSpec, workdir: Path) -> Stack:
    """Start the stack (or, for an external one, check every URL answers) and return it.

    Logs, the TLS certificate and the baseline's engine stats go under ``workdir``. Raises
    ValueError for a spec :func:`check_spec` refuses (vllm-serve needs ``engine="vllm"``), and
    ``StartFailed`` naming the stack, its part, the reason and the log for a part that exited
    (or never answered) at start. How long it took goes into its metadata as ``stand_up_s``: the
    host's pace at starting this stack's parts, which bounds how long they may take to come back
    after a fault (``chaos.runner.for_host``).
    """
    check_spec(spec)
    kind = kind_for(spec)
    if not spec.urls:
        workdir = Path(workdir)
        workdir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    try:
        stack = kind.stand_up(spec, workdir)
    except StartFailed as exc:
        raise StartFailed(f"the {spec.name} stack's {exc.what}", exc.reason, exc.log) from None
    stack.metadata["stand_up_s"] = round(time.monotonic() - started, 2)
    return stack
