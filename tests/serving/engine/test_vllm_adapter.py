"""The vLLM adapter's mapping, against a stand-in for vLLM's AsyncLLM (fast unit tests).

The adapter against the real CPU vLLM is ``test_vllm_real.py`` beside this file (``nox -s
vllm``); here ``FakeAsyncLLMForTests`` stands in for the external system: it mimics the parts of
``vllm.v1.engine.async_llm.AsyncLLM`` the adapter uses (``generate`` yielding DELTA
``RequestOutput``s, ``abort``, ``shutdown``, stat loggers called with ``SchedulerStats``). It is
not one of our components.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from serving.engine import EngineError, EngineRequest, make_engine
from serving.engine.streams import VOCAB_SIZE, detokenize
from serving.engine.vllm_engine import VllmApi, VllmEngine, VllmEngineConfig, map_error
from tests.support.fake_vllm import DELTA, FakeAsyncLLMForTests


def fake_engine(**options: Any) -> VllmEngine:
    api = VllmApi(FakeAsyncLLMForTests, dict, dict, DELTA, None)
    return VllmEngine(VllmEngineConfig(model="/models/none", **options), api=api)


async def collect(engine: VllmEngine, request: EngineRequest) -> list:
    return [chunk async for chunk in engine.generate(request)]


def test_requests_map_to_delta_sampling_params_and_chunks() -> None:
    async def main() -> None:
        engine = fake_engine()
        llm = engine.llm
        reqs = [
            EngineRequest(f"r{i}", 7 + i, 4 + i, seed=i, prompt="x" * (20 + i)) for i in range(5)
        ]
        results = await asyncio.gather(*(collect(engine, r) for r in reqs))
        for req, chunks in zip(reqs, results, strict=True):
            assert sum(len(c.token_ids) for c in chunks) == req.max_tokens
            assert [c.finish_reason for c in chunks] == [None] * (req.max_tokens - 1) + ["length"]
            assert chunks[-1].completion_tokens == req.max_tokens
            assert all(c.prompt_tokens == req.prompt_tokens for c in chunks)
            assert chunks[0].text == f" t{chunks[0].token_ids[0]}"
        assert sorted(p["seed"] for p in llm.params) == list(range(5))
        assert all(p["ignore_eos"] and p["output_kind"] == DELTA for p in llm.params)
        assert sorted(len(p["prompt_token_ids"]) for p in llm.prompts) == [7, 8, 9, 10, 11]
        assert all(max(p["prompt_token_ids"]) < 1000 for p in llm.prompts), "model vocab"
        assert llm.loggers and engine.signal.records > 0
        await engine.close()
        assert llm.shut_down

    asyncio.run(main())


def test_abort_ends_the_stream_and_tells_vllm() -> None:
    async def main() -> None:
        engine = fake_engine()
        stream = engine.generate(EngineRequest("a", 5, 1000, logprobs=1))
        first = await anext(stream)
        assert engine.stats().running == 1
        engine.abort("a")
        rest = [c async for c in stream]
        assert rest[-1].finish_reason == "abort"
        assert rest[-1].logprobs == [], "one entry per token: none"
        assert rest[-1].completion_tokens == first.completion_tokens + sum(
            len(c.token_ids) for c in rest
        )
        await asyncio.sleep(0)
        assert "a" in engine.llm.aborted and not engine.llm.active
        engine.abort("unknown")
        await engine.close()

    asyncio.run(main())


def test_vllms_stream_is_read_in_the_callers_own_task() -> None:
    """No task per token: every output is read by the task that reads the adapter's stream."""

    async def main() -> set[Any]:
        engine = fake_engine()
        readers: set[Any] = set()
        generate = engine.llm.generate

        async def watched(*args: Any) -> Any:
            async for out in generate(*args):
                readers.add(asyncio.current_task())
                yield out

        engine.llm.generate = watched
        chunks = await collect(engine, EngineRequest("w", 5, 20))
        assert len(chunks) == 20
        await engine.close()
        return readers

    readers = asyncio.run(main())
    assert len(readers) == 1, "one reader: the caller's task"


