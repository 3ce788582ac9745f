"""The Ray Serve baseline against real Ray Serve: one local Ray for the whole module.

Every client call has a bounded timeout, so a hang fails the test instead of stalling the suite.
The module stands Ray up once (about 10 s on 2 cores) and the last test tears it down and checks
that no Ray process is left; the whole module takes about a minute.
"""

from __future__ import annotations

import asyncio
import http.client
import itertools
import math
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import orjson
import psutil
import pytest

from baselines.rayserve import BaselineHandle, start_baseline
from baselines.rayserve.config import (
    PROXY_READY_CHECK_S,
    QUEUE_LENGTH_DEADLINE_S,
    STAND_UP_GUARD_S,
    TenantBudget,
)
from chaos.elasticity import engine_routed
from serving.engine import EngineRequest, make_engine
from serving.wire.tokens import count_prompt_tokens, request_seed
from tests.support.replica_thread import replica_in_thread
from tests.support.waiting import STACK_IN_A_FIXTURE

pytestmark = STACK_IN_A_FIXTURE

ENGINE_OPTIONS: dict[str, Any] = {"max_num_seqs": 64}
INFLIGHT = 16
QUEUE = 2
TIMEOUT_S = 20.0
HANG_S = STAND_UP_GUARD_S
"""How long a call may stay open, or Serve take to replace a killed actor, before it counts as
hung: the guard the stand-up gives Serve to start its actors, since replacing one is starting
one (and the proxy may hold a call until it is up). A fixed 60 s failed under load twice:
'Serve replacing the engine replica did not happen within 60.0 s', and a call timed out."""


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
    headed: threading.Event | None = None,
) -> Reply:
    """One request on a fresh keep-alive-capable connection; transport failures are recorded.
    ``headed`` is set once the response's head has arrived (a stream's comes with its first
    token: the ingress answers once it has one)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    raw = body if isinstance(body, bytes) else None if body is None else orjson.dumps(body)
    try:
        conn.request("GET" if raw is None else "POST", path, body=raw, headers=headers or {})
        response = conn.getresponse()
        if headed is not None:
            headed.set()
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
        thread.join(HANG_S + 5)
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


SERVE_START_WAIT_S = 0.001
"""Serve's ``serve.start`` waits a fixed 60 s for its proxies (Ray's ``HTTP_PROXY_TIMEOUT``): CI's
loaded host took longer than that. The module's stand-up gives it 1 ms, a proxy slower than any,
so that the stand-up must wait for the proxy on its own terms, as it does on a loaded host."""


@pytest.fixture(scope="module")
def stats_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where each engine replica logs the requests it receives (``engine-requests-<pid>``)."""
    return tmp_path_factory.mktemp("baseline-stats")


