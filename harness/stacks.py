"""Stand the two stacks up and down, the same way for the bench, the chaos runner and tests.

A zero-layer replica is its own ``zl-replica`` process (as deployed: the loader and the servers
compete for the cores as they would in production, and chaos can signal it); the baseline is the
Ray Serve deployment from ``baselines.rayserve``. Either stack can also be a target that is
already running elsewhere (URLs given), in which case nothing is started or stopped here.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import orjson

LISTENING: Final = re.compile(r"zl-replica listening on (https?://\S+)")
STACKS: Final = ("zerolayer", "baseline")
READY_TIMEOUT_S: Final = 60.0


def engine_args(engine: str, options: Mapping[str, Any]) -> list[str]:
    """``zl-replica`` arguments for an engine and its options (each as ``--option k=json``)."""
    args = ["--engine", engine]
    for key, value in options.items():
        args += ["--option", f"{key}={orjson.dumps(value).decode()}"]
    return args


class ReplicaProcess:
    """One ``zl-replica`` process; restartable on the same port (chaos rollbacks need that)."""

    def __init__(
        self,
        engine: str = "null",
        options: Mapping[str, Any] | None = None,
        *,
        port: int = 0,
        name: str | None = None,
        extra_args: Sequence[str] = (),
        tls: tuple[str | os.PathLike[str], str | os.PathLike[str]] | None = None,
        ready_timeout_s: float = READY_TIMEOUT_S,
    ) -> None:
        self.engine = engine
        self.options = dict(options or {})
        self.name = name
        self.extra_args = list(extra_args)
        if tls is not None:
            self.extra_args += ["--tls-cert", str(tls[0]), "--tls-key", str(tls[1])]
        self.ready_timeout_s = ready_timeout_s
        self.url = ""
        self.output: list[str] = []
        self.proc: subprocess.Popen[str] | None = None
        self._start(port)

    def _start(self, port: int) -> None:
        cmd = [
            sys.executable,
            "-m",
            "zerolayer.server",
            *engine_args(self.engine, self.options),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *self.extra_args,
        ]
        if self.name:
            cmd += ["--name", self.name]
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        found = threading.Event()
        proc, output = self.proc, self.output

        def read() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                output.append(line)
                del output[:-200]
                match = LISTENING.search(line)
                if match and not found.is_set():
                    self.url = match.group(1)
                    found.set()
            found.set()

        threading.Thread(target=read, daemon=True, name=f"replica-{proc.pid}-out").start()
        if not found.wait(self.ready_timeout_s) or proc.poll() is not None:
            self.kill()
            raise RuntimeError(f"zl-replica did not start: {''.join(self.output)[-2000:]}")

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.pid, sig)

    def pause(self) -> None:
        """SIGSTOP: the process holds its sockets but answers nothing (a hung pod)."""
        self.signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.signal(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL, like a crashed pod."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait(10)

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGCONT (in case it was paused), SIGTERM (it drains), then SIGKILL if it lingers."""
        if not self.alive():
            return
        assert self.proc is not None
        self.signal(signal.SIGCONT)
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def restart(self) -> None:
        """Start again on the same port, as a restarted pod keeps its address."""
        port = self.port
        self.stop()
        self._start(port)

    def __enter__(self) -> ReplicaProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class StackHandle:
    """A running stack as the bench sees it: where to send, which processes to watch."""

    name: str
    urls: list[str]
    protocol: str
    metadata: dict[str, Any] = field(default_factory=dict)
    replicas: list[ReplicaProcess] = field(default_factory=list)
    baseline: Any = None

    def pids(self) -> dict[str, list[int]]:
        """Process ids by role, for telemetry and for chaos."""
        if self.baseline is not None:
            return dict(self.baseline.pids())
        return {"replica": [r.pid for r in self.replicas if r.alive()]}

    def close(self) -> None:
        for replica in self.replicas:
            replica.stop()
        if self.baseline is not None:
            self.baseline.close()

    def __enter__(self) -> StackHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_zerolayer(
    replicas: int = 2, engine: str = "sim", engine_options: Mapping[str, Any] | None = None
) -> StackHandle:
    """Start ``replicas`` zl-replica processes; a failure stops the ones already started."""
    started: list[ReplicaProcess] = []
    try:
        for i in range(replicas):
            started.append(ReplicaProcess(engine, engine_options, name=f"zl-{i}"))
    except BaseException:
        for replica in started:
            replica.kill()
        raise
    return StackHandle(
        name="zerolayer",
        urls=[r.url for r in started],
        protocol="h2",
        metadata={
            "impl": "zl-replica processes",
            "replicas": replicas,
            "engine": engine,
            "engine_options": dict(engine_options or {}),
        },
        replicas=started,
    )


def start_baseline_stack(
    replicas: int = 2,
    engine: str = "sim",
    engine_options: Mapping[str, Any] | None = None,
    ray_address: str | None = None,
    stats_dir: str | os.PathLike[str] | None = None,
) -> StackHandle:
    """Deploy the Ray Serve baseline (or attach to a cluster) over the same engine config.

    With ``stats_dir`` each engine replica publishes its stats there (one JSONL per replica).
    """
    from baselines.rayserve.standup import start_baseline

    if stats_dir is not None:
        Path(stats_dir).mkdir(parents=True, exist_ok=True)
    handle = start_baseline(
        engine=engine,
        replicas=replicas,
        engine_options=dict(engine_options or {}),
        ray_address=ray_address,
        stats_dir=None if stats_dir is None else str(stats_dir),
    )
    return StackHandle(
        name="baseline",
        urls=[handle.url],
        protocol="http1",
        metadata={"impl": "ray serve", **handle.metadata},
        baseline=handle,
    )


def external(name: str, urls: Sequence[str]) -> StackHandle:
    """A stack someone else runs: the bench only sends to it."""
    if name not in STACKS:
        raise ValueError(f"stack must be one of {STACKS}, got {name!r}")
    return StackHandle(
        name=name,
        urls=list(urls),
        protocol="h2" if name == "zerolayer" else "http1",
        metadata={"impl": "external", "urls": list(urls)},
    )
