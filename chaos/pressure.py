"""The KV-pressure fault's requests (``kv-pressure-one-replica``): how long each one's prompt is,
in the engine's tokens and in the bytes that make them, so that the pressure fills the replica's
KV cache as its requests arrive and each request still fits the engine's context."""

from __future__ import annotations

import dataclasses
import math

from harness.capacity import context_tokens, kv_tokens
from harness.profile import ChaosSettings
from harness.promptfit import fitted_bytes, target_tokens
from harness.stacks import StackSpec
from serving.engine import engine_kind
from serving.engine.tokenrules import BYTES_RULE, TokenRule
from serving.wire.tokens import BYTES_PER_TOKEN


@dataclasses.dataclass(frozen=True)
class KvPrompt:
    """Each KV-pressure request's prompt: its length in the engine's tokens, and the synthetic
    prompt bytes the engine's token rule counts as that many (four a token under the wire's
    rule; about 1.3 under the tiny model's BPE)."""

    tokens: int
    prompt_bytes: int


def kv_prompt(spec: StackSpec, settings: ChaosSettings, rule: TokenRule | None = None) -> KvPrompt:
    """The KV-pressure prompt: its prompts alone ask for ``kv_fill`` times one replica's KV
    cache over ``kv_requests`` requests, from the engine's own KV size (the same on both
    stacks), so that the cache fills as the requests arrive, not later as they decode; the
    profile's fixed figure when the KV size is unknown. Either way it is clamped, as a profile's
    classes are, so that prompt and output fit the engine's context
    (``harness.capacity.context_tokens``), and sized in bytes under ``rule`` (default: the
    engine's token rule)."""
    if rule is None:
        rule = engine_kind(spec.engine).token_rule(spec.engine_options)
    tokens = kv_tokens(spec.engine, spec.engine_options)
    if tokens is None:
        wanted = settings.kv_prompt_tokens
    else:
        wanted = math.ceil(settings.kv_fill * tokens / settings.kv_requests)
    context = context_tokens(spec.engine, spec.engine_options)
    if context is not None and context <= settings.kv_max_tokens:
        wanted = 1  # no room for a prompt: the engine refuses each, which the trial records
    else:
        wanted = target_tokens(wanted, settings.kv_max_tokens, context)
    if rule is BYTES_RULE:
        return KvPrompt(wanted, wanted * BYTES_PER_TOKEN)
    return KvPrompt(wanted, fitted_bytes(wanted, wanted * BYTES_PER_TOKEN, rule))