def test_abort_while_waiting_ends_the_stream_and_the_reader_goes_on() -> None:
    async def main() -> None:
        engine = fake_engine()
        stream = engine.generate(EngineRequest("a", 5, 1000))
        await anext(stream)

        async def read_rest() -> list[Any]:
            rest = [c async for c in stream]
            await asyncio.sleep(0)  # not cancelled: the abort cancelled the wait alone
            return rest

        reader = asyncio.ensure_future(read_rest())
        await asyncio.sleep(0)  # the reader now waits on vLLM's next output
        engine.abort("a")
        rest = await reader
        assert rest[-1].finish_reason == "abort" and not reader.cancelled()
        await engine.close()

    asyncio.run(main())


def test_a_reader_cancelled_from_outside_stays_cancelled_even_when_aborted_too() -> None:
    async def main() -> None:
        engine = fake_engine()
        stream = engine.generate(EngineRequest("c", 5, 1000))
        await anext(stream)
        reader = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0)
        reader.cancel()  # the replica stops the run (the client went away) ...
        engine.abort("c")  # ... and aborts the engine request
        with pytest.raises(asyncio.CancelledError):
            await reader
        await asyncio.sleep(0)
        assert "c" in engine.llm.aborted and not engine.llm.active
        await engine.close()

    asyncio.run(main())


def test_stats_come_from_the_stat_logger() -> None:
    async def main() -> None:
        engine = fake_engine(max_num_seqs=64)
        streams = [engine.generate(EngineRequest(f"s{i}", 5, 100)) for i in range(4)]
        for s in streams:
            await anext(s)
        stats = engine.stats()
        assert stats.running == 4 and stats.kv_blocks_total == 500
        assert stats.kv_usage == pytest.approx(0.4)
        assert stats.max_num_seqs == 64
        for s in streams:
            await s.aclose()
        assert not engine.llm.active, "closing a stream aborts it in vLLM"
        await engine.close()

    asyncio.run(main())


def test_close_fails_open_streams_and_errors_map_to_codes() -> None:
    async def main() -> None:
        engine = fake_engine()
        stream = engine.generate(EngineRequest("c", 5, 1000))
        await anext(stream)
        pending = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0)
        await engine.close()
        with pytest.raises(EngineError) as down:
            await pending
        assert down.value.code == "engine_down"
        with pytest.raises(EngineError):
            await anext(engine.generate(EngineRequest("d", 5, 5)))

    asyncio.run(main())
    assert map_error(ValueError("prompt is longer than max_model_len")).code == "prompt_too_long"
    assert map_error(ValueError("bad")).code == "bad_request"
    assert map_error(type("EngineDeadError", (Exception,), {})()).code == "engine_down"
    assert VllmEngineConfig(model="m", max_model_len=None).engine_args()["model"] == "m"
    with pytest.raises(ValueError):
        VllmEngineConfig().engine_args()


def test_skip_tokenizer_init_uses_the_suite_vocabulary() -> None:
    async def main() -> list:
        engine = fake_engine(skip_tokenizer_init=True)
        chunks = await collect(engine, EngineRequest("t", 5, 3, seed=2))
        await engine.close()
        return chunks

    chunks = asyncio.run(main())
    ids = [i for c in chunks for i in c.token_ids]
    assert "".join(c.text for c in chunks) == detokenize([i % VOCAB_SIZE for i in ids])


