"""Stand the baseline up and tear it down: the Python API the bench, chaos code and CLI share.

A local Ray is started with bounded resources (2 CPUs, a small object store, no dashboard, no
usage stats) unless an address is given, in which case the baseline attaches to that cluster.
Tear-down waits for every process Ray started here to exit, so nothing is left behind.
"""

from __future__ import annotations

import http.client
import os
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Self

import psutil

from baselines.rayserve.config import (
    APP_NAME,
    ENGINE_NAME,
    INGRESS_NAME,
    PROXY_READY_CHECK_S,
    QUEUE_LENGTH_DEADLINE_S,
    STAND_UP_GUARD_S,
    BaselineConfig,
    BaselineRouter,
    serve_constants,
    serve_env_flags,
)
from serving.ports import free_port

OBJECT_STORE_BYTES = 256 * 1024 * 1024
LOCAL_NUM_CPUS = 2
EXIT_WAIT_S = 15.0


def init_ray(
    ray_address: str | None,
    throughput_optimized: bool | None,
    num_cpus: int = LOCAL_NUM_CPUS,
    serve_env: Mapping[str, str] | None = None,
) -> bool:
    """Start or attach to Ray; True when this process started it (and so must stop it).

    ``throughput_optimized`` sets ``RAY_SERVE_THROUGHPUT_OPTIMIZED`` in this process's
    environment, which a Ray started here passes on to the controller, proxy and replicas.
    ``serve_env`` are further variables a Ray started here passes on (this process's own
    environment is left as it was). ``num_cpus`` is Ray's bookkeeping for a local Ray, not the
    cores its processes may use. A Ray started here waits ``PROXY_READY_CHECK_S`` for Serve's
    proxy to start and lets Serve's router wait up to ``QUEUE_LENGTH_DEADLINE_S`` for a replica's
    queue length (config.py says why of both) unless the environment sets its own.
    """
    import ray

    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if ray_address:
        ray.init(address=ray_address, log_to_driver=False)
        return False
    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", PROXY_READY_CHECK_S)
    os.environ.setdefault("RAY_SERVE_MAX_QUEUE_LENGTH_RESPONSE_DEADLINE_S", QUEUE_LENGTH_DEADLINE_S)
    if throughput_optimized is not None:
        os.environ["RAY_SERVE_THROUGHPUT_OPTIMIZED"] = "1" if throughput_optimized else "0"
    with environment(serve_env or {}):
        ray.init(
            num_cpus=num_cpus,
            object_store_memory=OBJECT_STORE_BYTES,
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
        )
    return True


@contextmanager
def environment(variables: Mapping[str, str]) -> Iterator[None]:
    """``variables`` set in this process's environment for the block, then restored: what Ray's
    processes inherit when they start, without changing what later stand-ups here see."""
    before = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def deployed_router(app_name: str, deployment_prefix: str) -> dict[str, Any]:
    """``router_class`` and ``router_kwargs`` as Serve's controller reports them for the first
    deployment of ``app_name`` whose name starts with ``deployment_prefix``: what Serve runs, not
    what was asked for (the metadata records these). Serve omits a default router's config."""
    from ray.serve._private.constants import DEFAULT_REQUEST_ROUTER_PATH
    from ray.serve.context import _get_global_client

    client = _get_global_client()  # raises when no controller runs; None is not returned then
    if client is None:
        raise RuntimeError("no Serve controller to ask which router it runs")
    details = client.get_serve_details()
    deployments = details["applications"][app_name]["deployments"]
    name = next(n for n in deployments if n.startswith(deployment_prefix))
    router = deployments[name]["deployment_config"].get("request_router_config") or {}
    return {
        "router_class": router.get("request_router_class", DEFAULT_REQUEST_ROUTER_PATH),
        "router_kwargs": router.get("request_router_kwargs", {}),
    }


def start_serve(host: str, port: int, proxy_location: str) -> None:
    """``serve.start``, where a proxy slower than Serve's own fixed wait for it (60 s, Ray's
    ``HTTP_PROXY_TIMEOUT``, which no setting changes) is not a failure: a loaded host takes longer
    to start one. The stand-up then waits for its front door to answer under its own hang guard
    (``wait_http``), which a proxy that never starts still fails."""
    from ray import serve

    http_options = {"host": host, "port": port}
    try:
        serve.start(http_options=http_options, proxy_location=proxy_location)
    except TimeoutError:
        # The controller is up and starting its proxy: this connects to it and returns.
        serve.start(http_options=http_options, proxy_location=proxy_location)


