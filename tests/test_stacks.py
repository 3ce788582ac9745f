"""The one stand-up path: zero-layer (plain and TLS), external stacks, restarts by command."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import psutil
import pytest

from harness.stacks import (
    REACH_TIMEOUT_S,
    Stack,
    StackName,
    StackSpec,
    StackUnreachable,
    engine_args,
    spawn_replica,
    stand_up,
    wait_listening,
)
from zerolayer.client import ZeroLayerClient


def _complete(stack: Stack, n: int = 8) -> list[str]:
    """Send ``n`` requests over different sessions through the stack's own client."""

    async def go() -> list[str]:
        async with stack.open_client() as client:
            out = []
            for i in range(n):
                done = await client.complete(prompt=f"hello {i}", max_tokens=4, session=f"s{i}")
                out.append(done.text)
            return out

    return asyncio.run(go())


def test_engine_options_are_spelled_engine_option_key_json() -> None:
    args = engine_args("sim", {"num_kv_blocks": 64, "model_shape": "llama-3.1-8b"})
    assert args == ["--engine", "sim", "--engine-option", "num_kv_blocks=64",
                    "--engine-option", 'model_shape="llama-3.1-8b"']  # fmt: skip


def test_zerolayer_stack_serves_reports_and_stops(tmp_path: Path) -> None:
    spec = StackSpec(StackName.ZEROLAYER, engine="null", replicas=2)
    with stand_up(spec, tmp_path) as stack:
        assert not stack.external and stack.protocol == "h2" and stack.tls_ca is None
        assert len(set(stack.urls)) == 2 and all(u.startswith("http://") for u in stack.urls)
        pids = stack.pids()["replica"]
        assert len(pids) == 2 and all(psutil.pid_exists(p) for p in pids)
        assert {c.role for c in stack.components()} == {"replica"}
        assert len(_complete(stack)) == 8
        rows = [t.read() for t in stack.engine_targets()]
        assert len(rows) == 2 and all("running" in r for r in rows)
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids)


def test_tls_stack_trusts_its_own_certificate(tmp_path: Path) -> None:
    spec = StackSpec(StackName.ZEROLAYER, engine="null", replicas=1, tls=True)
    with stand_up(spec, tmp_path) as stack:
        assert stack.tls_ca is not None and stack.tls_ca.exists()
        assert stack.urls[0].startswith("https://")
        client = stack.open_client()
        assert isinstance(client, ZeroLayerClient)
        assert len(_complete(stack, 2)) == 2
        assert "running" in stack.engine_targets()[0].read()


def test_unreachable_external_stack_is_refused_before_any_load(tmp_path: Path) -> None:
    spec = StackSpec(StackName.ZEROLAYER, urls=("http://127.0.0.1:1",))
    start = time.monotonic()
    with pytest.raises(StackUnreachable, match=r"http://127\.0\.0\.1:1 .*not reachable"):
        stand_up(spec, tmp_path)
    assert time.monotonic() - start < REACH_TIMEOUT_S * 4  # bounded by the connect timeout
    with pytest.raises(StackUnreachable, match="not an http"):
        stand_up(StackSpec(StackName.BASELINE, urls=("ftp://127.0.0.1:21",)), tmp_path)


def test_reachable_external_stack_starts_and_stops_nothing(tmp_path: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        url = f"http://127.0.0.1:{server.getsockname()[1]}"
        with stand_up(StackSpec(StackName.BASELINE, urls=(url,)), tmp_path) as stack:
            assert stack.external and stack.urls == [url] and stack.protocol == "http1"
            assert stack.pids() == {} and stack.engine_targets() == []
            assert stack.metadata["impl"] == "external"


def test_a_killed_replica_comes_back_with_its_command_and_is_adopted(tmp_path: Path) -> None:
    spec = StackSpec(StackName.ZEROLAYER, engine="null", replicas=2)
    with stand_up(spec, tmp_path) as stack:
        replica = stack.replicas[1]
        assert f"--port {replica.port}" in " ".join(replica.command)
        replica.kill()
        assert stack.pids()["replica"] == [stack.replicas[0].pid]
        proc = spawn_replica(replica.command, tmp_path / "again.log")
        assert wait_listening(tmp_path / "again.log", proc, time.monotonic() + 60) == replica.url
        stack.replica_restarted(replica.url, proc.pid)
        assert stack.pids()["replica"] == [stack.replicas[0].pid, proc.pid]
        assert len(_complete(stack)) == 8
    assert proc.poll() is not None, "close() stops an adopted replica too"
