"""Request bodies and response framing, sans IO."""

from __future__ import annotations

import orjson
import pytest

from serving.wire.contract import BAD_REQUEST, ContractError, parse_headers
from serving.wire.openai import CHAT, COMPLETIONS, Framer, parse_body, usage
from serving.wire.tokens import count_prompt_tokens, request_seed

NO_HEADERS = parse_headers([])


def body(**fields: object) -> bytes:
    return orjson.dumps(fields)


def test_completion_body_defaults() -> None:
    parsed = parse_body(COMPLETIONS, body(prompt="hello"), NO_HEADERS)
    assert parsed.prompt == "hello"
    assert parsed.prompt_tokens == count_prompt_tokens("hello")
    assert parsed.max_tokens == 16
    assert parsed.seed == request_seed("hello", None)
    assert parsed.stream is False and parsed.include_usage is False and parsed.model is None


def test_chat_prompt_is_the_contents_one_per_line() -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    parsed = parse_body(CHAT, body(messages=messages, max_completion_tokens=3, seed=5), NO_HEADERS)
    assert parsed.prompt == "be brief\nhi"
    assert parsed.max_tokens == 3 and parsed.seed == 5


def test_header_cost_and_body_must_agree() -> None:
    headers = parse_headers([("zl-prompt-tokens", "2"), ("zl-max-tokens", "9")])
    assert parse_body(COMPLETIONS, body(prompt="12345678"), headers).max_tokens == 9
    assert parse_body(COMPLETIONS, body(prompt="12345678", max_tokens=9), headers).max_tokens == 9
    with pytest.raises(ContractError, match="zl-max-tokens"):
        parse_body(COMPLETIONS, body(prompt="12345678", max_tokens=8), headers)
    with pytest.raises(ContractError, match="zl-prompt-tokens"):
        parse_body(COMPLETIONS, body(prompt="123456789", max_tokens=9), headers)


@pytest.mark.parametrize(
    "kind,raw,message",
    [
        (COMPLETIONS, b"{", "not valid JSON"),
        (COMPLETIONS, b"[]", "JSON object"),
        (COMPLETIONS, body(prompt=5), "prompt: must be a string"),
        (COMPLETIONS, body(prompt="x", max_tokens=0), "max_tokens"),
        (COMPLETIONS, body(prompt="x", max_tokens=True), "max_tokens"),
        (COMPLETIONS, body(prompt="x", max_tokens=70_000), "max_tokens"),
        (COMPLETIONS, body(prompt="x", stream="yes"), "stream"),
        (COMPLETIONS, body(prompt="x", temperature=2.5), "temperature"),
        (COMPLETIONS, body(prompt="x", stream_options={"include_usage": True}), "stream is true"),
        (COMPLETIONS, body(prompt="x", seed=1.5), "seed"),
        (COMPLETIONS, body(prompt="x", stream_options=[]), "stream_options"),
        (COMPLETIONS, body(prompt="x", model=3), "model"),
        (CHAT, body(messages=[]), "messages"),
        (CHAT, body(messages=[{"role": "user"}]), "content"),
        (CHAT, body(messages=[{"content": "x"}], top_logprobs=2), "logprobs set to true"),
    ],
)
def test_bad_bodies_are_bad_requests(kind: str, raw: bytes, message: str) -> None:
    with pytest.raises(ContractError, match=message) as info:
        parse_body(kind, raw, NO_HEADERS)
    assert info.value.error is BAD_REQUEST


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("include_usage", [False, True])
def test_framer_events_are_valid_openai_chunks(chat: bool, include_usage: bool) -> None:
    framer = Framer(CHAT if chat else COMPLETIONS, "r-1", "m", include_usage)
    first = framer.event(' a "quoted"\n', True)
    last = framer.last_event(" z", False, "length", usage(3, 2))
    events = [
        orjson.loads(e[6:]) for e in (first + last).split(b"\n\n") if e.startswith(b"data: {")
    ]
    assert (first + last).endswith(b"data: [DONE]\n\n")
    head = events[0]
    assert head["id"] == ("chatcmpl-r-1" if chat else "cmpl-r-1")
    assert head["model"] == "m"
    assert head["object"] == ("chat.completion.chunk" if chat else "text_completion")
    if chat:
        assert head["choices"][0]["delta"] == {"role": "assistant", "content": ' a "quoted"\n'}
        assert events[1]["choices"][0]["delta"] == {"content": " z"}
    else:
        assert head["choices"][0]["text"] == ' a "quoted"\n'
    assert head["choices"][0]["finish_reason"] is None
    assert events[1]["choices"][0]["finish_reason"] == "length"
    if include_usage:
        assert len(events) == 3
        assert events[2]["choices"] == [] and events[2]["usage"]["total_tokens"] == 5
    else:
        assert events[1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 2,
                                      "total_tokens": 5}  # fmt: skip


def test_framer_whole_body() -> None:
    out = orjson.loads(Framer(CHAT, "r", "m", False).body("hi", "length", usage(1, 1)))
    assert out["object"] == "chat.completion"
    assert out["choices"][0]["message"] == {"role": "assistant", "content": "hi"}
    assert out["usage"]["total_tokens"] == 2
