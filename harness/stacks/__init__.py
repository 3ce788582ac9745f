"""The one way a stack under test is stood up, watched, talked to and stopped.

Used by ``zl-bench run``, chaos (profile D), the overhead benchmark and the tests alike. One
module per job: ``spec`` (names, specs, credentials), ``processes`` (starting and stopping
processes), ``tls``, ``clients``, ``stack`` (the :class:`Stack` and the :class:`StackKind`
every kind answers), one module per kind (``zerolayer``, ``rayserve``: the orchestrator and Ray
Serve LLM, ``vllm_serve``, ``external``), and ``registry``, the only place that maps a name to
its kind. Callers ask the kind, never compare a stack's name.
"""

from harness.stacks.clients import (
    REACH_TIMEOUT_S,
    Http1Router,
    check_reachable,
    client_for,
    openai_server_body,
)
from harness.stacks.processes import (
    START_GUARD_S,
    VLLM_READY_TIMEOUT_S,
    ReplicaProcess,
    VllmServer,
    descendants,
    engine_args,
    kill_tree,
    spawn_replica,
    stop_pids,
    wait_listening,
)
from harness.stacks.rayserve import LLM_BASELINE_IMPL, baseline_router
from harness.stacks.registry import (
    ALL_STACKS,
    STACK_KINDS,
    STACKS,
    check_spec,
    kind_for,
    stack_kind,
    stand_up,
)
from harness.stacks.spec import Credentials, StackName, StackSpec, StackUnreachable
from harness.stacks.stack import Fault, Restore, Scaling, Stack, StackKind
from harness.stacks.tls import client_tls

__all__ = [
    "ALL_STACKS",
    "LLM_BASELINE_IMPL",
    "REACH_TIMEOUT_S",
    "STACKS",
    "STACK_KINDS",
    "START_GUARD_S",
    "VLLM_READY_TIMEOUT_S",
    "Credentials",
    "Fault",
    "Http1Router",
    "ReplicaProcess",
    "Restore",
    "Scaling",
    "Stack",
    "StackKind",
    "StackName",
    "StackSpec",
    "StackUnreachable",
    "VllmServer",
    "baseline_router",
    "check_reachable",
    "check_spec",
    "client_for",
    "client_tls",
    "descendants",
    "engine_args",
    "kill_tree",
    "kind_for",
    "openai_server_body",
    "spawn_replica",
    "stack_kind",
    "stand_up",
    "stop_pids",
    "wait_listening",
]
