"""The null engine: one chunk per token by default (each after a turn of the event loop, or a fixed
inter-token time), or the whole answer in one chunk (``per_token=False``); the same tokens and text
either way."""

from __future__ import annotations

import asyncio
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serving.engine import NullConfig, NullEngine, make_engine
from serving.engine.streams import token_blocks, token_ids
from serving.engine.types import EngineRequest, TokenChunk
from serving.wire.contract import MAX_OUTPUT_TOKENS


async def _chunks(engine: NullEngine, max_tokens: int, seed: int = 7) -> list[TokenChunk]:
    request = EngineRequest("r", 4, max_tokens, seed, logprobs=1)
    return [chunk async for chunk in engine.generate(request)]


@settings(deadline=None, max_examples=50)
@given(max_tokens=st.integers(1, 300) | st.integers(4090, 4200), seed=st.integers(0, 2**32))
def test_per_token_streams_the_per_request_answer_one_token_at_a_time(
    max_tokens: int, seed: int
) -> None:
    per_token = asyncio.run(_chunks(NullEngine(), max_tokens, seed))
    (whole,) = asyncio.run(_chunks(NullEngine(NullConfig(per_token=False)), max_tokens, seed))
    assert len(per_token) == max_tokens
    assert all(len(c.token_ids) == 1 for c in per_token)
    assert [t for c in per_token for t in c.token_ids] == whole.token_ids
    assert "".join(c.text for c in per_token) == whole.text
    assert [c.completion_tokens for c in per_token] == list(range(1, max_tokens + 1))
    assert [c.finish_reason for c in per_token][-1] == "length"
    assert all(c.finish_reason is None for c in per_token[:-1])
    assert [lp for c in per_token for lp in c.logprobs or []] == whole.logprobs


def test_each_token_after_a_loop_turn_or_the_inter_token_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pauses: list[float] = []
    real_sleep = asyncio.sleep

    async def sleep(delay: float) -> None:
        pauses.append(delay)
        await real_sleep(0)

    monkeypatch.setattr(asyncio, "sleep", sleep)
    asyncio.run(_chunks(NullEngine(), 5))
    assert pauses == [0.0] * 4, "a loop turn between tokens, none before the first"
    pauses.clear()
    asyncio.run(_chunks(make_engine("null", itl_ms=2.5), 3))  # type: ignore[arg-type]
    assert pauses == [0.0025] * 2
    pauses.clear()
    asyncio.run(_chunks(NullEngine(NullConfig(per_token=False)), 5))
    assert pauses == []


def test_a_closed_engine_ends_a_stream_under_way() -> None:
    async def main() -> list[str]:
        engine = NullEngine()
        seen = []
        with pytest.raises(Exception, match="engine is closed"):
            async for chunk in engine.generate(EngineRequest("r", 4, 10, 1)):
                seen.append(chunk.text)
                await engine.close()
        return seen

    assert len(asyncio.run(main())) == 1


def test_open_long_streams_pin_two_bytes_a_token_and_the_cache_stays_small() -> None:
    """Many clients each asking for the longest answer, none reading on (the attack suite's
    zero-window case): the engine holds each open stream compactly and keeps no long stream in
    its cache, so what they pin grows with their own tokens only, and the tokens are the seed's."""
    streams, longest = 40, MAX_OUTPUT_TOKENS

    async def open_all() -> tuple[int, list[int]]:
        engine = NullEngine()
        gens = [engine.generate(EngineRequest(f"r{i}", 4, longest, i)) for i in range(streams)]
        firsts = [(await anext(gen)).token_ids[0] for gen in gens]
        _, peak = tracemalloc.get_traced_memory()
        for gen in gens:
            await gen.aclose()
        return peak, firsts

    tracemalloc.start()
    try:
        peak, firsts = asyncio.run(open_all())
    finally:
        tracemalloc.stop()
    assert firsts == [token_ids(i, 1)[0] for i in range(streams)]
    bound = streams * longest * 2 * 1.5  # two bytes a token, half again for the rest
    assert peak < bound, f"{peak / 2**20:.1f} MiB pinned by {streams} open streams"


@settings(deadline=None, max_examples=60)
@given(
    seed=st.integers(0, 2**64 - 1),
    count=st.integers(0, 3000),
    block=st.integers(1, 600).map(lambda n: 2 * n),
)
def test_token_blocks_continue_the_single_draw(seed: int, count: int, block: int) -> None:
    """What the block-wise draw relies on (a power-of-two vocabulary, whole 64-bit words per
    block), pinned against numpy's own single draw."""
    blocks = list(token_blocks(seed, count, block))
    assert all(len(b) == block for b in blocks[:-1])
    assert [t for b in blocks for t in b] == token_ids(seed, count)
