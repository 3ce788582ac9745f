"""Baseline settings: one dataclass, turned into Serve options and recorded in the run metadata.

Everything that changes the baseline's latency lives here, so a run's ``metadata`` says exactly
how the middle layer was configured.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any, Final

from serving.auth import read_key_file
from serving.engine import engine_kind
from serving.engine.options import validate_engine_options

CONSISTENT_HASH_ROUTER: Final = "ray.serve.experimental.consistent_hash_router:ConsistentHashRouter"
POW2_ROUTER: Final = "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter"
APP_NAME: Final = "zl-baseline"
INGRESS_NAME: Final = "Orchestrator"
ENGINE_NAME: Final = "EngineReplica"
# Each engine replica's request log in the stats directory: ``engine-requests-<pid>.jsonl``.
REQUESTS_PREFIX: Final = "engine-requests-"


class BaselineRouter(StrEnum):
    """How a baseline's Serve router picks an engine replica; one spelling for both baselines
    (``zl-bench --baseline-router``, ``zl-baseline --router``)."""

    POW2 = "pow2"  # Serve's default: the less loaded of two random replicas
    CONSISTENT_HASH = "consistent-hash"  # Ray's ring on the request's session id
    PREFIX_AWARE = "prefix-aware"  # Ray Serve LLM's prefix tree over the prompt text


BASELINE_ROUTERS: Final = tuple(r.value for r in BaselineRouter)
# The orchestrator's routers and their classes. Ray's prefix-aware router reads the prompt text
# from the routed call, and the ingress sends the engine replicas token counts, not text.
ORCHESTRATOR_ROUTERS: Final = {
    BaselineRouter.CONSISTENT_HASH: CONSISTENT_HASH_ROUTER,
    BaselineRouter.POW2: POW2_ROUTER,
}
ORCHESTRATOR_PREFIX_AWARE: Final = (
    "the prefix-aware router is Ray Serve LLM's (zl-bench's baseline with --engine vllm): it "
    "matches prompt text, and the orchestrator baseline sends its engine replicas token counts"
)


def serve_llm_batching_ms() -> float:
    """Ray Serve LLM's default stream batching interval (``MODEL_RESPONSE_BATCH_TIMEOUT_MS``, 50
    ms unless its environment variable says otherwise): the interval a careful team running an
    orchestrator of its own would take from the orchestrator Ray ships for LLMs."""
    from ray.llm._internal.serve.constants import MODEL_RESPONSE_BATCH_TIMEOUT_MS

    return float(MODEL_RESPONSE_BATCH_TIMEOUT_MS)


def parse_router(name: str | BaselineRouter) -> BaselineRouter:
    """``name`` as a router; ValueError (one line, the choices named) for any other spelling."""
    try:
        return BaselineRouter(name)
    except ValueError:
        raise ValueError(
            f"baseline router must be one of {', '.join(BASELINE_ROUTERS)}, got {name!r}"
        ) from None


def orchestrator_router(name: str | BaselineRouter) -> BaselineRouter:
    """``name`` as a router the orchestrator baseline can run; ValueError (one line) if not."""
    router = parse_router(name)
    if router not in ORCHESTRATOR_ROUTERS:
        raise ValueError(ORCHESTRATOR_PREFIX_AWARE)
    return router


@dataclass(frozen=True, slots=True)
class TenantBudget:
    """A token bucket: ``rate`` tokens per second refill, at most ``burst`` tokens banked."""

    rate: float
    burst: float


@dataclass
class BaselineConfig:
    """How the baseline is stood up; defaults are the fair settings docs/design.md asks for."""

    engine: str = "sim"
    engine_options: dict[str, Any] = field(default_factory=dict)
    replicas: int = 2
    router: BaselineRouter = BaselineRouter.CONSISTENT_HASH
    virtual_nodes: int = 100
    fallback_replicas: int = 2
    health_check_period_s: float = 1.0
    health_check_timeout_s: float = 5.0
    graceful_shutdown_timeout_s: float = 5.0
    engine_max_ongoing_requests: int | None = None
    # How long an engine replica gathers its engine's chunks before streaming them to the
    # ingress as one item (Ray Serve LLM's Batcher; None: Ray Serve LLM's own default, 0: every
    # engine step as its own item). Fewer items through Ray's handles cost less CPU; the first
    # token waits for the first interval.
    stream_batching_interval_ms: float | None = None
    ingress_replicas: int = 1
    ingress_max_ongoing_requests: int = 4096
    max_inflight: int | None = None
    max_queue: int | None = None
    default_budget: TenantBudget = field(default_factory=lambda: TenantBudget(1e9, 1e9))
    tenant_budgets: dict[str, TenantBudget] = field(default_factory=dict)
    max_retries: int = 3
    retry_backoff_s: float = 0.05
    max_body_bytes: int = 8 * 1024 * 1024
    proxy_location: str = "HeadOnly"
    throughput_optimized: bool | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    stats_dir: str | None = None
    # A key file (serving.auth): the ingress then authenticates every /v1 request and
    # keys the tenant budgets by the authenticated tenant; None trusts zl-tenant as sent.
    api_keys: str | None = None
    # Ray resources each engine replica asks for beyond num_cpus=0: a custom resource naming
    # the nodes a placement file puts them on (empty: wherever Serve places them).
    engine_resources: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.router = orchestrator_router(self.router)
        batching = self.stream_batching_interval_ms
        if batching is not None and batching < 0:
            raise ValueError(f"the stream batching interval must be 0 ms or more, got {batching:g}")
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        # Checked here, before Ray starts, not inside a replica actor where it would surface
        # as a deployment that never becomes healthy.
        self.engine_options = validate_engine_options(self.engine, self.engine_options)
        self.key_grants()  # a bad key file fails here too, not in the ingress replica

    @property
    def engine_max_seqs(self) -> int:
        """The engine's own concurrency limit, which sizes ``max_ongoing_requests``: a modelled
        engine's ``max_num_seqs``, else 1024."""
        modelled = engine_kind(self.engine).modelled_engine
        return modelled(self.engine_options).max_num_seqs if modelled is not None else 1024

    @property
    def batching_ms(self) -> float:
        """The stream batching interval the engine replicas run with (the default resolved)."""
        if self.stream_batching_interval_ms is not None:
            return self.stream_batching_interval_ms
        return serve_llm_batching_ms()

    @property
    def engine_ongoing(self) -> int:
        """Serve's per-replica limit: the engine's ``max_num_seqs`` unless set explicitly."""
        return self.engine_max_ongoing_requests or self.engine_max_seqs

    @property
    def inflight_limit(self) -> int:
        """Requests the ingress lets through to the engines at once (the FIFO's exit)."""
        return self.max_inflight or self.replicas * self.engine_ongoing

    @property
    def queue_limit(self) -> int:
        """Requests the ingress holds in its FIFO before refusing with ``queue_full``."""
        return self.max_queue if self.max_queue is not None else 2 * self.inflight_limit

    def key_grants(self) -> dict[str, dict[str, Any]] | None:
        """The key file's grants as plain data (they cross to the ingress replica, which may run
        on another node than the file); None without one. ValueError if the file is bad."""
        if self.api_keys is None:
            return None
        return {digest: asdict(grant) for digest, grant in read_key_file(self.api_keys).items()}

    def router_class(self) -> str:
        return ORCHESTRATOR_ROUTERS[self.router]

    def router_kwargs(self) -> dict[str, Any]:
        """The installed ConsistentHashRouter names its kwargs ``num_virtual_nodes`` and
        ``num_fallback_replicas`` (docs/design.md calls them virtual_nodes, fallback_replicas)."""
        if self.router is BaselineRouter.CONSISTENT_HASH:
            return {
                "num_virtual_nodes": self.virtual_nodes,
                "num_fallback_replicas": self.fallback_replicas,
            }
        return {}

    def ingress_settings(self) -> dict[str, Any]:
        """What the ingress replica needs to do its job (plain data: it crosses to Ray)."""
        return {
            "inflight_limit": self.inflight_limit,
            "queue_limit": self.queue_limit,
            "default_budget": asdict(self.default_budget),
            "tenant_budgets": {k: asdict(v) for k, v in self.tenant_budgets.items()},
            "max_retries": self.max_retries,
            "retry_backoff_s": self.retry_backoff_s,
            "max_body_bytes": self.max_body_bytes,
            "model": f"zl-{self.engine}",
            "engine": self.engine,
            "router": self.router.value,
            "api_keys": self.key_grants(),
        }

    def metadata(self) -> dict[str, Any]:
        """Every Serve setting that affects latency, for the run's metadata."""
        import ray

        return {
            "stack": "rayserve",
            "ray_version": ray.__version__,
            "serve_version": ray.__version__,
            "engine": self.engine,
            "engine_options": dict(self.engine_options),
            "engine_replicas": self.replicas,
            "ingress_replicas": self.ingress_replicas,
            "proxy_location": self.proxy_location,
            "http_host": self.host,
            "http_port": self.port,
            "engine_max_ongoing_requests": self.engine_ongoing,
            "stream_batching_interval_ms": self.batching_ms,
            "stream_batching": "ray.llm Batcher, as Ray Serve LLM's LLMServer streams (0: off)",
            "ingress_max_ongoing_requests": self.ingress_max_ongoing_requests,
            "health_check_period_s": self.health_check_period_s,
            "health_check_timeout_s": self.health_check_timeout_s,
            "graceful_shutdown_timeout_s": self.graceful_shutdown_timeout_s,
            "engine_num_cpus": 0,
            "engine_resources": dict(self.engine_resources),
            "ingress_num_cpus": 0,
            "router": self.router.value,
            "router_class": self.router_class(),
            "router_kwargs": self.router_kwargs(),
            "router_implementation": (
                "serve.experimental ConsistentHashRouter (mmh3 ring)"
                if self.router is BaselineRouter.CONSISTENT_HASH
                else "serve default PowerOfTwoChoicesRequestRouter"
            ),
            "session_routing": "handle.options(session_id=zl-session)",
            "scaling": "Serve's external scaler API (ServeController.update_deployment_replicas, "
            "as Ray's dashboard scale endpoint calls it)",
            # the key file's digests stay out of the metadata: whether auth was on, and how many
            "ingress": {**self.ingress_settings(), "api_keys": len(self.key_grants() or {})},
            "auth": "api keys" if self.api_keys else "off",
            "throughput_optimized_requested": self.throughput_optimized,
            "serve_env": serve_env_flags(),
            "serve_constants": serve_constants(),
        }


