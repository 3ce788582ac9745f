"""What a stack is asked to be: its name, its spec, the credentials it starts with, and the error
an external stack that does not answer raises. Plain data, so every other module of the package
(and the bench, chaos and the loaders) can name a stack without importing how one starts."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from baselines.rayserve.config import BaselineRouter
from serving.cpus import CpuLayout


class StackName(StrEnum):
    """The stacks a run can compare: the system under test, the baseline, and the peer
    ``vllm-serve`` (vLLM's own OpenAI server, real vLLM engine only)."""

    ZEROLAYER = "zerolayer"
    BASELINE = "baseline"
    VLLM_SERVE = "vllm-serve"


@dataclass(frozen=True)
class Credentials:
    """A key file the stacks start with (``--api-keys``, ``serving.auth``) and the key
    each tenant's requests carry (``keys``: tenant -> API key, the first one also the key of
    requests that name no tenant: warm-up, probes)."""

    key_file: Path
    keys: Mapping[str, str] = field(repr=False)  # secrets: never in a log line

    def __post_init__(self) -> None:
        if not self.keys:
            raise ValueError("credentials need at least one tenant's key")

    @property
    def default_key(self) -> str:
        return next(iter(self.keys.values()))

    def key_for(self, tenant: str) -> str:
        """The key of ``tenant``'s requests (the default key for a tenant with none)."""
        return self.keys.get(tenant) or self.default_key

    def headers(self) -> dict[str, str]:
        """tenant -> its ``authorization`` header value, for a loader in another process."""
        return {tenant: f"Bearer {key}" for tenant, key in self.keys.items()}


@dataclass(frozen=True)
class StackSpec:
    """What to stand up: which stack, over which engine, how many engine replicas.

    ``tls``: zero-layer replicas serve TLS with ALPN h2/http1.1 (k6 needs that for HTTP/2).
    ``urls`` non-empty: an external stack, checked for reachability but never started or stopped.
    ``baseline_router``: the baseline's request router (``baseline_router``; ``None``: that
    baseline's own default). ``credentials``: the zero-layer replicas and the baseline start
    with a key file (``--api-keys``) and every client of the stack sends its tenant's key; the
    stacks that check no keys (Ray Serve LLM, vllm-serve) ignore it and say so in their metadata.
    ``baseline_stream_batching_ms``: how long a baseline's engine replicas gather chunks before
    streaming them on (Ray Serve LLM's ``stream_batching_interval_ms``; None: its default).
    ``cpu_layout``: each vLLM engine replica's cores and the rest's (``serving.cpus``; None:
    processes run anywhere, as for the engines without compute threads).
    """

    name: StackName
    engine: str = "sim"
    engine_options: Mapping[str, Any] = field(default_factory=dict)
    replicas: int = 2
    tls: bool = False
    urls: tuple[str, ...] = ()
    ray_address: str | None = None
    baseline_router: BaselineRouter | None = None
    credentials: Credentials | None = None
    baseline_stream_batching_ms: float | None = None
    cpu_layout: CpuLayout | None = None


class StackUnreachable(Exception):
    """An external stack's URL does not answer; the message names the URL."""


def cpu_label(spec: StackSpec) -> dict[str, object] | None:
    """What a stack's metadata records of its CPU layout (None: none applied)."""
    return None if spec.cpu_layout is None else spec.cpu_layout.to_data()


def auth_label(spec: StackSpec, checks_keys: bool = True) -> str:
    """What a stack's metadata says of authentication: off, on (the key file's name), or asked
    for of a stack that checks no keys (Ray Serve LLM, vllm-serve), which runs without."""
    if spec.credentials is None:
        return "off"
    if not checks_keys:
        return "off (asked for; this stack checks no API keys)"
    return f"api keys ({spec.credentials.key_file.name})"
