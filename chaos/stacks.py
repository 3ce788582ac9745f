"""Standing the two stacks up for a chaos run, each with the network proxy in its path.

Zero-layer: N ``zl-replica`` processes on fixed free ports (so a killed one can come back on the
same URL), the proxy in front of replica 0; clients get ``[proxy, replica 1, ...]``.
Baseline: ``baselines.rayserve.start_baseline`` (or a handle the caller already has), the proxy
in front of Serve's HTTP front door; clients get ``[proxy]``. (The baseline's hop from the
orchestrator to an engine replica is Ray's own RPC, with no per-replica TCP endpoint to stand a
proxy in; the front door is the one network path a loopback proxy can sit in.)
Both write the target file experiments read, and stop everything they started.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import psutil

from chaos.actions import alive, spawn_replica
from chaos.netproxy import NetProxy
from chaos.targets import ReplicaSpec, Target, read_target, write_target
from harness.stacks import LISTENING, engine_args

START_TIMEOUT_S: Final = 30.0
STOP_TIMEOUT_S: Final = 10.0


def _free_port() -> int:
    from baselines.rayserve.standup import free_port

    return free_port()


def replica_command(port: int, name: str, engine: str, options: dict[str, Any]) -> list[str]:
    """``python -m zerolayer.server`` for one replica; engine options as ``--option K=V``."""
    return [sys.executable, "-m", "zerolayer.server", *engine_args(engine, options),
            "--host", "127.0.0.1", "--port", str(port), "--name", name,
            "--keepalive-s", "0"]  # fmt: skip


def _wait_listening(log_path: str, proc: Any, deadline: float) -> str:
    while time.monotonic() < deadline:
        text = Path(log_path).read_text(errors="replace") if Path(log_path).exists() else ""
        match = LISTENING.search(text)
        if match:
            return match.group(1)
        if proc.poll() is not None:
            raise RuntimeError(f"zl-replica exited at start: {text[-2000:]}")
        time.sleep(0.05)
    raise TimeoutError(f"zl-replica did not listen within {START_TIMEOUT_S} s")


def stop_pids(pids: list[int], timeout_s: float = STOP_TIMEOUT_S) -> None:
    """SIGCONT (a paused process cannot exit), SIGTERM, wait, then SIGKILL what hangs on."""
    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc = psutil.Process(pid)
            proc.send_signal(signal.SIGCONT)
            proc.terminate()
            procs.append(proc)
    _, left = psutil.wait_procs(procs, timeout=timeout_s)
    for proc in left:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(left, timeout=5.0)


@contextlib.contextmanager
def zerolayer_stack(
    run_dir: str | os.PathLike[str],
    replicas: int = 2,
    engine: str = "sim",
    engine_options: dict[str, Any] | None = None,
) -> Iterator[Path]:
    """Stand the zero-layer stack up; yields the target file path; stops it all on exit."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "target-zerolayer.json"
    specs: list[ReplicaSpec] = []
    proxy: NetProxy | None = None
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        for i in range(replicas):
            port = _free_port()
            cmd = replica_command(port, f"zl-replica-{i}", engine, dict(engine_options or {}))
            log = str(run_dir / f"zl-replica-{i}.log")
            Path(log).unlink(missing_ok=True)
            proc = spawn_replica(cmd, log)
            specs.append(ReplicaSpec(f"http://127.0.0.1:{port}", proc.pid, port, cmd, log))
            specs[-1].url = _wait_listening(log, proc, deadline)
        proxy = NetProxy(specs[0].url.removeprefix("http://")).start()
        target = Target(
            stack="zerolayer",
            load_urls=[proxy.url, *(s.url for s in specs[1:])],
            protocol="h2",
            pids={"replica": [s.pid for s in specs]},
            replicas=specs,
            netproxy=proxy.control,
            netproxy_front=specs[0].url,
            netproxy_url=proxy.url,
            health_url=specs[0].url,
            engine_replicas=replicas,
        )
        write_target(path, target)
        yield path
    finally:
        pids = [s.pid for s in specs]
        if path.exists():
            pids += [s.pid for s in read_target(path).replicas]
        stop_pids([p for p in dict.fromkeys(pids) if alive(p)])
        if proxy is not None:
            proxy.close()


@contextlib.contextmanager
def baseline_stack(
    run_dir: str | os.PathLike[str],
    handle: Any = None,
    replicas: int = 2,
    engine: str = "sim",
    engine_options: dict[str, Any] | None = None,
) -> Iterator[Path]:
    """Stand the Ray Serve baseline up (or use ``handle``); yields the target file path.

    A baseline started here is closed on exit; a handle passed in is left running.
    """
    from baselines.rayserve import start_baseline

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "target-baseline.json"
    owned = handle is None
    if owned:
        handle = start_baseline(
            engine=engine, replicas=replicas, engine_options=dict(engine_options or {})
        )
    proxy: NetProxy | None = None
    try:
        proxy = NetProxy(handle.url.removeprefix("http://")).start()
        pids = handle.pids()
        target = Target(
            stack="baseline",
            load_urls=[proxy.url],
            protocol="http1",
            pids={"orchestrator": pids.pop("ingress"), **pids},
            netproxy=proxy.control,
            netproxy_front=handle.url,
            netproxy_url=proxy.url,
            health_url=handle.url,
            engine_replicas=handle.config.replicas,
        )
        write_target(path, target)
        yield path
    finally:
        if proxy is not None:
            proxy.close()
        if owned:
            handle.close()
