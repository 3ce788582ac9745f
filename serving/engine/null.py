"""The null engine: no compute time at all, for measuring what a serving layer itself costs.

By default it streams like a real engine, one chunk per token, each after the event loop has
turned once (``itl_ms`` 0) or after a fixed inter-token time: what a layer spends per token (a
chunk handed on, framed, written) is then measured as it is paid under a real engine. With
``per_token=False`` it answers each request at once in one chunk: the per-request figure, with
no per-token work at all.
"""

from __future__ import annotations

import asyncio
from array import array
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from functools import lru_cache
from itertools import chain
from typing import Final

from serving.engine.settings import EngineSettings
from serving.engine.streams import (
    VOCAB,
    detokenize,
    token_array,
    token_blocks,
    uniform_logprobs,
)
from serving.engine.types import EngineError, EngineRequest, EngineStats, TokenChunk


@dataclass(frozen=True)
class NullConfig:
    """``per_token``: one chunk per token (else one chunk per request); ``itl_ms``: the time
    between two tokens (0: one turn of the event loop, no timer)."""

    per_token: bool = True
    itl_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.itl_ms < 0:
            raise ValueError(f"itl_ms must be >= 0, got {self.itl_ms}")
        if self.itl_ms and not self.per_token:
            raise ValueError("itl_ms needs per_token: one chunk per request has no token times")


CACHED_TOKENS: Final = 4096
"""Streams up to this long are drawn once per (seed, length) and kept (at most 2 MiB in all)."""


@lru_cache(maxsize=256)
def _cached(seed: int, count: int) -> array[int]:
    return token_array(seed, count)


def _tokens(seed: int, count: int) -> Iterable[int]:
    """The request's tokens: short streams from a cache, because the null engine's own cost must
    not be a random-number generator's (numpy's is microseconds per request); long ones drawn a
    block at a time as they are streamed, so that clients asking for 65,536 tokens many times
    over and never reading pin almost nothing (the attack suite's RSS bound)."""
    if count <= CACHED_TOKENS:
        return _cached(seed, count)
    return chain.from_iterable(token_blocks(seed, count))


class NullEngine:
    """Answers every request with its deterministic tokens, at no cost of its own."""

    name = "null"

    def __init__(self, config: NullConfig | None = None) -> None:
        self.config = config or NullConfig()
        self._closed = False

    async def generate(self, request: EngineRequest) -> AsyncIterator[TokenChunk]:
        if self._closed:
            raise EngineError("engine_down", "engine is closed")
        tokens = _tokens(request.seed, request.max_tokens)
        if not self.config.per_token:
            ids = list(tokens)
            yield TokenChunk(
                token_ids=ids,
                text=detokenize(ids),
                finish_reason="length",
                prompt_tokens=request.prompt_tokens,
                completion_tokens=len(ids),
                logprobs=None
                if request.logprobs is None
                else uniform_logprobs(ids, request.logprobs),
            )
            return
        async for chunk in self._per_token(request, tokens):
            yield chunk

    async def _per_token(
        self, request: EngineRequest, ids: Iterable[int]
    ) -> AsyncIterator[TokenChunk]:
        """One chunk per token, the first at once and each next one a loop turn (or ``itl_ms``)
        later, as a real engine's steps arrive."""
        pause = self.config.itl_ms / 1000.0
        last = request.max_tokens - 1
        top = request.logprobs
        for i, token in enumerate(ids):
            if i:
                await asyncio.sleep(pause)
                if self._closed:
                    raise EngineError("engine_down", "engine is closed")
            yield TokenChunk(
                token_ids=[token],
                text=VOCAB[token],
                finish_reason="length" if i == last else None,
                prompt_tokens=request.prompt_tokens,
                completion_tokens=i + 1,
                logprobs=None if top is None else uniform_logprobs([token], top),
            )

    def abort(self, request_id: str) -> None:
        """Nothing to stop: the caller stops reading, and the stream ends with it."""

    def stats(self) -> EngineStats:
        return EngineStats(kv_blocks_total=1, max_num_seqs=1 << 30)

    def settings(self) -> EngineSettings:
        """None: no batch, no KV cache, no sampling, nothing to compare."""
        return EngineSettings()

    async def close(self) -> None:
        self._closed = True
