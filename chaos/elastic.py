"""Chaos Toolkit actions of profile G: one engine replica joins the stack, then one leaves.

How a stack scales is its kind's (``StackKind.scaling``):

- by command (the zero-layer stack): :func:`add_replica` starts a ``zl-replica`` with the
  command of the first one (a free port, its own name, an accounting file that records every
  request it receives), waits until its ``/health`` answers 200 (polled every 10 ms: its ready
  time), then publishes it in the SDK's discovery file (``zerolayer.client.discovery``), as a
  deployment tells its clients of a new endpoint. :func:`remove_replica` withdraws the newest
  replica from the file, waits ``leave_grace_s`` (clients stop sending to it), then stops it
  (SIGTERM: it drains what it still serves);
- by controller (the orchestrator baseline): the engine deployment's replica count is asked of
  Serve (``StackKind.scale_engines``: Serve's external scaler API); the new replica is the pid
  Serve reports running that was not there before, and its ready time is the moment its engine
  was loaded, from its own request log (``engine-requests-<pid>.jsonl``). On a scale-down Serve
  chooses which replica stops (the newest); the action waits until it is gone.

Either way :func:`add_replica` returns once the new replica's own log shows its first request
(or after its timeout), so that the experiment's hold counts from there.
:func:`restore_replicas` (the rollback, run always) brings the stack back to the replica count
it was stood up with. Each action returns a dict for the journal, with ``change`` (``join`` or
``leave``), the replica it concerned (``replica``: a URL, or ``pid<N>`` behind a front door),
the request log in which that replica's requests can be found (``request_log``) and its times
(wall-clock ns): ``t_ns`` when the action began, ``ready_ns`` when the joining replica could
serve, ``announced_ns`` when the stack's router was told (published to the discovery file; Serve
reporting it running), ``end_ns`` when the action ended (for a leave: the replica gone).

Configuration keys (set by ``chaos.elastic_runner``): ``target_file``, ``discovery_file``
(zero-layer), ``elastic_dir`` (the joining replica's log and accounting file), ``engine_log_dir``
(the baseline's engine request logs).
"""

from __future__ import annotations

import time
from enum import StrEnum
from pathlib import Path
from typing import Any, Final

import orjson

from baselines.rayserve.config import REQUESTS_PREFIX
from chaos.actions import _wait_listening, alive, start_given_up
from chaos.targets import ReplicaSpec, Target, load_target, target_path, write_target
from harness.stacks import Scaling
from harness.stacks.processes import START_GUARD_S, spawn_replica, stop_pids, wait_listening
from zerolayer.client.discovery import write_replicas

READY_POLL_S: Final = 0.01
SERVE_POLL_S: Final = 0.05  # a call to the controller: often enough, not a busy loop
DEFAULT_TIMEOUT_S: Final = 60.0
ACCOUNTING_FLUSH_S: Final = 0.1
READY_AFTER_LISTENING_S: Final = 60.0  # a listening replica answers /health at once: a hang guard


class Change(StrEnum):
    """What an action of profile G did to the stack."""

    JOIN = "join"
    LEAVE = "leave"
    NONE = "none"


def _conf(configuration: dict[str, Any] | None, key: str) -> str:
    value = (configuration or {}).get(key)
    if not value:
        raise ValueError(f"profile G needs configuration.{key}")
    return str(value)


def _unscalable(target: Target, change: Change) -> dict[str, Any]:
    return {
        "change": Change.NONE,
        "asked": change,
        "note": f"the {target.stack} stack is not scaled by profile G: nothing done",
        "t_ns": time.time_ns(),
    }


def _joining_command(command: list[str], name: str, accounting: Path) -> list[str]:
    """The first replica's command for a new one: any free port, its own name, and an
    accounting file flushed often (its requests, as the replica received them)."""
    out = list(command)
    for flag, value in (("--port", "0"), ("--name", name)):
        if flag in out:
            out[out.index(flag) + 1] = value
        else:
            out += [flag, value]
    return [*out, "--accounting", str(accounting), "--accounting-flush-s", str(ACCOUNTING_FLUSH_S)]


def _published(target: Target) -> list[str]:
    return [spec.url for spec in target.replicas]


