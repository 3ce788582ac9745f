"""The replica over real loopback HTTP/2: multiplexing, big bodies, refusals, deadlines, resets."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from serving.engine import NullEngine, SimConfig, SimEngine
from serving.engine.streams import detokenize, token_ids
from serving.wire.tokens import count_prompt_tokens, request_seed
from tests.support.server_client import H2Client, run, wait_all
from tests.support.waiting import HANG_GUARD_S, eventually
from zerolayer.scheduler import SchedulerConfig
from zerolayer.server import start_replica
from zerolayer.server.limits import Limits

NO_ERROR = 0
CANCEL = 8
SMALL = {"model_shape": "llama-3.2-1b"}


def expected_text(prompt: str, max_tokens: int, seed: int | None = None) -> str:
    return detokenize(token_ids(request_seed(prompt, seed), max_tokens))


@run
async def test_hundreds_of_concurrent_streams_on_one_connection() -> None:
    engine = SimEngine(SimConfig(**SMALL, max_num_seqs=512))
    async with await start_replica(engine) as replica:
        client = await H2Client.connect("127.0.0.1", replica.port)
        streams = [
            client.completion(f"prompt {i}", max_tokens=4, stream=i % 2 == 0) for i in range(400)
        ]
        await wait_all(streams, 20)
        for i, stream in enumerate(streams):
            assert stream.status == 200, stream.data
            assert stream.reset_code is None
            prompt = f"prompt {i}"
            if i % 2 == 0:
                events = stream.events()
                assert events[-1] == "[DONE]"
                assert events[-2]["usage"]["completion_tokens"] == 4
                assert stream.text() == expected_text(prompt, 4)
            else:
                body = stream.json()
                assert body["choices"][0]["text"] == expected_text(prompt, 4)
                assert body["usage"] == {
                    "prompt_tokens": count_prompt_tokens(prompt),
                    "completion_tokens": 4,
                    "total_tokens": count_prompt_tokens(prompt) + 4,
                }
        assert replica.replica.active == 0
        await client.close()
    await engine.close()


@run
async def test_a_512_kib_body_is_read_whole() -> None:
    engine = NullEngine()
    async with await start_replica(engine) as replica:
        client = await H2Client.connect("127.0.0.1", replica.port, window=65_535)
        prompt = "x" * (512 * 1024)
        stream = client.completion(prompt, max_tokens=3, stream=True)
        await wait_all([stream], 10)
        assert stream.status == 200
        assert stream.sent == len(orjson.dumps({"max_tokens": 3, "stream": True,
                                                "prompt": prompt}))  # fmt: skip
        final = stream.events()[-2]
        assert final["usage"]["prompt_tokens"] == count_prompt_tokens(prompt) == 131_072
        await client.close()
    await engine.close()


@run
async def test_refusal_arrives_before_the_body_is_uploaded() -> None:
    """zl-prompt-tokens beyond the KV cache: refused on HEADERS, then RST_STREAM(NO_ERROR)."""
    engine = SimEngine(SimConfig(**SMALL, num_kv_blocks=64))
    async with await start_replica(engine) as replica:
        client = await H2Client.connect("127.0.0.1", replica.port)
        body = orjson.dumps({"prompt": "y" * (512 * 1024), "max_tokens": 16})
        stream = client.request(
            "/v1/completions",
            body,
            headers=[("zl-prompt-tokens", "131072"), ("zl-max-tokens", "16")],
        )
        await wait_all([stream], 5)
        assert stream.status == 400
        assert stream.error == "prompt_too_long"
        assert stream.json()["error"]["code"] == "prompt_too_long"
        assert stream.reset_code == NO_ERROR
        assert stream.sent < len(body) / 4, (stream.sent, len(body))
        # the connection is fine afterwards
        ok = client.completion("after", max_tokens=2)
        await wait_all([ok], 5)
        assert ok.status == 200
        await client.close()
    await engine.close()


@run
async def test_queue_full_refusal_on_headers_alone() -> None:
    engine = SimEngine(SimConfig(**SMALL, max_num_seqs=1))
    config = SchedulerConfig.for_engine(engine, max_queue=(1, 1, 1))
    async with await start_replica(engine, scheduler_config=config) as replica:
        client = await H2Client.connect("127.0.0.1", replica.port)
        running = client.completion("first", max_tokens=5000, stream=True)
        await asyncio.wait_for(running.got_data.wait(), 5)
        queued = client.completion("second", max_tokens=2)
        await eventually(lambda: len(replica.replica.queue) == 1, "the second request queued")
        body = orjson.dumps({"prompt": "z" * (511 * 1024), "max_tokens": 4})
        refused = client.request(
            "/v1/completions", body, headers=[("zl-prompt-tokens", "130816"),
                                              ("zl-max-tokens", "4")]
        )  # fmt: skip
        await wait_all([refused], 5)
        assert refused.status == 429
        assert refused.error == "queue_full"
        assert int(refused.headers[b"retry-after-ms"]) > 0
        assert refused.reset_code == NO_ERROR
        assert refused.sent < len(body) / 4
        client.reset(running)
        await wait_all([queued], 5)
        assert queued.status == 200
        await client.close()
    await engine.close()


@run
async def test_deadline_expiring_mid_stream() -> None:
    engine = SimEngine(SimConfig(**SMALL))
    async with await start_replica(engine) as replica:
        client = await H2Client.connect("127.0.0.1", replica.port)
        # The first token must come within the deadline (else a 504, not a cut stream): 2 s is
        # far past any first token, and 5000 tokens take the sim over 7 s, so the cut is mid-way.
        stream = client.completion(
            "slow", max_tokens=5000, stream=True, headers=[("zl-deadline-ms", "2000")]
        )
        await wait_all([stream], HANG_GUARD_S)
        assert stream.status == 200
        assert stream.reset_code == CANCEL
        events = stream.events()
        assert len(events) >= 2
        assert events[-1]["error"]["code"] == "deadline_exceeded"
        assert "[DONE]" not in events
        await eventually(
            lambda: engine.stats().running == 0 and engine.kv.used_blocks == 0,
            "the engine let go of the cut request",
        )
        assert replica.replica.failures["deadline_exceeded"] == 1
        await client.close()
    await engine.close()


@run
async def test_deadline_before_output_is_a_504() -> None:
    engine = SimEngine(SimConfig(**SMALL, max_num_seqs=1))
    async with await start_replica(engine) as replica:
        client = await H2Client.connect("127.0.0.1", replica.port)
        hog = client.completion("hog", max_tokens=5000, stream=True)
        await asyncio.wait_for(hog.got_data.wait(), 5)
        late = client.completion("late", max_tokens=4, headers=[("zl-deadline-ms", "100")])
        await wait_all([late], 5)
        assert late.status == 504
        assert late.error == "deadline_exceeded"
        assert len(replica.replica.queue) == 0
        client.reset(hog)
        await client.close()
    await engine.close()


@run
async def test_client_reset_aborts_the_engine_request() -> None:
    engine = SimEngine(SimConfig(**SMALL))
    async with await start_replica(engine) as replica:
        client = await H2Client.connect("127.0.0.1", replica.port)
        stream = client.completion("long", max_tokens=5000, stream=True)
        await asyncio.wait_for(stream.got_data.wait(), 5)
        assert engine.stats().running == 1
        client.reset(stream)
        await eventually(lambda: engine.stats().running == 0, "the engine request aborted")
        assert engine.kv.used_blocks == 0
        assert replica.replica.active == 0
        assert replica.replica.outcomes["cancelled"] == 1
        await client.close()
    await engine.close()


@run
async def test_bad_requests_get_4xx_while_other_streams_finish() -> None:
    engine = SimEngine(SimConfig(**SMALL))
    async with await start_replica(engine, max_body_bytes=64 * 1024) as replica:
        client = await H2Client.connect("127.0.0.1", replica.port)
        good = [client.completion(f"good {i}", max_tokens=20, stream=True) for i in range(5)]
        bad = {
            "malformed": client.request("/v1/completions", b'{"prompt": "x", '),
            "bad_field": client.request(
                "/v1/completions", orjson.dumps({"prompt": "x", "temperature": "hot"})
            ),
            "not_object": client.request("/v1/completions", b"[1, 2]"),
            "bad_priority": client.completion("x", headers=[("zl-priority", "urgent")]),
            "bad_deadline": client.completion("x", headers=[("zl-deadline-ms", "-5")]),
            "huge_deadline": client.completion("x", headers=[("zl-deadline-ms", "99999999999")]),
            "bad_max_tokens": client.completion("x", max_tokens=0),
            "header_body_disagree": client.completion(
                "x", max_tokens=4, headers=[("zl-max-tokens", "5")]
            ),
            "prompt_tokens_disagree": client.completion(
                "x", max_tokens=4, headers=[("zl-prompt-tokens", "7"), ("zl-max-tokens", "4")]
            ),
            "unknown_path": client.request("/v2/nothing", b"{}"),
            "wrong_method": client.request("/v1/completions", method="GET"),
            "oversize_declared": client.request("/v1/completions", b"a" * (100 * 1024)),
            "oversize_streamed": client.request(
                "/v1/completions", b"a" * (100 * 1024), content_length=False
            ),
        }
        await wait_all([*good, *bad.values()], 10)
        expected = {
            "malformed": (400, "bad_request"),
            "bad_field": (400, "bad_request"),
            "not_object": (400, "bad_request"),
            "bad_priority": (400, "bad_request"),
            "bad_deadline": (400, "bad_request"),
            "huge_deadline": (400, "bad_request"),
            "bad_max_tokens": (400, "bad_request"),
            "header_body_disagree": (400, "bad_request"),
            "prompt_tokens_disagree": (400, "bad_request"),
            "unknown_path": (404, "not_found"),
            "wrong_method": (405, "method_not_allowed"),
            "oversize_declared": (413, "payload_too_large"),
            "oversize_streamed": (413, "payload_too_large"),
        }
        for name, (status, code) in expected.items():
            stream = bad[name]
            assert (stream.status, stream.error) == (status, code), (name, stream.data)
            assert stream.json()["error"]["code"] == code
        error = bad["bad_field"].json()["error"]
        assert error["param"] == "temperature" and error["type"] == "BadRequestError"
        assert error["message"] == "temperature: must be a number in [0, 2]"
        for i, stream in enumerate(good):
            assert stream.status == 200
            assert stream.reset_code is None
            assert stream.text() == expected_text(f"good {i}", 20)
        assert client.terminated is None
        assert not client.lost.is_set()
        await client.close()
    await engine.close()


@run
async def test_strict_priority_then_earliest_deadline_first() -> None:
    engine = SimEngine(SimConfig(**SMALL, max_num_seqs=1))
    async with await start_replica(engine) as replica:
        client = await H2Client.connect("127.0.0.1", replica.port)
        hog = client.completion("hog", max_tokens=2000, stream=True)
        await asyncio.wait_for(hog.got_data.wait(), 5)
        order: list[str] = []
        specs = [
            ("low", "low", "60000"),
            ("normal-late", "normal", "60000"),
            ("normal-soon", "normal", "30000"),
            ("high", "high", "60000"),
        ]
        streams = {}
        for name, priority, deadline in specs:
            streams[name] = client.completion(
                name, max_tokens=1, headers=[("zl-priority", priority),
                                             ("zl-deadline-ms", deadline)]
            )  # fmt: skip
        await eventually(lambda: len(replica.replica.queue) == 4, "all four requests queued")
        client.reset(hog)

        async def note(name: str) -> None:
            await streams[name].closed.wait()
            order.append(name)

        await asyncio.wait_for(asyncio.gather(*(note(n) for n in streams)), 10)
        assert order == ["high", "normal-soon", "normal-late", "low"]
        await client.close()
    await engine.close()


@run
async def test_kv_watermark_refuses_low_before_normal() -> None:
    engine = SimEngine(SimConfig(**SMALL, num_kv_blocks=200))
    async with await start_replica(engine) as replica:
        client = await H2Client.connect("127.0.0.1", replica.port)
        # 2960 prompt tokens: 186 of the 200 blocks once decoding (93 %), at most 195 (97.5 %).
        hog = client.completion("h" * (2960 * 4), max_tokens=150, stream=True)
        await asyncio.wait_for(hog.got_data.wait(), 5)
        assert engine.kv.used_blocks >= 186
        cost = [("zl-prompt-tokens", "1"), ("zl-max-tokens", "15")]
        low = client.completion("x", max_tokens=15, headers=[*cost, ("zl-priority", "low")])
        normal = client.completion("x", max_tokens=15, headers=cost)
        await wait_all([low, normal], 5)
        assert (low.status, low.error) == (503, "kv_exhausted")
        assert int(low.headers[b"retry-after-ms"]) >= 20
        assert normal.status == 200
        client.reset(hog)
        await client.close()
    await engine.close()


@run
async def test_ping_is_answered_and_keepalive_pings_the_client() -> None:
    # A PING unanswered for keepalive_s closes the connection: 0.5 s is far past the few loop
    # turns an ACK takes, even on a loaded host (test_server_backpressure winds it by hand).
    async with await start_replica(NullEngine(), limits=Limits(keepalive_s=0.5)) as replica:
        client = await H2Client.connect("127.0.0.1", replica.port)
        client.ping()
        await eventually(
            lambda: client.pings_received >= 2 or client.lost.is_set(), "two keepalive PINGs"
        )
        assert not client.lost.is_set()
        assert client.pings_received >= 2
        await client.close()


@run
async def test_health_models_and_metrics() -> None:
    engine = SimEngine(SimConfig(**SMALL))
    async with await start_replica(engine, name="r1") as replica:
        client = await H2Client.connect("127.0.0.1", replica.port)
        done = client.completion("counted", max_tokens=3)
        await wait_all([done], 5)
        client.completion("x", headers=[("zl-priority", "nope")])
        health = await client.get("/health")
        assert health.status == 200
        payload = health.json()
        assert payload["health"] == 1.0
        assert payload["draining"] is False
        assert payload["replica"] == "r1"
        assert {"kv_usage", "queue_depth"} <= set(payload)
        models = (await client.get("/v1/models")).json()
        assert models["data"][0]["id"] == "llama-3.2-1b"
        metrics = (await client.get("/metrics")).data.decode()
        for name in ("vllm:kv_cache_usage_perc", "vllm:num_requests_running",
                     "vllm:num_requests_waiting", "vllm:num_preemptions_total"):  # fmt: skip
            assert f'\n{name}{{model_name="llama-3.2-1b"}} ' in metrics
        assert 'zl_refusals_total{code="bad_request"} 1' in metrics
        assert 'zl_requests_total{outcome="completed"} 1' in metrics
        assert 'vllm:generation_tokens_total{model_name="llama-3.2-1b"} 3' in metrics
        await client.close()
    await engine.close()


@run
async def test_drain_refuses_new_streams_and_finishes_in_flight() -> None:
    engine = SimEngine(SimConfig(**SMALL))
    replica = await start_replica(engine)
    client = await H2Client.connect("127.0.0.1", replica.port)
    inflight = client.completion("inflight", max_tokens=40, stream=True)
    await asyncio.wait_for(inflight.got_data.wait(), 5)
    drain = asyncio.ensure_future(replica.drain(5))
    await asyncio.sleep(0.01)
    refused = client.completion("new", max_tokens=2)
    await wait_all([refused], 5)
    assert (refused.status, refused.error) == (503, "draining")
    health = (await client.get("/health")).json()
    assert health["draining"] is True and health["health"] == 0.0
    assert await drain is True
    assert inflight.status == 200 and inflight.events()[-1] == "[DONE]"
    await replica.close()
    await asyncio.wait_for(client.lost.wait(), 5)
    await client.close()
    await engine.close()


@pytest.mark.parametrize("chat", [False, True])
@run
async def test_chat_and_completion_non_streaming(chat: bool) -> None:
    async with await start_replica(NullEngine()) as replica:
        client = await H2Client.connect("127.0.0.1", replica.port)
        stream = client.completion("hi there", max_tokens=6, chat=chat, seed=7)
        await wait_all([stream], 5)
        body = stream.json()
        choice = body["choices"][0]
        text = choice["message"]["content"] if chat else choice["text"]
        assert text == expected_text("hi there", 6, seed=7)
        assert body["object"] == ("chat.completion" if chat else "text_completion")
        assert body["usage"]["completion_tokens"] == 6
        assert stream.headers[b"zl-request-id"].startswith(b"replica-")
        await client.close()


@run
async def test_responses_larger_than_the_client_window_wait_for_window_updates() -> None:
    async with await start_replica(NullEngine()) as replica:
        client = await H2Client.connect("127.0.0.1", replica.port, window=65_535)
        big = [client.completion(f"big {i}", max_tokens=30_000) for i in range(3)]
        streamed = client.completion("big stream", max_tokens=30_000, stream=True)
        await wait_all([*big, streamed], HANG_GUARD_S)  # several seconds on a loaded host
        for i, stream in enumerate(big):
            assert len(stream.data) > 3 * 65_535
            assert stream.json()["choices"][0]["text"] == expected_text(f"big {i}", 30_000)
        assert streamed.text() == expected_text("big stream", 30_000)
        assert replica.replica.outcomes["completed"] == 4
        await client.close()
