"""Stand Ray Serve LLM up and tear it down, with the surface of ``baselines.rayserve``'s handle.

A local Ray is started (no dashboard, no usage stats, a small object store) unless an address is
given. Its logical CPUs cover what Ray Serve LLM reserves (each ``LLMServer`` replica's placement
group: the replica actor's CPU plus the engine bundle; one CPU for the ingress); they are
bookkeeping, not the cores the processes may use. Tear-down stops that Ray and waits for every
process it started, vLLM's engine-core processes included.
"""

from __future__ import annotations

import http.client
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import psutil

from baselines.rayserve.config import serve_constants, serve_env_flags
from baselines.rayserve.standup import OBJECT_STORE_BYTES, _reap, free_port
from baselines.rayserve_llm.config import (
    APP_NAME,
    LlmBaselineConfig,
    LlmRouterName,
    llm_constants,
)

LLM_SERVER_PREFIX = "LLMServer"
INGRESS_PREFIX = "OpenAiIngress"
ROUTER_PREFIX = "LLMRouter"
CPUS_PER_REPLICA = 2  # the replica actor's CPU merged into the engine's bundle
EXTRA_CPUS = 2  # the ingress replica, and room for a second (e.g. direct streaming's router)


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def _init_ray(ray_address: str | None, replicas: int, throughput_optimized: bool | None) -> bool:
    """Start or attach to Ray; True when this process started it (and so must stop it)."""
    import ray

    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if ray_address:
        ray.init(address=ray_address, log_to_driver=False)
        return False
    if throughput_optimized is not None:
        os.environ["RAY_SERVE_THROUGHPUT_OPTIMIZED"] = "1" if throughput_optimized else "0"
    ray.init(
        num_cpus=CPUS_PER_REPLICA * replicas + EXTRA_CPUS,
        object_store_memory=OBJECT_STORE_BYTES,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
    )
    return True


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

    serve.start(
        http_options={"host": config.host, "port": config.port},
        proxy_location=config.proxy_location,
    )
    app = build_openai_app({"llm_configs": [config.llm_config()]})
    deployed = _deployments(app)
    serve.run(app, name=APP_NAME, route_prefix="/")
    return deployed


def wait_models(host: str, port: int, model_id: str, timeout_s: float) -> None:
    """Poll ``GET /v1/models`` until it lists ``model_id``, or raise TimeoutError."""
    end = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < end:
        conn = http.client.HTTPConnection(host, port, timeout=5.0)
        try:
            conn.request("GET", "/v1/models")
            response = conn.getresponse()
            body = response.read()
            if response.status == 200 and model_id.encode() in body:
                return
            last = (response.status, body[:200])
        except OSError as exc:
            last = exc
        finally:
            conn.close()
        time.sleep(0.2)
    raise TimeoutError(f"Ray Serve LLM not ready on {host}:{port} after {timeout_s} s: {last!r}")


def llm_actor_pids() -> dict[str, list[int]]:
    """Live pids by role: Serve's ``controller`` and ``proxy``, the OpenAI ``ingress`` (which
    also routes, unless direct streaming adds an ``LLMRouter``: ``router``), the ``engine``
    replicas (``LLMServer`` actors) and their vLLM ``engine_core`` child processes."""
    from ray._private import state

    pids: dict[str, list[int]] = {
        "controller": [],
        "proxy": [],
        "ingress": [],
        "router": [],
        "engine": [],
        "engine_core": [],
    }
    replica = f"SERVE_REPLICA::{APP_NAME}#"
    for actor in state.actors().values():
        name, pid = actor.get("Name") or "", actor.get("Pid")
        if actor.get("State") != "ALIVE" or not pid:
            continue
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


def _cluster_settings(timeout_s: float) -> dict[str, Any]:
    """Serve's and Serve LLM's flags as a worker of the cluster sees them, as replicas do."""
    import ray

    def read() -> dict[str, Any]:
        return {
            "serve_constants": serve_constants(),
            "serve_env": serve_env_flags(),
            "llm_constants": llm_constants(),
        }

    return ray.get(ray.remote(num_cpus=0)(read).remote(), timeout=timeout_s)


def _descendants(exclude: frozenset[int]) -> list[psutil.Process]:
    """This process's descendants that were not there before Ray started."""
    return [p for p in psutil.Process().children(recursive=True) if p.pid not in exclude]


def _with_children(processes: list[psutil.Process]) -> list[psutil.Process]:
    """``processes`` and everything they started, each once."""
    found = {p.pid: p for p in processes}
    for proc in processes:
        try:
            found.update({c.pid: c for c in proc.children(recursive=True)})
        except psutil.NoSuchProcess:
            continue
    return list(found.values())


@dataclass
class LlmBaselineHandle:
    """A running Ray Serve LLM: where to send traffic, how it is configured, how to stop it."""

    url: str
    config: LlmBaselineConfig
    owns_ray: bool
    metadata: dict[str, Any] = field(default_factory=dict)
    _processes: list[psutil.Process] = field(default_factory=list)
    _closed: bool = False

    def pids(self) -> dict[str, list[int]]:
        """Process ids by role: ``controller``, ``proxy``, ``ingress``, ``router``, ``engine``,
        ``engine_core``."""
        return llm_actor_pids()

    def ray_processes(self) -> list[psutil.Process]:
        """Every process the local Ray started here, with what those started (workers, vLLM's
        engine cores); not other children of this process. Empty when attached to a cluster."""
        if not self.owns_ray:
            return []
        return _with_children(self._processes)

    def close(self) -> None:
        """Stop the Ray started here and wait for all its processes (vLLM's included); when
        attached to a cluster, delete only the app."""
        if self._closed:
            return
        self._closed = True
        import ray
        from ray import serve

        try:
            if not self.owns_ray:
                serve.delete(APP_NAME)
        finally:
            processes = self.ray_processes()
            ray.shutdown()
            _reap(processes)

    def __enter__(self) -> LlmBaselineHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_llm_baseline(
    model: str,
    replicas: int = 1,
    engine_options: Mapping[str, Any] | None = None,
    router: LlmRouterName = "default",
    ray_address: str | None = None,
    port: int = 0,
    ready_timeout_s: float = 600.0,
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
    before = frozenset(p.pid for p in psutil.Process().children(recursive=True))
    owns_ray = _init_ray(ray_address, replicas, config.throughput_optimized)
    processes = _descendants(before) if owns_ray else []  # gcs_server, raylet, Ray's agents
    try:
        started = time.monotonic()
        deployed = _deploy(config)
        wait_models(config.host, config.port, config.model_id, ready_timeout_s)
        handle = LlmBaselineHandle(
            url=f"http://{config.host}:{config.port}",
            config=config,
            owns_ray=owns_ray,
            metadata={
                **config.metadata(),
                "ray_address": ray_address or "local",
                "ray_num_cpus": CPUS_PER_REPLICA * replicas + EXTRA_CPUS if owns_ray else None,
                "deployments": deployed,
                "ready_s": round(time.monotonic() - started, 1),
            },
            _processes=processes,
        )
        handle.metadata.update(_cluster_settings(ready_timeout_s))
        handle.metadata["pids"] = handle.pids()
        return handle
    except BaseException:
        import ray

        if owns_ray:
            everything = _with_children(processes)
            ray.shutdown()
            _reap(everything)
        raise
