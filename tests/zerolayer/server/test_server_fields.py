"""vLLM's request fields through a running replica: a stop string ends the work in the engine,
logprobs come from engines that have them and are refused by one that has none."""

from __future__ import annotations

import orjson
import pytest

from serving.engine import SimConfig, SimEngine
from serving.engine.streams import VOCAB, token_ids
from serving.engine.torch_engine import TorchEngine, TorchEngineConfig
from serving.wire.tokens import request_seed
from tests.support.server_client import H2Client, run, wait_all
from tests.support.waiting import eventually
from zerolayer.server import start_replica

SMALL = {"model_shape": "llama-3.2-1b"}
PROMPT = "stop me early"
MAX_TOKENS = 200


@pytest.mark.parametrize("stream", [False, True])
@run
async def test_a_stop_string_ends_the_answer_and_the_engines_work(stream: bool) -> None:
    ids = token_ids(request_seed(PROMPT, None), MAX_TOKENS)
    stop = VOCAB[ids[5]]
    before = "".join(VOCAB[i] for i in ids)
    before = before[: before.index(stop)]
    engine = SimEngine(SimConfig(**SMALL))
    async with await start_replica(engine) as replica:
        client = await H2Client.connect("127.0.0.1", replica.port)
        body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "stop": [stop], "stream": stream}
        call = client.request("/v1/completions", orjson.dumps(body))
        await wait_all([call], 10)
        assert call.status == 200, call.data
        if stream:
            events = [e for e in call.events() if isinstance(e, dict)]
            text = "".join(e["choices"][0]["text"] for e in events)
            last = events[-1]
        else:
            last = call.json()
            text = last["choices"][0]["text"]
        assert text == before
        assert last["choices"][0]["finish_reason"] == "stop"
        assert last["choices"][0]["stop_reason"] == stop
        assert last["usage"]["completion_tokens"] < MAX_TOKENS
        # The engine lets go of the request (abort) without a client, well before max_tokens
        # (it would also end by itself at max_tokens, a fraction of a second later).
        await eventually(lambda: engine.stats().running == 0, "the engine's work ended")
        assert engine.stats().steps < MAX_TOKENS, "the engine ran on to max_tokens"
        assert replica.replica.outcomes["completed"] == 1
        await client.close()
    await engine.close()


@run
async def test_an_engine_without_logprobs_refuses_them_before_any_output() -> None:
    engine = TorchEngine(TorchEngineConfig(model_shape="tiny", max_num_seqs=2))
    async with await start_replica(engine) as replica:
        client = await H2Client.connect("127.0.0.1", replica.port)
        call = client.request(
            "/v1/completions", orjson.dumps({"prompt": "x", "max_tokens": 2, "logprobs": 1})
        )
        plain = client.request("/v1/completions", orjson.dumps({"prompt": "x", "max_tokens": 2}))
        await wait_all([call, plain], 30)
        assert (call.status, call.error) == (400, "unsupported_parameter")
        assert call.json()["error"]["type"] == "BadRequestError"
        assert plain.status == 200
        await client.close()
    await engine.close()
