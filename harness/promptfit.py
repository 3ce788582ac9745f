"""Synthetic request classes resized to a token rule, so each class's prompts come out at the
class's token count under the engine's rule (``serving.engine.tokenrules``).

Synthetic profiles size prompts in bytes at four bytes a token. Under a tokenizer that makes more
or fewer bytes a token, :func:`fit_classes` rescales each class's prompt bytes so its prompts
come out at the class's token count (clamped to the engine's context where prompt plus output
would not fit); the schedule then counts each prompt with the same rule.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from harness.profile import Profile
from serving.engine.streams import detokenize, token_ids
from serving.engine.tokenrules import TokenRule
from serving.wire.tokens import BYTES_PER_TOKEN


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
