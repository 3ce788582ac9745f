"""Token rules: how the harness counts a prompt's tokens and builds text of a given length.

The replica charges a prompt what its engine counts: an engine with a tokenizer (vLLM over a
model directory) counts with it, every other engine by the wire's rule of four UTF-8 bytes a token
(``serving.wire.tokens``). The schedule uses the same rule as the engine it is sent to, so the
``zl-prompt-tokens`` a loader announces, the lengths a report shows and what the engine prefills
agree. Every run records which rule it used (``TokenRule.name``).

Which rule an engine gets (:func:`token_rule`): vLLM over a model directory counts with that
model's tokenizer (:class:`TokenizerRule`), unless started with ``skip_tokenizer_init``. The sim,
null and torch engines keep the bytes rule: the torch engine's models are built from a shape name,
with no tokenizer (its prompt ids are the suite's synthetic ids, as the sim's), so the replica
charges them the wire's count.

Synthetic profiles size prompts in bytes at four bytes a token. Under a tokenizer that makes more
or fewer bytes a token, :func:`fit_classes` rescales each class's prompt bytes so its prompts
come out at the class's token count (clamped to the engine's context where prompt plus output
would not fit); the schedule then counts each prompt with the same rule.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Protocol, runtime_checkable

from harness.profile import Profile
from serving.engine.tokens import detokenize, token_ids
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


def token_rule(engine: str, engine_options: Mapping[str, Any]) -> TokenRule:
    """The rule the replica will count prompts by: the model's tokenizer for ``vllm`` over a
    model directory without ``skip_tokenizer_init``; the bytes rule for every other engine.
    ValueError (a user's mistake) when the tokenizer cannot be loaded."""
    model = engine_options.get("model")
    if engine != "vllm" or not model or engine_options.get("skip_tokenizer_init"):
        return BYTES_RULE
    return TokenizerRule(Path(str(model)))


def context_length(engine_options: Mapping[str, Any]) -> int | None:
    """The engine's context in tokens where it is known: ``max_model_len`` when given, else the
    model directory's ``max_position_embeddings`` (vLLM's default), else None."""
    if engine_options.get("max_model_len"):
        return int(engine_options["max_model_len"])
    model = engine_options.get("model")
    config = Path(str(model)) / "config.json" if model else None
    if config is None or not config.is_file():
        return None
    positions = json.loads(config.read_text()).get("max_position_embeddings")
    return int(positions) if positions else None


# -- synthetic classes under a real tokenizer ---------------------------------------------------

# Where a prompt must be clamped, aim this far under the limit: the tokenizer's bytes per token
# differ a little from prompt to prompt.
CLAMP_MARGIN: Final = 0.05


def target_tokens(intended: int, max_tokens: int, max_model_len: int | None) -> int:
    """Prompt tokens to aim for: the profile's count, clamped (with a margin) so prompt plus
    output stays inside ``max_model_len`` (no clamp where the context is unknown)."""
    if max_model_len is None:
        return intended
    room = max_model_len - max_tokens
    if room < 1:
        raise ValueError(f"max_tokens {max_tokens} leaves no room in max_model_len {max_model_len}")
    if intended <= room:
        return intended
    return max(1, math.floor(room * (1 - CLAMP_MARGIN)))


def scaled_bytes(tokens: int, sample_bytes: int, sample_tokens: int) -> int:
    """Bytes that make ``tokens`` tokens at the sample's bytes per token."""
    if sample_bytes < 1 or sample_tokens < 1:
        raise ValueError("the sample must have bytes and tokens")
    return max(1, round(tokens * sample_bytes / sample_tokens))


# A request id's place at the head of a synthetic prompt: ids tokenize unlike the words after them.
SAMPLE_HEAD: Final = "x0000000:"


def synthetic_sample(prompt_bytes: int) -> str:
    """Text like a synthetic prompt of that size, to measure a rule's bytes per token on: an id,
    then the vocabulary's words, as ``harness.workload.make_prompt`` builds it (not imported
    from there: the workload module builds its schedules with this module's rules)."""
    words = detokenize(token_ids(0, prompt_bytes // 3 + 2))
    return (SAMPLE_HEAD + words)[:prompt_bytes]


def fitted_bytes(tokens: int, start_bytes: int, rule: TokenRule) -> int:
    """Synthetic prompt bytes that ``rule`` counts as about ``tokens``: scaled by a sample's bytes
    per token at the class's size, then once more at the size found (the id at the head weighs
    more in a shorter prompt)."""
    size = start_bytes
    for _ in range(2):
        sample = synthetic_sample(size)
        size = scaled_bytes(tokens, len(sample), rule.count(sample))
    return size


@dataclass(frozen=True)
class ClassFit:
    """How one request class's prompt was resized for a token rule."""

    profile: str
    name: str
    intended_tokens: int
    target_tokens: int
    bytes_before: int
    bytes_after: int

    @property
    def clamped(self) -> bool:
        return self.target_tokens < self.intended_tokens

    def line(self) -> str:
        if self.clamped:
            how = "clamped to fit max_model_len"
        else:
            how = "kept" if self.bytes_after == self.bytes_before else "scaled"
        return (
            f"{self.profile} class {self.name}: {self.bytes_before} B -> {self.bytes_after} B "
            f"({how}: {self.target_tokens} tokens as the replica counts them, the profile asks "
            f"{self.intended_tokens} at {BYTES_PER_TOKEN} B a token)"
        )


def class_fits(profile: Profile, rule: TokenRule, max_model_len: int | None) -> list[ClassFit]:
    """Each class's prompt bytes that give its intended tokens under ``rule`` (clamped to
    ``max_model_len``)."""
    fits = []
    for cls in profile.classes:
        want = target_tokens(cls.prompt_tokens, cls.max_tokens, max_model_len)
        size = fitted_bytes(want, cls.prompt_bytes, rule)
        fits.append(
            ClassFit(profile.name, cls.name, cls.prompt_tokens, want, cls.prompt_bytes, size)
        )
    return fits


def apply_fits(profile: Profile, fits: list[ClassFit]) -> Profile:
    """``profile`` with each class's prompt bytes as fitted; arrivals, classes and seeds kept."""
    size = {fit.name: fit.bytes_after for fit in fits}
    classes = tuple(dataclasses.replace(c, prompt_bytes=size[c.name]) for c in profile.classes)
    return dataclasses.replace(profile, classes=classes)


def fit_classes(profile: Profile, rule: TokenRule, max_model_len: int | None = None) -> Profile:
    """``profile`` with each class's prompts at its token count under ``rule``; the bytes rule
    leaves an unclamped profile as it is."""
    return apply_fits(profile, class_fits(profile, rule, max_model_len))
