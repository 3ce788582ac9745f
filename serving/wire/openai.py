"""OpenAI request bodies in, response bytes out, sans IO: one request's wire on every stack.

The replica and the Ray Serve baseline's ingress both parse with :func:`parse_body` and answer
with :class:`Answer`, so the same body costs the same tokens, is checked by the same rules
(vLLM's: ``serving.wire.fields``) and streams the same bytes everywhere. Response framing is
pre-encoded: per request the constant head of every SSE event is built once, and per engine
chunk only the chunk's text is JSON-encoded; stop strings, echo and logprobs, when a request
asks for them, take a slower path of their own.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Final

import orjson

from serving.wire import fields
from serving.wire.contract import (
    BAD_REQUEST,
    DEFAULT_MAX_TOKENS,
    MAX_OUTPUT_TOKENS,
    UNSUPPORTED_PARAMETER,
    ContractError,
    ErrorCode,
    RequestMeta,
    error_body,
)
from serving.wire.tokens import count_prompt_tokens, request_seed

COMPLETIONS: Final = "completions"
CHAT: Final = "chat"
TABLES: Final = {COMPLETIONS: fields.COMPLETION_FIELDS, CHAT: fields.CHAT_FIELDS}
SAMPLING_PARAMS: Final = fields.SAMPLING_PARAMS

DONE: Final = b"data: [DONE]\n\n"


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One output token's log-probability and its ``top`` alternatives (token text, logprob),
    most likely first, as vLLM's ``Logprob`` entries carry them."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()


@dataclass(slots=True)
class Body:
    """A parsed, validated request body: what the engine request and the answer need."""

    prompt: str
    prompt_tokens: int
    max_tokens: int
    seed: int
    stream: bool = False
    include_usage: bool = False
    model: str | None = None
    continuous_usage: bool = False
    # SamplingParams arguments (fields.SAMPLING_PARAMS) the body set: vLLM applies them
    sampling: dict[str, Any] = field(default_factory=dict)
    stop: tuple[str, ...] = ()
    include_stop: bool = False
    echo: str = ""  # the text the answer starts with (``echo``), not generated
    logprobs: int | None = None  # alternatives per token, when the body asked for logprobs
    ignored: tuple[str, ...] = ()  # names outside vLLM's schema: accepted and ignored, as vLLM


def _bad(message: str, param: str | None = None) -> ContractError:
    return ContractError(BAD_REQUEST, message, param=param)


def _message_text(content: Any) -> str:
    """A message's text: a string, or OpenAI's content parts of type ``text`` (joined by
    newlines, as vLLM joins them); other parts (images, audio) no engine here can take."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise ContractError(
                    UNSUPPORTED_PARAMETER, "only text content parts are supported", "messages"
                )
            if not isinstance(part.get("text"), str):
                raise _bad("a text content part needs a string text", "messages")
            texts.append(part["text"])
        return "\n".join(texts)
    raise _bad("each message must be an object with a string content", "messages")


