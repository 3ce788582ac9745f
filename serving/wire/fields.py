"""Every request field of vLLM's OpenAI server, as a table: what it is, how it is checked, and
what each stack does with it. One table serves the replica and the baseline's ingress.

It follows vLLM 0.29.0's request models (``vllm.entrypoints.openai.completion.protocol.
CompletionRequest`` and ``...chat_completion.protocol.ChatCompletionRequest``); the ``vllm``
tests compare it with them field by field, so a new vLLM that adds or drops a field fails there.
Types and ranges are vLLM's: its pydantic types and the checks of ``SamplingParams._verify_args``
(temperature in [0, 2], top_p in (0, 1], at most 4 stop strings, at most 20 logprobs, ...).

A field not in vLLM's schema is accepted and ignored, as vLLM does (``extra="allow"``: it logs
the names at debug level and generation never reads them).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any, Final

VLLM_VERSION: Final = "0.29.0"

INT64: Final = (-(1 << 63), (1 << 63) - 1)
MAX_STOP_STRINGS: Final = 4  # vLLM's VLLM_MAX_STOP_STRINGS default
MAX_LOGPROBS: Final = 20  # vLLM's ModelConfig.max_logprobs default
MAX_N: Final = 16_384  # vLLM's VLLM_MAX_N_SEQUENCES


class Use(Enum):
    """What a stack does with a field."""

    PROMPT = "prompt"  # what is generated from
    WORK = "work"  # how much the engine does: honoured by every engine (docs/openai-fields.md)
    SAMPLING = "sampling"  # what a real engine computes: to vLLM's SamplingParams, else recorded
    RESPONSE = "response"  # the shape of the answer (streaming, usage, logprobs)
    IGNORED = "ignored"  # vLLM's server ignores it too, or it names what the contract headers do
    # Accepted at its default; any other value is refused with ``unsupported_parameter`` because
    # no engine here can honour it (tool calls, structured output, beam search, n > 1, ...).
    UNSUPPORTED = "unsupported"


class FieldError(ValueError):
    """A field's value that vLLM's server would refuse too (``bad_request``), or one that no
    engine here can honour (``unsupported``)."""

    def __init__(self, param: str, message: str, *, unsupported: bool = False) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
        self.unsupported = unsupported


Check = Callable[[Any], str | None]  # the reason a value is wrong, or None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def boolean(value: Any) -> str | None:
    return None if isinstance(value, bool) else "must be a boolean"


def string(value: Any) -> str | None:
    return None if isinstance(value, str) else "must be a string"


def obj(value: Any) -> str | None:
    return None if isinstance(value, dict) else "must be an object"


def array(value: Any) -> str | None:
    return None if isinstance(value, list) else "must be an array"


def anything(value: Any) -> str | None:
    return None


def integer(low: int = INT64[0], high: int = INT64[1]) -> Check:
    def check(value: Any) -> str | None:
        ok = _is_int(value) and low <= value <= high
        return None if ok else f"must be an integer in [{low}, {high}]"

    return check


def number(low: float, high: float, *, open_low: bool = False) -> Check:
    """A finite number in [low, high] (or (low, high] with ``open_low``)."""
    bracket = "(" if open_low else "["

    def check(value: Any) -> str | None:
        ok = _is_number(value) and (low < value if open_low else low <= value) and value <= high
        return None if ok else f"must be a number in {bracket}{low:g}, {high:g}]"

    return check


def one_of(*choices: str) -> Check:
    def check(value: Any) -> str | None:
        return None if value in choices else f"must be one of {', '.join(choices)}"

    return check


def int_list(value: Any) -> str | None:
    ok = isinstance(value, list) and all(_is_int(v) and v >= 0 for v in value)
    return None if ok else "must be an array of token ids (integers >= 0)"


def words(value: Any) -> str | None:
    ok = isinstance(value, list) and all(isinstance(v, str) and v for v in value)
    return None if ok else "must be an array of non-empty strings"


def stop(value: Any) -> str | None:
    """vLLM's ``str | list[str]`` of at most 4, none of them empty."""
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        return "must be a string or an array of strings"
    if len(values) > MAX_STOP_STRINGS:
        return f"must hold at most {MAX_STOP_STRINGS} strings"
    return "cannot contain an empty string" if "" in values else None


def top_k(value: Any) -> str | None:
    return None if _is_int(value) and value >= -1 else "must be 0 (disable), -1, or at least 1"


def repetition_penalty(value: Any) -> str | None:
    return None if _is_number(value) and value > 0 else "must be a number greater than zero"


