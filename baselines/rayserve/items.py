"""What an engine replica streams to the ingress across the Ray actor boundary.

Named tuples: as cheap to pickle as the plain tuples they are, and typed at both ends. Engine
errors travel as a final :class:`ErrorItem` rather than as exceptions, so the ingress can tell
"the engine refused" from "the replica died" (only the second is worth retrying elsewhere).
"""

from __future__ import annotations

from typing import NamedTuple

from serving.wire.openai import TokenLogprob


class ChunkItem(NamedTuple):
    """One engine step's output for one request."""

    text: str
    token_count: int
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[TokenLogprob] | None = None


class ErrorItem(NamedTuple):
    """The engine refused or failed the request: its engine error code and message."""

    code: str
    message: str


EngineItem = ChunkItem | ErrorItem
