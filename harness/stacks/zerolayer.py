"""The zero-layer stack: one ``zl-replica`` process per engine replica, as deployed (the loader
and the servers compete for the cores as in production, and chaos can signal each one), the
SDK's ring over every replica picking where each request goes."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from harness.stacks.placed import node_addresses
from harness.stacks.processes import (
    START_GUARD_S,
    ReplicaProcess,
    spawn_replica,
    stop_pids,
)
from harness.stacks.spec import StackName, StackSpec, auth_label, cpu_label
from harness.stacks.stack import ALL_FAULTS, Restore, Scaling, Stack, StackKind
from harness.stacks.tls import serving_certificate
from harness.telemetry import EngineTarget
from harness.telemetry.engine import read_metrics_settings
from serving.engine.kvwatch import FILE_PREFIX as KV_WATCH_PREFIX
from serving.engine.settings import EngineSettings

if TYPE_CHECKING:
    from harness.stacks.stack import Replica


def engine_metrics(prefix: str, stack: Stack) -> list[EngineTarget]:
    """Each replica's own ``/metrics`` as an engine telemetry source named ``prefix-i``."""
    return [
        EngineTarget.metrics(f"{prefix}-{i}", stack.name, f"{url}/metrics", tls_ca=stack.tls_ca)
        for i, url in enumerate(stack.urls)
    ]


def metrics_settings(prefix: str, stack: Stack) -> dict[str, EngineSettings]:
    """The settings each replica's own ``/metrics`` publishes, by the replica's target name."""
    return {
        f"{prefix}-{i}": read_metrics_settings(f"{url}/metrics", tls_ca=stack.tls_ca)
        for i, url in enumerate(stack.urls)
    }


def kv_watch_path(workdir: Path, index: int) -> Path:
    """Where replica ``index`` stamps its engine's KV under pressure (``--kv-watch``)."""
    return workdir / f"{KV_WATCH_PREFIX}zl-{index}.jsonl"


class ZeroLayerKind(StackKind):
    """The system under test: killed replicas come back by their own command, on their port."""

    name = StackName.ZEROLAYER
    summary = "zl-replica processes, the zero-layer SDK routing over them"
    protocol = "h2"
    client_routes = True
    engine_role = "replica"
    faults = ALL_FAULTS
    restore = Restore.BY_COMMAND
    scaling = Scaling.BY_COMMAND

    def stand_up(self, spec: StackSpec, workdir: Path) -> Stack:
        tls = serving_certificate(workdir, node_addresses(spec)) if spec.tls else None
        started = self._start_replicas(spec, workdir, tls)
        metadata = {
            "impl": "zl-replica processes",
            "label": f"zero-layer: zl-replica x{spec.replicas}, {spec.engine} engine",
            "replicas": spec.replicas,
            "engine": spec.engine,
            "engine_options": dict(spec.engine_options),
            "tls": spec.tls,
            "auth": auth_label(spec),
            "cpu_layout": cpu_label(spec),
        }
        urls = [r.url for r in started]
        tls_ca = tls[0] if tls else None
        return Stack(
            spec,
            urls,
            kind=self,
            metadata=metadata,
            replicas=started,
            tls_ca=tls_ca,
            stats_dir=workdir,
        )

    @staticmethod
    def _start_replicas(
        spec: StackSpec, workdir: Path, tls: tuple[Path, Path] | None
    ) -> list[Replica]:
        """Every replica started at once, then each waited for; all stopped if one fails. On a
        Ray cluster (``ray_address``) each node's agent starts those placed on its node."""
        started: list[Replica] = []
        creds = spec.credentials
        auth_args = [] if creds is None else ["--api-keys", str(creds.key_file)]
        # Every start waits while its process runs (one that fails exits, and is caught at
        # once): a real vLLM engine takes ~30 s alone on 2 cores, a loaded host's sim minutes.
        if spec.ray_address:
            from harness.stacks.placed import start_replicas

            return list(start_replicas(spec, workdir, tls, START_GUARD_S))
        try:
            for i in range(spec.replicas):
                started.append(
                    ReplicaProcess(
                        spec.engine,
                        spec.engine_options,
                        name=f"zl-{i}",
                        extra_args=[*auth_args, "--kv-watch", str(kv_watch_path(workdir, i))],
                        tls=tls,
                        log_path=workdir / f"zl-replica-{i}.log",
                        ready_timeout_s=START_GUARD_S,
                        wait=False,
                        cpus=spec.cpu_layout,
                        replica=i,
                    )
                )
            for replica in started:
                replica.wait_ready()
        except BaseException:
            stop_pids([r.pid for r in started])
            raise
        return started

    def pids(self, stack: Stack) -> dict[str, list[int]]:
        """``replica``, and their children (vLLM's engine cores) as ``engine``."""
        live = [r for r in stack.replicas if r.alive()]
        engines = [pid for r in live for pid in r.children()]
        pids = [r.pid for r in live]
        return {"replica": pids, "engine": engines} if engines else {"replica": pids}

    def engine_targets(self, stack: Stack) -> list[EngineTarget]:
        """Each replica's ``/metrics``."""
        return engine_metrics("zl", stack)

    def engine_settings(self, stack: Stack) -> dict[str, EngineSettings]:
        """Each replica's engine settings, from the info gauge on its ``/metrics``."""
        return metrics_settings("zl", stack)

    def restart(self, command: Sequence[str], log_path: str | Path) -> int:
        return spawn_replica(command, log_path).pid
