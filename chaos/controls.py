"""Chaos Toolkit controls: background load and telemetry around every experiment.

Declared in an experiment as ``{"name": "load", "provider": {"type": "python",
"module": "chaos.controls"}}``. Before the experiment: the native loader starts profile D's load
(profile A's requests, open loop) against the target in a background thread, the telemetry
sampler starts, and both run for a warm-up so the first hypothesis has a full SLI window: at least
``warmup_s``, and on until the window holds an answer (a loaded host answers the first requests
later than a quiet one; ``WARMUP_LIMIT_S`` is the hang guard, and the hypothesis then fails). The
method and rollbacks are marked as phases (``fault``, ``recovery``) in ``phases.jsonl``. After
the experiment (rollbacks included): a tail of load, then the load stops and every request still
in flight ends as completed, error or lost, and telemetry stops. The host's CPU from the start of
the load to the fault (the steady state the fault met) goes into the journal as
``zl_host_steady`` (``cpu_pct``, ``busiest_cpu_pct``), for the trial's validity.

The load is bounded in time (``load_max_s``) and count (its schedule), and stops at the next
arrival once asked to. Everything is configured through Chaos Toolkit ``configuration`` keys
(set by ``chaos.runner``): ``target_file``, ``requests_path``, ``telemetry_path``,
``phases_path``, ``sdk_health_path``, ``scale``, ``seed``, ``load_rate``, ``load_deadline_ms``,
``load_max_s``, ``warmup_s``, ``tail_s``, ``health_interval_s``, ``health_timeout_s``; profile
G's runner (``chaos.elastic_runner``) adds ``profile`` (the load's profile, D's by default),
``discovery_file`` and ``discovery_interval_s`` (the zero-layer SDK then takes its replicas
from that file, and writes each change of them to ``sdk_changes_path``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Final, overload

import psutil

from chaos.actions import live_pids
from chaos.probes import follow_load, sli
from chaos.targets import Target, load_target
from harness.loaders.base import DEFAULT_GRACE_S, LoadResult
from harness.loaders.native import run_schedule
from harness.loaders.senders import client_sender
from harness.profile import Profile, load_profile
from harness.schema import JsonlWriter
from harness.stacks import Credentials, client_for
from harness.telemetry import (
    Component,
    EngineSource,
    EngineTarget,
    HostCpu,
    PhaseLog,
    ProcessSource,
    Sampler,
    Source,
    host_cpu_between,
)
from harness.telemetry.process import ROLES
from harness.workload import PlannedRequest, build_schedule
from zerolayer.client import Http1Client, ZeroLayerClient

PROFILE: Final = "d_fault"
HEALTH_WATCH_S: Final = 0.02


def psutil_cpu_times() -> list[Any]:
    return list(psutil.cpu_times(percpu=True))


TELEMETRY_INTERVAL_S: Final = 0.25
STOP_MARGIN_S: Final = 10.0
WARMUP_LIMIT_S: Final = 120.0
WARMUP_POLL_S: Final = 0.1


class StoppableSchedule(Sequence[PlannedRequest]):
    """A schedule whose iteration ends at the next arrival once :meth:`stop` is called.

    The loader iterates the schedule to dispatch it, so stopping here ends the dispatch without
    cancelling anything: requests already sent run to their end and get their record; requests
    never dispatched are not part of the run.
    """

    def __init__(self, inner: Sequence[PlannedRequest]) -> None:
        self.inner = inner
        self._stop = threading.Event()

    def stop(self) -> None:
        self._stop.set()

    def __len__(self) -> int:
        return len(self.inner)

    @overload
    def __getitem__(self, i: int) -> PlannedRequest: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[PlannedRequest]: ...

    def __getitem__(self, i: int | slice) -> PlannedRequest | Sequence[PlannedRequest]:
        return self.inner[i]

    def __iter__(self) -> Iterator[PlannedRequest]:
        for req in self.inner:
            if self._stop.is_set():
                return
            yield req


def chaos_profile(conf: dict[str, Any]) -> Profile:
    """Profile D (or ``conf["profile"]``) at the configured scale, with the chaos run's rate,
    deadline and time bound."""
    base = load_profile(conf.get("profile", PROFILE), conf.get("scale", "smoke"), conf.get("seed"))
    rate = float(conf.get("load_rate", base.rate))
    max_s = float(conf.get("load_max_s", 120.0))
    deadline = int(conf.get("load_deadline_ms", base.classes[0].deadline_ms))
    classes = tuple(dataclasses.replace(c, deadline_ms=deadline) for c in base.classes)
    return dataclasses.replace(
        base,
        rate=rate,
        duration_s=max_s,
        max_requests=int(rate * max_s) + 1,
        classes=classes,
        fault=None,
    )


async def watch_sdk_health(client: ZeroLayerClient, path: Path) -> None:
    """Write every change of the SDK's up/down verdict per replica URL to ``path``, until
    cancelled: each at the time the SDK made it (``ReplicaEndpoint.changed_ns``), looked for
    every ``HEALTH_WATCH_S``, so a request routed between a change and the look is judged
    against the change."""
    state = {url: client.is_up(url) for url in client.replicas}
    with JsonlWriter(path) as out:
        for url, up in state.items():
            out.write({"t_ns": time.time_ns(), "url": url, "up": up})
        while True:
            await asyncio.sleep(HEALTH_WATCH_S)
            for url, replica in list(client.replicas.items()):  # profile G: joins and leaves
                up = client.is_up(url)
                if up != state.get(url):
                    state[url] = up
                    out.write({"t_ns": replica.changed_ns or time.time_ns(), "url": url, "up": up})


class BackgroundLoad:
    """Profile D's open-loop load in its own thread and event loop, until :meth:`stop`.

    In-flight requests are not capped (no wrk2-style connection bound): requests stuck on a
    faulted replica must not hold back requests bound for healthy ones, or the loader's own
    queue would show up as the fault's blast radius.

    On the zero-layer stack it also records the SDK's view of each replica (up or down, with
    the time it changed) to ``sdk_health_path``: that is when the SDK routes around a fault.
    """

    def __init__(self, target: Target, conf: dict[str, Any], experiment: str) -> None:
        self.target = target
        self.conf = conf
        self.profile = chaos_profile(conf)
        self.schedule = StoppableSchedule(build_schedule(self.profile, run_tag=experiment))
        self.records_path = Path(conf["requests_path"])
        health = conf.get("sdk_health_path")
        self.health_path = Path(health) if health else None
        self.result: LoadResult | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="chaos-load", daemon=True)
        self._done = threading.Event()

    def start(self) -> None:
        self._thread.start()

    @property
    def running(self) -> bool:
        """Whether a request may still be sent or answered (its thread has not ended)."""
        return not self._done.is_set()

    def stop(self) -> LoadResult | None:
        """Stop dispatching and wait for every request in flight to end."""
        self.schedule.stop()
        deadline_s = self.profile.classes[0].deadline_ms / 1000 + DEFAULT_GRACE_S + STOP_MARGIN_S
        self._thread.join(deadline_s)
        if self._thread.is_alive():
            raise RuntimeError(f"background load did not stop within {deadline_s} s")
        if self.error is not None:
            raise self.error
        return self.result

    def _client(self) -> ZeroLayerClient | Http1Client:
        """The stack's client over the target's load URLs (the fault proxy among them); under
        ``--auth`` each request carries its tenant's key (see :func:`target_credentials`)."""
        options: dict[str, Any] = {
            "grace_ms": int(DEFAULT_GRACE_S * 1000),
            "api_key": self.target.default_api_key,
        }
        if self.target.protocol == "h2":
            options["health_interval_s"] = float(self.conf.get("health_interval_s", 1.0))
            options["health_timeout_s"] = float(self.conf.get("health_timeout_s", 0.5))
            if self.conf.get("discovery_file"):
                options["discovery"] = self.conf["discovery_file"]
                options["discovery_interval_s"] = float(self.conf["discovery_interval_s"])
        tls_ca = Path(self.target.tls_ca) if self.target.tls_ca else None
        return client_for(self.target.protocol, self.target.load_urls, tls_ca, **options)

    async def _run(self) -> None:
        async with self._client() as client:
            watcher = (
                asyncio.create_task(watch_sdk_health(client, self.health_path))
                if self.health_path is not None and isinstance(client, ZeroLayerClient)
                else None
            )
            try:
                self.result = await run_schedule(
                    self.schedule,
                    client_sender(client, target_credentials(self.target)),
                    stack=self.target.stack,
                    profile=self.profile.name,
                    records_path=self.records_path,
                    grace_s=DEFAULT_GRACE_S,
                    progress=None,
                )
            finally:
                if watcher is not None:
                    watcher.cancel()
                    await asyncio.gather(watcher, return_exceptions=True)
                self._write_changes(client)

    def _write_changes(self, client: ZeroLayerClient | Http1Client) -> None:
        """The SDK's replica-set changes (discovery), when asked for (``sdk_changes_path``)."""
        path = self.conf.get("sdk_changes_path")
        if path and isinstance(client, ZeroLayerClient):
            with JsonlWriter(Path(path)) as out:
                for change in client.changes:
                    out.write(change)

    def _main(self) -> None:
        try:
            asyncio.run(self._run())
        except BaseException as exc:  # reported by stop() in the experiment's thread
            self.error = exc
        finally:
            self._done.set()