def _deploy(config: BaselineConfig) -> None:
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from baselines.rayserve.engine_replica import engine_deployment
    from baselines.rayserve.ingress import ingress_deployment

    start_serve(config.host, config.port, config.proxy_location)
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
    placed = {"ray_actor_options": {"num_cpus": 0, "resources": dict(config.engine_resources)}}
    engines = engine_deployment().options(
        num_replicas=config.replicas,
        max_ongoing_requests=config.engine_ongoing,
        request_router_config=RequestRouterConfig(**router),
        **{**lifecycle, **(placed if config.engine_resources else {})},
    )
    ingress = ingress_deployment().options(
        num_replicas=config.ingress_replicas,
        max_ongoing_requests=config.ingress_max_ongoing_requests,
        **lifecycle,
    )
    app = ingress.bind(
        engines.bind(
            config.engine, dict(config.engine_options), config.stats_dir, config.batching_ms
        ),
        config.ingress_settings(),
    )
    # The external scaler API (``baselines.rayserve.scaling``) is how profile G scales the
    # engine replicas through Serve; it leaves Serve's own autoscaling off, which is unused.
    serve.run(app, name=APP_NAME, route_prefix="/", external_scaler_enabled=True)


def wait_http(
    host: str, port: int, path: str, ready: Callable[[int, bytes], bool], timeout_s: float
) -> None:
    """Poll ``GET path`` until ``ready(status, body)``, or raise TimeoutError with the last
    answer (a stand-up is done when its front door says so, not when Ray says deployed)."""
    end = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < end:
        conn = http.client.HTTPConnection(host, port, timeout=5.0)
        try:
            conn.request("GET", path)
            response = conn.getresponse()
            body = response.read()
            if ready(response.status, body):
                return
            last = (response.status, body[:200])
        except OSError as exc:
            last = exc
        finally:
            conn.close()
        time.sleep(0.1)
    raise TimeoutError(f"no ready answer from {host}:{port}{path} after {timeout_s} s: {last!r}")


def alive_actors() -> Iterator[tuple[str, int]]:
    """(name, pid) of every live named Ray actor, from the GCS."""
    from ray._private import state

    for actor in state.actors().values():
        name, pid = actor.get("Name") or "", actor.get("Pid")
        if actor.get("State") == "ALIVE" and pid:
            yield name, pid


def serve_actor_pids() -> dict[str, list[int]]:
    """Live pids of Serve's controller, proxies, ingress and engine replicas (from the GCS)."""
    pids: dict[str, list[int]] = {"controller": [], "proxy": [], "ingress": [], "engine": []}
    for name, pid in alive_actors():
        if name == "SERVE_CONTROLLER_ACTOR":
            pids["controller"].append(pid)
        elif name.startswith("SERVE_PROXY_ACTOR"):
            pids["proxy"].append(pid)
        elif name.startswith(f"SERVE_REPLICA::{APP_NAME}#{INGRESS_NAME}#"):
            pids["ingress"].append(pid)
        elif name.startswith(f"SERVE_REPLICA::{APP_NAME}#{ENGINE_NAME}#"):
            pids["engine"].append(pid)
    return {k: sorted(v) for k, v in pids.items()}


def on_a_worker(read: Callable[[], dict[str, Any]], timeout_s: float) -> dict[str, Any]:
    """``read()`` run by a worker of the cluster: Serve's flags as its replicas see them (the
    driver's own may differ: Serve reads them once, at import)."""
    import ray

    settings: dict[str, Any] = ray.get(ray.remote(num_cpus=0)(read).remote(), timeout=timeout_s)
    return settings


def _serve_settings() -> dict[str, Any]:
    return {"serve_constants": serve_constants(), "serve_env": serve_env_flags()}


@dataclass(kw_only=True)
class ServeHandle:
    """A Serve app stood up here: where to send traffic, its settings, and how to stop it.

    ``close`` stops the Ray started here (all of it, Serve included) and waits for every process
    it started; attached to a cluster, it deletes only the app (and disconnects, unless this
    process was attached before the stand-up: ``attached_before``, a run placed on a cluster);
    Serve itself is shut down too where this stand-up started it (``serve_started``: no Serve
    ran on the cluster before), so that nothing it started stays on the cluster's nodes.
    """

    APP: ClassVar[str] = APP_NAME
    url: str
    owns_ray: bool
    attached_before: bool = False
    serve_started: bool = False
    metadata: dict[str, Any] = field(default_factory=dict)
    _ray_processes: list[psutil.Process] = field(default_factory=list)
    _closed: bool = False

    def pids(self) -> dict[str, list[int]]:
        """Process ids by role (each baseline names its own roles)."""
        raise NotImplementedError

    def describe(
        self, read: Callable[[], dict[str, Any]], deployment_prefix: str, timeout_s: float
    ) -> Self:
        """This handle with what the running app reports added to ``metadata``: Serve's
        settings as a worker sees them (``read``), the router deployed and the pids by role."""
        self.metadata.update(on_a_worker(read, timeout_s))
        self.metadata.update(deployed_router(self.APP, deployment_prefix))
        self.metadata["pids"] = self.pids()
        return self

    def ray_processes(self) -> list[psutil.Process]:
        """Every process the local Ray started here, with what those started (workers, engine
        processes); not other children of this process. Empty when attached to a cluster."""
        return with_children(self._ray_processes) if self.owns_ray else []

    def with_ray_system(self, actors: dict[str, list[int]]) -> dict[str, list[int]]:
        """``actors`` (pids by role) and, as ``ray``, the rest of the local Ray: its GCS,
        raylet, agents and idle workers, which the layer costs as much as its own actors (none
        when attached to a cluster: those run on its nodes)."""
        taken = {pid for pids in actors.values() for pid in pids}
        for proc in with_children([p for p in self.ray_processes() if p.pid in taken]):
            taken.add(proc.pid)
        system = sorted(p.pid for p in self.ray_processes() if p.pid not in taken and alive(p))
        return {**actors, "ray": system}

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            shutdown_ray(
                self.owns_ray,
                self.APP,
                self.ray_processes(),
                disconnect=not self.attached_before,
                stop_serve=self.serve_started,
            )

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(kw_only=True)
class BaselineHandle(ServeHandle):
    """The orchestrator baseline: proxy -> ingress -> engine replicas."""

    config: BaselineConfig

    def pids(self) -> dict[str, list[int]]:
        """Process ids by role (``controller``, ``proxy``, ``ingress``, ``engine``, and Ray's own
        processes as ``ray``)."""
        return self.with_ray_system(serve_actor_pids())