@pytest.fixture(scope="module")
def baseline(stats_dir: Path) -> Iterator[BaselineHandle]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("ray.serve._private.api.HTTP_PROXY_TIMEOUT", SERVE_START_WAIT_S)
        handle = start_baseline(
            engine="sim",
            replicas=2,
            engine_options=ENGINE_OPTIONS,
            max_inflight=INFLIGHT,
            max_queue=QUEUE,
            # A refill slower than any host: at 10 tokens/s a first call slower than 2.2 s
            # (tests-under-load) refilled what the second needs, and it was served.
            tenant_budgets={"tiny": TenantBudget(rate=0.01, burst=100.0)},
            # The full-queue test pauses both engine replicas until the ingress has refused what
            # it must; Serve replaces a replica whose health check outlasts this (5 s by
            # default), so it waits the hang guard. A killed replica is replaced at once anyway:
            # Ray reports its actor dead.
            health_check_timeout_s=HANG_S,
            stats_dir=str(stats_dir),
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
    assert meta["stream_batching_interval_ms"] == 50.0, "Ray Serve LLM's default interval"
    assert meta["engine_max_ongoing_requests"] == ENGINE_OPTIONS["max_num_seqs"]
    assert meta["router_kwargs"] == {"num_virtual_nodes": 100, "num_fallback_replicas": 2}
    assert meta["serve_constants"]["SERVE_SESSION_ID"]  # as a worker of the cluster sees it
    assert "RAY_SERVE_THROUGHPUT_OPTIMIZED" in meta["serve_constants"]
    # a proxy slow to start on a loaded host is waited for, not killed mid-stand-up
    assert meta["serve_constants"]["PROXY_READY_CHECK_TIMEOUT_S"] == float(PROXY_READY_CHECK_S)
    # and a replica slow to answer Serve's queue-length probe is waited for, not routed around
    deadline = meta["serve_constants"]["RAY_SERVE_MAX_QUEUE_LENGTH_RESPONSE_DEADLINE_S"]
    assert deadline == float(QUEUE_LENGTH_DEADLINE_S)
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
    with replica_in_thread("sim", **ENGINE_OPTIONS) as replica_port:
        yield replica_port


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
        ("/v1/completions", {"prompt": "x", "top_p": 0}, {}, 400, "bad_request"),
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

    wait_for(logged, HANG_S, "the ingress's log line")


def test_tenant_over_budget_gets_429_budget_exceeded(port: int) -> None:
    body = {"prompt": "cost", "max_tokens": 60}
    first = call(port, "/v1/completions", body, {"zl-tenant": "tiny"})
    second = call(port, "/v1/completions", body, {"zl-tenant": "tiny"})
    assert first.status == 200
    assert second.status == 429 and second.headers["zl-error"] == "budget_exceeded"
    assert int(second.headers["retry-after-ms"]) > 0
    assert call(port, "/v1/completions", body, {"zl-tenant": "other"}).status == 200


def test_full_queue_gets_429_queue_full_with_a_retry_hint(
    baseline: BaselineHandle, port: int
) -> None:
    """With both engine replicas paused (SIGSTOP) no slot of the ingress frees, however slow the
    host: of 24 requests 16 hold the slots, 2 wait in line, and exactly the other 6 are refused at
    once with ``queue_full`` and a retry hint; the 18 finish once the engines run again.

    Streams of 300 tokens held the slots before, which a loaded host did not keep held until the
    last of the 24 arrived (tests-under-load). The calls and Serve's health checks (see
    ``baseline``) wait the hang guard, not a time sized on a quiet host."""
    body = {"prompt": "long", "max_tokens": 8, "stream": True}
    waits = {"zl-deadline-ms": str(round(HANG_S * 1000))}
    jobs = [(port, "/v1/completions", body, {"zl-session": f"q{i}", **waits}, HANG_S)
            for i in range(24)]  # fmt: skip
    refusals = len(jobs) - INFLIGHT - QUEUE
    engines = [psutil.Process(pid) for pid in baseline.pids()["engine"]]
    with ThreadPoolExecutor(len(jobs)) as pool:
        for engine in engines:
            engine.suspend()
        try:
            futures = [pool.submit(call, *job) for job in jobs]
            wait_for(lambda: sum(f.done() for f in futures) >= refusals and _gate(port) == (
                INFLIGHT, QUEUE), HANG_S, "a full gate and its refusals")  # fmt: skip
            answered_while_paused = [f.result() for f in futures if f.done()]
        finally:
            for engine in engines:
                engine.resume()
        replies = [f.result(HANG_S + 5) for f in futures]
    assert [r.status for r in answered_while_paused] == [429] * refusals
    for reply in answered_while_paused:
        assert reply.headers["zl-error"] == "queue_full"
        assert int(reply.headers["retry-after-ms"]) >= 10
    served = [r for r in replies if r.status != 429]
    assert len(served) == INFLIGHT + QUEUE, [(r.status, r.error) for r in served]
    assert all(r.status == 200 and r.events()[-1] == "[DONE]" for r in served)


def _gate(port: int) -> tuple[int, int]:
    """The ingress's FIFO gate as its ``/health`` reports it: slots held, requests in line."""
    health = orjson.loads(call(port, "/health").body)
    return health["inflight"], health["queued"]


def test_deadline_mid_stream_ends_with_an_error_event(port: int) -> None:
    # The deadline must fall after the stream's first event (else the answer is a 504) and
    # before its 2,000th token: set from how long a one-token stream takes here now (a loaded
    # host answers later; CI once saw a 504 at a fixed 150 ms).
    started = time.perf_counter()
    one = call(port, "/v1/completions", {"prompt": "slow", "max_tokens": 1, "stream": True})
    one_ms = (time.perf_counter() - started) * 1000
    assert one.status == 200
    deadline_ms = round(150 + 2 * one_ms)
    body = {"prompt": "slow", "max_tokens": 2000, "stream": True}
    reply = call(port, "/v1/completions", body, {"zl-deadline-ms": str(deadline_ms)})
    assert reply.status == 200, f"a deadline of {deadline_ms} ms; one token took {one_ms:.0f} ms"
    last = reply.events()[-1]
    assert last["error"]["code"] == "deadline_exceeded"


# -- the real ``openai`` client, on both stacks -------------------------------------------------
# These come before the fault-injection tests below: those kill Serve's replicas and the last one
# shuts Ray down, and every test here needs both stacks up and healthy.

STACKS = ("port", "zerolayer_port")  # the fixtures: the Ray Serve baseline, the zero-layer replica
UNIFORM_LOGPROB = -math.log(4096)  # the sim draws every token uniformly over 4096 ids
FINGERPRINT = "zerolayer-sim"
SEED = 4321
# vLLM's own fields go in ``extra_body`` (the client has no argument for them); the standard
# sampling fields beside them. The sim records them: the text depends on the prompt and seed only.
SAMPLING: dict[str, Any] = {
    "logit_bias": {"17": -5},
    "seed": SEED,
    "top_p": 0.9,
    "extra_body": {"min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 2},
}


@pytest.fixture(params=STACKS, ids=("rayserve", "zerolayer"))
def stack_port(request: pytest.FixtureRequest) -> int:
    """One stack's port; both stacks are the module's, started once."""
    return int(request.getfixturevalue(request.param))


def openai_client(port: int) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="any", timeout=HANG_S, max_retries=0
    )


@pytest.fixture
def client(stack_port: int) -> Iterator[openai.OpenAI]:
    with openai_client(stack_port) as sync_client:
        yield sync_client


@pytest.fixture
def model(client: openai.OpenAI) -> str:
    """The model the stack lists (the baseline and the replica name the sim differently)."""
    return client.models.list().data[0].id


def stop_reason(choice: Any) -> Any:
    """vLLM's ``stop_reason``, which the client keeps as an extra field of the choice."""
    extra = choice.model_extra or {}
    assert "stop_reason" in extra, "every choice carries stop_reason, as vLLM's do"
    return extra["stop_reason"]


def assert_final_usage(chunk: Any, prompt: str, max_tokens: int) -> None:
    """The usage chunk of ``include_usage``: no choices, the totals, the fingerprint."""
    assert chunk.choices == []
    prompt_tokens = count_prompt_tokens(prompt)
    assert chunk.usage.prompt_tokens == prompt_tokens
    assert chunk.usage.completion_tokens == max_tokens  # the sim always runs to max_tokens
    assert chunk.usage.total_tokens == prompt_tokens + max_tokens
    assert chunk.system_fingerprint == FINGERPRINT


def assert_completion_logprobs(text: str, parts: list[Any], max_tokens: int) -> None:
    """vLLM's completions logprobs (one or more streamed parts, joined): one entry per output
    token, offsets into the text, and the token plus its alternatives, 2 in all."""
    tokens = [t for part in parts for t in part.tokens]
    assert len(tokens) == max_tokens and "".join(tokens) == text
    assert [t for part in parts for t in part.token_logprobs] == pytest.approx(
        [UNIFORM_LOGPROB] * max_tokens
    )
    offsets = list(itertools.accumulate(map(len, tokens), initial=0))[:-1]
    assert [o for part in parts for o in part.text_offset] == offsets
    tops = [top for part in parts for top in part.top_logprobs]
    assert [len(top) for top in tops] == [2] * max_tokens
    assert all(token in top for token, top in zip(tokens, tops, strict=True))
    assert all(v == pytest.approx(UNIFORM_LOGPROB) for top in tops for v in top.values())


def assert_chat_logprobs(text: str, content: list[Any], max_tokens: int) -> None:
    """vLLM's chat logprobs: one entry per output token with its UTF-8 bytes and 2 alternatives."""
    assert len(content) == max_tokens and "".join(e.token for e in content) == text
    for entry in content:
        assert entry.logprob == pytest.approx(UNIFORM_LOGPROB)
        assert entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 2
        assert all(t.logprob == pytest.approx(UNIFORM_LOGPROB) for t in entry.top_logprobs)


@pytest.mark.parametrize("stream", [False, True], ids=("whole", "streamed"))
def test_openai_client_completion_with_vllm_fields_and_logprobs(
    client: openai.OpenAI, model: str, stream: bool
) -> None:
    prompt, max_tokens = "the openai client asks for a completion", 12
    args: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens}
    args |= {"logprobs": 2, **SAMPLING}
    if stream:
        chunks = list(
            client.completions.create(stream=True, stream_options={"include_usage": True}, **args)
        )
        assert_final_usage(chunks[-1], prompt, max_tokens)
        assert all(c.usage is None and c.system_fingerprint is None for c in chunks[:-1])
        choices = [c.choices[0] for c in chunks[:-1]]
        assert len(choices) > 1
    else:
        response = client.completions.create(**args)
        assert response.system_fingerprint == FINGERPRINT and response.model == model
        assert response.usage is not None
        assert response.usage.completion_tokens == max_tokens
        assert response.usage.prompt_tokens == count_prompt_tokens(prompt)
        choices = response.choices
        assert len(choices) == 1
    text = "".join(c.text for c in choices)
    assert text == engine_text(prompt, max_tokens, seed=SEED)[0]
    assert [c.finish_reason for c in choices] == [None] * (len(choices) - 1) + ["length"]
    assert all(stop_reason(c) is None for c in choices)
    assert_completion_logprobs(text, [c.logprobs for c in choices if c.logprobs], max_tokens)


