"""The replica charges an engine's own token count (``count_tokens``) when the engine has one."""

from __future__ import annotations

from collections.abc import AsyncIterator

from serving.engine import EngineRequest, SimConfig, SimEngine, TokenChunk
from serving.engine.types import TokenCounter
from serving.wire.tokens import count_prompt_tokens
from tests.support.server_client import H2Client, run, wait_all
from zerolayer.server import start_replica


class WordCountingSim(SimEngine):
    """The sim with a 'tokenizer' of one token a word, and a log of what it was asked."""

    def __init__(self) -> None:
        super().__init__(SimConfig(model_shape="llama-3.2-1b"))
        self.seen: list[int] = []

    def count_tokens(self, text: str) -> int | None:
        return len(text.split())

    def generate(self, request: EngineRequest) -> AsyncIterator[TokenChunk]:
        self.seen.append(request.prompt_tokens)
        return super().generate(request)


@run
async def test_prompt_tokens_are_the_engines_count() -> None:
    engine = WordCountingSim()
    assert isinstance(engine, TokenCounter)
    assert not isinstance(SimEngine(SimConfig(model_shape="llama-3.2-1b")), TokenCounter)
    replica = await start_replica(engine, name="words")
    client = await H2Client.connect("127.0.0.1", replica.port)
    prompt = "the replica charges these eight words in tokens"
    streams = [client.completion(prompt, max_tokens=3), client.completion("", max_tokens=3)]
    await wait_all(streams, 15)
    usage = [s.json()["usage"]["prompt_tokens"] for s in streams]
    assert len(prompt.split()) == 8 != count_prompt_tokens(prompt)
    assert usage == [8, 1], "an empty count keeps the wire's (at least one token)"
    assert sorted(engine.seen) == [1, 8]
    await client.close()
    await replica.close()
    await engine.close()