def target_credentials(target: Target) -> Credentials | None:
    """The stack's credentials from the target file, for the loader's per-tenant keys."""
    if not target.api_keys:
        return None
    return Credentials(Path(target.api_key_file), target.api_keys)


def components(target: Target) -> list[Component]:
    """Every process of the stack by role, plus this process as the loader, for telemetry."""
    out = [Component("loader", os.getpid(), "loader")]
    for role, pids in live_pids(target).items():
        kind = role if role in ROLES else "other"
        out.extend(Component(f"{role}-{i}", pid, kind, target.stack) for i, pid in enumerate(pids))
    return out


def engine_source(target: Target) -> EngineSource:
    """The stack's engines for telemetry: zero-layer ``/metrics``, the baseline's stats files."""
    tls_ca = Path(target.tls_ca) if target.tls_ca else None
    targets = [
        EngineTarget.metrics(f"zl-{i}", target.stack, url, tls_ca=tls_ca)
        for i, url in enumerate(target.engine_metrics)
    ]
    targets += [
        EngineTarget.stats_file(f"serve-{i}", target.stack, path)
        for i, path in enumerate(target.engine_stats_files)
    ]
    return EngineSource(targets)


@dataclasses.dataclass
class _Running:
    load: BackgroundLoad
    sampler: Sampler | None
    phases: PhaseLog | None
    cpu_at_start: list[Any] = dataclasses.field(default_factory=psutil_cpu_times)
    host_steady: HostCpu | None = None


