"""Scaling the orchestrator's engine replicas through Serve, as an operator (or an external
autoscaler) does it: Serve's external scaler API, the call behind Ray's dashboard endpoint
``POST /api/v1/applications/{app}/deployments/{deployment}/scale``
(``ServeController.update_deployment_replicas``). The app is deployed with
``external_scaler_enabled`` (``standup``), so nothing but this call changes its replica count.

Serve then starts or stops replicas itself; which one it stops on a scale-down is its own choice
(the newest on a node first, in Ray 2.60). The replicas as Serve's controller reports them
(``engine_replicas``) say when a new one is running and which pid it has.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from baselines.rayserve.config import APP_NAME, ENGINE_NAME

if TYPE_CHECKING:
    from ray.serve._private.client import ServeControllerClient

CALL_TIMEOUT_S: Final = 30.0
RUNNING: Final = "RUNNING"


@dataclass(frozen=True, slots=True)
class ServeReplica:
    """One engine replica as Serve's controller reports it."""

    replica_id: str
    state: str
    pid: int | None


def _client() -> ServeControllerClient:
    from ray.serve.context import _get_global_client

    client = _get_global_client()
    if client is None:
        raise RuntimeError("no Serve controller is running here to scale")
    return client


def scale_engines(replicas: int) -> None:
    """Ask Serve for ``replicas`` engine replicas (returns once the controller has the target;
    the replicas start or stop after it)."""
    import ray
    from ray.serve._private.common import DeploymentID

    if replicas < 1:
        raise ValueError(f"replicas must be at least 1, got {replicas}")
    ref = _client()._controller.update_deployment_replicas.remote(
        DeploymentID(name=ENGINE_NAME, app_name=APP_NAME), replicas
    )
    ray.get(ref, timeout=CALL_TIMEOUT_S)


def engine_replicas() -> list[ServeReplica]:
    """The engine deployment's replicas and their states, as Serve's controller reports them."""
    details = _client().get_serve_details()
    deployment = details["applications"][APP_NAME]["deployments"][ENGINE_NAME]
    return [
        ServeReplica(str(r["replica_id"]), _text(r["state"]), r.get("pid"))
        for r in deployment.get("replicas", [])
    ]


def _text(state: Any) -> str:
    """A state as its name: Serve's ``ReplicaState`` is a str enum, whose ``str()`` is not."""
    return str(getattr(state, "value", state))


def running_pids() -> list[int]:
    """The pids of the engine replicas Serve reports running."""
    return sorted(r.pid for r in engine_replicas() if r.state == RUNNING and r.pid)


def changing_count() -> int:
    """How many replicas of the app (its ingress and its engines) Serve reports in any state but
    running (starting, updating, recovering, stopping): a scale or a replacement under way."""
    deployments = _client().get_serve_details()["applications"][APP_NAME]["deployments"]
    return sum(
        _text(r["state"]) != RUNNING for d in deployments.values() for r in d.get("replicas", [])
    )
