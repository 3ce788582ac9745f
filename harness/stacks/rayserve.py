"""The baselines, on Ray Serve: our orchestrator (``baselines.rayserve``: proxy -> ingress ->
engine replicas, which publish engine stats files), and Ray Serve LLM (``baselines.rayserve_llm``)
when the engine kind serves vLLM, as users deploy it for a real engine. Serve's controller
replaces a lost actor itself; chaos asks Ray's GCS for the new pids."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Final, cast

from baselines.rayserve.config import BaselineRouter, orchestrator_router, parse_router
from baselines.rayserve_llm.standup import READY_PATH as LLM_READY_PATH
from harness.stacks.clients import openai_server_body
from harness.stacks.placed import record_actors, serve_resources
from harness.stacks.spec import StackName, StackSpec, auth_label, cpu_label
from harness.stacks.stack import ALL_FAULTS, Restore, Scaling, Stack, StackKind
from harness.telemetry import EngineTarget
from harness.telemetry.engine import read_stats_file_settings
from serving.cpus import cores_text
from serving.engine.kinds import engine_kind
from serving.engine.settings import EngineSettings

if TYPE_CHECKING:
    from baselines.rayserve_llm.standup import LlmBaselineHandle

STATS_DIR: Final = "engine-stats"
STATS_WAIT_S: Final = 10.0
LLM_BASELINE_IMPL: Final = "ray serve llm"
# The baselines' process roles -> the telemetry roles (harness.telemetry.process.ROLES): the
# orchestrator's ingress, and Ray Serve LLM's ingress, router and vLLM engine-core children.
BASELINE_ROLES: Final = {
    "ingress": "orchestrator",
    "router": "orchestrator",
    "engine_core": "engine",
}


def merged_roles(found: Mapping[str, list[int]], *, engine_cores: bool) -> dict[str, list[int]]:
    """A baseline's own process roles as telemetry roles (several map to one), sorted; without
    ``engine_cores`` Ray Serve LLM's vLLM engine cores are left out: each is its replica actor's
    child, killed and replaced with it, so ``engine`` counts replicas on both baselines."""
    pids: dict[str, list[int]] = {}
    for role, some in found.items():
        if engine_cores or role != "engine_core":
            pids.setdefault(BASELINE_ROLES.get(role, role), []).extend(some)
    return {role: sorted(some) for role, some in pids.items()}


def _ray_attached() -> bool:
    """Whether this process is attached to a Ray cluster (Ray installed and initialized)."""
    with contextlib.suppress(ImportError):
        import ray

        return bool(ray.is_initialized())
    return False


class RayServeKind(StackKind):
    """The orchestrator baseline (ours): a consistent-hash router by default."""

    name = StackName.BASELINE
    summary = "our Ray Serve orchestrator over engine replica actors"
    faults = ALL_FAULTS
    restore = Restore.BY_CONTROLLER
    scaling = Scaling.BY_CONTROLLER
    app = "orchestrator"

    def router(self, spec: StackSpec) -> BaselineRouter:
        """The router asked for, else consistent-hash, as docs/design.md asks; ValueError (one line)
        for one the orchestrator cannot run."""
        return orchestrator_router(spec.baseline_router or BaselineRouter.CONSISTENT_HASH)

    def check(self, spec: StackSpec) -> None:
        """ValueError for a router this baseline cannot run, or one asked of a baseline already
        running (its router is its own)."""
        if not spec.urls:
            self.router(spec)
        elif spec.baseline_router is not None:
            raise ValueError(
                f"baseline router {spec.baseline_router}: a running baseline ({spec.urls[0]}) "
                "keeps the router it was started with"
            )

    def stand_up(self, spec: StackSpec, workdir: Path) -> Stack:
        from baselines.rayserve.standup import start_baseline

        stats_dir = workdir / STATS_DIR
        stats_dir.mkdir(parents=True, exist_ok=True)
        resources = serve_resources(spec)
        handle = start_baseline(
            engine=spec.engine,
            replicas=spec.replicas,
            engine_options=dict(spec.engine_options),
            router=self.router(spec),
            ray_address=spec.ray_address,
            stats_dir=str(stats_dir),
            api_keys=None if spec.credentials is None else str(spec.credentials.key_file),
            stream_batching_interval_ms=spec.baseline_stream_batching_ms,
            engine_resources=resources,
        )
        metadata = {
            "impl": "ray serve",
            "auth": auth_label(spec),
            "label": f"Ray Serve orchestrator (ours) x{spec.replicas}, {spec.engine} engine, "
            f"{handle.config.router} router",
            **handle.metadata,
        }
        stack = Stack(
            spec, [handle.url], kind=self, metadata=metadata, baseline=handle, stats_dir=stats_dir
        )
        record_actors(spec, self.pids(stack), self.engine_role, resources)
        return stack

    def pids(self, stack: Stack) -> dict[str, list[int]]:
        """``orchestrator``, ``proxy``, ``controller``, ``engine``, asked of Ray so that
        replaced actors count."""
        if stack.baseline is None:
            return {}
        return merged_roles(stack.baseline.pids(), engine_cores=True)

    def engine_targets(self, stack: Stack) -> list[EngineTarget]:
        """The stats files the engine replicas publish (waited for briefly)."""
        if stack.stats_dir is None:
            return []
        return [
            EngineTarget.stats_file(f"serve-{i}", stack.name, path)
            for i, path in enumerate(_stats_files(stack.stats_dir, stack.spec.replicas))
        ]

    def engine_settings(self, stack: Stack) -> dict[str, EngineSettings]:
        """The settings each engine replica published with its stats (none for a baseline
        running elsewhere: its stats files are not here)."""
        if stack.stats_dir is None:
            return {}
        return {
            f"serve-{i}": read_stats_file_settings(path)
            for i, path in enumerate(_stats_files(stack.stats_dir, stack.spec.replicas))
        }

    def cluster_pids(self) -> dict[str, list[int]] | None:
        if not _ray_attached():
            return None
        return merged_roles(self.actor_pids(), engine_cores=False)

    def actor_pids(self) -> dict[str, list[int]]:
        """Its actors' pids by the baseline's own roles, asked of Ray's GCS."""
        from baselines.rayserve.standup import serve_actor_pids

        return serve_actor_pids()

    def is_whole(self, pids: Mapping[str, Sequence[int]], engine_replicas: int) -> bool:
        return super().is_whole(pids, engine_replicas) and bool(pids.get("orchestrator"))

    def scale_engines(self, replicas: int) -> None:
        """Through Serve's external scaler API (``baselines.rayserve.scaling``)."""
        from baselines.rayserve.scaling import scale_engines

        scale_engines(replicas)

    def running_engines(self) -> list[int]:
        from baselines.rayserve.scaling import running_pids

        return running_pids()

    def replicas_changing(self) -> int:
        from baselines.rayserve.scaling import changing_count

        return changing_count()