def logit_bias(value: Any) -> str | None:
    """Token ids (as strings, as JSON keys must be) to finite biases."""
    if not isinstance(value, dict):
        return "must be an object of token id to bias"
    for key, bias in value.items():
        if not key.lstrip("-").isdigit() or not _is_number(bias):
            return "must map token ids (integer strings) to numbers"
    return None


def stream_options(value: Any) -> str | None:
    if not isinstance(value, dict):
        return "must be an object"
    for key in ("include_usage", "continuous_usage_stats"):
        if value.get(key) is not None and not isinstance(value[key], bool):
            return f"{key} must be a boolean"
    return None


def prompt(value: Any) -> str | None:
    """A string, or a batch of one string (vLLM takes token-id prompts too; refused below)."""
    single = value[0] if isinstance(value, list) and len(value) == 1 else value
    return None if isinstance(single, str) else "must be a string"


def cache_salt(value: Any) -> str | None:
    return None if isinstance(value, str) and 1 <= len(value) <= 1024 else "must be 1-1024 chars"


@dataclass(frozen=True, slots=True)
class Field:
    """One request field: its check, what the stacks do with it, the value that leaves it
    unused (what an UNSUPPORTED field may carry), and whether OpenAI's API has it too."""

    name: str
    check: Check
    use: Use
    unused: tuple[Any, ...] = (None,)
    openai: bool = False


def _table(*fields: Field) -> Mapping[str, Field]:
    return {f.name: f for f in fields}


_OPENAI_COMMON: Final = (
    Field("model", string, Use.PROMPT, openai=True),
    Field("frequency_penalty", number(-2, 2), Use.SAMPLING, openai=True),
    Field("logit_bias", logit_bias, Use.SAMPLING, openai=True),
    Field("n", integer(1, MAX_N), Use.UNSUPPORTED, unused=(None, 1), openai=True),
    Field("presence_penalty", number(-2, 2), Use.SAMPLING, openai=True),
    Field("seed", integer(*INT64), Use.SAMPLING, openai=True),
    Field("stop", stop, Use.WORK, openai=True),
    Field("stream", boolean, Use.RESPONSE, openai=True),
    Field("stream_options", stream_options, Use.RESPONSE, openai=True),
    Field("temperature", number(0, 2), Use.SAMPLING, openai=True),
    Field("top_p", number(0, 1, open_low=True), Use.SAMPLING, openai=True),
    Field("user", string, Use.IGNORED, openai=True),
)
# vLLM's own sampling and output parameters, the same on both endpoints.
_VLLM_COMMON: Final = (
    Field("use_beam_search", boolean, Use.UNSUPPORTED, unused=(None, False)),
    Field("top_k", top_k, Use.SAMPLING),
    Field("min_p", number(0, 1), Use.SAMPLING),
    Field("repetition_penalty", repetition_penalty, Use.SAMPLING),
    Field("length_penalty", number(-math.inf, math.inf), Use.IGNORED),  # beam search only
    # ids are the engine's own vocabulary's: the answer path sees text, not ids, and the sim has
    # no tokenizer to map them; refused until an engine does it (see docs/openai-fields.md)
    Field("stop_token_ids", int_list, Use.UNSUPPORTED, unused=(None, [])),
    Field("include_stop_str_in_output", boolean, Use.RESPONSE),
    Field("ignore_eos", boolean, Use.WORK),
    Field("min_tokens", integer(0), Use.WORK),
    Field("skip_special_tokens", boolean, Use.SAMPLING),
    Field("spaces_between_special_tokens", boolean, Use.SAMPLING),
    Field("truncate_prompt_tokens", integer(-1), Use.UNSUPPORTED),
    Field("truncation_side", one_of("left", "right"), Use.IGNORED),
    Field("allowed_token_ids", int_list, Use.SAMPLING),
    Field("prompt_logprobs", integer(-1), Use.UNSUPPORTED),
    Field("logprob_token_ids", int_list, Use.UNSUPPORTED),
    Field("bad_words", words, Use.SAMPLING),
    Field("structured_outputs", obj, Use.UNSUPPORTED),
    Field("priority", integer(*INT64), Use.IGNORED),
    Field("request_id", string, Use.IGNORED),
    Field("session_id", string, Use.IGNORED),
    Field("return_tokens_as_token_ids", boolean, Use.UNSUPPORTED, unused=(None, False)),
    Field("return_token_ids", boolean, Use.UNSUPPORTED, unused=(None, False)),
    Field("routed_experts_prompt_start", integer(0), Use.IGNORED),
    Field("return_token_offsets", boolean, Use.UNSUPPORTED, unused=(None, False)),
    Field("cache_salt", cache_salt, Use.UNSUPPORTED),
    Field("kv_transfer_params", obj, Use.UNSUPPORTED),
    Field("ec_transfer_params", obj, Use.UNSUPPORTED),
    Field("vllm_xargs", obj, Use.UNSUPPORTED),
    Field("repetition_detection", obj, Use.UNSUPPORTED),
    Field("thinking_token_budget", integer(-1), Use.UNSUPPORTED, unused=(None, -1)),
    Field("stream_interval", integer(1), Use.UNSUPPORTED, unused=(None, 1)),
)

