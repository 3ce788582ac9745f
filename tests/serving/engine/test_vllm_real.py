"""The vLLM adapter against the real CPU vLLM (``nox -s vllm``), serving the offline tiny model.

One engine serves every in-process test (vLLM starts in about 25 s on two cores), on one event
loop that outlives the tests, since ``AsyncLLM`` binds its output handler to the loop it first
runs on. Its KV cache is deliberately small (8 blocks of 128 tokens), so the KV-pressure test can
fill it. The last test starts ``zl-replica --engine vllm`` as a subprocess and streams over h2c
and HTTP/1.1. Where vLLM is not installed, everything here skips with the reason.
"""

from __future__ import annotations

import asyncio
import http.client
import importlib.util
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import orjson
import psutil
import pytest

from harness.stacks import VLLM_READY_TIMEOUT_S, ReplicaProcess, descendants
from serving.engine import EngineError, EngineRequest, make_engine
from serving.engine.settings import EngineSettings
from serving.engine.vllm_engine import VllmEngine
from serving.wire.contract import KV_EXHAUSTED, PRIORITY_NORMAL, RequestMeta
from serving.wire.tokens import count_prompt_tokens
from tests.support.server_client import H2Client, wait_all
from tests.support.waiting import HANG_GUARD_S
from zerolayer.scheduler import SchedulerConfig, decide

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vllm is not installed (the CPU build installs with: nox -s vllm)",
    ),
]

T = TypeVar("T")
KV_BYTES = 1 << 20  # 1024 tokens of this model's KV: 8 blocks of 128 on the CPU backend
MAX_MODEL_LEN = 512
STEP_TOKENS = 128  # vLLM's max_num_batched_tokens: a longer prompt is prefilled in chunks
PROMPT = "The replica streams tokens from the engine to the client"
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from bench.tinymodel import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("vllm") / "tiny")


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def engine(model_dir: Path, loop: asyncio.AbstractEventLoop) -> Iterator[VllmEngine]:
    async def start() -> VllmEngine:
        engine = make_engine(
            "vllm",
            model=str(model_dir),
            max_model_len=MAX_MODEL_LEN,
            kv_cache_memory_bytes=KV_BYTES,
            max_num_seqs=8,
            max_num_batched_tokens=STEP_TOKENS,
        )
        assert isinstance(engine, VllmEngine)
        return engine

    with pytest.MonkeyPatch.context() as env:
        for key, value in OFFLINE.items():
            env.setenv(key, value)
        engine = loop.run_until_complete(start())
        yield engine
        loop.run_until_complete(engine.close())


def on(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T]) -> T:
    return loop.run_until_complete(coro)


def request(engine: VllmEngine, rid: str, prompt: str, max_tokens: int) -> EngineRequest:
    count = engine.count_tokens(prompt)
    assert count is not None
    return EngineRequest(rid, count, max_tokens, seed=7, prompt=prompt)


async def collect(engine: VllmEngine, req: EngineRequest) -> list:
    return [chunk async for chunk in engine.generate(req)]


def long_prompt(engine: VllmEngine, tokens: int) -> str:
    """A prompt of at least ``tokens`` of the model's tokens."""
    text = PROMPT
    while (engine.count_tokens(text) or 0) < tokens:
        text += " " + PROMPT
    return text


def test_the_cpu_defaults_and_the_tokenizer_are_vllms(engine: VllmEngine) -> None:
    assert engine.api.on_cpu and engine.tokenizer is not None
    assert (engine.num_blocks, engine.block_size) == (8, 128)
    ids = engine.tokenizer.encode(PROMPT)
    assert engine.count_tokens(PROMPT) == len(ids) < len(PROMPT.encode()) / 2


