"""Token rules: how the harness counts a prompt's tokens and builds text of a given length.

The replica charges a prompt what its engine counts: an engine with a tokenizer (vLLM over a
model directory) counts with it, every other engine by the wire's rule of four UTF-8 bytes a token
(``zerolayer.wire.tokens``). The schedule uses the same rule as the engine it is sent to, so the
``zl-prompt-tokens`` a loader announces, the lengths a report shows and what the engine prefills
agree. Every run records which rule it used (``TokenRule.name``).
"""

from __future__ import annotations

from typing import Final, Protocol, runtime_checkable

from zerolayer.engine.tokens import detokenize, token_ids
from zerolayer.wire.tokens import BYTES_PER_TOKEN, count_prompt_tokens


@runtime_checkable
class TokenRule(Protocol):
    """Counts text in an engine's tokens and makes text of a given token length."""

    @property
    def name(self) -> str:
        """``bytes/4`` for the wire's rule, ``tokenizer:<model dir>`` for a real tokenizer."""
        ...

    def count(self, text: str) -> int:
        """The prompt's length in tokens, as the engine will charge it (at least 1)."""
        ...

    def text(self, tokens: int, seed: int) -> str:
        """Seeded text that ``count`` counts as ``tokens`` tokens (a tokenizer's merges at the
        cut may make it a token or two off: callers that need the exact figure count it)."""
        ...


class BytesRule:
    """The wire's rule (four UTF-8 bytes a token), for engines without a tokenizer."""

    name = "bytes/4"

    def count(self, text: str) -> int:
        return count_prompt_tokens(text)

    def text(self, tokens: int, seed: int) -> str:
        size = tokens * BYTES_PER_TOKEN
        return detokenize(token_ids(seed, size // 3 + 2))[:size]


BYTES_RULE: Final = BytesRule()
