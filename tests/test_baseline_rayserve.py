"""The Ray Serve baseline against real Ray Serve: one local Ray for the whole module.

Every client call has a bounded timeout, so a hang fails the test instead of stalling the suite.
The module stands Ray up once (about 10 s on 2 cores) and the last test tears it down and checks
that no Ray process is left; the whole module takes about a minute.
"""

from __future__ import annotations

import asyncio
import http.client
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import psutil
import pytest

from baselines.rayserve import BaselineHandle, start_baseline
from baselines.rayserve.config import TenantBudget
from zerolayer.engine import EngineRequest, make_engine
from zerolayer.wire.tokens import count_prompt_tokens, request_seed

ENGINE_OPTIONS: dict[str, Any] = {"max_num_seqs": 64}
INFLIGHT = 16
QUEUE = 2
TIMEOUT_S = 20.0


class Reply:
    """One HTTP/1.1 exchange as the client saw it (or the error that ended it)."""

    def __init__(self, status: int, headers: dict[str, str], body: bytes, error: str = "") -> None:
        self.status = status
        self.headers = headers
        self.body = body
        self.error = error

    def events(self) -> list[Any]:
        """The SSE ``data:`` payloads, decoded (``[DONE]`` stays a string)."""
        out: list[Any] = []
        for block in self.body.split(b"\n\n"):
            if block.startswith(b"data: "):
                data = block[6:]
                out.append("[DONE]" if data == b"[DONE]" else orjson.loads(data))
        return out

    def text(self) -> str:
        return "".join(
            e["choices"][0].get("text") or e["choices"][0].get("delta", {}).get("content", "")
            for e in self.events()
            if isinstance(e, dict) and e.get("choices")
        )