def test_the_engine_reports_the_settings_vllm_settled_on(engine: VllmEngine) -> None:
    """From vLLM's own config: the CPU backend's block size and dtype, V1's chunked prefill."""
    assert engine.settings() == EngineSettings(
        max_num_seqs=8,
        max_num_batched_tokens=STEP_TOKENS,
        max_model_len=MAX_MODEL_LEN,
        block_size=128,
        kv_blocks=8,
        prefix_caching=True,
        chunked_prefill=True,
        dtype="float32",
        temperature=0.0,
    )


def test_streams_exactly_max_tokens_in_chunks_of_the_steps_since_the_last_read(
    engine: VllmEngine, loop: asyncio.AbstractEventLoop
) -> None:
    """A chunk per step when the reader keeps pace; on a loaded host vLLM's output collector
    merges the steps the reader missed into one chunk (CI saw [1, 1, 3] for 5 tokens), so what
    is judged is that no chunk is empty, the tokens add up and only the last one finishes."""
    reqs = [request(engine, f"exact{i}", f"{PROMPT} {i}", 5 + 7 * i) for i in range(3)]

    async def all_of() -> list[list]:
        return await asyncio.gather(*(collect(engine, r) for r in reqs))

    results = on(loop, all_of())
    for req, chunks in zip(reqs, results, strict=True):
        sizes = [len(c.token_ids) for c in chunks]
        assert min(sizes) >= 1 and sum(sizes) == req.max_tokens, sizes
        assert [c.finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
        assert chunks[-1].completion_tokens == req.max_tokens
        assert {c.prompt_tokens for c in chunks} == {req.prompt_tokens}


def test_seeded_requests_prefilled_in_chunks_stream_to_the_end(
    engine: VllmEngine, loop: asyncio.AbstractEventLoop
) -> None:
    """vLLM's CPU build fails a step (``CPU Generator does not use offset``) when a seeded,
    randomly sampled request's prefill is chunked; the adapter's default sampling is greedy,
    where the seed needs no generator, so profile C's long prompts run."""
    prompt = long_prompt(engine, 3 * STEP_TOKENS)
    reqs = [request(engine, f"chunked{i}", f"{i} {prompt}", 4) for i in range(3)]

    async def all_of() -> list[list]:
        return await asyncio.gather(*(collect(engine, r) for r in reqs))

    for req, chunks in zip(reqs, on(loop, all_of()), strict=True):
        assert req.prompt_tokens > STEP_TOKENS
        assert chunks[-1].completion_tokens == req.max_tokens
        assert chunks[-1].finish_reason == "length"


def test_greedy_tokens_match_vllms_own_generate(
    engine: VllmEngine, loop: asyncio.AbstractEventLoop
) -> None:
    """The adapter's tokenization and delta stitching against vLLM tokenizing the text itself."""
    from vllm import SamplingParams

    async def reference() -> Any:
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        final = None
        async for out in engine.llm.generate(PROMPT, params, "reference"):
            final = out
        return final

    chunks = on(loop, collect(engine, request(engine, "greedy", PROMPT, 24)))
    final = on(loop, reference())
    assert [i for c in chunks for i in c.token_ids] == list(final.outputs[0].token_ids)
    assert "".join(c.text for c in chunks) == final.outputs[0].text
    assert chunks[-1].prompt_tokens == len(final.prompt_token_ids)


def test_load_signal_is_vllms_scheduler_stats(
    engine: VllmEngine, loop: asyncio.AbstractEventLoop
) -> None:
    async def main() -> None:
        records = engine.signal.records
        streams = [engine.generate(request(engine, f"load{i}", PROMPT, 200)) for i in range(4)]
        for stream in streams:  # two chunks each: every request has been through a step
            await anext(stream)
            await anext(stream)
        stats = engine.stats()
        assert engine.signal.records > records
        assert (stats.running, stats.waiting, stats.max_num_seqs) == (4, 0, 8)
        assert stats.kv_blocks_used >= 1 and stats.kv_blocks_total == 8
        for stream in streams:
            await stream.aclose()

    on(loop, main())


def test_abort_frees_the_request_inside_vllm(
    engine: VllmEngine, loop: asyncio.AbstractEventLoop
) -> None:
    async def main() -> None:
        stream = engine.generate(request(engine, "doomed", PROMPT, 400))
        await anext(stream)
        engine.abort("doomed")
        rest = [chunk async for chunk in stream]
        assert rest[-1].finish_reason == "abort"
        await asyncio.gather(*engine._aborts)  # vLLM has taken the abort
        # A probe request then runs alone: vLLM's own scheduler no longer counts the aborted one
        # (the stats that come with its last token are taken after it finished: 0).
        running = [
            engine.stats().running async for _ in engine.generate(request(engine, "p", PROMPT, 6))
        ]
        assert running[0] == max(running) == 1
        assert engine.llm.output_processor.get_num_unfinished_requests() == 0

    on(loop, main())


def test_kv_pressure_refusal_comes_from_vllms_kv_cache_usage(
    engine: VllmEngine, loop: asyncio.AbstractEventLoop
) -> None:
    config = SchedulerConfig.for_engine(engine)
    big = long_prompt(engine, 250)
    cost = {"prompt_tokens": engine.count_tokens(big), "max_tokens": 200}
    meta = RequestMeta("s", "t", PRIORITY_NORMAL, 60_000, None, None)
    assert decide(meta, engine.stats(), config=config, **cost).admitted, "idle: it fits"

    async def main() -> None:
        streams = [engine.generate(request(engine, f"kv{i}", big, 200)) for i in range(2)]
        for stream in streams:
            await anext(stream)
            await anext(stream)
        stats = engine.stats()
        assert stats.kv_usage >= 0.5, stats  # two prompts of 250+ tokens: 3 blocks each of 8
        refused = decide(meta, stats, config=config, **cost)
        assert refused.error == KV_EXHAUSTED, refused
        for stream in streams:
            await stream.aclose()

    on(loop, main())


def test_zl_replica_serves_vllm_over_h2c_and_http1(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Streams over both protocols; usage counts the prompt in the model's tokens. Killed as
    chaos kills a pod, the replica takes vLLM's engine core (its child process) with it."""
    import transformers

    for key, value in OFFLINE.items():
        monkeypatch.setenv(key, value)
    options = {
        "model": str(model_dir),
        "max_model_len": MAX_MODEL_LEN,
        "kv_cache_memory_bytes": KV_BYTES * 4,
    }
    replica = ReplicaProcess(
        "vllm", options, log_path=tmp_path / "replica.log", ready_timeout_s=VLLM_READY_TIMEOUT_S
    )
    try:
        port = replica.port
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
        prompt_tokens = len(tokenizer(PROMPT)["input_ids"])
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        body = {"prompt": PROMPT, "max_tokens": 12, "stream": True, "seed": 3,
                "stream_options": {"include_usage": True}}  # fmt: skip
        conn.request("POST", "/v1/completions", orjson.dumps(body))
        response = conn.getresponse()
        assert response.status == 200
        sse = response.read().split(b"\n\n")
        conn.close()
        events = [orjson.loads(b[6:]) for b in sse if b.startswith(b"data: {")]
        # all twelve tokens, in as many chunks as the engine's pace gave (a chunk carries every
        # token vLLM produced since the last read: fewer chunks on a loaded host)
        assert any(e.get("choices") for e in events)
        assert events[-1]["usage"]["completion_tokens"] == 12
        assert sse[-2] == b"data: [DONE]"

        async def h2() -> None:
            client = await H2Client.connect("127.0.0.1", port)
            streams = [
                client.completion(PROMPT, 10, stream=True, stream_options={"include_usage": True})
                for _ in range(3)
            ]
            await wait_all(streams, 60)
            for stream in streams:
                assert stream.status == 200 and stream.events()[-1] == "[DONE]"
                usage = stream.events()[-2]["usage"]
                assert usage["completion_tokens"] == 10
                assert usage["prompt_tokens"] == prompt_tokens != count_prompt_tokens(PROMPT)
            await client.close()

        asyncio.run(h2())
        engine_core = descendants(replica.pid)
        assert engine_core, "vLLM's engine core runs as a child of the replica"
        replica.kill()
        _, alive = psutil.wait_procs(engine_core, timeout=HANG_GUARD_S)  # CI saw 10 s outlasted
        assert not alive, f"left running: {[p.pid for p in alive]}"
    finally:
        replica.stop()


def test_sampling_fields_and_logprobs_reach_vllm(
    engine: VllmEngine, loop: asyncio.AbstractEventLoop
) -> None:
    """vLLM's own sampling extensions and OpenAI's logit_bias go through to SamplingParams, and
    each streamed token comes back with its logprob and the two most likely alternatives."""
    sampling = {
        "temperature": 0.0,
        "repetition_penalty": 1.2,
        "min_p": 0.1,
        "logit_bias": {"5": -100},
    }
    req = request(engine, "sampled", PROMPT, 8)
    req.sampling, req.logprobs = sampling, 2
    chunks = on(loop, collect(engine, req))
    assert chunks[-1].finish_reason == "length" and chunks[-1].completion_tokens == 8
    entries = [entry for c in chunks for entry in c.logprobs or []]
    assert [len(c.logprobs or []) for c in chunks] == [len(c.token_ids) for c in chunks]
    assert len(entries) == 8 and 5 not in [i for c in chunks for i in c.token_ids]
    for entry in entries:
        assert entry.logprob <= 0 and len(entry.top) == 2, entry
        assert entry.top[0][1] >= entry.top[1][1], "most likely first"
    # vLLM's decoded tokens: the streamed text, less the replacement characters it shows for
    # a byte-level token that ends inside a UTF-8 character (the tiny model's noise has some)
    text = "".join(c.text for c in chunks)
    assert "".join(e.token for e in entries) == text.replace("\ufffd", "")


def test_a_sampling_value_vllm_refuses_is_a_bad_request(
    engine: VllmEngine, loop: asyncio.AbstractEventLoop
) -> None:
    req = request(engine, "refused", PROMPT, 4)
    req.sampling = {"min_tokens": 10}
    with pytest.raises(EngineError) as refused:
        on(loop, collect(engine, req))
    assert refused.value.code == "bad_request"
    assert "min_tokens must be less than or equal to max_tokens=4" in str(refused.value)


def test_a_stop_string_ends_the_stream_with_stop(
    engine: VllmEngine, loop: asyncio.AbstractEventLoop
) -> None:
    """The stop string is the text of a token greedy decoding produces, so vLLM stops there,
    before ``max_tokens``, and leaves the string out of the text."""
    greedy = on(loop, collect(engine, request(engine, "unstopped", PROMPT, 12)))
    text = "".join(c.text for c in greedy)
    stop = next(c.text for c in greedy[2:] if c.text.strip())
    req = request(engine, "stopped", PROMPT, 12)
    req.sampling = {"stop": [stop]}
    chunks = on(loop, collect(engine, req))
    assert chunks[-1].finish_reason == "stop"
    assert chunks[-1].completion_tokens < 12
    assert "".join(c.text for c in chunks) == text[: text.index(stop)]


def test_random_sampling_of_a_chunked_prefill_streams_to_the_end(
    engine: VllmEngine, loop: asyncio.AbstractEventLoop
) -> None:
    """A request's temperature reaches vLLM; on the CPU build a seeded, randomly sampled request
    whose prefill is chunked would fail vLLM's step and its engine core with it, so the adapter
    samples it unseeded. Last in the file, so that an engine core it killed fails no other
    test."""
    req = request(engine, "random", long_prompt(engine, 2 * STEP_TOKENS), 4)
    req.sampling = {"temperature": 0.8, "top_p": 0.9}
    assert req.prompt_tokens > STEP_TOKENS
    chunks = on(loop, collect(engine, req))
    assert chunks[-1].finish_reason == "length" and chunks[-1].completion_tokens == 4