@pytest.mark.parametrize("stream", [False, True], ids=("whole", "streamed"))
def test_openai_client_chat_with_vllm_fields_and_logprobs(
    client: openai.OpenAI, model: str, stream: bool
) -> None:
    prompt, max_tokens = "the openai client asks for a chat answer", 10
    args: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_completion_tokens": max_tokens,
        "logprobs": True,
        "top_logprobs": 2,
        **SAMPLING,
    }
    if stream:
        chunks = list(
            client.chat.completions.create(
                stream=True, stream_options={"include_usage": True}, **args
            )
        )
        assert_final_usage(chunks[-1], prompt, max_tokens)
        assert all(c.usage is None and c.system_fingerprint is None for c in chunks[:-1])
        choices = [c.choices[0] for c in chunks[:-1]]
        assert len(choices) > 1 and choices[0].delta.role == "assistant"
        text = "".join(c.delta.content or "" for c in choices)
        content = [e for c in choices if c.logprobs for e in c.logprobs.content or []]
    else:
        response = client.chat.completions.create(**args)
        assert response.system_fingerprint == FINGERPRINT and response.model == model
        assert response.usage is not None
        assert response.usage.completion_tokens == max_tokens
        assert response.usage.prompt_tokens == count_prompt_tokens(prompt)
        choices = response.choices
        assert len(choices) == 1 and choices[0].message.role == "assistant"
        text = choices[0].message.content or ""
        assert choices[0].logprobs is not None
        content = choices[0].logprobs.content or []
    assert text == engine_text(prompt, max_tokens, seed=SEED)[0]
    assert [c.finish_reason for c in choices] == [None] * (len(choices) - 1) + ["length"]
    assert all(stop_reason(c) is None for c in choices)
    assert_chat_logprobs(text, content, max_tokens)


