"""Token rules: how a prompt's tokens are counted and text of a given length is built, as the
engine the prompt is sent to charges it.

The replica charges a prompt what its engine counts: an engine with a tokenizer (vLLM over a
model directory) counts with it, every other engine by the wire's rule of four UTF-8 bytes a token
(``serving.wire.tokens``). Every stack and the harness's schedules count by the same rule, which
the engine's kind names (``EngineKind.token_rule``), so the ``zl-prompt-tokens`` a loader
announces, the lengths a report shows and what the engine prefills agree. Every run records
which rule it used (``TokenRule.name``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final, Protocol, runtime_checkable

from serving.engine.streams import detokenize, token_ids
from serving.wire.tokens import BYTES_PER_TOKEN, count_prompt_tokens


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


# ``text`` re-counts its cut and moves it by the difference at most this many times: a BPE
# tokenizer may merge across the cut, so the decoded prefix of n ids can re-encode as n +/- 1.
FIT_TRIES: Final = 4


def load_tokenizer(model_dir: Path) -> Any:
    """The model directory's tokenizer as ``transformers.AutoTokenizer`` loads it (vLLM loads it
    so), offline: a local directory only, never the Hugging Face hub."""
    if not model_dir.is_dir():
        raise ValueError(f"model {model_dir} is not a local model directory")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ValueError(
            f"counting tokens for model {model_dir} needs transformers (the vllm extra brings it)"
        ) from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ValueError(f"model {model_dir}: its tokenizer does not load ({reason})") from None
    tokenizer.model_max_length = 1 << 30  # counting only: no warning for long prompts
    return tokenizer


class TokenizerRule:
    """A model's own tokenizer: counts as the vLLM engine charges a prompt
    (``tokenizer.encode(text, add_special_tokens=True)``, see ``VllmEngine.count_tokens``).

    ``text(n, seed)`` takes seeded words of the suite's vocabulary, encodes them, cuts the ids to
    the wanted length and decodes. Decoding a cut and encoding it again can merge across the cut,
    so the result is re-counted and the cut moved by the difference, up to ``FIT_TRIES`` times;
    the text is exact whenever one of those cuts re-encodes to the wanted count (on the tiny
    model's byte-level BPE and word-separated text, the first cut does), and otherwise the
    closest found, off by the merges at the cut (a token or two). ``n`` below the tokenizer's
    special tokens (a BOS it adds) gives the shortest text, one id of words.
    """

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self.name = f"tokenizer:{model_dir.name}"
        self._tokenizer = load_tokenizer(model_dir)
        self._specials = len(self._tokenizer.encode("", add_special_tokens=True))

    def count(self, text: str) -> int:
        return max(1, len(self._tokenizer.encode(text, add_special_tokens=True)))

    def text(self, tokens: int, seed: int) -> str:
        want = max(1, tokens - self._specials)
        # every vocabulary word is at least one id: room for the cut to move past ``want``
        words = detokenize(token_ids(seed, want + 2 * FIT_TRIES + 1))
        ids = self._tokenizer.encode(words, add_special_tokens=False)
        return self._closest_cut(ids, want, tokens)

    def _closest_cut(self, ids: list[int], cut: int, tokens: int) -> str:
        best, best_off = "", math.inf
        for _ in range(FIT_TRIES):
            text = self._tokenizer.decode(ids[:cut])
            off = self.count(text) - tokens
            if abs(off) < best_off:
                best, best_off = text, abs(off)
            if off == 0:
                break
            cut = min(len(ids), max(1, cut - off))
        return best


def bytes_rule(_engine_options: Mapping[str, Any]) -> TokenRule:
    """The wire's rule whatever the options: the token rule of every engine without a tokenizer
    (the torch engine's models are built from a shape name, with no tokenizer: its prompt ids are
    the suite's synthetic ids, as the sim's)."""
    return BYTES_RULE


def model_tokenizer_rule(engine_options: Mapping[str, Any]) -> TokenRule:
    """The vLLM engine's rule: the model directory's tokenizer, unless there is no model or the
    engine starts with ``skip_tokenizer_init`` (then the bytes rule). ValueError (a user's
    mistake) when the tokenizer cannot be loaded."""
    model = engine_options.get("model")
    if not model or engine_options.get("skip_tokenizer_init"):
        return BYTES_RULE
    return TokenizerRule(Path(str(model)))
