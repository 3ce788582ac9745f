"""Stand Ray Serve LLM up and tear it down, with the surface of ``baselines.rayserve``'s handle.

A local Ray is started (no dashboard, no usage stats, a small object store) unless an address is
given. Its logical CPUs cover what Ray Serve LLM reserves (each ``LLMServer`` replica's placement
group: the replica actor's CPU plus the engine bundle; one CPU for the ingress); they are
bookkeeping, not the cores the processes may use. Tear-down stops that Ray and waits for every
process it started, vLLM's engine-core processes included.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import psutil

from baselines.rayserve.config import (
    STAND_UP_GUARD_S,
    BaselineRouter,
    serve_constants,
    serve_env_flags,
)
from baselines.rayserve.standup import (
    ServeHandle,
    alive_actors,
    child_pids,
    init_ray,
    on_a_worker,
    processes_since,
    ray_attached,
    serve_running,
    start_serve,
    undo_stand_up,
    wait_http,
)
from baselines.rayserve_llm.config import (
    APP_NAME,
    SESSION_HEADER_VARIABLE,
    LlmBaselineConfig,
    llm_constants,
)
from serving.ports import free_port
from serving.wire.contract import SESSION

LLM_SERVER_PREFIX = "LLMServer"
INGRESS_PREFIX = "OpenAiIngress"
ROUTER_PREFIX = "LLMRouter"
CPUS_PER_REPLICA = 2  # the replica actor's CPU merged into the engine's bundle
EXTRA_CPUS = 2  # the ingress replica, and room for a second (e.g. direct streaming's router)
READY_PATH = "/v1/models"  # the OpenAI app has no /health; it lists the model once it serves


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def _deployments(app: Any) -> dict[str, Any]:
    """What ``build_openai_app`` deployed, per deployment: the options that affect latency."""
    found: dict[str, Any] = {}

    def visit(node: Any) -> None:
        bound = getattr(node, "_bound_deployment", None)
        if bound is None:
            return
        deployment = bound  # a serve Deployment: its public options, and Serve's config
        config = deployment._deployment_config
        autoscaling = config.autoscaling_config
        router = getattr(config, "request_router_config", None)
        found[deployment.name] = {
            "num_replicas": config.num_replicas,
            "autoscaling": None
            if autoscaling is None
            else {
                "min_replicas": autoscaling.min_replicas,
                "max_replicas": autoscaling.max_replicas,
                "target_ongoing_requests": autoscaling.target_ongoing_requests,
            },
            "max_ongoing_requests": config.max_ongoing_requests,
            "max_queued_requests": config.max_queued_requests,
            "health_check_period_s": config.health_check_period_s,
            "health_check_timeout_s": config.health_check_timeout_s,
            "graceful_shutdown_timeout_s": config.graceful_shutdown_timeout_s,
            "request_router_class": None
            if router is None
            else getattr(router, "request_router_class", None),
            "num_cpus": (deployment.ray_actor_options or {}).get("num_cpus"),
            "placement_group_bundles": deployment._replica_config.placement_group_bundles,
            "placement_group_strategy": deployment._replica_config.placement_group_strategy,
        }
        for value in [*(deployment.init_args or ()), *(deployment.init_kwargs or {}).values()]:
            for child in value.values() if isinstance(value, dict) else [value]:
                visit(child)

    visit(app)
    return found


def _deploy(config: LlmBaselineConfig) -> dict[str, Any]:
    from ray import serve
    from ray.serve.llm import build_openai_app

    start_serve(config.host, config.port, config.proxy_location)
    app = build_openai_app({"llm_configs": [config.llm_config()]})
    deployed = _deployments(app)
    serve.run(app, name=APP_NAME, route_prefix="/")
    return deployed


def _lists(model_id: str) -> Callable[[int, bytes], bool]:
    """Ready when ``GET /v1/models`` lists the model (the ingress knows its engine)."""
    return lambda status, body: status == 200 and model_id.encode() in body


def llm_actor_pids() -> dict[str, list[int]]:
    """Live pids by role: Serve's ``controller`` and ``proxy``, the OpenAI ``ingress`` (which
    also routes, unless direct streaming adds an ``LLMRouter``: ``router``), the ``engine``
    replicas (``LLMServer`` actors) and their vLLM ``engine_core`` child processes."""
    pids: dict[str, list[int]] = {
        "controller": [],
        "proxy": [],
        "ingress": [],
        "router": [],
        "engine": [],
        "engine_core": [],
    }
    replica = f"SERVE_REPLICA::{APP_NAME}#"
    for name, pid in alive_actors():
        deployment = name[len(replica) :].split("#")[0] if name.startswith(replica) else ""
        if name == "SERVE_CONTROLLER_ACTOR":
            pids["controller"].append(pid)
        elif name.startswith("SERVE_PROXY_ACTOR"):
            pids["proxy"].append(pid)
        elif deployment.startswith(INGRESS_PREFIX):
            pids["ingress"].append(pid)
        elif deployment.startswith(ROUTER_PREFIX):
            pids["router"].append(pid)
        elif deployment.startswith(LLM_SERVER_PREFIX):
            pids["engine"].append(pid)
            pids["engine_core"].extend(_children(pid))
    return {k: sorted(v) for k, v in pids.items()}


def _children(pid: int) -> list[int]:
    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def check_session_header(constants: Mapping[str, Any]) -> None:
    """ValueError (one line) unless the cluster's Serve reads the session id from the header
    the loaders send: consistent hashing would otherwise key every request on its own id."""
    header = constants.get("SERVE_SESSION_ID")
    if header != SESSION:
        raise ValueError(
            f"the consistent-hash router keys on the {SESSION} header, but this cluster's "
            f"Serve reads {header!r}: start it with {SESSION_HEADER_VARIABLE}={SESSION}"
        )


def _settings() -> dict[str, Any]:
    """Serve's and Serve LLM's flags, read on a worker of the cluster as replicas see them."""
    return {
        "serve_constants": serve_constants(),
        "serve_env": serve_env_flags(),
        "llm_constants": llm_constants(),
    }


@dataclass(kw_only=True)
class LlmBaselineHandle(ServeHandle):
    """A running Ray Serve LLM (ingress -> LLMServer replicas, vLLM inside each)."""

    APP: ClassVar[str] = APP_NAME
    config: LlmBaselineConfig

    def pids(self) -> dict[str, list[int]]:
        """Process ids by role: ``controller``, ``proxy``, ``ingress``, ``router``, ``engine``,
        ``engine_core``, and Ray's own processes as ``ray``."""
        return self.with_ray_system(llm_actor_pids())

    def applied_engine_kwargs(self, timeout_s: float = 60.0) -> dict[str, Any]:
        """The vLLM engine arguments an LLMServer replica runs with, asked of it (its
        ``llm_config``): what Ray Serve LLM applied, its own defaults included."""
        from ray import serve

        names = [n for n in self.metadata.get("deployments", {}) if n.startswith(LLM_SERVER_PREFIX)]
        if not names:
            raise RuntimeError(f"no {LLM_SERVER_PREFIX} deployment in {APP_NAME}")
        server = serve.get_deployment_handle(names[0], app_name=APP_NAME)
        config = server.llm_config.remote().result(timeout_s=timeout_s)
        return dict(config.engine_kwargs)


