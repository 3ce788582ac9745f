"""The overhead benchmark's targets: one table row per built-in target (how it is stood up, its
role in the report, what it needs of the engine, whether it checks API keys), the plug-ins of
``--target NAME=module:function``, and the choice of which a run measures."""

from __future__ import annotations

import asyncio
import importlib
import os
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import psutil

from bench.overhead.model import TENANT, Role, Settings, SystemUnderTest, TargetFactory, Workload
from harness.errors import UsageError
from harness.loaders.senders import client_sender, engine_sender
from harness.stacks import Credentials, StackName, StackSpec, stand_up, stop_pids
from serving.auth import write_key_file
from serving.cpus import engine_cores, pin_threads
from serving.engine import make_engine
from zerolayer.client import ZeroLayerClient

AUTH_SUFFIX = "+auth"
ECHO_LISTENING: Final = re.compile(r"h2-echo listening on (http://\S+)")
ECHO_READY_S: Final = 30.0


async def inproc_target(name: str, workload: Workload, workdir: Path) -> SystemUnderTest:
    """The floor: the engine called in this process, no serving layer at all. Its server CPU is
    its child processes' (vLLM's engine core); the reference engine has none."""
    layout = workload.cpu_layout
    with engine_cores(layout):
        engine = make_engine(workload.engine, **workload.engine_options)
    if layout is not None:  # as a replica's front: this process's threads on the rest's cores
        pin_threads(os.getpid(), layout.rest)
    no_children = workload.kind.is_reference
    children = [] if no_children else [c.pid for c in psutil.Process().children()]
    return SystemUnderTest(name, engine_sender(engine), engine.close, children)