class WordTokenizer:
    """A stand-in tokenizer: one id per word (vLLM hands the adapter the model's own)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [len(word) for word in text.split()]


class FakeWithTokenizer(FakeAsyncLLMForTests):
    def get_tokenizer(self) -> WordTokenizer:
        return WordTokenizer()


def test_prompts_go_through_the_models_tokenizer() -> None:
    api = VllmApi(FakeWithTokenizer, dict, dict, DELTA, None)
    engine = VllmEngine(VllmEngineConfig(model="/models/none", temperature=0.0), api=api)
    assert engine.count_tokens("three word prompt") == 3
    assert fake_engine().count_tokens("no tokenizer") is None

    async def main() -> None:
        await collect(engine, EngineRequest("w", 3, 2, prompt="three word prompt"))
        await collect(engine, EngineRequest("n", 4, 2))  # no text: the suite's synthetic ids
        await engine.close()

    asyncio.run(main())
    assert engine.llm.prompts[0]["prompt_token_ids"] == [5, 4, 6]
    assert len(engine.llm.prompts[1]["prompt_token_ids"]) == 4
    assert engine.llm.params[0]["temperature"] == 0.0
    cpu_args = VllmEngineConfig(model="m", dtype="bfloat16").engine_args(on_cpu=True)
    assert cpu_args["dtype"] == "bfloat16" and cpu_args["enforce_eager"] is True
    assert "kv_cache_memory_bytes" not in VllmEngineConfig(model="m").engine_args()
    assert "temperature" not in cpu_args


def test_sampling_fields_go_through_to_sampling_params() -> None:
    """Every sampling field reaches SamplingParams, over the engine's temperature and the
    EOS-ignoring default; logit_bias keys become token ids as vLLM's server makes them."""
    sampling = {
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 5,
        "min_p": 0.1,
        "repetition_penalty": 1.2,
        "logit_bias": {"5": -100, "7": 250.0},
        "stop": ["."],
        "stop_token_ids": [3],
        "ignore_eos": False,
        "min_tokens": 2,
        "bad_words": ["no"],
    }

    async def main() -> None:
        engine = fake_engine(temperature=0.0)
        await collect(engine, EngineRequest("s", 5, 3, seed=4, sampling=sampling))
        await collect(engine, EngineRequest("d", 5, 2, seed=6))
        await engine.close()
        asked, default = engine.llm.params
        expected = {**sampling, "logit_bias": {5: -100, 7: 100.0}}
        assert asked == {**expected, "max_tokens": 3, "seed": 4, "output_kind": DELTA}
        assert default == {
            "ignore_eos": True,
            "temperature": 0.0,
            "max_tokens": 2,
            "seed": 6,
            "output_kind": DELTA,
        }

    asyncio.run(main())


def test_random_sampling_runs_unseeded_on_the_cpu_build() -> None:
    """vLLM's CPU build fails a step (and its engine core) when a seeded, randomly sampled
    request's prefill is chunked; greedy requests, and every request off the CPU, keep the
    seed."""
    api = VllmApi(FakeAsyncLLMForTests, dict, dict, DELTA, None, on_cpu=True)
    engine = VllmEngine(VllmEngineConfig(model="/models/none"), api=api)
    random = EngineRequest("r", 5, 2, seed=3, sampling={"temperature": 0.7})
    greedy = EngineRequest("g", 5, 2, seed=3, sampling={"temperature": 0.0})
    assert engine.sampling_params(random)["seed"] is None
    assert engine.sampling_params(greedy)["seed"] == 3
    assert fake_engine().sampling_params(random)["seed"] == 3


def test_logprobs_come_back_per_token_in_vllms_rank_order() -> None:
    async def main() -> None:
        engine = fake_engine()
        chunks = await collect(engine, EngineRequest("l", 5, 4, seed=1, logprobs=2))
        plain = await collect(engine, EngineRequest("p", 5, 2, seed=1))
        await engine.close()
        assert engine.llm.params[0]["logprobs"] == 2 and "logprobs" not in engine.llm.params[1]
        assert all(c.logprobs is None for c in plain)
        undecoded = detokenize([1002 % VOCAB_SIZE])  # rank 2 came without decoded_token
        for step, chunk in enumerate(chunks):
            (token,) = chunk.token_ids
            assert chunk.logprobs is not None and len(chunk.logprobs) == 1
            (entry,) = chunk.logprobs
            first = (f" t{token}", -0.5) if step % 2 == 0 else (" a1", -0.5)
            assert entry.token == f" t{token}"
            assert entry.logprob == (-0.5 if step % 2 == 0 else -1.5)
            assert entry.top == (first, (undecoded, -1.0)), step

    asyncio.run(main())


class FakeVLLMError(Exception):
    """Stand-ins for vLLM 0.29's exception classes, which are not ValueErrors: the adapter
    knows a client error by the ``VLLMClientError`` base."""


