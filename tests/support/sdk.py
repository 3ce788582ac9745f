"""What the SDK's tests share: running on uvloop with a bound, ring ownership, expected text."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import uvloop

from harness.stacks import ReplicaProcess
from serving.engine import NullEngine
from serving.engine.types import EngineRequest
from serving.wire.tokens import count_prompt_tokens, request_seed
from zerolayer.client import ZeroLayerClient

Spawn = Callable[..., ReplicaProcess]


def run(coro: Coroutine[Any, Any, Any], limit_s: float = 60.0) -> Any:
    """Run on uvloop, as the SDK is meant to; a hang fails at ``limit_s``."""
    return uvloop.run(asyncio.wait_for(coro, limit_s))


def session_owned_by(client: ZeroLayerClient, url: str) -> str:
    """A session key whose ring owner is ``url``."""
    return next(f"s{i}" for i in range(10_000) if client.ring.lookup(f"s{i}") == url)


async def expected_text(prompt: str, max_tokens: int, seed: int | None) -> str:
    """What the engine itself returns for this request (every engine gives the same tokens)."""
    request = EngineRequest(
        "x", count_prompt_tokens(prompt), max_tokens, request_seed(prompt, seed)
    )
    return "".join([chunk.text async for chunk in NullEngine().generate(request)])
