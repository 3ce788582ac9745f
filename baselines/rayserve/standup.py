"""Stand the baseline up and tear it down: the Python API the bench, chaos code and CLI share.

A local Ray is started with bounded resources (2 CPUs, a small object store, no dashboard, no
usage stats) unless an address is given, in which case the baseline attaches to that cluster.
Tear-down waits for every process Ray started here to exit, so nothing is left behind.
"""

from __future__ import annotations

import http.client
import os
import socket
import time
from dataclasses import dataclass, field, replace
from typing import Any

import psutil

from baselines.rayserve.config import (
    APP_NAME,
    ENGINE_NAME,
    INGRESS_NAME,
    BaselineConfig,
    RouterName,
    serve_constants,
    serve_env_flags,
)

OBJECT_STORE_BYTES = 256 * 1024 * 1024
LOCAL_NUM_CPUS = 2
EXIT_WAIT_S = 15.0
RAY_BINARIES = frozenset({"raylet", "gcs_server"})


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS calls free right now (Serve needs a fixed one; 0 means pick one)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _init_ray(ray_address: str | None, throughput_optimized: bool | None) -> bool:
    """Start or attach to Ray; True when this process started it (and so must stop it).

    ``throughput_optimized`` sets ``RAY_SERVE_THROUGHPUT_OPTIMIZED`` in this process's
    environment, which a Ray started here passes on to the controller, proxy and replicas.
    """
    import ray

    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if throughput_optimized is not None and not ray_address:
        os.environ["RAY_SERVE_THROUGHPUT_OPTIMIZED"] = "1" if throughput_optimized else "0"
    if ray_address:
        ray.init(address=ray_address, log_to_driver=False)
        return False
    ray.init(
        num_cpus=LOCAL_NUM_CPUS,
        object_store_memory=OBJECT_STORE_BYTES,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
    )
    return True


def _deploy(config: BaselineConfig) -> None:
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from baselines.rayserve.engine_replica import engine_deployment
    from baselines.rayserve.ingress import ingress_deployment

    serve.start(
        http_options={"host": config.host, "port": config.port},
        proxy_location=config.proxy_location,
    )
    # A dict: Ray annotates RequestRouterConfig's **kwargs as if every value were a dict.
    router: dict[str, Any] = {
        "request_router_class": config.router_class(),
        "request_router_kwargs": config.router_kwargs(),
    }
    lifecycle: dict[str, Any] = {  # the same health checks and shutdown for both deployments
        "health_check_period_s": config.health_check_period_s,
        "health_check_timeout_s": config.health_check_timeout_s,
        "graceful_shutdown_timeout_s": config.graceful_shutdown_timeout_s,
        "ray_actor_options": {"num_cpus": 0},
    }
    engines = engine_deployment().options(
        num_replicas=config.replicas,
        max_ongoing_requests=config.engine_ongoing,
        request_router_config=RequestRouterConfig(**router),
        **lifecycle,
    )
    ingress = ingress_deployment().options(
        num_replicas=config.ingress_replicas,
        max_ongoing_requests=config.ingress_max_ongoing_requests,
        **lifecycle,
    )
    app = ingress.bind(
        engines.bind(config.engine, dict(config.engine_options), config.stats_dir),
        config.ingress_settings(),
    )
    serve.run(app, name=APP_NAME, route_prefix="/")


def wait_healthy(host: str, port: int, timeout_s: float) -> None:
    """Poll ``GET /health`` until it answers 200, or raise TimeoutError."""
    end = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < end:
        conn = http.client.HTTPConnection(host, port, timeout=2.0)
        try:
            conn.request("GET", "/health")
            response = conn.getresponse()
            response.read()
            if response.status == 200:
                return
            last = response.status
        except OSError as exc:
            last = exc
        finally:
            conn.close()
        time.sleep(0.1)
    raise TimeoutError(f"baseline not healthy on {host}:{port} after {timeout_s} s: {last!r}")


