"""A two-node Ray cluster on this machine, as the tests' stand-in for a GPU cluster.

Each node is a real ``ray start`` (``--block``, in a session of its own, with its own
``--temp-dir``, a custom resource naming it, a small CPU count and object store, no dashboard),
on a loopback address that is not 127.0.0.1 (Ray replaces that one by the host's own address).
The cluster has a token of its own (``RAY_AUTH_MODE=token``, ``RAY_AUTH_TOKEN_PATH``), so no
other Ray on the machine can join it or be reached by it. Stopping sends SIGTERM to each
``ray start`` (it stops the processes it started) and then kills whatever of its tree is left:
never ``ray stop``, which stops every Ray on the machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import psutil

from serving.ports import free_port

NODE_IP: Final = "127.0.0.2"  # loopback, and not one Ray swaps for the host's address
START_TIMEOUT_S: Final = 180.0
STARTED: Final = "Ray runtime started."
START_ATTEMPTS: Final = 3
"""How often the cluster is started before its failure is reported: each of a node's ports is
picked free and handed to Ray, and on a busy host another process may take one in between."""
OBJECT_STORE_BYTES: Final = 80 * 1024 * 1024


def _ray_binary() -> str:
    here = Path(sys.executable).parent / "ray"
    return str(here) if here.exists() else "ray"


@dataclass
class Node:
    """One ``ray start --block`` process: its name (the custom resource), temp dir and log."""

    name: str
    temp_dir: Path
    log: Path
    proc: subprocess.Popen[bytes]

    def tree(self) -> list[psutil.Process]:
        """The ``ray start`` process and every process it started (raylet, workers, ...)."""
        with contextlib.suppress(psutil.NoSuchProcess):
            top = psutil.Process(self.proc.pid)
            return [top, *top.children(recursive=True)]
        return []


@dataclass
class LocalCluster:
    """A running two-node cluster: its address, the environment a driver or child needs to
    reach it (the token), and its nodes by name (the first is the head)."""

    address: str
    env: dict[str, str]
    nodes: list[Node] = field(default_factory=list)
    root: Path = Path()

    @property
    def names(self) -> list[str]:
        return [n.name for n in self.nodes]

    def processes(self) -> list[psutil.Process]:
        """Every live process of the cluster: each node's tree, and any process whose command
        line names one of the cluster's temp dirs (a worker whose raylet is gone)."""
        found = {p.pid: p for node in self.nodes for p in node.tree()}
        roots = [str(n.temp_dir) for n in self.nodes]
        for proc in psutil.process_iter(["pid", "cmdline"]):
            cmd = " ".join(proc.info.get("cmdline") or [])
            if any(root in cmd for root in roots):
                found[proc.pid] = proc
        return [p for p in found.values() if _running(p)]

    def stop_node(self, node: Node, grace_s: float = 15.0) -> None:
        """SIGTERM to the node's ``ray start`` (it stops what it started), then SIGKILL to any
        of its tree left after ``grace_s``."""
        tree = node.tree()
        with contextlib.suppress(ProcessLookupError):
            node.proc.send_signal(signal.SIGTERM)
        _, alive = psutil.wait_procs(tree, timeout=grace_s)
        for proc in alive:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(alive, timeout=5.0)
        with contextlib.suppress(subprocess.TimeoutExpired):
            node.proc.wait(5.0)

    def stop(self) -> None:
        """Workers first, then the head; then whatever still names the cluster's temp dirs."""
        for node in reversed(self.nodes):
            self.stop_node(node)
        left = self.processes()
        for proc in left:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(left, timeout=5.0)


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _start_node(
    name: str, root: Path, env: dict[str, str], head: bool, port: int, num_cpus: int
) -> Node:
    """``ray start --block`` for one node (the head when ``head``; else joining ``port``)."""
    temp_dir = root / name
    temp_dir.mkdir(parents=True, exist_ok=True)
    log = root / f"{name}.log"
    args = [
        _ray_binary(), "start", "--block", f"--node-ip-address={NODE_IP}",
        f"--num-cpus={num_cpus}", f"--object-store-memory={OBJECT_STORE_BYTES}",
        "--min-worker-port=0", "--max-worker-port=0", "--disable-usage-stats",
        "--include-log-monitor=false", f"--temp-dir={temp_dir}",
        f"--resources={json.dumps({name: 1})}",
        f"--dashboard-agent-listen-port={free_port()}",
        f"--dashboard-agent-grpc-port={free_port()}",
        f"--runtime-env-agent-port={free_port()}", f"--metrics-export-port={free_port()}",
    ]  # fmt: skip
    if head:
        args += [
            "--head",
            f"--port={port}",
            "--include-dashboard=false",
            f"--dashboard-port={free_port()}",
            f"--ray-client-server-port={free_port()}",
        ]
    else:
        args += [f"--address={NODE_IP}:{port}"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            args, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    return Node(name, temp_dir, log, proc)


def _wait_started(node: Node, deadline: float) -> None:
    """Until ``ray start`` says its node runs (it has registered with the GCS, and blocks);
    RuntimeError with its log if it exits, TimeoutError past ``deadline``."""
    while time.monotonic() < deadline:
        text = node.log.read_text(errors="replace") if node.log.exists() else ""
        if STARTED in text:
            return
        if node.proc.poll() is not None:
            raise RuntimeError(
                f"ray start for {node.name} exited ({node.proc.returncode}): {text[-1500:]}"
            )
        time.sleep(0.5)
    raise TimeoutError(f"ray start for {node.name} did not start its node in time")


@contextlib.contextmanager
def local_cluster(
    names: Sequence[str] = ("zl-node-a", "zl-node-b"),
    num_cpus: int = 2,
    timeout_s: float = START_TIMEOUT_S,
) -> Iterator[LocalCluster]:
    """The cluster, up with every node alive, stopped (every process of it) however the block
    ends. A node whose ``ray start`` exits is started again on fresh ports, the whole cluster
    at most :data:`START_ATTEMPTS` times; then RuntimeError, or TimeoutError, with the node's
    log."""
    for attempt in range(1, START_ATTEMPTS + 1):
        cluster = _new_cluster()
        try:
            _start_nodes(cluster, names, num_cpus, timeout_s)
        except RuntimeError:
            _remove(cluster)
            if attempt == START_ATTEMPTS:
                raise
            continue
        except BaseException:
            _remove(cluster)
            raise
        try:
            yield cluster
        finally:
            _remove(cluster)
        return


def _new_cluster() -> LocalCluster:
    """A cluster with no node yet: its temp dir, token and head port."""
    root = Path(tempfile.mkdtemp(prefix="zlrc-", dir="/tmp"))  # short: Ray's socket paths
    token = root / "token"
    token.write_text(secrets.token_hex(32))
    env = {
        **os.environ,
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(token),
    }
    return LocalCluster(address=f"{NODE_IP}:{free_port()}", env=env, root=root)


def _start_nodes(
    cluster: LocalCluster, names: Sequence[str], num_cpus: int, timeout_s: float
) -> None:
    port = int(cluster.address.rsplit(":", 1)[1])
    for i, name in enumerate(names):
        cluster.nodes.append(_start_node(name, cluster.root, cluster.env, i == 0, port, num_cpus))
        _wait_started(cluster.nodes[-1], time.monotonic() + timeout_s)


def _remove(cluster: LocalCluster) -> None:
    cluster.stop()
    shutil.rmtree(cluster.root, ignore_errors=True)