def test_async_openai_client_streams_chat_and_completes(stack_port: int) -> None:
    chat_prompt, prompt, max_tokens = "async chat", "async completion", 8

    async def run() -> tuple[str, list[Any], Any]:
        async with openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{stack_port}/v1",
            api_key="any",
            timeout=HANG_S,
            max_retries=0,
        ) as client:
            model = (await client.models.list()).data[0].id
            stream = await client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": chat_prompt}],
                max_tokens=max_tokens,
                seed=SEED,
                stream=True,
            )
            chunks = [chunk async for chunk in stream]
            completion = await client.completions.create(
                model=model, prompt=prompt, max_tokens=max_tokens, seed=SEED
            )
            return model, chunks, completion

    model, chunks, completion = asyncio.run(run())
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == engine_text(chat_prompt, max_tokens, seed=SEED)[0]
    assert chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].system_fingerprint == FINGERPRINT
    (choice,) = completion.choices
    assert choice.text == engine_text(prompt, max_tokens, seed=SEED)[0]
    assert choice.finish_reason == "length" and choice.logprobs is None
    assert completion.usage.completion_tokens == max_tokens and completion.model == model


def test_openai_client_same_seed_same_text_on_both_stacks(port: int, zerolayer_port: int) -> None:
    messages = [{"role": "user", "content": "one seed, two stacks"}]

    def answers(stack: int) -> list[str]:
        with openai_client(stack) as client:
            model = client.models.list().data[0].id
            return [
                client.chat.completions.create(
                    model=model, messages=messages, max_tokens=16, seed=seed
                )
                .choices[0]
                .message.content
                or ""
                for seed in (SEED, SEED + 1)
            ]

    ours, theirs = answers(port), answers(zerolayer_port)
    assert ours == theirs
    assert ours[0] != ours[1], "the seed must matter, or this test proves nothing"