class RayServeLlmKind(RayServeKind):
    """Ray Serve LLM over vLLM, Serve's default (pow2) router by default. Its engines publish no
    stats file, so it has no engine telemetry targets (vLLM's metrics go to Ray's)."""

    summary = "Ray Serve LLM (ray.serve.llm) over vLLM, as users deploy it"
    scaling = Scaling.NONE  # profile G does not scale its LLMServer deployment
    app = "llm"
    ready_path = LLM_READY_PATH

    def router(self, spec: StackSpec) -> BaselineRouter:
        return parse_router(spec.baseline_router or BaselineRouter.POW2)

    def stand_up(self, spec: StackSpec, workdir: Path) -> Stack:
        from baselines.rayserve_llm import start_llm_baseline

        options = dict(spec.engine_options)
        resources = serve_resources(spec)
        layout = spec.cpu_layout
        handle = start_llm_baseline(
            model=str(options.get("model", "")),
            replicas=spec.replicas,
            engine_options=options,
            router=self.router(spec),
            ray_address=spec.ray_address,
            stream_batching_interval_ms=spec.baseline_stream_batching_ms,
            engine_resources=resources,
            engine_cores=tuple(cores_text(c) for c in layout.engines) if layout else (),
            slots_dir=str(workdir / "engine-core-slots") if layout else "",
        )
        metadata = {
            "impl": LLM_BASELINE_IMPL,
            "label": f"Ray Serve LLM {handle.metadata['ray_version']} x{spec.replicas}, "
            f"{handle.config.router} router, vllm engine",
            "auth": auth_label(spec, checks_keys=False),
            "cpu_layout": cpu_label(spec),
            **handle.metadata,
        }
        stack = Stack(
            spec,
            [handle.url],
            kind=self,
            metadata=metadata,
            baseline=handle,
            model=handle.config.model_id,
            extra_body=openai_server_body(options),
        )
        record_actors(spec, self.pids(stack), self.engine_role, resources)
        return stack

    def engine_settings(self, stack: Stack) -> dict[str, EngineSettings]:
        """Ray Serve LLM's applied engine arguments, as its LLMServer holds them (one LLMConfig
        builds every replica), with the temperature every request body carries; a setting the
        arguments leave to vLLM's defaults is not known."""
        from serving.engine.vllm_engine import engine_args_settings

        if stack.baseline is None:
            return {}
        handle = cast("LlmBaselineHandle", stack.baseline)
        kwargs = handle.applied_engine_kwargs()
        return {"llm-server": engine_args_settings(kwargs, stack.extra_body.get("temperature"))}

    def actor_pids(self) -> dict[str, list[int]]:
        from baselines.rayserve_llm.standup import llm_actor_pids

        return llm_actor_pids()


ORCHESTRATOR: Final = RayServeKind()
RAY_SERVE_LLM: Final = RayServeLlmKind()


def baseline_kind(engine: str) -> RayServeKind:
    """The baseline over ``engine``: Ray Serve LLM when the engine kind serves vLLM, else ours."""
    return RAY_SERVE_LLM if engine_kind(engine).serves_vllm else ORCHESTRATOR


def baseline_router(spec: StackSpec) -> BaselineRouter:
    """The router the baseline of ``spec`` runs: the one asked for, else that baseline's own
    default (the orchestrator: consistent-hash; Ray Serve LLM: pow2, Serve's default).
    ValueError (one line) for one that baseline cannot run."""
    return baseline_kind(spec.engine).router(spec)


def _stats_files(stats_dir: Path, replicas: int) -> list[Path]:
    deadline = time.monotonic() + STATS_WAIT_S
    files = sorted(stats_dir.glob("engine-stats-*.jsonl"))
    while len(files) < replicas and time.monotonic() < deadline:
        time.sleep(0.2)
        files = sorted(stats_dir.glob("engine-stats-*.jsonl"))
    return files
