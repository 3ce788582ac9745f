"""The ``vllm-serve`` stack against the real CPU vLLM (``nox -s vllm``): vLLM's own OpenAI server.

One server (one replica) on the offline tiny model serves every test here (a vLLM start takes
about 30 s on two cores); the last test closes it and checks no process of its group is left.
Where vLLM is not installed, everything here skips with the reason.

Peer load generators (issue 17, ``tests/peer_tools.py``): vLLM's own ``vllm bench serve`` drives
that server and a zero-layer replica (over the sim engine, started once for the module and stopped
at its end) for a short run each; ``test_rayserve_llm.py`` drives the Ray Serve LLM baseline.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from harness.stacks import Stack, StackName, StackSpec, VllmServer, stand_up
from tests.support.peer_tools import check_bench_result, listed_model, vllm_bench_serve
from tests.support.replica_thread import replica_in_thread
from tests.support.waiting import STACK_IN_A_FIXTURE

pytestmark = [
    STACK_IN_A_FIXTURE,
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vllm is not installed (the CPU build installs with: nox -s vllm)",
    ),
]

MAX_TOKENS = 12
OPTIONS = {"max_model_len": 512, "kv_cache_memory_bytes": 4 << 20, "max_num_seqs": 8}
SIM_OPTIONS = {"max_num_seqs": 16}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The offline tiny model: vLLM serves it, and ``vllm bench serve`` tokenizes with it."""
    from bench.tinymodel import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Stack]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    root = tmp_path_factory.mktemp("vllm-serve")
    spec = StackSpec(
        StackName.VLLM_SERVE, engine="vllm",
        engine_options={"model": str(tiny_model), **OPTIONS}, replicas=1,
    )  # fmt: skip
    with stand_up(spec, root / "stack") as up:
        yield up


@pytest.fixture(scope="module")
def zerolayer_url() -> Iterator[str]:
    """A zero-layer replica over the sim engine, on its own event loop in a thread."""

    with replica_in_thread("sim", **SIM_OPTIONS) as port:
        yield f"http://127.0.0.1:{port}"


@pytest.fixture
def vllm_serve_url(stack: Stack) -> str:
    return stack.urls[0]


@pytest.fixture
def bench_url(request: pytest.FixtureRequest) -> str:
    """One stack's base URL; each stack is the module's, started once."""
    return str(request.getfixturevalue(request.param))


def test_stack_is_vllms_own_server_over_http1(stack: Stack) -> None:
    assert stack.protocol == "http1" and len(stack.urls) == 1 and not stack.external
    assert "vllm.entrypoints.openai.api_server" in stack.metadata["command"]
    assert "--kv-cache-memory-bytes" in stack.metadata["command"]
    pids = stack.pids()
    assert len(pids["replica"]) == 1 and pids["engine"], "the server and its engine core"
    roles = {c.role for c in stack.components()}
    assert roles == {"replica", "engine"}


def test_streams_a_completion_through_the_stacks_client(stack: Stack) -> None:
    async def go() -> tuple[int, int, int, str]:
        async with stack.open_client() as client:
            stream = client.stream(prompt="the replica streams", max_tokens=MAX_TOKENS, seed=3)
            chunks = 0
            async with stream as s:
                async for _ in s:
                    chunks += 1
            t = stream.timing
            return chunks, t.status, t.output_tokens, t.replica

    chunks, status, tokens, replica = asyncio.run(go())
    assert status == 200 and chunks >= 1 and replica == stack.urls[0]
    # the stack's body fields (ignore_eos, usage) make vLLM serve all of them, in its own count
    assert tokens == MAX_TOKENS


def test_engine_targets_read_vllms_own_metrics(stack: Stack) -> None:
    (target,) = stack.engine_targets()
    assert target.how == f"{stack.urls[0]}/metrics"
    row = target.read()
    assert {"running", "waiting", "kv_usage"} <= set(row)
    assert row["running"] == 0 and 0.0 <= row["kv_usage"] <= 1.0


@pytest.mark.parametrize(
    "bench_url",
    ["zerolayer_url", "vllm_serve_url"],
    ids=["zerolayer", "vllm-serve"],
    indirect=True,
)
def test_vllm_bench_serve_completes_every_request(bench_url: str, tiny_model: Path) -> None:
    """vLLM's own benchmark client, a peer tool, finishes a short random run on the stack (the
    Ray Serve LLM baseline's run is in test_rayserve_llm.py, beside its one start)."""
    check_bench_result(vllm_bench_serve(bench_url, listed_model(bench_url), tiny_model))


def test_engine_settings_are_what_vllms_server_reports(stack: Stack) -> None:
    """Its cache config on /metrics, max_model_len on /v1/models, the request's temperature; the
    scheduler's settings vLLM's server does not publish are not known."""
    from serving.engine.settings import EngineSettings

    (settings,) = stack.engine_settings().values()
    assert settings == EngineSettings(
        max_model_len=512, block_size=128, kv_blocks=32, prefix_caching=True, temperature=0.0
    )


def test_close_leaves_no_process(stack: Stack) -> None:
    server = stack.servers[0]
    group = [p.pid for p in server.group()]
    assert server.pid in group and len(group) >= 2
    stack.close()
    alive = [p for p in group if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
    assert not alive and not server.group()


def test_stand_up_refuses_another_engine(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs --engine vllm"):
        stand_up(StackSpec(StackName.VLLM_SERVE, engine="null", replicas=1), tmp_path)
    assert VllmServer.__name__  # the stack's replica type is public for chaos and bench
