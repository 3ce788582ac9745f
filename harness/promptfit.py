"""Synthetic request classes resized to a token rule, so each class's prompts come out at the
class's token count under the engine's rule (``serving.engine.tokenrules``).

Synthetic profiles size prompts in bytes at four bytes a token. Under a tokenizer that makes more
or fewer bytes a token, :func:`fit_classes` rescales each class's prompt bytes so its prompts
come out at the class's token count (clamped to the engine's context where prompt plus output
would not fit); the schedule then counts each prompt with the same rule.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from harness.profile import Profile, RequestClass, WorkloadSource
from serving.engine.modeldir import read_model_dir
from serving.engine.streams import detokenize, token_ids
from serving.engine.tokenrules import TokenRule
from serving.wire.tokens import BYTES_PER_TOKEN


def context_length(engine_options: Mapping[str, Any]) -> int | None:
    """The engine's context in tokens where it is known: ``max_model_len`` when given, else the
    model directory's own as vLLM derives it (``serving.engine.modeldir``), else None."""
    if engine_options.get("max_model_len"):
        return int(engine_options["max_model_len"])
    model = engine_options.get("model")
    if not model or not (Path(str(model)) / "config.json").is_file():
        return None
    return read_model_dir(str(model), needs_tokenizer=False).context


# -- profiles inside a context, before any tokenizer ------------------------------------------


@dataclass(frozen=True)
class ContextFit:
    """A profile inside an engine's context: what is left of it (None: nothing fits) and a line
    for each class refused or session cut."""

    profile: Profile | None
    lines: tuple[str, ...] = ()


def _refused(profile: Profile, cls: RequestClass, why: str) -> str:
    return f"{profile.name} class {cls.name}: refused ({why})"


def _session_tokens(profile: Profile, cls: RequestClass, turn: int) -> int:
    """About how many tokens turn ``turn`` of a generated session of ``cls`` needs: the shared
    prefix, each earlier message and reply (a reply counted as its ``max_tokens``), its own
    message, and its output."""
    spec = profile.workload
    message = spec.message_tokens or cls.prompt_tokens
    return spec.prefix_tokens + turn * message + turn * cls.max_tokens


def _session_turns(profile: Profile, cls: RequestClass, room: int) -> int:
    """The most turns (up to the profile's) whose every prompt and output fit ``room``."""
    turns = 0
    while turns < profile.workload.max_turns and _session_tokens(profile, cls, turns + 1) <= room:
        turns += 1
    return turns


def _fit_sessions(profile: Profile, context: int) -> ContextFit:
    """Generated sessions cut to the turns that fit (a class none of whose turns fits is
    refused), with a margin for the tokenizer's count of the history."""
    room = math.floor(context * (1 - CLAMP_MARGIN))
    turns = {c.name: _session_turns(profile, c, room) for c in profile.classes}
    lines = [
        _refused(profile, c, f"its first turn, about {_session_tokens(profile, c, 1)} tokens, "
                 f"passes max_model_len {context}")
        for c in profile.classes if turns[c.name] == 0
    ]  # fmt: skip
    kept = tuple(c for c in profile.classes if turns[c.name] > 0)
    if not kept:
        return ContextFit(None, tuple(lines))
    most = min(turns[c.name] for c in kept)
    spec = profile.workload
    if most < spec.max_turns:
        lines.append(
            f"{profile.name} sessions: {spec.max_turns} turns -> {most} (turn {most + 1}, with "
            f"its history and output, would pass about {room} tokens of max_model_len {context})"
        )
    workload = dataclasses.replace(spec, max_turns=most)
    return ContextFit(dataclasses.replace(profile, classes=kept, workload=workload), tuple(lines))


def fit_to_context(profile: Profile, context: int) -> ContextFit:
    """``profile`` inside ``context`` tokens: each class whose output leaves no room for a
    prompt refused, generated sessions cut to the turns that fit; prompts that are merely too
    long are clamped later, under the tokenizer (:func:`class_fits`)."""
    if profile.workload.source is WorkloadSource.SESSIONS:
        return _fit_sessions(profile, context)
    lines = tuple(
        _refused(profile, c, f"max_tokens {c.max_tokens} leaves no room for a prompt in "
                 f"max_model_len {context}")
        for c in profile.classes if c.max_tokens >= context
    )  # fmt: skip
    kept = tuple(c for c in profile.classes if c.max_tokens < context)
    return ContextFit(dataclasses.replace(profile, classes=kept) if kept else None, lines)


def fit_profiles(
    profiles: Sequence[Profile], context: int | None
) -> tuple[list[Profile], list[str]]:
    """The profiles inside ``context`` (all of them where it is unknown) and a line for each
    class refused, session cut or profile left out; ValueError when none is left."""
    if context is None:
        return list(profiles), []
    kept: list[Profile] = []
    lines: list[str] = []
    for profile in profiles:
        fit = fit_to_context(profile, context)
        lines += fit.lines
        if fit.profile is None:
            lines.append(
                f"{profile.name}: left out, none of its classes fits max_model_len {context}"
            )
        else:
            kept.append(fit.profile)
    if not kept:
        raise ValueError(f"no profile fits max_model_len {context}: {'; '.join(lines)}")
    return kept, lines


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