@pytest.mark.parametrize(
    ("field", "value", "code"),
    [("temperature", 3, "bad_request"), ("n", 2, "unsupported_parameter")],
)
def test_openai_client_raises_bad_request_with_code_and_param(
    client: openai.OpenAI, model: str, field: str, value: Any, code: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "refused"}], **{field: value}
        )
    error = caught.value
    assert error.status_code == 400
    assert error.code == code and error.param == field and error.type == "BadRequestError"
    assert isinstance(error.body, dict) and error.body["message"]


def test_openai_client_continuous_usage_on_every_chunk(client: openai.OpenAI, model: str) -> None:
    prompt, max_tokens = "running usage", 5
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=max_tokens,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
    )
    assert_final_usage(chunks[-1], prompt, max_tokens)
    running = [c.usage.completion_tokens if c.usage else None for c in chunks[:-1]]
    assert None not in running, f"chunks without usage: {running}"
    assert running == sorted(running) and running[-1] == max_tokens


def test_openai_client_unknown_field_is_ignored(client: openai.OpenAI, model: str) -> None:
    response = client.completions.create(
        model=model,
        prompt="an unknown field",
        max_tokens=4,
        seed=SEED,
        extra_body={"not_a_vllm_field": 1},
    )
    assert response.choices[0].text == engine_text("an unknown field", 4, seed=SEED)[0]
    assert response.choices[0].finish_reason == "length"


def _received(stats_dir: Path, sessions: set[str]) -> dict[int, int]:
    """How many of ``sessions`` each engine replica (pid) has received, from its request log."""
    routed = engine_routed(stats_dir, 0, 2**63)
    pids = (int(r.replica.removeprefix("pid")) for r in routed if r.session in sessions)
    return dict(Counter(pids))


def _engine_holding_all_before_a_first_token(
    stats_dir: Path, sessions: set[str], runner: threading.Thread, headed: threading.Event
) -> int | None:
    """The engine replica holding the most of ``sessions`` once the engines have received all
    of them and none has had its first token (its response head); None when a first token came
    first. Events, not times: on a loaded host the prefills may end before the last request is
    dispatched, and the kill must find requests still before their first token."""
    end = time.monotonic() + HANG_S
    while runner.is_alive() and not headed.is_set():
        received = _received(stats_dir, sessions)
        if sum(received.values()) >= len(sessions):
            victim = max(received, key=lambda pid: received[pid])
            return None if headed.is_set() else victim
        assert time.monotonic() < end, f"{len(sessions)} requests not received within {HANG_S} s"
        time.sleep(0.05)
    return None


def _long_prefills(
    port: int, tokens: int, count: int
) -> tuple[threading.Thread, list[Reply], threading.Event]:
    """``count`` streamed requests of ``tokens``-token prompts (each its own prefix and session),
    sent at once from a thread, sessions ``kill-<tokens>-<i>``; their replies fill the list as the
    thread ends, and the event is set when the first of them has its first token."""
    prompt = "p" * (4 * tokens)
    headed = threading.Event()
    jobs = [
        (port, "/v1/completions", {"prompt": f"{tokens}-{i}{prompt}", "max_tokens": 4,
         "stream": True}, {"zl-session": f"kill-{tokens}-{i}"}, HANG_S, headed)
        for i in range(count)
    ]  # fmt: skip
    replies: list[Reply] = []
    runner = threading.Thread(target=lambda: replies.extend(concurrently(jobs)))
    runner.start()
    return runner, replies, headed