def processes_since(before: frozenset[int]) -> list[psutil.Process]:
    """This process's descendants that were not there in ``before``: right after ``ray.init``,
    the Ray it started (gcs_server, raylet, agents), not, say, a replica a test started."""
    return [p for p in psutil.Process().children(recursive=True) if p.pid not in before]


def alive(proc: psutil.Process) -> bool:
    """Whether ``proc`` still runs (a zombie waiting to be reaped does not)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def child_pids() -> frozenset[int]:
    return frozenset(p.pid for p in psutil.Process().children(recursive=True))


def with_children(processes: list[psutil.Process]) -> list[psutil.Process]:
    """``processes`` and everything they started (Ray's workers, vLLM's engine cores), once."""
    found = {p.pid: p for p in processes}
    for proc in processes:
        try:
            found.update({c.pid: c for c in proc.children(recursive=True)})
        except psutil.NoSuchProcess:
            continue
    return list(found.values())


def shutdown_ray(
    owns_ray: bool,
    app_name: str,
    processes: list[psutil.Process],
    disconnect: bool = True,
    stop_serve: bool = False,
) -> None:
    """Stop a Ray started here and wait for ``processes``; attached to a cluster, delete only
    ``app_name`` (all of Serve when ``stop_serve``: the stand-up started it), and disconnect
    unless ``disconnect`` is False (the connection is another part of this process's)."""
    import ray
    from ray import serve

    try:
        if not owns_ray and stop_serve:
            serve.shutdown()
        elif not owns_ray:
            serve.delete(app_name)
    finally:
        if owns_ray or disconnect:
            ray.shutdown()
        _reap(processes)


def undo_stand_up(
    app_name: str,
    processes: list[psutil.Process],
    owns_ray: bool,
    attached_before: bool,
    serve_started: bool,
) -> None:
    """What a stand-up that failed started, stopped: the Ray it started, or, attached to a
    cluster, Serve where it started it (nothing of another's)."""
    if owns_ray or serve_started:
        shutdown_ray(
            owns_ray,
            app_name,
            with_children(processes),
            disconnect=not attached_before,
            stop_serve=serve_started,
        )


def ray_attached() -> bool:
    """Whether this process is attached to a Ray already (a run placed on a cluster)."""
    import ray

    return bool(ray.is_initialized())


def serve_running() -> bool:
    """Whether Serve's controller runs on the cluster this process is attached to."""
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    try:
        ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    except ValueError:
        return False
    return True


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
    router: BaselineRouter = BaselineRouter.CONSISTENT_HASH,
    ray_address: str | None = None,
    ready_timeout_s: float = STAND_UP_GUARD_S,
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
    before = child_pids()
    attached_before = ray_attached()
    owns_ray = init_ray(ray_address, config.throughput_optimized)
    serve_started = not owns_ray and not serve_running()
    processes = processes_since(before) if owns_ray else []
    try:
        _deploy(config)
        wait_http(config.host, config.port, "/health", lambda status, _: status == 200,
                  ready_timeout_s)  # fmt: skip
        handle = BaselineHandle(
            url=f"http://{config.host}:{config.port}",
            config=config,
            owns_ray=owns_ray,
            attached_before=attached_before,
            serve_started=serve_started,
            metadata={**config.metadata(), "ray_address": ray_address or "local"},
            _ray_processes=processes,
        )
        return handle.describe(_serve_settings, ENGINE_NAME, ready_timeout_s)
    except BaseException:
        undo_stand_up(APP_NAME, processes, owns_ray, attached_before, serve_started)
        raise