def call(
    port: int,
    path: str,
    body: dict[str, Any] | bytes | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = TIMEOUT_S,
) -> Reply:
    """One request on a fresh keep-alive-capable connection; transport failures are recorded."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    raw = body if isinstance(body, bytes) else None if body is None else orjson.dumps(body)
    try:
        conn.request("GET" if raw is None else "POST", path, body=raw, headers=headers or {})
        response = conn.getresponse()
        status, head = response.status, {k.lower(): v for k, v in response.getheaders()}
        try:
            return Reply(status, head, response.read())
        except (http.client.HTTPException, OSError) as exc:
            return Reply(status, head, b"", error=repr(exc))
    except (http.client.HTTPException, OSError) as exc:
        return Reply(0, {}, b"", error=repr(exc))
    finally:
        conn.close()


def concurrently(jobs: list[Any]) -> list[Reply]:
    """Run ``call`` argument tuples at once on threads (bounded: one thread per job)."""
    replies: list[Reply | None] = [None] * len(jobs)

    def run(i: int) -> None:
        replies[i] = call(*jobs[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT_S * 2)
    assert all(r is not None for r in replies), "a client thread hung"
    return [r for r in replies if r is not None]


def engine_text(prompt: str, max_tokens: int, seed: int | None = None) -> tuple[str, int]:
    """The same request straight to an in-process engine built with the same options."""

    async def run() -> tuple[str, int]:
        engine = make_engine("sim", **ENGINE_OPTIONS)
        request = EngineRequest(
            "direct", count_prompt_tokens(prompt), max_tokens, request_seed(prompt, seed)
        )
        parts, tokens = [], 0
        async for chunk in engine.generate(request):
            parts.append(chunk.text)
            tokens = chunk.completion_tokens
        await engine.close()
        return "".join(parts), tokens

    return asyncio.run(run())


def wait_for(predicate: Any, timeout_s: float, what: str) -> Any:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"{what} did not happen within {timeout_s} s")


@pytest.fixture(scope="module")
def baseline() -> Iterator[BaselineHandle]:
    handle = start_baseline(
        engine="sim",
        replicas=2,
        engine_options=ENGINE_OPTIONS,
        max_inflight=INFLIGHT,
        max_queue=QUEUE,
        tenant_budgets={"tiny": TenantBudget(rate=10.0, burst=100.0)},
    )
    try:
        yield handle
    finally:
        handle.close()


@pytest.fixture(scope="module")
def port(baseline: BaselineHandle) -> int:
    return baseline.config.port


def test_health_models_and_metadata(baseline: BaselineHandle, port: int) -> None:
    assert call(port, "/health").status == 200
    models = orjson.loads(call(port, "/v1/models").body)
    assert models["data"][0]["id"] == "zl-sim"
    meta = baseline.metadata
    assert meta["health_check_period_s"] == 1.0
    assert meta["engine_max_ongoing_requests"] == ENGINE_OPTIONS["max_num_seqs"]
    assert meta["router_kwargs"] == {"num_virtual_nodes": 100, "num_fallback_replicas": 2}
    assert meta["serve_constants"]["SERVE_SESSION_ID"]  # as a worker of the cluster sees it
    assert "RAY_SERVE_THROUGHPUT_OPTIMIZED" in meta["serve_constants"]
    pids = baseline.pids()
    assert len(pids["engine"]) == 2 and len(pids["ingress"]) == 1
    assert pids["proxy"] and pids["controller"]
    assert all(psutil.pid_exists(p) for group in pids.values() for p in group)


def test_stream_matches_the_engine_called_directly(port: int) -> None:
    prompt = "the same request gives the same tokens " * 5
    reply = call(
        port,
        "/v1/completions",
        {"prompt": prompt, "max_tokens": 24, "stream": True},
        {"zl-session": "same-stream"},
    )
    assert reply.status == 200 and not reply.error
    assert reply.headers["content-type"].startswith("text/event-stream")
    events = reply.events()
    assert events[-1] == "[DONE]"
    assert len(events) > 2, "one event per engine step, not one blob"
    expected, tokens = engine_text(prompt, 24)
    assert reply.text() == expected
    last = events[-2]
    assert last["choices"][0]["finish_reason"] == "length"
    assert last["usage"]["completion_tokens"] == tokens == 24


def test_chat_and_explicit_seed_match_the_engine(port: int) -> None:
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 9, "seed": 1234}
    reply = call(port, "/v1/chat/completions", body, {"zl-session": "chat"})
    assert reply.status == 200
    doc = orjson.loads(reply.body)
    assert doc["choices"][0]["message"]["content"] == engine_text("hello", 9, seed=1234)[0]
    streamed = call(port, "/v1/chat/completions", {**body, "stream": True}, {"zl-session": "x"})
    assert streamed.text() == doc["choices"][0]["message"]["content"]


@pytest.fixture(scope="module")
def zerolayer_port() -> Iterator[int]:
    """A zero-layer replica over the same engine options, on its own loop in a thread."""
    server = pytest.importorskip("zerolayer.server")
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start() -> Any:
        return await server.start_replica(make_engine("sim", **ENGINE_OPTIONS), port=0)

    replica = asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    try:
        yield replica.port
    finally:
        asyncio.run_coroutine_threadsafe(replica.close(timeout=5), loop).result(30)
        asyncio.run_coroutine_threadsafe(replica.engine.close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "identical on both stacks " * 3, "max_tokens": 20}),
        ("/v1/completions", {"prompt": "seeded", "max_tokens": 7, "seed": 99}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                  "max_tokens": 11}),
    ],
)  # fmt: skip
def test_stream_matches_the_zero_layer_replica(
    port: int, zerolayer_port: int, path: str, body: dict[str, Any]
) -> None:
    request = {**body, "stream": True}
    ours = call(port, path, request, {"zl-session": "cmp"})
    theirs = call(zerolayer_port, path, request, {"zl-session": "cmp"})
    assert ours.status == theirs.status == 200
    assert ours.text() == theirs.text() != ""
    assert ours.events()[-1] == theirs.events()[-1] == "[DONE]"
    # How many steps one SSE event carries depends on how loaded the machine is (a slow reader
    # gets steps merged), so compare what is reported, not how the stream was cut into events.
    usage = [[e["usage"] for e in r.events() if isinstance(e, dict) and e.get("usage")]
             for r in (ours, theirs)]  # fmt: skip
    assert usage[0] == usage[1] and len(usage[0]) == 1


@pytest.mark.parametrize(
    ("path", "body", "headers", "status", "code"),
    [
        ("/v1/completions", b"{not json", {}, 400, "bad_request"),
        ("/v1/completions", {"prompt": "x", "colour": "red"}, {}, 400, "bad_request"),
        ("/v1/completions", {"prompt": "x"}, {"zl-priority": "urgent"}, 400, "bad_request"),
        ("/v1/completions", {"prompt": "x"}, {"zl-deadline-ms": "-5"}, 400, "bad_request"),
        (
            "/v1/completions",
            {"prompt": "x" * 280_000, "max_tokens": 65536},
            {},
            400,
            "prompt_too_long",
        ),  # refused by the engine itself, passed through by the ingress
        ("/v1/nothing", None, {}, 404, "not_found"),
        ("/v1/models", {"prompt": "x"}, {}, 405, "method_not_allowed"),
    ],
)
def test_bad_input_gets_the_contract_error(
    port: int, path: str, body: Any, headers: dict[str, str], status: int, code: str
) -> None:
    reply = call(port, path, body, headers)
    assert reply.status == status
    assert reply.headers["zl-error"] == code
    assert orjson.loads(reply.body)["error"]["code"] == code


def test_every_request_gets_a_log_line(baseline: BaselineHandle, port: int) -> None:
    import ray

    request_id = f"log-probe-{os.getpid()}"
    reply = call(port, "/v1/completions", {"prompt": "log me"}, {"zl-request-id": request_id})
    assert reply.status == 200 and reply.headers["zl-request-id"] == request_id
    logs = Path(ray._private.worker._global_node.get_session_dir_path()) / "logs" / "serve"

    def logged() -> bool:
        return any(
            f"zl-request id={request_id} " in path.read_text(errors="replace")
            for path in logs.glob("replica_zl-baseline_Orchestrator_*.log")
        )

    wait_for(logged, 10, "the ingress's log line")


def test_tenant_over_budget_gets_429_budget_exceeded(port: int) -> None:
    body = {"prompt": "cost", "max_tokens": 60}
    first = call(port, "/v1/completions", body, {"zl-tenant": "tiny"})
    second = call(port, "/v1/completions", body, {"zl-tenant": "tiny"})
    assert first.status == 200
    assert second.status == 429 and second.headers["zl-error"] == "budget_exceeded"
    assert int(second.headers["retry-after-ms"]) > 0
    assert call(port, "/v1/completions", body, {"zl-tenant": "other"}).status == 200


def test_full_queue_gets_429_queue_full_with_a_retry_hint(port: int) -> None:
    body = {"prompt": "long", "max_tokens": 300, "stream": True}
    jobs = [(port, "/v1/completions", body, {"zl-session": f"q{i}"}) for i in range(24)]
    replies = concurrently(jobs)
    refused = [r for r in replies if r.status == 429]
    assert {r.status for r in replies} <= {200, 429}
    assert len(refused) >= 24 - INFLIGHT - QUEUE
    for reply in refused:
        assert reply.headers["zl-error"] == "queue_full"
        assert int(reply.headers["retry-after-ms"]) >= 10
    for reply in replies:
        if reply.status == 200:
            assert reply.events()[-1] == "[DONE]"


def test_deadline_mid_stream_ends_with_an_error_event(port: int) -> None:
    body = {"prompt": "slow", "max_tokens": 2000, "stream": True}
    reply = call(port, "/v1/completions", body, {"zl-deadline-ms": "150"})
    assert reply.status == 200
    last = reply.events()[-1]
    assert last["error"]["code"] == "deadline_exceeded"


def test_engine_replica_killed_before_first_token_is_retried_and_replaced(
    baseline: BaselineHandle, port: int
) -> None:
    before = baseline.pids()["engine"]
    victim = before[0]
    prompt = "p" * (4 * 12_000)  # ~12k tokens: a prefill long enough to kill the replica in
    jobs = [
        (port, "/v1/completions", {"prompt": f"{i}{prompt}", "max_tokens": 4, "stream": True},
         {"zl-session": f"kill-{i}"})
        for i in range(10)
    ]  # fmt: skip
    replies: list[Reply] = []
    runner = threading.Thread(target=lambda: replies.extend(concurrently(jobs)))
    runner.start()
    wait_for(lambda: orjson.loads(call(port, "/health").body)["inflight"] >= 10, 10, "dispatch")
    time.sleep(0.1)
    os.kill(victim, signal.SIGKILL)
    runner.join(TIMEOUT_S * 3)
    assert len(replies) == 10
    assert [r.status for r in replies] == [200] * 10, [r.body[:200] for r in replies]
    assert all(r.events()[-1] == "[DONE]" for r in replies)
    retried = [int(r.headers["zl-attempts"]) for r in replies]
    assert max(retried) >= 2, f"no request was retried elsewhere: {retried}"
    after = wait_for(
        lambda: (p := baseline.pids()["engine"]) and len(p) == 2 and victim not in p and p,
        60,
        "Serve replacing the engine replica",
    )
    assert set(after) - set(before)


def test_ingress_killed_gives_explicit_errors_then_is_restored(
    baseline: BaselineHandle, port: int
) -> None:
    victim = baseline.pids()["ingress"][0]
    body = {"prompt": "long", "max_tokens": 3000, "stream": True}
    inflight: list[Reply] = []
    runner = threading.Thread(
        target=lambda: inflight.append(call(port, "/v1/completions", body, timeout=10))
    )
    runner.start()
    wait_for(lambda: orjson.loads(call(port, "/health").body)["inflight"] >= 1, 10, "dispatch")
    killed_at = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    runner.join(15)
    assert not runner.is_alive()
    reply = inflight[0]
    assert time.monotonic() - killed_at < 10, "the client hung on the dead ingress"
    done = reply.status == 200 and reply.body.endswith(b"data: [DONE]\n\n")
    assert not done, "a stream served by the killed ingress cannot have completed"
    assert reply.error or reply.status >= 500
    for _ in range(3):  # meanwhile: an answer or an explicit error, never a hang
        after = call(port, "/v1/completions", {"prompt": "x", "max_tokens": 2}, timeout=10)
        assert "timed out" not in after.error
        assert after.status in (200, 500, 502, 503, 504) or after.error
    wait_for(
        lambda: victim not in (p := baseline.pids()["ingress"]) and len(p) == 1,
        60,
        "Serve restoring the ingress",
    )
    wait_for(lambda: call(port, "/health", timeout=5).status == 200, 60, "ingress healthy")
    again = call(port, "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert again.status == 200


def test_close_leaves_no_ray_process(baseline: BaselineHandle) -> None:
    processes = baseline.ray_processes() + [
        p for p in psutil.Process().children(recursive=True) if "ray" in p.name().lower()
    ]
    pids = [p for group in baseline.pids().values() for p in group]
    assert processes and pids
    baseline.close()
    alive = [p for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive
    assert not [p for p in pids if psutil.pid_exists(p)]