def test_engine_replica_killed_before_first_token_is_retried_and_replaced(
    baseline: BaselineHandle, port: int, stats_dir: Path
) -> None:
    """Ten long prefills received by the engines at once, and the replica holding the most of
    them killed before any has its first token. Five 24k-token prefills on one sim replica give
    their first tokens over 1.1-4.1 s (12k: 0.4-1.5 s, which a loaded host's proxy took to say
    they were all in flight), so a first token relayed to its client seconds late still leaves
    some before theirs. The prompt doubles until the host dispatches all ten before a first
    token."""
    before = baseline.pids()["engine"]
    for tokens in (24_000, 48_000, 96_000):
        runner, replies, headed = _long_prefills(port, tokens, 10)
        sessions = {f"kill-{tokens}-{i}" for i in range(10)}
        victim = _engine_holding_all_before_a_first_token(stats_dir, sessions, runner, headed)
        if victim is not None:
            break
        runner.join()
    else:
        pytest.fail("ten prefills of 96k tokens were never all received before a first token")
    assert victim in before
    os.kill(victim, signal.SIGKILL)
    runner.join(HANG_S + 10)
    assert len(replies) == 10
    assert [r.status for r in replies] == [200] * 10, [r.body[:200] for r in replies]
    for events in (r.events() for r in replies):
        if events[-1] != "[DONE]":
            # On a loaded machine a request may get its first token before the kill: that one is
            # not retried (by design) and ends with the mid-stream error, after its text.
            assert events[-1]["error"]["code"] == "engine_down" and len(events) > 1, events[-3:]
    retried = [int(r.headers["zl-attempts"]) for r in replies]
    assert max(retried) >= 2, f"no request was retried elsewhere: {retried}"
    after = wait_for(
        lambda: (p := baseline.pids()["engine"]) and len(p) == 2 and victim not in p and p,
        HANG_S,
        "Serve replacing the engine replica",
    )
    assert set(after) - set(before)


def test_ingress_killed_gives_explicit_errors_then_is_restored(
    baseline: BaselineHandle, port: int
) -> None:
    """The stream the killed ingress served ends, not completed, and every call made before Serve
    has restored it ends by itself, with an answer or an explicit error. No speed is judged: on
    a loaded host the proxy may hold a call until the new ingress is up (CI saw a call held past
    10 s), so a call that is still open after :data:`HANG_S` is a hang."""
    victim = baseline.pids()["ingress"][0]
    body = {"prompt": "long", "max_tokens": 3000, "stream": True}
    inflight: list[Reply] = []
    runner = threading.Thread(
        target=lambda: inflight.append(call(port, "/v1/completions", body, timeout=HANG_S))
    )
    runner.start()
    wait_for(lambda: orjson.loads(call(port, "/health").body)["inflight"] >= 1, HANG_S, "dispatch")
    killed_at = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    runner.join(HANG_S + 5)
    assert not runner.is_alive(), "the client hung on the dead ingress"
    reply = inflight[0]
    print(f"the killed ingress's stream ended {time.monotonic() - killed_at:.1f} s after the kill")
    done = reply.status == 200 and reply.body.endswith(b"data: [DONE]\n\n")
    assert not done, "a stream served by the killed ingress cannot have completed"
    assert reply.error or reply.status >= 500
    for _ in range(3):  # meanwhile: an answer or an explicit error, never a hang
        after = call(port, "/v1/completions", {"prompt": "x", "max_tokens": 2}, timeout=HANG_S)
        assert "timed out" not in after.error
        assert after.status in (200, 500, 502, 503, 504) or after.error
    wait_for(
        lambda: victim not in (p := baseline.pids()["ingress"]) and len(p) == 1,
        HANG_S,
        "Serve restoring the ingress",
    )
    wait_for(lambda: call(port, "/health", timeout=5).status == 200, HANG_S, "ingress healthy")
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
