"""The null engine: no compute time at all, for measuring what a serving layer itself costs."""

from __future__ import annotations

from collections.abc import AsyncIterator

from serving.engine.settings import EngineSettings
from serving.engine.streams import detokenize, token_ids, uniform_logprobs
from serving.engine.types import EngineError, EngineRequest, EngineStats, TokenChunk


class NullEngine:
    """Answers every request at once with its deterministic tokens, in a single chunk."""

    name = "null"

    def __init__(self) -> None:
        self._closed = False

    async def generate(self, request: EngineRequest) -> AsyncIterator[TokenChunk]:
        if self._closed:
            raise EngineError("engine_down", "engine is closed")
        ids = token_ids(request.seed, request.max_tokens)
        yield TokenChunk(
            token_ids=ids,
            text=detokenize(ids),
            finish_reason="length",
            prompt_tokens=request.prompt_tokens,
            completion_tokens=len(ids),
            logprobs=None if request.logprobs is None else uniform_logprobs(ids, request.logprobs),
        )

    def abort(self, request_id: str) -> None:
        """Nothing to stop: a null request is over before anyone could abort it."""

    def stats(self) -> EngineStats:
        return EngineStats(kv_blocks_total=1, max_num_seqs=1 << 30)

    def settings(self) -> EngineSettings:
        """None: no batch, no KV cache, no sampling, nothing to compare."""
        return EngineSettings()

    async def close(self) -> None:
        self._closed = True