def start_llm_baseline(
    model: str,
    replicas: int = 1,
    engine_options: Mapping[str, Any] | None = None,
    router: BaselineRouter = BaselineRouter.POW2,
    ray_address: str | None = None,
    port: int = 0,
    ready_timeout_s: float = STAND_UP_GUARD_S,
    **settings: Any,
) -> LlmBaselineHandle:
    """Start (or attach to) Ray, deploy Ray Serve LLM for ``model``, wait until it lists it.

    ``engine_options`` are the zero-layer vllm engine's (``VllmEngineConfig`` fields);
    ``settings`` are further :class:`LlmBaselineConfig` fields (``model_id``,
    ``max_ongoing_requests``, ``stream_batching_interval_ms``, ``router_kwargs``, ...).
    """
    config = LlmBaselineConfig(
        model=model,
        replicas=replicas,
        engine_options=dict(engine_options or {}),
        router=router,
        **settings,
    )
    config = replace(config, port=port or free_port(config.host), on_cpu=_on_cpu())
    before = child_pids()
    cpus = CPUS_PER_REPLICA * replicas + EXTRA_CPUS
    attached_before = ray_attached()
    owns_ray = init_ray(
        ray_address, config.throughput_optimized, num_cpus=cpus, serve_env=config.serve_env()
    )
    serve_started = not owns_ray and not serve_running()
    processes = processes_since(before) if owns_ray else []  # gcs_server, raylet, Ray's agents
    try:
        if config.serve_env():
            check_session_header(on_a_worker(serve_constants, ready_timeout_s))
        started = time.monotonic()
        deployed = _deploy(config)
        wait_http(config.host, config.port, READY_PATH, _lists(config.model_id), ready_timeout_s)
        handle = LlmBaselineHandle(
            url=f"http://{config.host}:{config.port}",
            config=config,
            owns_ray=owns_ray,
            attached_before=attached_before,
            serve_started=serve_started,
            metadata={
                **config.metadata(),
                "ray_address": ray_address or "local",
                "ray_num_cpus": cpus if owns_ray else None,
                "deployments": deployed,
                "ready_s": round(time.monotonic() - started, 1),
            },
            _ray_processes=processes,
        )
        return handle.describe(_settings, LLM_SERVER_PREFIX, ready_timeout_s)
    except BaseException:
        undo_stand_up(APP_NAME, processes, owns_ray, attached_before, serve_started)
        raise