_running: _Running | None = None


def before_experiment_control(
    context: dict[str, Any], configuration: dict[str, Any] | None = None, **_: Any
) -> None:
    """Start telemetry and the background load, then let the SLI window fill."""
    global _running
    conf = dict(configuration or {})
    target = load_target(conf)
    phases = PhaseLog(conf["phases_path"]) if conf.get("phases_path") else None
    sampler = None
    if conf.get("telemetry_path"):
        sources: list[Source] = [ProcessSource(components(target)), engine_source(target)]
        sampler = Sampler(sources, conf["telemetry_path"], TELEMETRY_INTERVAL_S, phases)
        sampler.start()
    title = str(context.get("title", "experiment"))
    load = BackgroundLoad(target, conf, conf.get("experiment_tag", "x"))
    _running = _Running(load, sampler, phases)
    follow_load(lambda: load.running)  # a wait for the SLI ends with the load
    if phases is not None:
        phases.begin("warmup", experiment=title)
    load.start()
    time.sleep(float(conf.get("warmup_s", 2.0)))
    until_the_window_holds_an_answer(conf)
    if phases is not None:
        phases.begin("steady", experiment=title)


def until_the_window_holds_an_answer(
    conf: dict[str, Any], limit_s: float = WARMUP_LIMIT_S
) -> float:
    """Wait until the rolling SLI (``chaos.probes.sli``) has a request to judge, or ``limit_s``;
    the seconds waited. An empty window is no steady state to test, only a host still slow to
    answer the load's first requests."""
    start = time.monotonic()
    while sli(conf)["requests"] == 0 and time.monotonic() - start < limit_s:
        time.sleep(WARMUP_POLL_S)
    return time.monotonic() - start


def before_method_control(context: dict[str, Any], **_: Any) -> None:
    if _running is not None:
        _running.host_steady = host_cpu_between(_running.cpu_at_start, psutil_cpu_times())
    if _running is not None and _running.phases is not None:
        _running.phases.begin("fault")
        _running.phases.fault("method", "start")


def after_method_control(context: dict[str, Any], **_: Any) -> None:
    if _running is not None and _running.phases is not None:
        _running.phases.fault("method", "end")
        _running.phases.begin("recovery")


def after_experiment_control(
    context: dict[str, Any],
    state: dict[str, Any] | None = None,
    configuration: dict[str, Any] | None = None,
    **_: Any,
) -> None:
    """After rollbacks: a tail of load, then stop load and telemetry (in that order)."""
    global _running
    running, _running = _running, None
    follow_load(None)
    if running is None:
        return
    if running.phases is not None:
        running.phases.begin("tail")
    if state is not None:
        # No fault when the steady state did not hold: the host over the steady state it tried.
        host = running.host_steady or host_cpu_between(running.cpu_at_start, psutil_cpu_times())
        state["zl_host_steady"] = {"cpu_pct": round(host.cpu_pct, 1),
                                   "busiest_cpu_pct": round(host.busiest_cpu_pct, 1)}  # fmt: skip
    try:
        time.sleep(float((configuration or {}).get("tail_s", 1.0)))
        result = running.load.stop()
        if state is not None and result is not None:
            state["zl_load"] = {
                "requests": result.summary["num_requests"],
                "completed": result.summary["completed"],
                "errors": result.summary["errors"],
                "lost": result.summary["lost"],
                "errors_by_code": result.summary["errors_by_code"],
            }
    finally:
        if running.sampler is not None:
            running.sampler.stop()
        if running.phases is not None:
            running.phases.end()
            running.phases.close()


def cleanup_control() -> None:
    """Chaos Toolkit's last call: never leave a load thread or sampler running."""
    global _running
    running, _running = _running, None
    follow_load(None)
    if running is None:
        return
    try:
        running.load.stop()
    finally:
        if running.sampler is not None:
            running.sampler.stop()
        if running.phases is not None:
            running.phases.close()
