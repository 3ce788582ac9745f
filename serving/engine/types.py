"""The engine protocol and the value types every engine and both stacks share."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from serving.wire.contract import PRIORITY_NORMAL
from serving.wire.openai import TokenLogprob


@dataclass(slots=True)
class EngineRequest:
    """One generation request as an engine sees it: a cost in tokens plus a token seed.

    ``prompt_tokens`` is the prompt length in tokens; ``prompt`` is kept for engines that run a
    real model. ``seed`` fixes the output stream, so every stack returns the same tokens.
    """

    request_id: str
    prompt_tokens: int
    max_tokens: int
    seed: int = 0
    priority: int = PRIORITY_NORMAL
    prompt: str = ""
    # The body's sampling fields as vLLM's SamplingParams arguments (serving.wire.fields):
    # the vllm engine applies them; the others, whose tokens do not depend on them, record them.
    sampling: dict[str, Any] = field(default_factory=dict)
    # Log-probabilities of each output token and this many alternatives (None: not asked for).
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1:
            raise ValueError(f"prompt_tokens must be >= 1, got {self.prompt_tokens}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")


@dataclass(slots=True)
class TokenChunk:
    """The tokens one engine step produced for one request (one chunk per step, not per token)."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # One entry per token in ``token_ids`` when the request asked for logprobs.
    logprobs: list[TokenLogprob] | None = None


@dataclass(slots=True)
class EngineStats:
    """A snapshot of engine load; the scheduler's and the telemetry's only view of the engine."""

    running: int = 0
    waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    block_size: int = 16
    # Tokens the KV blocks in use hold; None where the engine does not count them (vLLM's
    # scheduler publishes block usage, not the tokens in the blocks).
    live_tokens: int | None = 0
    preemptions: int = 0
    busy_time_s: float = 0.0
    steps: int = 0
    step_ms_recent: float = 0.0
    waiting_prefill_tokens: int = 0
    max_num_seqs: int = 0
    # Automatic prefix caching, counted in tokens as vLLM's ``vllm:prefix_cache_queries`` and
    # ``vllm:prefix_cache_hits`` count them: prompt tokens looked up, and those found cached.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    allocator: dict[str, float] = field(default_factory=dict)

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks in use (vLLM's ``kv_cache_usage_perc`` as a fraction)."""
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Cached prompt tokens over prompt tokens looked up (0 before any lookup)."""
        q = self.prefix_cache_queries
        return self.prefix_cache_hits / q if q else 0.0

    @property
    def kv_waste(self) -> float | None:
        """Internal fragmentation (KV tail waste): ``1 - live_tokens / (block_size *
        used_blocks)``; None where the engine does not count its live tokens."""
        if self.live_tokens is None:
            return None
        capacity = self.block_size * self.kv_blocks_used
        return 1.0 - self.live_tokens / capacity if capacity else 0.0


class EngineError(RuntimeError):
    """The engine cannot serve a request (stopped, or the request can never fit)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class EngineStartError(ValueError):
    """The engine refused its configuration at start; the message is the reason, one line
    (a ValueError: like every bad option, the caller's mistake)."""


@runtime_checkable
class Engine(Protocol):
    """What both stacks call. Implementations: sim, null, torch, vllm."""

    name: str

    def generate(self, request: EngineRequest) -> AsyncIterator[TokenChunk]:
        """Stream the request's output, one chunk per engine step; the last has a finish_reason."""
        ...

    def abort(self, request_id: str) -> None:
        """Stop a request now and free what it holds; its stream ends with ``abort``."""
        ...

    def stats(self) -> EngineStats:
        """Current load, cheap enough to call per request."""
        ...

    async def close(self) -> None:
        """Stop the engine's loop and fail whatever is still running."""
        ...


@runtime_checkable
class TokenCounter(Protocol):
    """An engine that runs a real tokenizer and so knows what a prompt costs in its tokens.

    Optional, apart from :class:`Engine`: engines without it are charged by the wire's rule
    (four UTF-8 bytes a token). ``count_tokens`` returns None when the engine has no tokenizer
    after all (vLLM started with ``skip_tokenizer_init``).
    """

    def count_tokens(self, text: str) -> int | None:
        """The prompt's length in the model's own tokens, or None to keep the wire's count."""
        ...


def token_counter(engine: Engine) -> Callable[[str], int | None] | None:
    """The engine's ``count_tokens`` if it has one, looked up once so the sim pays nothing."""
    return engine.count_tokens if isinstance(engine, TokenCounter) else None