def serve_actor_pids() -> dict[str, list[int]]:
    """Live pids of Serve's controller, proxies, ingress and engine replicas (from the GCS)."""
    from ray._private import state

    pids: dict[str, list[int]] = {"controller": [], "proxy": [], "ingress": [], "engine": []}
    for actor in state.actors().values():
        name, pid = actor.get("Name") or "", actor.get("Pid")
        if actor.get("State") != "ALIVE" or not pid:
            continue
        if name == "SERVE_CONTROLLER_ACTOR":
            pids["controller"].append(pid)
        elif name.startswith("SERVE_PROXY_ACTOR"):
            pids["proxy"].append(pid)
        elif name.startswith(f"SERVE_REPLICA::{APP_NAME}#{INGRESS_NAME}#"):
            pids["ingress"].append(pid)
        elif name.startswith(f"SERVE_REPLICA::{APP_NAME}#{ENGINE_NAME}#"):
            pids["engine"].append(pid)
    return {k: sorted(v) for k, v in pids.items()}


def _cluster_serve_settings(timeout_s: float) -> dict[str, Any]:
    """The Serve flags as a worker of the cluster sees them, like the replicas do (the driver's
    own may differ: Serve reads them once, at import)."""
    import ray

    def read() -> dict[str, Any]:
        return {"serve_constants": serve_constants(), "serve_env": serve_env_flags()}

    return ray.get(ray.remote(num_cpus=0)(read).remote(), timeout=timeout_s)


@dataclass
class BaselineHandle:
    """A running baseline: where to send traffic, how it is configured, and how to stop it."""

    url: str
    config: BaselineConfig
    owns_ray: bool
    metadata: dict[str, Any] = field(default_factory=dict)
    _ray_processes: list[psutil.Process] = field(default_factory=list)
    _closed: bool = False

    def pids(self) -> dict[str, list[int]]:
        """Process ids by role (``controller``, ``proxy``, ``ingress``, ``engine``)."""
        return serve_actor_pids()

    def ray_processes(self) -> list[psutil.Process]:
        """Every process this handle's local Ray started (empty when attached to a cluster)."""
        return list(self._ray_processes)

    def close(self) -> None:
        """Stop the Ray started here (all of it, Serve included) and wait for its processes;
        when attached to a cluster, delete only the app."""
        if self._closed:
            return
        self._closed = True
        import ray
        from ray import serve

        try:
            if not self.owns_ray:
                serve.delete(APP_NAME)
        finally:
            processes = self._ray_processes + _ray_descendants() if self.owns_ray else []
            ray.shutdown()
            _reap(processes)

    def __enter__(self) -> BaselineHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _is_ray(proc: psutil.Process) -> bool:
    try:
        name = proc.name()
        cmdline = " ".join(proc.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False
    return name.startswith("ray::") or name in RAY_BINARIES or "/ray/" in cmdline


def _ray_descendants() -> list[psutil.Process]:
    """This process's descendants that belong to Ray (not, say, a replica a test started)."""
    return [p for p in psutil.Process().children(recursive=True) if _is_ray(p)]


def _reap(processes: list[psutil.Process]) -> None:
    """Wait for Ray's processes to exit after ``ray.shutdown``; kill any that hang on."""
    unique = list({p.pid: p for p in processes}.values())
    _, alive = psutil.wait_procs(unique, timeout=EXIT_WAIT_S)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            continue
    psutil.wait_procs(alive, timeout=5.0)


def start_baseline(
    engine: str = "sim",
    replicas: int = 2,
    port: int = 0,
    engine_options: dict[str, Any] | None = None,
    router: RouterName = "consistent_hash",
    ray_address: str | None = None,
    ready_timeout_s: float = 120.0,
    **settings: Any,
) -> BaselineHandle:
    """Start (or attach to) Ray, deploy the baseline, wait until ``/health`` answers.

    ``settings`` are further :class:`BaselineConfig` fields (budgets, queue sizes, retries).
    """
    config = BaselineConfig(
        engine=engine,
        engine_options=dict(engine_options or {}),
        replicas=replicas,
        router=router,
        **settings,
    )
    config = replace(config, port=port or free_port(config.host))
    owns_ray = _init_ray(ray_address, config.throughput_optimized)
    try:
        processes = _ray_descendants() if owns_ray else []
        _deploy(config)
        wait_healthy(config.host, config.port, ready_timeout_s)
        handle = BaselineHandle(
            url=f"http://{config.host}:{config.port}",
            config=config,
            owns_ray=owns_ray,
            metadata={**config.metadata(), "ray_address": ray_address or "local"},
            _ray_processes=processes,
        )
        handle.metadata.update(_cluster_serve_settings(ready_timeout_s))
        handle.metadata["pids"] = handle.pids()
        return handle
    except BaseException:
        import ray

        if owns_ray:
            processes = _ray_descendants()
            ray.shutdown()
            _reap(processes)
        raise
