"""The prompt-token rule and the token seed: what every stack and loader agrees a request costs
and which stream it returns, before any engine sees it."""

from __future__ import annotations

import math

import xxhash

BYTES_PER_TOKEN = 4


def count_prompt_tokens(text: str) -> int:
    """The token count the engines charge for a prompt: about four UTF-8 bytes per token."""
    return max(1, math.ceil(len(text.encode()) / BYTES_PER_TOKEN))


def request_seed(prompt: str, seed: int | None) -> int:
    """The token seed for a request: the body's ``seed`` if given, else xxh64 of the prompt.

    Every stack derives the seed here, so the same request returns the same stream everywhere.
    """
    if seed is not None:
        return seed
    return xxhash.xxh64_intdigest(prompt.encode())
