"""The peer ``vllm-serve``: vLLM's own OpenAI server, one process group per replica, load spread
over them by the SDK's ring (an :class:`~harness.stacks.clients.Http1Router`). Real vLLM engine
only; no faults are defined for it."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

import orjson

from harness.stacks.clients import openai_server_body
from harness.stacks.processes import VllmServer
from harness.stacks.spec import StackName, StackSpec, auth_label, cpu_label
from harness.stacks.stack import Stack, StackKind
from harness.stacks.zerolayer import engine_metrics, metrics_settings
from harness.telemetry import EngineTarget
from harness.telemetry.engine import http_get
from serving.engine.kinds import engine_kind
from serving.engine.settings import EngineSettings

if TYPE_CHECKING:
    from harness.stacks.stack import Server


class VllmServeKind(StackKind):
    """vLLM's own server per replica; the client routes over them as the zero-layer SDK does."""

    name = StackName.VLLM_SERVE
    summary = "vLLM's own OpenAI server per replica (--engine vllm only)"
    client_routes = True

    def check(self, spec: StackSpec) -> None:
        if not spec.urls and not engine_kind(spec.engine).serves_vllm:
            raise ValueError(
                f"the vllm-serve stack is vLLM's own server: it needs --engine vllm, "
                f"not {spec.engine!r}"
            )

    def stand_up(self, spec: StackSpec, workdir: Path) -> Stack:
        started = self._start_servers(spec, workdir)
        metadata = {
            "impl": "vllm api_server processes",
            "label": f"vLLM's own server x{spec.replicas}",
            "replicas": spec.replicas,
            "engine": spec.engine,
            "engine_options": dict(spec.engine_options),
            "command": started[0].command[:-2],
            "auth": auth_label(spec, checks_keys=False),
            "cpu_layout": cpu_label(spec),
        }
        return Stack(
            spec,
            [s.url for s in started],
            kind=self,
            metadata=metadata,
            servers=started,
            model=str(spec.engine_options.get("model", "")),
            extra_body=openai_server_body(spec.engine_options),
        )

    @staticmethod
    def _start_servers(spec: StackSpec, workdir: Path) -> list[Server]:
        """Every server started at once, then each waited for; all stopped if one fails. On a
        Ray cluster (``ray_address``) each node's agent starts those placed on its node."""
        if spec.ray_address:
            from harness.stacks.placed import start_servers

            return list(start_servers(spec, workdir))
        started: list[Server] = []
        try:
            for i in range(spec.replicas):
                log_path = workdir / f"vllm-serve-{i}.log"
                started.append(
                    VllmServer(spec.engine_options, log_path, cpus=spec.cpu_layout, replica=i)
                )
            for server in started:
                server.wait_ready()
        except BaseException:
            for server in started:
                server.stop()
            raise
        return started

    def pids(self, stack: Stack) -> dict[str, list[int]]:
        """Each server as ``replica``, its children (vLLM's engine cores) as ``engine``."""
        return {
            "replica": [s.pid for s in stack.servers if s.alive()],
            "engine": [pid for s in stack.servers for pid in s.children()],
        }

    def engine_targets(self, stack: Stack) -> list[EngineTarget]:
        """Each vLLM server's own ``/metrics``."""
        return engine_metrics("vllm", stack)

    def engine_settings(self, stack: Stack) -> dict[str, EngineSettings]:
        """What vLLM's own server reports of its engine: its cache config on ``/metrics``
        (block size, KV blocks, prefix caching), ``max_model_len`` on ``/v1/models``, and the
        temperature every request body carries. vLLM's server publishes no scheduler or model
        dtype settings (outside its development mode), so those are not compared for it."""
        temperature = stack.extra_body.get("temperature")
        found = metrics_settings("vllm", stack)
        for (name, settings), url in zip(found.items(), stack.urls, strict=True):
            found[name] = dataclasses.replace(
                settings, max_model_len=_served_model_len(url), temperature=temperature
            )
        return found


def _served_model_len(url: str) -> int | None:
    """``max_model_len`` of the model vLLM's server lists on ``/v1/models`` (None: not listed)."""
    models = orjson.loads(http_get(f"{url}/v1/models", 5.0)).get("data") or [{}]
    value = models[0].get("max_model_len")
    return None if value is None else int(value)
