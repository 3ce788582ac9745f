"""Prompt token ids for engines that run a real model (torch, vllm); no torch import here."""

from __future__ import annotations

import xxhash

from serving.engine.streams import token_ids
from serving.engine.types import EngineRequest


def prompt_token_ids(request: EngineRequest, vocab_size: int) -> list[int]:
    """``prompt_tokens`` ids derived from the prompt text (4 bytes a token), or from the seed.

    Engines charge ``prompt_tokens``, so the list always has exactly that length, whatever the
    text; the same prompt gives the same ids on every engine and stack.
    """
    data = request.prompt.encode()
    if not data:
        return [i % vocab_size for i in token_ids(request.seed ^ 0x5EED, request.prompt_tokens)]
    ids = [xxhash.xxh32_intdigest(data[i : i + 4]) % vocab_size for i in range(0, len(data), 4)]
    ids = ids[: request.prompt_tokens]
    return ids + [ids[i % len(ids)] for i in range(request.prompt_tokens - len(ids))]