def chat_prompt(messages: Any) -> str:
    """The prompt text a chat request is charged for: its message contents, one per line."""
    if not isinstance(messages, list) or not messages:
        raise _bad("messages must be a non-empty list", "messages")
    parts = []
    for message in messages:
        if not isinstance(message, dict):
            raise _bad("each message must be an object with a string content", "messages")
        parts.append(_message_text(message.get("content")))
    return "\n".join(parts)


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise _bad(f"body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise _bad("body must be a JSON object")
    return body


def _checked(kind: str, body: dict[str, Any], ignored: list[str]) -> dict[str, Any]:
    try:
        return fields.check(TABLES[kind], body, ignored)
    except fields.FieldError as exc:
        error = UNSUPPORTED_PARAMETER if exc.unsupported else BAD_REQUEST
        raise ContractError(error, str(exc), param=exc.param) from None


def _prompt(kind: str, given: dict[str, Any]) -> str:
    if kind == CHAT:
        if given.get("add_generation_prompt") and given.get("continue_final_message"):
            raise _bad(
                "continue_final_message and add_generation_prompt cannot both be true",
                "continue_final_message",
            )
        return chat_prompt(given.get("messages"))
    text = given.get("prompt")
    if isinstance(text, list):
        text = text[0]
    if not isinstance(text, str):
        raise _bad("prompt must be a string", "prompt")
    return text


def _max_tokens(kind: str, given: dict[str, Any], meta: RequestMeta) -> int:
    """vLLM's precedence (chat: ``max_completion_tokens`` over ``max_tokens``), else the header,
    else the contract's default; a body that disagrees with the header it was admitted on is
    refused: the cost admitted is the cost served."""
    value = given.get("max_completion_tokens") if kind == CHAT else None
    if value is None:
        value = given.get("max_tokens")
    if value is None:
        return meta.max_tokens or DEFAULT_MAX_TOKENS
    if value > MAX_OUTPUT_TOKENS:
        raise _bad(f"max_tokens must be an integer in [1, {MAX_OUTPUT_TOKENS}]", "max_tokens")
    if meta.max_tokens is not None and value != meta.max_tokens:
        raise _bad(f"body max_tokens {value} disagrees with header zl-max-tokens", "max_tokens")
    return int(value)


def _logprobs(kind: str, given: dict[str, Any]) -> int | None:
    """How many alternatives per token (completions: ``logprobs``; chat: ``top_logprobs`` when
    ``logprobs`` is true, which vLLM requires for ``top_logprobs`` above 0)."""
    if kind == COMPLETIONS:
        return given.get("logprobs")
    top = given.get("top_logprobs", 0)
    if not given.get("logprobs"):
        if top:
            raise _bad("top_logprobs needs logprobs set to true", "top_logprobs")
        return None
    return int(top)


def _echo(kind: str, given: dict[str, Any], prompt: str) -> str:
    """What ``echo`` puts before the answer: the prompt (completions), or the last message
    when it is the assistant's own (chat, as vLLM continues it)."""
    if not given.get("echo"):
        return ""
    if kind == COMPLETIONS:
        return prompt
    last = given["messages"][-1]
    return _message_text(last.get("content")) if last.get("role") == "assistant" else ""


def parse_body(kind: str, raw: bytes, meta: RequestMeta) -> Body:
    """Validate a body once, by vLLM's rules (malformed JSON, bad values -> ``bad_request``;
    values no engine here can honour -> ``unsupported_parameter``; unknown names ignored).

    When the request carried ``zl-prompt-tokens``/``zl-max-tokens`` (what it was admitted on),
    the body must say the same, or it is refused.
    """
    body = _json_object(raw)
    ignored: list[str] = []
    given = _checked(kind, body, ignored)
    prompt = _prompt(kind, given)
    stream = bool(given.get("stream", False))
    options = given.get("stream_options") or {}
    if options and not stream:
        raise _bad("stream_options can only be defined when stream is true", "stream_options")
    max_tokens = _max_tokens(kind, given, meta)
    if given.get("min_tokens", 0) > max_tokens:
        raise _bad(f"min_tokens must be at most max_tokens={max_tokens}", "min_tokens")
    logprobs = _logprobs(kind, given)
    echo = _echo(kind, given, prompt)
    stop = given.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    if logprobs is not None and (echo or stop):
        raise ContractError(
            UNSUPPORTED_PARAMETER,
            "logprobs with echo (prompt logprobs) or stop strings is not supported",
            param="logprobs",
        )
    prompt_tokens = count_prompt_tokens(prompt)
    if meta.prompt_tokens is not None and prompt_tokens != meta.prompt_tokens:
        raise _bad(
            f"the prompt is {prompt_tokens} tokens; header zl-prompt-tokens says "
            f"{meta.prompt_tokens}",
            "prompt",
        )
    return Body(
        prompt=prompt,
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        seed=request_seed(prompt, given.get("seed")),
        stream=stream,
        include_usage=bool(options.get("include_usage")),
        model=given.get("model"),
        continuous_usage=bool(options.get("include_usage"))
        and bool(options.get("continuous_usage_stats")),
        sampling={k: v for k, v in given.items() if k in SAMPLING_PARAMS},
        stop=stop,
        include_stop=bool(given.get("include_stop_str_in_output")),
        echo=echo,
        logprobs=logprobs,
        ignored=tuple(sorted(ignored)),
    )


class StopMatcher:
    """Stop strings over streamed text, as vLLM applies them: the answer ends before the first
    stop string (after it with ``include_stop_str_in_output``) with finish reason ``stop``. The
    last ``len(longest) - 1`` characters wait until they cannot begin a stop string, so no part
    of one is ever sent."""

    __slots__ = ("include", "keep", "pending", "stops")

    def __init__(self, stops: tuple[str, ...], include: bool) -> None:
        self.stops = stops
        self.include = include
        self.keep = max(map(len, stops)) - 1
        self.pending = ""

    def feed(self, text: str) -> tuple[str, str | None]:
        """The text that may be sent now, and the stop string that ended the answer if one did."""
        buffer = self.pending + text
        found = [(i, s) for s in self.stops if (i := buffer.find(s)) >= 0]
        if found:
            at, stop = min(found)
            self.pending = ""
            return buffer[: at + len(stop) if self.include else at], stop
        sendable = max(0, len(buffer) - self.keep)
        self.pending = buffer[sendable:]
        return buffer[:sendable], None

    def flush(self) -> str:
        """What was held back, at the end of an answer no stop string ended."""
        rest, self.pending = self.pending, ""
        return rest


class Framer:
    """Frames one request's chunks as SSE events, or as one JSON body at the end.

    The constant head of every event (id, object, created, model, and the choice up to its
    text) is encoded once here; :meth:`event` adds only the chunk's JSON-encoded text.
    """

    __slots__ = ("_chunk_head", "_first_head", "_head", "_tail", "chat", "fingerprint",
                 "include_usage", "model", "response_id")  # fmt: skip

    def __init__(
        self,
        kind: str,
        request_id: str,
        model: str,
        include_usage: bool,
        fingerprint: str | None = None,
    ) -> None:
        self.chat = chat = kind == CHAT
        self.model = model
        self.include_usage = include_usage
        self.fingerprint = fingerprint
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
            self._tail = b'},"logprobs":null,'
        else:
            self._chunk_head = self._first_head = (
                b"data: " + head + b',"choices":[{"index":0,"text":'
            )
            self._tail = b',"logprobs":null,'

    def event(self, text: str, first: bool) -> bytes:
        """One SSE event for one chunk that is not the last."""
        return (
            (self._first_head if first else self._chunk_head)
            + orjson.dumps(text)
            + self._tail
            + b'"finish_reason":null,"stop_reason":null}]}\n\n'
        )

    def last_event(
        self,
        text: str,
        first: bool,
        finish: str,
        usage: dict[str, int],
        stop_reason: str | int | None = None,
        running: bool = False,
    ) -> bytes:
        """The last chunk's event (with ``finish_reason``; with ``usage`` unless the client
        asked for the separate usage event, or asked for it on every chunk: ``running``), any
        usage event, and ``[DONE]``."""
        head = (
            (self._first_head if first else self._chunk_head)
            + orjson.dumps(text)
            + self._tail
            + b'"finish_reason":'
            + orjson.dumps(finish)
            + b',"stop_reason":'
            + orjson.dumps(stop_reason)
        )
        fingerprint = self._fingerprint()
        if self.include_usage:
            return (
                head
                + (b'}],"usage":' + orjson.dumps(usage) + b"}" if running else b"}]}")
                + b"\n\ndata: "
                + self._head
                + b',"choices":[],"usage":'
                + orjson.dumps(usage)
                + fingerprint
                + b"}\n\n"
                + DONE
            )
        return head + b'}],"usage":' + orjson.dumps(usage) + fingerprint + b"}\n\n" + DONE

    def _fingerprint(self) -> bytes:
        if self.fingerprint is None:
            return b""
        return b',"system_fingerprint":' + orjson.dumps(self.fingerprint)

    def logprob_event(
        self,
        text: str,
        first: bool,
        logprobs: dict[str, Any] | None,
        usage: dict[str, int] | None = None,
    ) -> bytes:
        """One SSE event built whole (logprobs, or running usage): the slower path."""
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["delta"] = {"role": "assistant", "content": text} if first else {"content": text}
        else:
            choice["text"] = text
        choice |= {"logprobs": logprobs, "finish_reason": None, "stop_reason": None}
        event = orjson.loads(self._head + b"}") | {"choices": [choice]}
        if usage is not None:
            event["usage"] = usage
        return b"data: " + orjson.dumps(event) + b"\n\n"

    def body(
        self,
        text: str,
        finish: str,
        usage: dict[str, int],
        stop_reason: str | int | None = None,
        logprobs: dict[str, Any] | None = None,
    ) -> bytes:
        """The whole non-streaming response."""
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
            obj = "chat.completion"
        else:
            choice["text"] = text
            obj = "text_completion"
        choice |= {"logprobs": logprobs, "finish_reason": finish, "stop_reason": stop_reason}
        response: dict[str, Any] = {
            "id": self.response_id,
            "object": obj,
            "created": int(time.time()),
            "model": self.model,
            "choices": [choice],
            "usage": usage,
        }
        if self.fingerprint is not None:
            response["system_fingerprint"] = self.fingerprint
        return orjson.dumps(response)


def completion_logprobs(entries: list[TokenLogprob], offset: int) -> dict[str, Any]:
    """vLLM's ``CompletionLogProbs`` for these tokens, their text offsets counted from
    ``offset`` (the text already answered)."""
    offsets, at = [], offset
    for entry in entries:
        offsets.append(at)
        at += len(entry.token)
    return {
        "text_offset": offsets,
        "token_logprobs": [_finite(e.logprob) for e in entries],
        "tokens": [e.token for e in entries],
        "top_logprobs": [
            {t: _finite(lp) for t, lp in ((e.token, e.logprob), *e.top)} for e in entries
        ],
    }


def chat_logprobs(entries: list[TokenLogprob]) -> dict[str, Any]:
    """vLLM's ``ChatCompletionLogProbs``: one content entry per token, with its UTF-8 bytes."""

    def one(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": _finite(logprob), "bytes": list(token.encode())}

    return {
        "content": [
            one(e.token, e.logprob) | {"top_logprobs": [one(t, lp) for t, lp in e.top]}
            for e in entries
        ]
    }


def _finite(logprob: float) -> float:
    """vLLM's floor for a logprob (``-inf`` is not JSON)."""
    return max(logprob, -9999.0) if not math.isnan(logprob) else -9999.0


class Answer:
    """One request's answer, sans IO: engine chunks in, the bytes to send out.

    Streams as SSE or collects one JSON body; applies stop strings (ending the answer early:
    the caller then stops the engine, see :attr:`done`), echo, logprobs and usage the same way on
    every stack.
    """

    __slots__ = ("body", "completion_tokens", "done", "finish", "first", "framer", "logprobs",
                 "offset", "plain", "prompt_tokens", "stop_reason", "stopper", "text")  # fmt: skip

    def __init__(self, kind: str, request_id: str, model: str, body: Body, fingerprint: str):
        self.body = body
        self.framer = Framer(kind, request_id, model, body.include_usage, fingerprint)
        self.stopper = StopMatcher(body.stop, body.include_stop) if body.stop else None
        # nothing asked beyond the text: every streamed chunk but the last takes the fast path
        self.plain = (
            self.stopper is None
            and not body.echo
            and body.logprobs is None
            and not body.continuous_usage
        )
        self.first = True
        self.done = False
        self.finish: str | None = None
        self.stop_reason: str | None = None
        self.text: list[str] = []
        self.logprobs: list[TokenLogprob] = []
        self.offset = 0
        self.prompt_tokens = body.prompt_tokens
        self.completion_tokens = 0

    @property
    def usage(self) -> dict[str, int]:
        return usage(self.prompt_tokens, self.completion_tokens)

    def step(
        self,
        text: str,
        finish: str | None,
        prompt_tokens: int,
        completion_tokens: int,
        logprobs: list[TokenLogprob] | None = None,
    ) -> bytes:
        """Take one engine chunk; return what to send now (nothing, for a body not yet done).
        After the last chunk, or a stop string, :attr:`done` is true."""
        if prompt_tokens:
            self.prompt_tokens = prompt_tokens
        self.completion_tokens = completion_tokens
        body = self.body
        if self.plain and finish is None:
            if not body.stream:
                self.text.append(text)
                return b""
            out = self.framer.event(text, self.first)
            self.first = False
            return out
        if self.stopper is not None:
            text, hit = self.stopper.feed(text)
            if hit is not None:
                finish, self.stop_reason = "stop", hit
            elif finish is not None:
                text += self.stopper.flush()
        if self.first and body.echo:
            text = body.echo + text
        self.done = finish is not None
        self.finish = finish
        if not body.stream:
            self.text.append(text)
            self.logprobs.extend(logprobs or ())
            return self._body() if self.done else b""
        out = self._event(text, logprobs)
        self.first = False
        return out

    def _event(self, text: str, logprobs: list[TokenLogprob] | None) -> bytes:
        framer, body = self.framer, self.body
        plain = body.logprobs is None and not body.continuous_usage
        if not self.done:
            return framer.event(text, self.first) if plain else self._rich(text, logprobs)
        assert self.finish is not None
        if plain:
            return framer.last_event(text, self.first, self.finish, self.usage, self.stop_reason)
        # the last text in an event of its own (with its logprobs), then the finish alone
        lead = self._rich(text, logprobs) if text or logprobs else b""
        first = self.first and not lead
        running = body.continuous_usage
        return lead + framer.last_event(
            "", first, self.finish, self.usage, self.stop_reason, running
        )

    def _rich(self, text: str, logprobs: list[TokenLogprob] | None) -> bytes:
        """An event built whole: with logprobs, or with the running usage."""
        shaped = None if self.body.logprobs is None else self._shaped(logprobs or [])
        running = self.usage if self.body.continuous_usage else None
        out = self.framer.logprob_event(text, self.first, shaped, running)
        self.offset += len(text)
        return out

    def _shaped(self, entries: list[TokenLogprob]) -> dict[str, Any]:
        if self.framer.chat:
            return chat_logprobs(entries)
        return completion_logprobs(entries, self.offset)

    def _body(self) -> bytes:
        assert self.finish is not None
        shaped = None if self.body.logprobs is None else self._shaped(self.logprobs)
        return self.framer.body(
            "".join(self.text), self.finish, self.usage, self.stop_reason, shaped
        )


def error_event(error: ErrorCode, message: str) -> bytes:
    """The final SSE event of a stream that fails after it started."""
    return b"data: " + error_body(error, message) + b"\n\n"


def fingerprint(engine: str) -> str:
    """OpenAI's ``system_fingerprint``: which engine answered (vLLM sends its version), the
    same on every stack over that engine."""
    return f"zerolayer-{engine}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def models_body(model: str) -> bytes:
    """``/v1/models`` as vLLM lists a model: tools written for vLLM read ``root`` (the model it
    was loaded from) to find the served name."""
    card = {"id": model, "object": "model", "created": 0, "owned_by": "zerolayer", "root": model,
            "parent": None}  # fmt: skip
    return orjson.dumps({"object": "list", "data": [card]})