SERVE_CONSTANTS: Final = (
    "RAY_SERVE_THROUGHPUT_OPTIMIZED",
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP",
    "RAY_SERVE_USE_GRPC_BY_DEFAULT",
    "RAY_SERVE_PROXY_USE_GRPC",
    "RAY_SERVE_ENABLE_DIRECT_INGRESS",
    "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE",
    "RAY_SERVE_LOG_TO_STDERR",
    "RAY_SERVE_FREEZE_GC_ON_STARTUP",
    "RAY_SERVE_HTTP_KEEP_ALIVE_TIMEOUT_S",
    "RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING",
    "RAY_SERVE_SESSION_ID_HEADER_KEY",
    "SERVE_SESSION_ID",
    "PROXY_READY_CHECK_TIMEOUT_S",
    "RAY_SERVE_MAX_QUEUE_LENGTH_RESPONSE_DEADLINE_S",
)
# A hang guard for a stand-up, which waits on events (Serve's proxy ready, the front door's
# /health answering): no start comes near it, and it turns a hang into an error. CI's loaded
# 2-core host took over 60 s to start Serve's proxy beside five other test processes.
STAND_UP_GUARD_S: Final = 600.0
# Serve's controller kills a proxy that is not ready within RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S
# (5 s by default) of its start, and ``serve.start`` then fails on that proxy's ActorDiedError
# ("killed by ray.kill"): on a loaded host a new worker process takes longer than that to import
# Serve's HTTP stack. A Ray started here gives the proxy the stand-up's hang guard (a proxy ready
# in time is not affected); the value a cluster's workers see is in the metadata's
# ``serve_constants``.
PROXY_READY_CHECK_S: Final = f"{STAND_UP_GUARD_S:.0f}"
# Serve's router routes only to a replica that answers its queue-length probe within 0.1 s, the
# deadline doubling on each miss up to RAY_SERVE_MAX_QUEUE_LENGTH_RESPONSE_DEADLINE_S (1 s by
# default): on a loaded host a replica's event loop answers later than that, and the router then
# routes nothing at all (CI saw ten requests not dispatched in 60 s). A Ray started here lets the
# probe's deadline grow to this; a probe answered within 0.1 s, as on a quiet host, is unaffected.
QUEUE_LENGTH_DEADLINE_S: Final = "10"


def serve_constants() -> dict[str, Any]:
    """The Serve flags in effect in this process (the ingress replica reports its own)."""
    from ray.serve._private import constants

    return {name: getattr(constants, name) for name in SERVE_CONSTANTS if hasattr(constants, name)}


def serve_env_flags() -> dict[str, str]:
    """The ``RAY_SERVE_*`` variables set in this environment (the throughput flags among them)."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("RAY_SERVE_")}
