"""The target file: how an experiment finds the stack it acts on.

Whoever stands a stack up writes a small JSON file (stack name, the URLs load goes to, process
ids by role, the zero-layer replicas' restart commands, the network proxy's control address);
experiments read its path from Chaos Toolkit ``configuration["target_file"]``, so the same
experiment JSON runs against either stack, started by our runner or by someone else. The file
names the stack as a string; :attr:`Target.kind` maps it to the stack's kind (the registry's
``stack_kind``) on load, and every provider asks that kind, never the name.
Roles: ``replica`` (zero-layer engine replica, one process each), ``engine`` (baseline engine
replica actor), ``orchestrator`` (baseline ingress), ``proxy`` (Serve's HTTP proxy),
``controller`` (Serve's controller).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import orjson

from harness.schema import from_data, to_data
from harness.stacks.registry import stack_kind
from harness.stacks.stack import StackKind

ENGINE_ROLES: Final = ("replica", "engine")
"""The roles that run an engine: ``replica`` on the zero-layer stack, ``engine`` on the baseline."""


@dataclass
class ReplicaSpec:
    """One zero-layer replica: where it listens, its process, and how to start it again."""

    url: str
    pid: int
    port: int
    command: list[str]
    log_path: str = ""
    node_id: str = ""  # the Ray node it runs on (a stack placed on a cluster)


@dataclass
class Target:
    """A stack under test, as the chaos providers see it.

    ``load_urls`` are what clients send to (zero-layer: every replica, one through the network
    proxy; baseline: the front door, possibly through the proxy). ``pids`` maps a role to its
    live processes at the time the file was written; ``replicas`` lets a killed zero-layer
    replica be restarted on its port. ``netproxy`` is the proxy's control address
    (``host:port``) and ``netproxy_front`` what it stands in front of. ``tls_ca`` is the
    certificate to trust on a TLS stack; ``engine_metrics`` (zero-layer ``/metrics`` URLs) and
    ``engine_stats_files`` (the baseline's published engine stats) feed engine telemetry;
    ``kv_watch_dir`` is where the stack's engine hosts stamp their KV under pressure
    (``serving.engine.kvwatch``; empty where they do not).
    ``baseline_app`` says whose Ray actors the baseline's pids are: ``orchestrator`` (ours) or
    ``llm`` (Ray Serve LLM); ``health_path`` what answers 200 on ``health_url`` once the stack
    serves (Ray Serve LLM's OpenAI app has no ``/health``: ``/v1/models``). ``api_keys`` (tenant
    -> API key, the first also the key of requests naming no tenant) and ``api_key_file`` (what
    the stack started with) are set when the stack authenticates tenants (``zl-bench run
    --auth``); the keys stay out of ``repr`` so that no log shows them, and the file this is
    written to is the owner's alone, like the key file. ``ray_address``: the stack is placed on
    that Ray cluster, and its processes are acted on where they run (``chaos.nodes``).
    """

    stack: str
    load_urls: list[str]
    protocol: str
    pids: dict[str, list[int]] = field(default_factory=dict)
    replicas: list[ReplicaSpec] = field(default_factory=list)
    netproxy: str = ""
    netproxy_front: str = ""
    netproxy_url: str = ""
    health_url: str = ""
    engine_replicas: int = 0
    tls_ca: str = ""
    engine_metrics: list[str] = field(default_factory=list)
    engine_stats_files: list[str] = field(default_factory=list)
    kv_watch_dir: str = ""
    baseline_app: str = ""
    health_path: str = "/health"
    api_keys: dict[str, str] = field(default_factory=dict, repr=False)
    api_key_file: str = ""
    ray_address: str = ""

    @property
    def default_api_key(self) -> str | None:
        """The key of a request that names no tenant (KV pressure, readiness on a ``/v1`` path);
        None when the stack checks no keys."""
        return next(iter(self.api_keys.values()), None)

    def __post_init__(self) -> None:
        """A file naming no known stack is refused as it is read (ValueError naming them)."""
        stack_kind(self.stack, self.baseline_app)

    @property
    def kind(self) -> StackKind:
        """The kind of the stack this file names (the baseline's by its ``baseline_app``)."""
        return stack_kind(self.stack, self.baseline_app)

    @property
    def engine_role(self) -> str:
        return self.kind.engine_role


def write_target(path: str | os.PathLike[str], target: Target) -> Path:
    """Write atomically (rename), so a provider reading concurrently never sees half a file;
    ``mkstemp`` makes the file readable by its owner only, as the API keys in it need."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".target-", suffix=".json")
    with os.fdopen(fd, "wb") as fh:
        fh.write(orjson.dumps(to_data(target), option=orjson.OPT_INDENT_2))
    os.replace(tmp, path)
    return path


def read_target(path: str | os.PathLike[str]) -> Target:
    return from_data(Target, orjson.loads(Path(path).read_bytes()))


def target_path(configuration: dict[str, Any] | None) -> Path:
    """The target file named in an experiment's configuration (or ``ZL_CHAOS_TARGET``)."""
    value = (configuration or {}).get("target_file") or os.environ.get("ZL_CHAOS_TARGET")
    if not value:
        raise ValueError("no target file: set configuration.target_file or ZL_CHAOS_TARGET")
    return Path(value)


def load_target(configuration: dict[str, Any] | None) -> Target:
    return read_target(target_path(configuration))
