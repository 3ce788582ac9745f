"""Chaos Toolkit actions: faults mirroring Chaos Mesh's, and the rollbacks that undo them.

- pod-kill: :func:`kill` sends SIGKILL to one process of a role (a zero-layer replica, a
  baseline engine replica, the baseline's orchestrator ingress);
- pod-failure: :func:`pause` sends SIGSTOP, holds for a duration, and SIGCONT (always);
- network delay and partition: :func:`add_delay`, :func:`partition`, :func:`heal` switch the
  loopback proxy (``chaos.netproxy``) the stack is pointed through;
- stress: :func:`cpu_stress` keeps N busy processes for a bounded time;
- KV pressure: :func:`kv_pressure` sends long requests, one after another, that fill one
  replica's KV cache, and logs each (its refusal, if refused) for ``chaos.refusal``;
- node loss: :func:`node_loss` takes a worker node out of the stack's Ray cluster.

Rollbacks (Chaos Toolkit runs them ``always``): :func:`resume_all`, :func:`heal`,
:func:`restart_replicas` (a killed zero-layer replica, on its port), :func:`wait_ready`.
Each action returns a small dict for the journal: which processes or replicas it touched and
when, so ``chaos.recovery`` can tell the fault's start and its intended blast radius.
Every provider takes Chaos Toolkit's ``configuration`` to find the target file, and asks the
target's stack kind (``harness.stacks``) whatever differs between stacks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import http.client
import os
import signal
import ssl
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from chaos import netproxy
from chaos.nodes import alive as alive  # the providers' liveness check, where the tests find it
from chaos.nodes import (
    alive_where,
    kill_where,
    lose_node,
    node_label,
    node_of,
    restart_where,
    signal_where,
)
from chaos.refusal import CUT
from chaos.targets import Target, load_target, target_path, write_target
from harness.schema import JsonlWriter, RequestRecord
from harness.stacks.clients import client_for
from harness.stacks.processes import START_GUARD_S
from harness.stacks.registry import stack_kind
from harness.stacks.spec import StackName
from harness.stacks.stack import Fault, Restore
from serving.wire.tokens import BYTES_PER_TOKEN
from zerolayer.client.sdk import split_url

if TYPE_CHECKING:
    from zerolayer.client import Http1Client, ZeroLayerClient

ABSENT: Final = "absent"
READY_POLL_S: Final = 0.1
LISTEN_TIMEOUT_S: Final = 30.0
ALIVE_CHECK_S: Final = 1.0  # how often a start past its allowance is checked for an exit
STRESS_SCRIPT: Final = (
    "import time\nend = time.monotonic() + {s}\nwhile time.monotonic() < end: pass\n"
)


def _now_ns() -> int:
    return time.time_ns()


def live_pids(target: Target) -> dict[str, list[int]]:
    """Process ids by role now: asked of the stack's cluster when this process is attached to
    it (Serve replaces actors it loses, with new pids); otherwise the target file's, alive
    where they run."""
    found = target.kind.cluster_pids()
    if found is not None:
        return found
    return {role: [p for p in pids if alive_where(target, p)] for role, pids in target.pids.items()}


def baseline_pids(app: str) -> dict[str, list[int]]:
    """The baseline's processes by chaos role, asked of Ray's GCS (``app``: the Ray Serve app
    its target file names, ``orchestrator`` or ``llm``); empty when not attached to Ray."""
    return stack_kind(StackName.BASELINE, app).cluster_pids() or {}


def _replica_urls(target: Target, role: str, pid: int) -> list[str]:
    """The load URLs a zero-layer replica answers on (directly, or through the proxy)."""
    if role != "replica":
        return []
    urls = []
    for spec in target.replicas:
        if spec.pid == pid:
            urls.append(spec.url)
            if target.netproxy_front == spec.url:
                urls.append(target.netproxy_url)
    return urls


def target_role(target: Target, role: str) -> str:
    """``engine`` names the engine replicas of either stack (``replica`` on the zero-layer)."""
    return target.engine_role if role == "engine" else role


def _pick(target: Target, role: str, index: int) -> int | None:
    pids = live_pids(target).get(role, [])
    return pids[index % len(pids)] if pids else None


def _absent(target: Target, role: str) -> dict[str, Any]:
    """What an action on a component the stack does not have records (and does nothing)."""
    return {
        "fault": ABSENT,
        "role": role,
        "stack": target.stack,
        "pids": [],
        "note": f"the {target.stack} stack has no {role} component: nothing to act on",
        "t_ns": _now_ns(),
    }


def kill(role: str, index: int = 0, configuration: dict[str, Any] | None = None) -> dict[str, Any]:
    """pod-kill: SIGKILL the ``index``-th live process of ``role`` and what it started (no clean
    shutdown; a replica's vLLM engine core dies with it, as a pod's containers do)."""
    target = load_target(configuration)
    role = target_role(target, role)
    pid = _pick(target, role, index)
    if pid is None:
        return _absent(target, role)
    t_ns = _now_ns()
    node = node_of(target, pid)
    killed = kill_where(target, pid)
    return {
        "fault": Fault.KILL,
        "role": role,
        "pids": [pid],
        "node": node_label(node),
        "killed": killed,
        "urls": _replica_urls(target, role, pid),
        "t_ns": t_ns,
    }


def pause(
    role: str,
    index: int = 0,
    duration_s: float = 5.0,
    configuration: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """pod-failure: SIGSTOP one process of ``role`` for ``duration_s``, then SIGCONT (always)."""
    target = load_target(configuration)
    role = target_role(target, role)
    pid = _pick(target, role, index)
    if pid is None:
        return _absent(target, role)
    t_ns = _now_ns()
    node = node_of(target, pid)
    signal_where(target, pid, signal.SIGSTOP)
    try:
        time.sleep(duration_s)
    finally:
        signal_where(target, pid, signal.SIGCONT)
    return {
        "fault": Fault.PAUSE,
        "role": role,
        "pids": [pid],
        "node": node_label(node),
        "urls": _replica_urls(target, role, pid),
        "t_ns": t_ns,
        "end_ns": _now_ns(),
    }


def node_loss(configuration: dict[str, Any] | None = None) -> dict[str, Any]:
    """Node loss: one worker node hosting an engine replica of the stack leaves the Ray
    cluster as a lost machine does (``chaos.nodes.lose_node``; a stack on one host: absent)."""
    return lose_node(load_target(configuration))


def resume_all(configuration: dict[str, Any] | None = None) -> dict[str, Any]:
    """Rollback for ``pause``: SIGCONT every process of the stack (harmless when running)."""
    target = load_target(configuration)
    resumed = []
    for pids in live_pids(target).values():
        for pid in pids:
            if signal_where(target, pid, signal.SIGCONT):
                resumed.append(pid)
    return {"resumed": sorted(resumed)}


def _netproxy(target: Target) -> str:
    if not target.netproxy:
        raise ValueError(f"the {target.stack} target has no network proxy in its path")
    return target.netproxy


def add_delay(
    delay_ms: float = 200.0,
    direction: str = "down",
    configuration: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Network delay: the proxy holds every chunk ``delay_ms`` before forwarding it."""
    target = load_target(configuration)
    mode = netproxy.command(_netproxy(target), f"delay {delay_ms} {direction}")
    return {"fault": Fault.DELAY, "front": target.netproxy_front, "urls": [target.netproxy_url],
            "mode": mode, "t_ns": mode["since_ns"]}  # fmt: skip


