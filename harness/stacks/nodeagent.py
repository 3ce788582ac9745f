"""The node agent: the one small Ray actor the suite places on each node it uses.

Ray places the agent (pinned to its node) and supervises it; the agent starts the stacks'
processes on its node as ordinary processes (``harness.stacks.processes``: a ``zl-replica`` or
vLLM's own server, in a session of its own, its log on that node), fate-shared with it (Ray's
own ``PR_SET_PDEATHSIG`` helper: if the agent's worker dies, because the run ended, the driver
died or the node's raylet went, they die with it). It stops, kills, pauses and resumes them
where they run (chaos acts through it), reports which of them live, samples the node's
telemetry (host CPU and memory, per-process CPU and RSS of what it is asked to watch, NVML), and
can take its own node down (the node-loss experiment). It is never in a request's path.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import psutil

from harness.stacks.processes import (
    START_GUARD_S,
    ReplicaProcess,
    VllmServer,
    descendants,
    kill_tree,
    spawn_replica,
    stop_pids,
)
from harness.telemetry import Component, NvmlSource, ProcessSource
from harness.telemetry.host import busy_pct

AGENT_PREFIX: Final = "zl-agent-"
# The node-loss helper: SIGKILL the node's raylet and every process under it, itself spared.
_LOSE_NODE: Final = (
    "import os, sys, time, psutil\n"
    "time.sleep(float(sys.argv[2]))\n"
    "top = psutil.Process(int(sys.argv[1]))\n"
    "for p in [top, *top.children(recursive=True)]:\n"
    "    if p.pid != os.getpid():\n"
    "        try:\n"
    "            p.kill()\n"
    "        except psutil.Error:\n"
    "            pass\n"
)


def fate_share() -> None:
    """``preexec`` for a process the agent starts: it dies when the agent's worker does (Ray's
    own fate-sharing, as it gives its own processes)."""
    from ray._private.utils import set_kill_on_parent_death_linux

    set_kill_on_parent_death_linux()


@dataclass(frozen=True, slots=True)
class NodeWhere:
    """Where an agent runs: its node's id and address, the host's name, its own pid."""

    node_id: str
    ip: str
    hostname: str
    pid: int


@dataclass(frozen=True, slots=True)
class Started:
    """A process an agent started: its pid, URL, port, the command that starts it again (on
    the same port) and its log on the node."""

    pid: int
    url: str
    port: int
    command: tuple[str, ...]
    log_path: str


def node_path(path: str) -> Path:
    """``path`` on this node, its folder made; where that cannot be (another host's results
    folder), the same name under this node's temporary folder."""
    wanted = Path(path)
    try:
        wanted.parent.mkdir(parents=True, exist_ok=True)
        return wanted
    except OSError:
        fallback = Path(tempfile.gettempdir()) / "zl-bench" / wanted.parent.name / wanted.name
        fallback.parent.mkdir(parents=True, exist_ok=True)
        return fallback


def _write_tls(tls: tuple[bytes, bytes] | None, folder: Path) -> tuple[Path, Path] | None:
    """The stack's certificate and key written on this node (the driver's files are not here)."""
    if tls is None:
        return None
    folder.mkdir(parents=True, exist_ok=True)
    cert, key = folder / "cert.pem", folder / "key.pem"
    cert.write_bytes(tls[0])
    key.write_bytes(tls[1])
    key.chmod(0o600)
    return cert, key


