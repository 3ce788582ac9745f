"""Block identity for automatic prefix caching, as vLLM V1 names its blocks.

A full block of a prompt is named by a hash chained over the content of every block before it,
``h_i = H(h_{i-1}, content_i)``, so two prompts share block ``i``'s name only if they agree on
everything up to the end of that block: equal content after a different history is a different
block. The sim has no tokenizer, so its tokens are the wire's (four UTF-8 bytes a token): block
``i`` is bytes ``[4 * bs * i, 4 * bs * (i + 1))`` of the prompt. A trailing partial block has no
name (vLLM hashes only full blocks). Only prompt blocks are named: the sim's output text is not
tokenised by that rule, so its output blocks are never cached (vLLM caches those too).
"""

from __future__ import annotations

from typing import Final

from xxhash import xxh3_64_intdigest

from serving.wire.tokens import BYTES_PER_TOKEN

ROOT_HASH: Final = 0


def block_hash(parent: int, content: bytes) -> int:
    """The name of a block: its content hashed with its parent's name (the chain's one link)."""
    return xxh3_64_intdigest(content, parent)


def prompt_block_hashes(prompt: str, prompt_tokens: int, block_size: int) -> list[int] | None:
    """The chained names of the prompt's full blocks; None when there is no prompt text.

    Callers that give only ``prompt_tokens`` have nothing to look up (None: no query at all),
    while a prompt shorter than a block is a lookup that can only miss (an empty list). Blocks
    past ``prompt_tokens`` are not named, so a count smaller than the text's is honoured.
    """
    if not prompt:
        return None
    data = prompt.encode()
    size = BYTES_PER_TOKEN * block_size
    end = min(len(data) // size, prompt_tokens // block_size) * size
    hashes: list[int] = []
    parent = ROOT_HASH
    for start in range(0, end, size):
        parent = block_hash(parent, data[start : start + size])
        hashes.append(parent)
    return hashes
