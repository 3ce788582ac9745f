"""OpenAI request bodies in, response bytes out, sans IO: the replica's per-request framing.

The parsing rules are the ones every stack applies (the Ray Serve baseline's ingress has the same
fields, prompt rule and seed), so the same body costs the same tokens and streams the same text
everywhere. Response framing is pre-encoded: per request the constant head of every SSE event is
built once, and per engine chunk only the chunk's text is JSON-encoded.
"""

from __future__ import annotations

import time
from typing import Any, Final

import orjson

from zerolayer.wire.contract import (
    BAD_REQUEST,
    DEFAULT_MAX_TOKENS,
    MAX_OUTPUT_TOKENS,
    ContractError,
    ErrorCode,
    RequestMeta,
)
from zerolayer.wire.tokens import count_prompt_tokens, request_seed

COMPLETIONS: Final = "completions"
CHAT: Final = "chat"

_COMMON_FIELDS: Final = frozenset(
    {
        "model", "max_tokens", "stream", "stream_options", "seed", "temperature", "top_p",
        "top_k", "n", "stop", "user", "presence_penalty", "frequency_penalty", "ignore_eos",
        "logprobs", "min_tokens",
    }
)  # fmt: skip
FIELDS: Final = {
    COMPLETIONS: _COMMON_FIELDS | {"prompt", "echo", "best_of"},
    CHAT: _COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs"},
}
_SEED_RANGE: Final = (-(1 << 63), (1 << 64) - 1)

DONE: Final = b"data: [DONE]\n\n"


class Body:
    """A parsed, validated request body: what the engine request and the framing need."""

    __slots__ = ("include_usage", "max_tokens", "model", "prompt", "prompt_tokens", "seed",
                 "stream")  # fmt: skip

    def __init__(
        self,
        prompt: str,
        prompt_tokens: int,
        max_tokens: int,
        seed: int,
        stream: bool,
        include_usage: bool,
        model: str | None,
    ) -> None:
        self.prompt = prompt
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.seed = seed
        self.stream = stream
        self.include_usage = include_usage
        self.model = model


def _bad(message: str) -> ContractError:
    return ContractError(BAD_REQUEST, message)


def chat_prompt(messages: Any) -> str:
    """The prompt text a chat request is charged for: its message contents, one per line."""
    if not isinstance(messages, list) or not messages:
        raise _bad("messages must be a non-empty list")
    parts = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise _bad("each message must be an object with a string content")
        parts.append(message["content"])
    return "\n".join(parts)