def overhead_credentials(folder: Path) -> Credentials:
    """A key file in ``folder`` with one fresh key, for the tenant every request names."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "api-keys.toml"
    return Credentials(path, write_key_file(path, {TENANT: "normal"}))


def stack_target(
    stack_name: StackName, auth: bool = False, protocol: str | None = None
) -> TargetFactory:
    """A stack over the workload's engine (one replica), stood up the one way; sent to through
    its client (``protocol``: another than the stack's own). ``auth``: started with a key file,
    every request sent with its key."""

    async def factory(name: str, workload: Workload, workdir: Path) -> SystemUnderTest:
        spec = StackSpec(
            stack_name,
            engine=workload.engine,
            engine_options=dict(workload.engine_options),
            replicas=1,
            credentials=overhead_credentials(workdir / name) if auth else None,
            cpu_layout=workload.cpu_layout,
        )
        stack = await asyncio.to_thread(stand_up, spec, workdir / name)
        try:
            client = stack.open_client(protocol)
            await client.__aenter__()
        except BaseException:
            await asyncio.to_thread(stack.close)
            raise

        async def close() -> None:
            try:
                await client.close()
            finally:
                await asyncio.to_thread(stack.close)

        pids = [pid for group in stack.pids().values() for pid in group]
        return SystemUnderTest(name, client_sender(client, stack.credentials), close, pids)

    return factory


async def echo_target(name: str, workload: Workload, workdir: Path) -> SystemUnderTest:
    """The bare h2 echo server (``bench.overhead.echo``) streaming as the workload's null engine
    does, sent to through the zero-layer SDK as the replica is."""
    options = workload.engine_options
    args = ["--per-token" if options.get("per_token", True) else "--no-per-token",
            "--itl-ms", str(options.get("itl_ms", 0.0))]  # fmt: skip
    workdir.mkdir(parents=True, exist_ok=True)
    proc, url = await asyncio.to_thread(start_echo, args, workdir / f"{name}.log")
    client = ZeroLayerClient([url], health_interval_s=0)
    await client.__aenter__()

    async def close() -> None:
        try:
            await client.close()
        finally:
            await asyncio.to_thread(stop_pids, [proc.pid])

    return SystemUnderTest(name, client_sender(client), close, [proc.pid])


def start_echo(args: Sequence[str], log_path: Path) -> tuple[subprocess.Popen[bytes], str]:
    """The echo server started with ``args``, and the URL it listens on (bounded wait)."""
    command = [sys.executable, "-m", "bench.overhead.echo", *args]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    deadline = time.monotonic() + ECHO_READY_S
    while time.monotonic() < deadline and proc.poll() is None:
        found = ECHO_LISTENING.search(log_path.read_text(errors="replace"))
        if found:
            return proc, found.group(1)
        time.sleep(0.05)
    stop_pids([proc.pid])
    raise RuntimeError(f"the h2 echo server did not listen: {log_path.read_text()[-2000:]}")


@dataclass(frozen=True, slots=True)
class TargetKind:
    """One target a run can measure: its name, how it is stood up, its role in the report;
    ``needs_vllm``: only a vLLM engine can serve it; ``needs_reference``: it stands in for the
    reference engine (no engine at all); ``with_auth``: how it is stood up checking API keys
    (None: it checks none); ``auth_over_vllm``: it still checks them over vLLM."""

    name: str
    factory: TargetFactory
    role: Role = Role.OTHER
    needs_vllm: bool = False
    with_auth: TargetFactory | None = None
    auth_over_vllm: bool = False
    needs_reference: bool = False

    def checks_keys(self, workload: Workload) -> bool:
        """Whether it checks API keys over ``workload``'s engine."""
        return self.with_auth is not None and (self.auth_over_vllm or not workload.kind.serves_vllm)

    def authenticated(self) -> TargetKind:
        """The same target run a second time with authentication on, as ``NAME+auth``."""
        assert self.with_auth is not None, f"{self.name} checks no API keys"
        return TargetKind(self.name + AUTH_SUFFIX, self.with_auth)


# Over vLLM the baseline is Ray Serve LLM, which checks no keys; ``rayserve`` names it too.
TARGET_KINDS: dict[str, TargetKind] = {
    kind.name: kind
    for kind in (
        TargetKind("inproc", inproc_target, Role.FLOOR),
        TargetKind(
            "zerolayer",
            stack_target(StackName.ZEROLAYER),
            Role.OURS,
            with_auth=stack_target(StackName.ZEROLAYER, auth=True),
            auth_over_vllm=True,
        ),
        *(
            TargetKind(
                name,
                stack_target(StackName.BASELINE),
                with_auth=stack_target(StackName.BASELINE, auth=True),
            )
            for name in ("baseline", "rayserve")
        ),
        TargetKind("zerolayer-h1", stack_target(StackName.ZEROLAYER, protocol="http1"), Role.HTTP1),
        TargetKind("h2-echo", echo_target, Role.ECHO, needs_reference=True),
        TargetKind("vllm-serve", stack_target(StackName.VLLM_SERVE), Role.PEER, needs_vllm=True),
    )
}


def plugin(spec: str) -> TargetKind:
    """A ``--target NAME=module:function`` plug-in: a factory, role OTHER."""
    name, _, ref = spec.partition("=")
    module, _, attr = ref.partition(":")
    if not (name and module and attr):
        raise UsageError(f"--target wants NAME=module:function, got {spec!r}")
    try:
        return TargetKind(name, getattr(importlib.import_module(module), attr))
    except (ImportError, AttributeError) as exc:
        raise UsageError(f"--target {spec!r}: {exc}") from exc


def _built_in(settings: Settings) -> list[TargetKind]:
    """The built-in targets ``settings`` names, each one an engine can serve."""
    names = [n for n in settings.targets.split(",") if n]
    unknown = [n for n in names if n not in TARGET_KINDS]
    if unknown:
        raise UsageError(f"unknown targets {unknown}; built in: {', '.join(TARGET_KINDS)}")
    chosen = [TARGET_KINDS[n] for n in names]
    engine = settings.workload.kind
    for kind in chosen:
        if kind.needs_vllm and not engine.serves_vllm:
            raise UsageError(f"target {kind.name} is vLLM's own server: it needs --engine vllm")
        if kind.needs_reference and not engine.is_reference:
            raise UsageError(
                f"target {kind.name} stands in for a replica of the null engine: it needs "
                f"--engine null, not {settings.workload.engine}"
            )
    return chosen


def _checks_keys(settings: Settings, chosen: Sequence[TargetKind]) -> set[str]:
    """The targets ``--auth`` runs again with authentication on (none without ``--auth``)."""
    if not settings.auth:
        return set()
    found = {kind.name for kind in chosen if kind.checks_keys(settings.workload)}
    if not found:
        raise UsageError("--auth needs a target that checks API keys: zerolayer (or baseline)")
    return found


def choose_targets(settings: Settings, plugins: Sequence[str] = ()) -> list[TargetKind]:
    """The built-in targets ``settings`` names (each that checks keys followed by its run with
    them, under ``--auth``) and the plug-ins of ``--target``."""
    built_in = _built_in(settings)
    checks_keys = _checks_keys(settings, built_in)
    chosen: list[TargetKind] = []
    for kind in built_in:
        chosen.append(kind)
        if kind.name in checks_keys:  # measured right after its run without authentication
            chosen.append(kind.authenticated())
    return chosen + [plugin(spec) for spec in plugins]
