"""Deterministic token streams: the same (seed, position) gives the same token on every stack."""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterator

import numpy as np

from serving.wire.openai import TokenLogprob

VOCAB_SIZE = 4096
_SYLLABLES = (
    "ka",
    "lo",
    "mi",
    "ne",
    "su",
    "ta",
    "ri",
    "po",
    "da",
    "ve",
    "zu",
    "bo",
    "fi",
    "ge",
    "hu",
    "ja",
)


def _make_vocab() -> tuple[str, ...]:
    words = []
    n = len(_SYLLABLES)
    for i in range(VOCAB_SIZE):
        a, b, c = i % n, (i // n) % n, (i // (n * n)) % n
        words.append(" " + _SYLLABLES[a] + _SYLLABLES[b] + (_SYLLABLES[c] if c else ""))
    return tuple(words)


VOCAB: tuple[str, ...] = _make_vocab()


def token_ids(seed: int, count: int) -> list[int]:
    """The first ``count`` tokens of the stream for ``seed``: one vectorised draw per request."""
    rng = np.random.default_rng(seed & 0xFFFFFFFFFFFFFFFF)
    return rng.integers(0, VOCAB_SIZE, size=count, dtype=np.int64).tolist()


def token_array(seed: int, count: int) -> array[int]:
    """The same stream as :func:`token_ids`, packed two bytes a token for long-lived sequences."""
    rng = np.random.default_rng(seed & 0xFFFFFFFFFFFFFFFF)
    draw = rng.integers(0, VOCAB_SIZE, size=count, dtype=np.int64).astype(np.uint16)
    return array("H", draw.tobytes())


def token_blocks(seed: int, count: int, block: int = 512) -> Iterator[array[int]]:
    """The stream of :func:`token_ids` drawn ``block`` tokens at a time, so that a long answer
    never exists whole. The blocks continue the single draw exactly because a power-of-two
    vocabulary takes one 32-bit word per token with no rejection (numpy's Lemire bound) and an
    even block uses whole 64-bit words; the tests hold it to :func:`token_ids`."""
    if block <= 0 or block % 2:
        raise ValueError(f"block must be even and positive, got {block}")
    rng = np.random.default_rng(seed & 0xFFFFFFFFFFFFFFFF)
    for start in range(0, count, block):
        size = min(block, count - start)
        draw = rng.integers(0, VOCAB_SIZE, size=size, dtype=np.int64).astype(np.uint16)
        yield array("H", draw.tobytes())


def detokenize(ids: list[int]) -> str:
    """Text for token ids; a fixed vocabulary so byte counts are realistic but cheap."""
    vocab = VOCAB
    return "".join([vocab[i] for i in ids])


# Every token of the stream is an independent uniform draw over the vocabulary, so this is the
# exact log-probability of each one under the sim's own sampler; no alternative is likelier.
UNIFORM_LOGPROB = -math.log(VOCAB_SIZE)


def uniform_logprobs(ids: list[int], top: int) -> list[TokenLogprob]:
    """Each token's logprob under the uniform draw, and ``top`` alternatives (all as likely:
    the token itself first, then the ids after it)."""
    return [
        TokenLogprob(
            VOCAB[i],
            UNIFORM_LOGPROB,
            tuple((VOCAB[(i + k) % VOCAB_SIZE], UNIFORM_LOGPROB) for k in range(top)),
        )
        for i in ids
    ]