COMPLETION_FIELDS: Final = _table(
    *_OPENAI_COMMON,
    Field("prompt", prompt, Use.PROMPT, openai=True),
    Field("echo", boolean, Use.RESPONSE, openai=True),
    Field("logprobs", integer(0, MAX_LOGPROBS), Use.RESPONSE, openai=True),
    Field("max_tokens", integer(1), Use.WORK, openai=True),
    Field("suffix", string, Use.IGNORED, openai=True),
    *_VLLM_COMMON,
    Field("prompt_embeds", anything, Use.UNSUPPORTED),
    Field("add_special_tokens", boolean, Use.PROMPT),
    Field("response_format", obj, Use.UNSUPPORTED),
)

CHAT_FIELDS: Final = _table(
    Field("messages", array, Use.PROMPT, openai=True),
    *_OPENAI_COMMON,
    Field("logprobs", boolean, Use.RESPONSE, openai=True),
    Field("top_logprobs", integer(0, MAX_LOGPROBS), Use.RESPONSE, openai=True),
    Field("max_tokens", integer(1), Use.WORK, openai=True),
    Field("max_completion_tokens", integer(1), Use.WORK, openai=True),
    Field("response_format", obj, Use.UNSUPPORTED, openai=True),
    Field("tools", array, Use.UNSUPPORTED, openai=True),
    Field("tool_choice", anything, Use.UNSUPPORTED, unused=(None, "none"), openai=True),
    Field("reasoning_effort", string, Use.UNSUPPORTED, openai=True),
    Field("thinking_token_budget", integer(-1), Use.UNSUPPORTED, unused=(None, -1)),
    Field("include_reasoning", boolean, Use.IGNORED),
    Field("parallel_tool_calls", boolean, Use.IGNORED, openai=True),
    *_VLLM_COMMON,
    Field("echo", boolean, Use.RESPONSE),
    Field("add_generation_prompt", boolean, Use.PROMPT),
    Field("continue_final_message", boolean, Use.PROMPT),
    Field("add_special_tokens", boolean, Use.PROMPT),
    Field("documents", array, Use.UNSUPPORTED),
    Field("chat_template", string, Use.UNSUPPORTED),
    Field("chat_template_kwargs", obj, Use.IGNORED),
    Field("media_io_kwargs", obj, Use.IGNORED),
    Field("mm_processor_kwargs", obj, Use.IGNORED),
    Field("return_prompt_text", boolean, Use.UNSUPPORTED, unused=(None, False)),
    Field("return_assistant_tokens_mask", boolean, Use.UNSUPPORTED, unused=(None, False)),
)

# The SamplingParams arguments the sampling fields become (vLLM's ``to_sampling_params``).
SAMPLING_PARAMS: Final = frozenset(
    {
        "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
        "repetition_penalty", "logit_bias", "allowed_token_ids", "bad_words",
        "skip_special_tokens", "spaces_between_special_tokens", "stop",
        "include_stop_str_in_output", "ignore_eos", "min_tokens",
    }
)  # fmt: skip


def check(
    table: Mapping[str, Field], body: Mapping[str, Any], ignored: list[str] | None = None
) -> dict[str, Any]:
    """The body's known fields that are set, each checked; unknown names are dropped (vLLM's
    ``extra="allow"``), and listed in ``ignored`` when one is given. Raises
    :class:`FieldError` for a bad value or an unsupported one."""
    known = {}
    for name, value in body.items():
        spec = table.get(name)
        if spec is None:
            if ignored is not None:
                ignored.append(name)
            continue
        if value is None:
            continue
        problem = spec.check(value)
        if problem is not None:
            raise FieldError(name, problem)
        if spec.use is UNSUPPORTED and value not in spec.unused:
            raise FieldError(name, "not supported by this suite's engines", unsupported=True)
        known[name] = value
    return known


UNSUPPORTED: Final = Use.UNSUPPORTED