def _int_field(body: dict[str, Any], name: str, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise _bad(f"{name} must be an integer in [{low}, {high}]")
    return value


def parse_body(kind: str, raw: bytes, meta: RequestMeta) -> Body:
    """Validate a body once (malformed JSON, unknown fields, bad values -> ``bad_request``).

    ``max_tokens`` comes from the body, else ``zl-max-tokens``, else the contract's default.
    When the request carried ``zl-prompt-tokens``/``zl-max-tokens`` (what it was admitted on),
    the body must say the same, or it is refused: the cost admitted is the cost served.
    """
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise _bad(f"body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise _bad("body must be a JSON object")
    fields = FIELDS[kind]
    for name in body:
        if name not in fields:
            unknown = sorted(set(body) - fields)
            raise _bad(f"unknown fields: {', '.join(unknown)}")
    if kind == CHAT:
        prompt = chat_prompt(body.get("messages"))
    else:
        given = body.get("prompt")
        if isinstance(given, list) and len(given) == 1:
            given = given[0]
        if not isinstance(given, str):
            raise _bad("prompt must be a string")
        prompt = given
    if body.get("n", 1) != 1:
        raise _bad("only n=1 is supported")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("stream must be a boolean")
    options = body.get("stream_options")
    if options is None:
        options = {}
    elif not isinstance(options, dict):
        raise _bad("stream_options must be an object")
    max_tokens = _int_field(body, "max_tokens", 1, MAX_OUTPUT_TOKENS)
    if max_tokens is None:
        max_tokens = _int_field(body, "max_completion_tokens", 1, MAX_OUTPUT_TOKENS)
    if max_tokens is None:
        max_tokens = meta.max_tokens or DEFAULT_MAX_TOKENS
    elif meta.max_tokens is not None and max_tokens != meta.max_tokens:
        raise _bad(f"body max_tokens {max_tokens} disagrees with header zl-max-tokens")
    seed = _int_field(body, "seed", *_SEED_RANGE)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("model must be a string")
    prompt_tokens = count_prompt_tokens(prompt)
    if meta.prompt_tokens is not None and prompt_tokens != meta.prompt_tokens:
        raise _bad(
            f"the prompt is {prompt_tokens} tokens; header zl-prompt-tokens says "
            f"{meta.prompt_tokens}"
        )
    return Body(
        prompt,
        prompt_tokens,
        max_tokens,
        request_seed(prompt, seed),
        stream,
        bool(options.get("include_usage", False)),
        model,
    )


class Framer:
    """Frames one request's engine chunks as SSE events, or as one JSON body at the end.

    The constant head of every event (id, object, created, model, and the choice up to its
    text) is encoded once here; :meth:`event` adds only the chunk's JSON-encoded text.
    """

    __slots__ = ("_chunk_head", "_first_head", "_head", "_tail", "chat", "include_usage", "model",
                 "response_id")  # fmt: skip

    def __init__(self, kind: str, request_id: str, model: str, include_usage: bool) -> None:
        self.chat = chat = kind == CHAT
        self.model = model
        self.include_usage = include_usage
        self.response_id = ("chatcmpl-" if chat else "cmpl-") + request_id
        head = (
            b'{"id":'
            + orjson.dumps(self.response_id)
            + (b',"object":"chat.completion.chunk"' if chat else b',"object":"text_completion"')
            + b',"created":'
            + str(int(time.time())).encode()
            + b',"model":'
            + orjson.dumps(model)
        )
        self._head = head
        if chat:
            self._chunk_head = b"data: " + head + b',"choices":[{"index":0,"delta":{"content":'
            self._first_head = (
                b"data: " + head + b',"choices":[{"index":0,"delta":{"role":"assistant","content":'
            )
            self._tail = b"},"
        else:
            self._chunk_head = self._first_head = (
                b"data: " + head + b',"choices":[{"index":0,"text":'
            )
            self._tail = b',"logprobs":null,'

    def event(self, text: str, first: bool) -> bytes:
        """One SSE event for one engine chunk that is not the last."""
        return (
            (self._first_head if first else self._chunk_head)
            + orjson.dumps(text)
            + self._tail
            + b'"finish_reason":null}]}\n\n'
        )

    def last_event(self, text: str, first: bool, finish: str, usage: dict[str, int]) -> bytes:
        """The last chunk's event (with ``finish_reason``; with ``usage`` unless the client
        asked for the separate usage event), any usage event, and ``[DONE]``."""
        head = (self._first_head if first else self._chunk_head) + orjson.dumps(text) + self._tail
        if self.include_usage:
            return (
                head
                + b'"finish_reason":'
                + orjson.dumps(finish)
                + b"}]}\n\ndata: "
                + self._head
                + b',"choices":[],"usage":'
                + orjson.dumps(usage)
                + b"}\n\n"
                + DONE
            )
        return (
            head
            + b'"finish_reason":'
            + orjson.dumps(finish)
            + b'}],"usage":'
            + orjson.dumps(usage)
            + b"}\n\n"
            + DONE
        )

    def body(self, text: str, finish: str, usage: dict[str, int]) -> bytes:
        """The whole non-streaming response."""
        if self.chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": finish,
            }
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            obj = "text_completion"
        return orjson.dumps(
            {
                "id": self.response_id,
                "object": obj,
                "created": int(time.time()),
                "model": self.model,
                "choices": [choice],
                "usage": usage,
            }
        )


def error_event(error: ErrorCode, message: str) -> bytes:
    """The final SSE event of a stream that fails after it started."""
    return (
        b"data: "
        + orjson.dumps({"error": {"code": error.code, "message": message, "type": error.code}})
        + b"\n\n"
    )


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def models_body(model: str) -> bytes:
    return orjson.dumps(
        {
            "object": "list",
            "data": [{"id": model, "object": "model", "created": 0, "owned_by": "zerolayer"}],
        }
    )