def request_times(path: str | Path) -> list[tuple[int, str]]:
    """(time received, session) of every request in a replica's own log: a zero-layer
    accounting file (``start_ns``) or a baseline engine replica's request log (``request``
    events)."""
    path = Path(path)
    if not path.exists():
        return []
    out = []
    for line in path.read_bytes().splitlines():
        row = orjson.loads(line)
        if "start_ns" in row:
            out.append((int(row["start_ns"]), str(row.get("session") or "")))
        elif row.get("event") == "request":
            out.append((int(row["t_ns"]), str(row.get("session") or "")))
    return sorted(out)


def _wait_first_request(request_log: str, timeout_s: float) -> None:
    """Until the joined replica's own log shows a request (or ``timeout_s``): the hold before
    the leave counts from there, so that a host too busy to route to it within the hold (CI saw
    none in the 5 s of smoke's) still measures a join. A replica that takes none is the row's
    note (``chaos.elasticity``), not an error here."""
    deadline = time.monotonic() + timeout_s
    while not request_times(request_log) and time.monotonic() < deadline:
        time.sleep(SERVE_POLL_S)


def _start_replica(target: Target, conf: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """By command: start, wait until ready, publish (see the module docstring). Past
    ``timeout_s`` only while the replica's process runs, up to ``START_GUARD_S``, as a scale by
    Serve is waited for while Serve starts one (:func:`_wait_running`)."""
    folder = Path(_conf(conf, "elastic_dir"))
    folder.mkdir(parents=True, exist_ok=True)
    discovery = _conf(conf, "discovery_file")
    name = f"zl-{len(target.replicas)}"
    log_path, accounting = folder / f"{name}.log", folder / f"accounting-{name}.jsonl"
    log_path.unlink(missing_ok=True)
    accounting.unlink(missing_ok=True)
    command = _joining_command(target.replicas[0].command, name, accounting)
    deadline = time.monotonic() + timeout_s
    proc = spawn_replica(command, log_path)
    url = wait_listening(log_path, proc, deadline + START_GUARD_S)  # fails at once on an exit
    if not _wait_listening(url, max(deadline, time.monotonic() + READY_AFTER_LISTENING_S),
                           target.tls_ca, poll_s=READY_POLL_S):  # fmt: skip
        stop_pids([proc.pid])
        raise RuntimeError(f"the joining replica {url} was not healthy within {timeout_s} s")
    ready_ns = time.time_ns()
    port = int(url.rsplit(":", 1)[1])
    command[command.index("--port") + 1] = str(port)
    target.replicas.append(ReplicaSpec(url, proc.pid, port, command, str(log_path)))
    target.pids.setdefault(target.engine_role, []).append(proc.pid)
    write_target(target_path(conf), target)
    write_replicas(discovery, _published(target))
    return {"replica": url, "pid": proc.pid, "ready_ns": ready_ns, "announced_ns": time.time_ns(),
            "request_log": str(accounting)}  # fmt: skip


def engine_log(conf: dict[str, Any], pid: int) -> Path:
    """A baseline engine replica's request log."""
    return Path(_conf(conf, "engine_log_dir")) / f"{REQUESTS_PREFIX}{pid}.jsonl"


def engine_ready_ns(path: Path) -> int | None:
    """When the engine replica's engine was loaded, from its own request log."""
    if not path.exists():
        return None
    for line in path.read_bytes().splitlines():
        event = orjson.loads(line)
        if event.get("event") == "ready":
            return int(event["t_ns"])
    return None


def _wait_running(target: Target, want: int, timeout_s: float) -> list[int]:
    """Poll the controller until it reports ``want`` engine replicas running. Past ``timeout_s``
    (the profile's allowance) only while it reports a replica starting or stopping, a scale
    still under way (a loaded host took Serve longer than smoke's 60 s to start one), up to the
    start's hang guard (``START_GUARD_S``); at once when nothing is under way."""
    allowance = time.monotonic() + timeout_s
    guard = allowance + START_GUARD_S
    while True:
        running = target.kind.running_engines()
        if len(running) == want:
            return running
        if start_given_up(target, allowance, guard):
            raise RuntimeError(f"{len(running)} engine replicas running, not {want}, after "
                               f"{timeout_s} s")  # fmt: skip
        time.sleep(SERVE_POLL_S)


def _scale_up(target: Target, conf: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """By controller: one more replica asked of Serve; the new pid once Serve runs it."""
    before = target.kind.running_engines()
    target.kind.scale_engines(len(before) + 1)
    running = _wait_running(target, len(before) + 1, timeout_s)
    announced_ns = time.time_ns()
    pid = next(p for p in running if p not in before)
    path = engine_log(conf, pid)
    return {"replica": f"pid{pid}", "pid": pid, "ready_ns": engine_ready_ns(path),
            "announced_ns": announced_ns, "request_log": str(path)}  # fmt: skip


def add_replica(
    timeout_s: float = DEFAULT_TIMEOUT_S, configuration: dict[str, Any] | None = None
) -> dict[str, Any]:
    """One engine replica joins the stack (see the module docstring)."""
    conf = configuration or {}
    target = load_target(conf)
    t_ns = time.time_ns()
    if target.kind.scaling is Scaling.BY_COMMAND:
        out = _start_replica(target, conf, timeout_s)
    elif target.kind.scaling is Scaling.BY_CONTROLLER:
        out = _scale_up(target, conf, timeout_s)
    else:
        return _unscalable(target, Change.JOIN)
    _wait_first_request(out["request_log"], timeout_s)
    return {"change": Change.JOIN, "t_ns": t_ns, **out, "end_ns": time.time_ns()}


def _stop_newest(target: Target, conf: dict[str, Any], grace_s: float) -> dict[str, Any]:
    """By command: withdraw the newest replica from discovery, let clients move, stop it."""
    spec = target.replicas[-1]
    write_replicas(_conf(conf, "discovery_file"), _published(target)[:-1])
    announced_ns = time.time_ns()
    time.sleep(grace_s)
    stop_pids([spec.pid])
    target.replicas.pop()
    target.pids[target.engine_role] = [p for p in target.pids.get(target.engine_role, [])
                                       if p != spec.pid]  # fmt: skip
    write_target(target_path(conf), target)
    return {"replica": spec.url, "pid": spec.pid, "announced_ns": announced_ns}


def _scale_down(target: Target, conf: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """By controller: one replica fewer asked of Serve; the pid Serve stopped once gone."""
    before = target.kind.running_engines()
    target.kind.scale_engines(len(before) - 1)
    announced_ns = time.time_ns()
    after = _wait_running(target, len(before) - 1, timeout_s)
    deadline = time.monotonic() + timeout_s
    pid = next(p for p in before if p not in after)
    while alive(pid) and time.monotonic() < deadline:  # Serve drains it, then it exits
        time.sleep(SERVE_POLL_S)
    return {"replica": f"pid{pid}", "pid": pid, "announced_ns": announced_ns,
            "request_log": str(engine_log(conf, pid))}  # fmt: skip


def remove_replica(
    timeout_s: float = DEFAULT_TIMEOUT_S,
    grace_s: float = 1.0,
    configuration: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One engine replica leaves the stack: the newest (see the module docstring)."""
    conf = configuration or {}
    target = load_target(conf)
    t_ns = time.time_ns()
    scaling = target.kind.scaling
    if scaling is Scaling.BY_COMMAND and len(target.replicas) > target.engine_replicas:
        out = _stop_newest(target, conf, grace_s)
    elif scaling is Scaling.BY_CONTROLLER:
        out = _scale_down(target, conf, timeout_s)
    elif scaling is Scaling.BY_COMMAND:
        return {"change": Change.NONE, "asked": Change.LEAVE, "t_ns": t_ns,
                "note": "no replica joined, so none leaves"}  # fmt: skip
    else:
        return _unscalable(target, Change.LEAVE)
    return {"change": Change.LEAVE, "t_ns": t_ns, **out, "end_ns": time.time_ns()}


def restore_replicas(
    timeout_s: float = DEFAULT_TIMEOUT_S, configuration: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Rollback: the replica count the stack was stood up with, its discovery file to match."""
    conf = configuration or {}
    target = load_target(conf)
    want = target.engine_replicas
    stopped: list[int] = []
    if target.kind.scaling is Scaling.BY_COMMAND:
        extra = target.replicas[want:]
        if extra:
            write_replicas(_conf(conf, "discovery_file"), _published(target)[:want])
            stopped = [spec.pid for spec in extra]
            stop_pids(stopped)
            del target.replicas[want:]
            role = target.engine_role
            target.pids[role] = [p for p in target.pids.get(role, []) if p not in stopped]
            write_target(target_path(conf), target)
    elif (
        target.kind.scaling is Scaling.BY_CONTROLLER and len(target.kind.running_engines()) != want
    ):
        target.kind.scale_engines(want)
        _wait_running(target, want, timeout_s)
    return {"restored": want, "stopped": stopped, "t_ns": time.time_ns()}