FakeVLLMClientError = type("VLLMClientError", (FakeVLLMError,), {})
FakeVLLMValidationError = type("VLLMValidationError", (FakeVLLMClientError,), {})


def validating_sampling_params(**settings: Any) -> dict[str, Any]:
    """SamplingParams' min_tokens check, raising as vLLM 0.29 does."""
    if settings.get("min_tokens", 0) > settings["max_tokens"]:
        raise FakeVLLMValidationError(
            f"min_tokens must be less than or equal to max_tokens={settings['max_tokens']}, "
            f"got {settings['min_tokens']}. (parameter=min_tokens, value={settings['min_tokens']})"
        )
    return settings


def test_a_value_vllm_refuses_is_a_bad_request_before_any_output() -> None:
    api = VllmApi(FakeAsyncLLMForTests, validating_sampling_params, dict, DELTA, None)
    engine = VllmEngine(VllmEngineConfig(model="/models/none"), api=api)
    request = EngineRequest("v", 5, 2, sampling={"min_tokens": 5})

    async def main() -> None:
        with pytest.raises(EngineError) as refused:
            await anext(engine.generate(request))
        assert refused.value.code == "bad_request"
        assert "min_tokens must be less than or equal to max_tokens=2" in str(refused.value)
        assert not engine.llm.prompts and not engine._live, "vLLM never saw it"
        chunks = await collect(engine, EngineRequest("v", 5, 2, sampling={"min_tokens": 2}))
        assert chunks[-1].completion_tokens == 2, "the id is free again"
        await engine.close()

    asyncio.run(main())
    too_long = FakeVLLMValidationError(
        "The decoder prompt (length 600) is longer than the maximum model length of 512. "
        "Make sure that `max_model_len` is no smaller than the number of text tokens."
    )
    assert map_error(too_long).code == "prompt_too_long"
    assert map_error(FakeVLLMValidationError("top_p must be in (0, 1]")).code == "bad_request"
    assert map_error(FakeVLLMError("engine step failed")).code == "engine_down"


HAVE_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_VLLM, reason="vllm is not installed (nox -s vllm)")
def test_real_vllm_streams_exact_token_counts(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("vLLM needs a GPU")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 4096,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))

    async def main() -> None:
        engine = make_engine(
            "vllm",
            model=str(tmp_path),
            load_format="dummy",
            skip_tokenizer_init=True,
            max_model_len=1024,
            gpu_memory_utilization=0.3,
            enforce_eager=True,
        )
        try:
            reqs = [EngineRequest(f"v{i}", 16, 8 + i, seed=i) for i in range(4)]
            results = await asyncio.gather(*(collect(engine, r) for r in reqs))
            for req, chunks in zip(reqs, results, strict=True):
                assert sum(len(c.token_ids) for c in chunks) == req.max_tokens
                assert chunks[-1].finish_reason == "length"
            assert engine.signal.records > 0
        finally:
            await engine.close()

    asyncio.run(main())


class CountingTokenizer:
    """A tokenizer that counts its calls: one id per word."""

    def __init__(self) -> None:
        self.calls = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.calls += 1
        return [len(word) for word in text.split()]


def test_a_prompt_counted_at_admission_is_not_tokenized_again() -> None:
    async def main() -> None:
        engine = fake_engine()
        engine.tokenizer = tokenizer = CountingTokenizer()
        assert engine.count_tokens("one two three") == 3
        await collect(engine, EngineRequest("p", 3, 2, prompt="one two three"))
        assert tokenizer.calls == 1 and engine.llm.prompts[-1]["prompt_token_ids"] == [3, 3, 5]
        await collect(engine, EngineRequest("q", 3, 2, prompt="one two three"))
        assert tokenizer.calls == 2, "not counted this time: tokenized by generate"
        for i in range(2000):  # counted, never generated (refused): the kept ids stay bounded
            engine.count_tokens(f"refused prompt {i} " + "word " * 500)
        assert sum(len(ids) for ids in engine._counted.values()) <= 1 << 18
        await engine.close()

    asyncio.run(main())