def partition(kind: str = "drop", configuration: dict[str, Any] | None = None) -> dict[str, Any]:
    """Network partition: the proxy black-holes (``drop``) or resets (``refuse``) its traffic."""
    target = load_target(configuration)
    mode = netproxy.command(_netproxy(target), f"partition {kind}")
    return {"fault": Fault.PARTITION, "front": target.netproxy_front, "urls": [target.netproxy_url],
            "mode": mode, "t_ns": mode["since_ns"]}  # fmt: skip


def heal(configuration: dict[str, Any] | None = None) -> dict[str, Any]:
    """Rollback for delay and partition: the proxy passes traffic through untouched again."""
    target = load_target(configuration)
    if not target.netproxy:
        return {"healed": False}
    return {"healed": True, "mode": netproxy.command(target.netproxy, "heal")}


def cpu_stress(
    duration_s: float = 5.0, workers: int = 1, configuration: dict[str, Any] | None = None
) -> dict[str, Any]:
    """CPU stress: ``workers`` busy-looping processes for ``duration_s`` (killed on overrun)."""
    t_ns = _now_ns()
    code = STRESS_SCRIPT.format(s=float(duration_s))
    procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(workers)]
    try:
        for proc in procs:
            try:
                proc.wait(timeout=duration_s + 5.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return {"fault": Fault.CPU_STRESS, "workers": workers, "pids": [p.pid for p in procs],
            "t_ns": t_ns, "end_ns": _now_ns()}  # fmt: skip


def _health_conn(url: str, tls_ca: str) -> http.client.HTTPConnection:
    host, port, tls = split_url(url)
    if not tls:
        return http.client.HTTPConnection(host, port, timeout=1.0)
    ctx = ssl.create_default_context(cafile=tls_ca or None)
    return http.client.HTTPSConnection(host, port, timeout=1.0, context=ctx)


def _wait_listening(
    url: str,
    deadline: float,
    tls_ca: str = "",
    path: str = "/health",
    api_key: str | None = None,
    poll_s: float = READY_POLL_S,
) -> bool:
    """Until ``GET path`` on ``url`` answers 200 over HTTP/1.1, or the deadline passes.

    ``api_key`` goes with every try: the readiness path may be a ``/v1`` route (Ray Serve LLM's
    ``/v1/models``), which needs a key on a stack that checks them; ``/health`` ignores it."""
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    while time.monotonic() < deadline:
        conn = _health_conn(url, tls_ca)
        try:
            conn.request("GET", path, headers=headers)
            response = conn.getresponse()
            response.read()
            if response.status == 200:
                return True
        except OSError:
            pass
        finally:
            conn.close()
        time.sleep(poll_s)
    return False


def restart_replicas(
    timeout_s: float = LISTEN_TIMEOUT_S, configuration: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Rollback for a kill on a stack whose parts come back by command (the zero-layer): start
    every dead replica again on its own port.

    The new pid goes into the target file (the stand-up owns and later stops it). The baseline
    needs no such step: Serve's controller replaces lost actors itself (see :func:`wait_ready`).
    """
    path = target_path(configuration)
    target = load_target(configuration)
    kind = target.kind
    restarted: list[dict[str, Any]] = []
    if kind.restore is not Restore.BY_COMMAND:
        return {"restarted": restarted, "t_ns": _now_ns()}
    for spec in target.replicas:
        if alive_where(target, spec.pid):
            continue
        pid = restart_where(target, spec, spec.log_path or os.devnull)
        old, spec.pid = spec.pid, pid
        role = target.pids[kind.engine_role]
        target.pids[kind.engine_role] = [p if p != old else pid for p in role]
        restarted.append({"url": spec.url, "old_pid": old, "pid": pid})
    if restarted:
        write_target(path, target)
    deadline = time.monotonic() + timeout_s
    for item in restarted:
        _until_the_restarted_answer(target, item, deadline)
    return {"restarted": restarted, "t_ns": _now_ns()}


def _until_the_restarted_answer(target: Target, item: dict[str, Any], deadline: float) -> None:
    """Until a restarted replica answers ``/health``. Past ``deadline`` (the recovery allowance,
    sized on the stand-up) only while its process runs, which is a start still under way: CI's
    host grew busier after the stand-up and took longer than that to start one. RuntimeError
    once it exits, or at the start's hang guard (``START_GUARD_S``)."""
    url, pid = str(item["url"]), int(item["pid"])
    if _wait_listening(url, deadline, target.tls_ca):
        return
    guard = deadline + START_GUARD_S
    while alive_where(target, pid) and time.monotonic() < guard:
        if _wait_listening(url, min(guard, time.monotonic() + ALIVE_CHECK_S), target.tls_ca):
            return
    state = "exited" if not alive_where(target, pid) else f"not listening after {START_GUARD_S} s"
    raise RuntimeError(f"replica {url} did not come back: its process (pid {pid}) {state}")


def _ready(target: Target) -> bool:
    return target.kind.is_whole(live_pids(target), target.engine_replicas)


def start_given_up(target: Target, allowance: float, guard: float) -> bool:
    """Whether a wait for a start ends now: past its hang guard, or past its allowance with
    nothing the stack's controller reports starting or stopping (``replicas_changing``)."""
    now = time.monotonic()
    return now >= guard or (now >= allowance and not target.kind.replicas_changing())


def wait_ready(
    timeout_s: float = LISTEN_TIMEOUT_S, configuration: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Rollback: wait until every engine replica (and the orchestrator) is alive and answering.

    For the baseline this waits for Serve to replace what a fault took, then refreshes the
    target file's pids; raises when the stack is not whole again within ``timeout_s``, or, past
    it, while its controller reports a replica starting or stopping (a replacement under way: a
    loaded host took Serve past 60 s to replace one that missed its health checks), once that
    ends or at the start's hang guard (``START_GUARD_S``). A whole stack's health is waited for
    up to the same guard: its parts live, and a saturated host answers late, not never. The
    error says which it was: the parts found, or the URLs that did not answer.
    """
    path = target_path(configuration)
    target = load_target(configuration)
    start = time.monotonic()
    deadline = start + timeout_s
    guard = deadline + START_GUARD_S
    while not _ready(target) and not start_given_up(target, deadline, guard):
        time.sleep(READY_POLL_S)
    urls = [s.url for s in target.replicas] or [target.health_url]
    key = target.default_api_key
    answer_by = max(guard, time.monotonic() + LISTEN_TIMEOUT_S)
    whole = _ready(target)
    silent = [] if not whole else [
        u for u in urls if not _wait_listening(u, answer_by, target.tls_ca, target.health_path, key)
    ]  # fmt: skip
    if not whole or silent:
        state = f"no answer from {', '.join(silent)}" if whole else f"found {live_pids(target)}"
        raise RuntimeError(f"the {target.stack} stack is not whole after {timeout_s} s ({state})")
    if target.kind.restore is Restore.BY_CONTROLLER:  # the controller's replacements: new pids
        target.pids = live_pids(target)
        write_target(path, target)
    return {"ready": True, "waited_s": round(time.monotonic() - start, 3), "pids": target.pids}


def _pressure_client(target: Target, index: int) -> tuple[str, ZeroLayerClient | Http1Client]:
    """(URL, client) for KV pressure: where the client routes, straight to the ``index``-th
    replica with no retries elsewhere; otherwise the front door."""
    tls_ca = Path(target.tls_ca) if target.tls_ca else None
    key = target.default_api_key
    if not target.kind.client_routes:
        url = target.load_urls[0]
        return url, client_for("http1", [url], tls_ca, api_key=key)
    url = target.replicas[index % len(target.replicas)].url
    return url, client_for("h2", [url], tls_ca, max_retries=0, health_interval_s=0, api_key=key)


@dataclasses.dataclass
class _Pressure:
    """What a KV-pressure run sends: ``requests`` of one shape, one every ``ramp_s / requests``
    seconds, held (after the first send) for ``hold_s``."""

    requests: int
    prompt_tokens: int
    prompt_bytes: int
    max_tokens: int
    hold_s: float
    ramp_s: float
    deadline_ms: int


async def _press_one(
    client: ZeroLayerClient | Http1Client,
    rec: RequestRecord,
    prompt: str,
    pressure: _Pressure,
    done: list[RequestRecord],
) -> None:
    """One pressure request, its record kept whatever happens (cut: ``refusal.CUT``)."""
    from harness.loaders.senders import copy_timing
    from zerolayer.client import ZeroLayerError

    rec.dispatch_ns = _now_ns()
    stream = client.stream(prompt=prompt, max_tokens=pressure.max_tokens, session=rec.session,
                           deadline_ms=pressure.deadline_ms)  # fmt: skip
    try:
        async with stream as s:
            async for _ in s:
                pass
    except ZeroLayerError:
        pass
    except asyncio.CancelledError:
        copy_timing(stream.timing, rec, 0)
        rec.outcome, rec.error_code, rec.refused_ns = "error", CUT, 0
        rec.end_ns = rec.end_ns or _now_ns()
        done.append(rec)
        raise
    copy_timing(stream.timing, rec, 0)
    done.append(rec)


async def _pressure(
    target: Target, index: int, pressure: _Pressure
) -> tuple[dict[str, Any], list[RequestRecord]]:
    from harness.workload import make_prompt

    session = f"kv-pressure-{index}"
    url, client = _pressure_client(target, index)
    gap_s = pressure.ramp_s / max(1, pressure.requests)
    prompts = [make_prompt(f"{session}-{i}", pressure.prompt_bytes)
               for i in range(pressure.requests)]  # fmt: skip
    done: list[RequestRecord] = []
    async with client:
        t0 = time.monotonic()
        t0_ns = _now_ns()
        tasks = []
        for i, prompt in enumerate(prompts):
            await asyncio.sleep(max(0.0, t0 + i * gap_s - time.monotonic()))
            rec = RequestRecord(f"{session}-{i}", target.stack, "kv_pressure", "chaos",
                                t0_ns + int(i * gap_s * 1e9), session=session,
                                prompt_tokens=pressure.prompt_tokens)  # fmt: skip
            tasks.append(asyncio.create_task(_press_one(client, rec, prompt, pressure, done)))
        await asyncio.wait(tasks, timeout=max(0.0, t0 + pressure.hold_s - time.monotonic()))
        pending = [t for t in tasks if not t.done()]
        for task in pending:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    outcomes = Counter(r.error_code or r.outcome for r in done)
    return {"url": url, "session": session, "outcomes": dict(outcomes)}, done


def kv_pressure(
    index: int = 0,
    requests: int = 32,
    prompt_tokens: int = 1500,
    max_tokens: int = 1024,
    hold_s: float = 5.0,
    ramp_s: float = 1.0,
    deadline_ms: int = 30_000,
    prompt_bytes: int | None = None,
    configuration: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Rising KV pressure: ``requests`` long requests of one shape pinned to one replica, sent
    one after another over ``ramp_s``, held for ``hold_s`` from the first, then cut. Each
    prompt is ``prompt_bytes`` long: the bytes the engine's token rule counts as
    ``prompt_tokens`` (``chaos.pressure.kv_prompt``); four a token when not given.

    Zero-layer: straight to the ``index``-th replica (no retries elsewhere). Baseline: through
    the front door with one session, which the consistent-hash router keeps on one replica.
    What is still running after ``hold_s`` is cancelled, which frees its KV. Each request's
    record goes to ``configuration["refusals_path"]`` when set (``chaos.refusal`` reads it).
    """
    target = load_target(configuration)
    size = prompt_tokens * BYTES_PER_TOKEN if prompt_bytes is None else prompt_bytes
    pressure = _Pressure(requests, prompt_tokens, size, max_tokens, hold_s, ramp_s, deadline_ms)
    t_ns = _now_ns()
    result, records = asyncio.run(_pressure(target, index, pressure))
    end_ns = _now_ns()
    path = (configuration or {}).get("refusals_path")
    if path:
        with JsonlWriter(path) as out:
            out.write_many(sorted(records, key=lambda r: r.intended_start_ns))
    urls = [result["url"]] if target.kind.client_routes else []
    return {"fault": Fault.KV_PRESSURE, "role": target.engine_role, "urls": urls, "t_ns": t_ns,
            "end_ns": end_ns, "request_tokens": prompt_tokens + max_tokens,
            "ramp_s": ramp_s, **result}  # fmt: skip