class NodeAgent:
    """One per node (see the module docstring). Made by ``ClusterSession.actor_on`` with
    ``num_cpus=0`` and a few threads (telemetry and chaos ask while a start waits)."""

    def __init__(self) -> None:
        self._replicas: dict[str, ReplicaProcess] = {}
        self._servers: dict[str, VllmServer] = {}
        self._restarted: dict[int, subprocess.Popen[bytes]] = {}
        self._procs = ProcessSource()
        self._nvml = NvmlSource()
        self._nvml_on = self._nvml.open().available
        self._cpu_last = psutil.cpu_times(percpu=True)

    def where(self) -> NodeWhere:
        import ray

        ip = ray.util.get_node_ip_address()
        node_id = ray.get_runtime_context().get_node_id()
        return NodeWhere(node_id, ip, socket.gethostname(), os.getpid())

    # -- starting and stopping --------------------------------------------------------------

    def start_replica(
        self,
        name: str,
        engine: str,
        options: Mapping[str, Any],
        *,
        host: str,
        log_path: str,
        extra_args: Sequence[str] = (),
        tls: tuple[bytes, bytes] | None = None,
        key_file: bytes | None = None,
        ready_timeout_s: float = START_GUARD_S,
    ) -> Started:
        """A ``zl-replica`` on this node listening on ``host``, waited for until it listens;
        ``key_file``: the run's API keys, written here for its ``--api-keys``."""
        log = node_path(log_path)
        if key_file is not None:
            keys = log.parent / f"api-keys-{name}.toml"
            keys.write_bytes(key_file)
            keys.chmod(0o600)
            extra_args = [*extra_args, "--api-keys", str(keys)]
        replica = ReplicaProcess(
            engine, options, name=name, extra_args=extra_args, log_path=log, host=host,
            tls=_write_tls(tls, log.parent / f"tls-{name}"), ready_timeout_s=ready_timeout_s,
            preexec=fate_share,
        )  # fmt: skip
        self._replicas[name] = replica
        return Started(replica.pid, replica.url, replica.port, tuple(replica.command), str(log))

    def start_server(
        self, name: str, options: Mapping[str, Any], *, host: str, log_path: str
    ) -> Started:
        """vLLM's own OpenAI server on this node, waited for until ``/health`` answers."""
        log = node_path(log_path)
        server = VllmServer(options, log, host=host, preexec=fate_share)
        self._servers[name] = server
        try:
            server.wait_ready()
        except BaseException:
            server.stop()
            raise
        return Started(server.pid, server.url, server.port, tuple(server.command), str(log))

    def stop(self, names: Sequence[str]) -> None:
        """Stop the named replicas and servers at once: SIGTERM (they drain), SIGKILL what
        hangs on, the processes they started included."""
        replicas = [self._replicas.pop(n) for n in names if n in self._replicas]
        stop_pids([r.pid for r in replicas])
        for replica in replicas:
            replica.stop()
        for name in names:
            if name in self._servers:
                self._servers.pop(name).stop()

    def restart(self, command: Sequence[str], log_path: str) -> int:
        """Start a killed replica again with its own command (same port); its new pid."""
        proc = spawn_replica(command, node_path(log_path), preexec=fate_share)
        self._restarted[proc.pid] = proc
        return proc.pid

    def adopt(self, name: str, pid: int) -> None:
        """The replica ``name`` is now served by ``pid`` (started again by :meth:`restart`)."""
        if name in self._replicas:
            self._replicas[name].adopt(pid)

    def shutdown(self) -> None:
        """Stop everything this agent started (the end of the run, or of a test)."""
        self.stop([*self._replicas, *self._servers])
        stop_pids(list(self._restarted))
        self._restarted.clear()

    # -- what lives, and faults where it runs ---------------------------------------------

    def alive(self, pids: Sequence[int]) -> list[int]:
        """Those of ``pids`` running (or stopped) here, not gone and not zombies."""
        live = []
        for pid in pids:
            with contextlib.suppress(psutil.Error):
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    live.append(pid)
        for pid, proc in list(self._restarted.items()):
            if proc.poll() is not None:  # reap what chaos killed, so it reads as gone
                self._restarted.pop(pid)
        return live

    def children(self, pids: Sequence[int]) -> list[int]:
        """The live descendants of ``pids`` (vLLM's engine cores)."""
        return [p.pid for pid in pids for p in descendants(pid)]

    def kill_tree(self, pid: int) -> list[int]:
        """SIGKILL ``pid`` and what it started (a crashed pod); the pids killed."""
        return kill_tree(pid)

    def send_signal(self, pid: int, signum: int) -> bool:
        """``signum`` to ``pid`` (SIGSTOP, SIGCONT); False when it is gone."""
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            return False
        return True

    def lose_node(self, delay_s: float = 0.5) -> dict[str, Any]:
        """Take this node out of the cluster as a lost machine goes: in ``delay_s`` a helper
        SIGKILLs the node's raylet and every process under it (this agent, the processes it
        started, Ray's workers and agents). Returns what it will kill."""
        raylet = psutil.Process(os.getppid())
        doomed = [raylet.pid, *(p.pid for p in raylet.children(recursive=True))]
        subprocess.Popen(
            [sys.executable, "-c", _LOSE_NODE, str(raylet.pid), str(delay_s)],
            start_new_session=True,
        )
        return {"raylet": raylet.pid, "raylet_name": raylet.name(), "pids": doomed}

    # -- telemetry --------------------------------------------------------------------------

    def watch(self, components: Sequence[Component]) -> None:
        """Sample these processes of this node from now on, and what each has started (a
        replica's vLLM engine core: role ``engine``)."""
        for component in components:
            self._procs.add(component)
            for k, child in enumerate(descendants(component.pid)):
                role = "engine" if component.role == "replica" else component.role
                self._procs.add(Component(f"{component.name}-child-{k}", child.pid, role,
                                          component.stack))  # fmt: skip

    def unwatch(self, names: Sequence[str]) -> None:
        for name in names:
            self._procs.remove(name)

    def sample(self) -> list[dict[str, Any]]:
        """One tick of this node's telemetry: a host row, a row per watched process, a row per
        GPU (NVML); each names its source (the sampler keeps it)."""
        now = psutil.cpu_times(percpu=True)
        per = [busy_pct(b, a) for b, a in zip(self._cpu_last, now, strict=True)]
        self._cpu_last = now
        memory = psutil.virtual_memory()
        rows: list[dict[str, Any]] = [
            {
                "source": "host",
                "name": "host",
                "cpus": len(per),
                "cpu_pct": sum(per) / len(per),
                "busiest_cpu_pct": max(per),
                "mem_used_bytes": memory.total - memory.available,
                "mem_total_bytes": memory.total,
                "load_1m": os.getloadavg()[0],
            }
        ]
        rows += [{**row, "source": "process"} for row in self._procs.read()]
        if self._nvml_on:
            rows += [{**row, "source": "nvml"} for row in self._nvml.read()]
        return rows

    def now_ns(self) -> int:
        """This node's wall clock, for the driver's offset measurement."""
        return time.time_ns()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self._nvml.close()
