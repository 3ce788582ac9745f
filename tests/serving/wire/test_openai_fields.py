"""vLLM's request fields on every stack (sans IO): what is accepted, refused and how answers are
shaped. The comparison with vLLM's own request models is ``test_openai_schema_vllm.py``."""

from __future__ import annotations

import math
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from serving.engine.streams import VOCAB, uniform_logprobs
from serving.wire import fields
from serving.wire.contract import (
    BAD_REQUEST,
    UNSUPPORTED_PARAMETER,
    ContractError,
    error_body,
    parse_headers,
)
from serving.wire.openai import (
    CHAT,
    COMPLETIONS,
    Answer,
    Body,
    StopMatcher,
    models_body,
    parse_body,
)
from tests.support.paths import DOCS

NO_HEADERS = parse_headers([])
CHAT_MESSAGES = [{"role": "user", "content": "hi"}]


def parse(kind: str, **body: Any) -> Body:
    if kind == CHAT:
        body.setdefault("messages", CHAT_MESSAGES)
    else:
        body.setdefault("prompt", "hello there")
    return parse_body(kind, orjson.dumps(body), NO_HEADERS)


def refused(kind: str, **body: Any) -> ContractError:
    with pytest.raises(ContractError) as info:
        parse(kind, **body)
    return info.value


VLLM_CLIENT_FIELDS = {
    "logit_bias": {"17": -100, "4": 5.5},
    "min_p": 0.05,
    "repetition_penalty": 1.1,
    "min_tokens": 4,
    "top_k": 20,
    "top_p": 0.9,
    "temperature": 0.7,
    "presence_penalty": 0.1,
    "frequency_penalty": -0.2,
    "skip_special_tokens": True,
    "stream": True,
    "stream_options": {"include_usage": True, "continuous_usage_stats": False},
    "max_tokens": 12,
    "user": "someone",
}


@pytest.mark.parametrize("kind", [COMPLETIONS, CHAT])
def test_what_clients_written_for_vllm_send_is_accepted(kind: str) -> None:
    """The fields the issue found refused (400 unknown fields) on today's main."""
    logprobs = {"logprobs": 2} if kind == COMPLETIONS else {"logprobs": True, "top_logprobs": 2}
    parsed = parse(kind, **VLLM_CLIENT_FIELDS, **logprobs)
    assert parsed.logprobs == 2 and parsed.max_tokens == 12 and parsed.include_usage
    assert parsed.sampling == {
        k: v for k, v in VLLM_CLIENT_FIELDS.items() if k in fields.SAMPLING_PARAMS
    }
    assert parsed.ignored == ()


def test_a_field_outside_vllms_schema_is_accepted_and_ignored_as_vllm_does() -> None:
    parsed = parse(COMPLETIONS, best_of=3, not_a_field={"x": 1})
    assert parsed.ignored == ("best_of", "not_a_field") and parsed.sampling == {}


@pytest.mark.parametrize(
    ("kind", "body", "param"),
    [
        (COMPLETIONS, {"temperature": 2.5}, "temperature"),
        (COMPLETIONS, {"temperature": "1"}, "temperature"),
        (COMPLETIONS, {"top_p": 0}, "top_p"),
        (COMPLETIONS, {"top_k": -2}, "top_k"),
        (COMPLETIONS, {"min_p": 1.5}, "min_p"),
        (COMPLETIONS, {"repetition_penalty": 0}, "repetition_penalty"),
        (COMPLETIONS, {"presence_penalty": -2.5}, "presence_penalty"),
        (COMPLETIONS, {"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        (COMPLETIONS, {"stop": [""]}, "stop"),
        (COMPLETIONS, {"logprobs": 21}, "logprobs"),
        (COMPLETIONS, {"seed": 1 << 63}, "seed"),
        (COMPLETIONS, {"logit_bias": {"x": 1}}, "logit_bias"),
        (COMPLETIONS, {"max_tokens": 4, "min_tokens": 5}, "min_tokens"),
        (COMPLETIONS, {"stream_options": {"include_usage": True}}, "stream_options"),
        (COMPLETIONS, {"ignore_eos": "yes"}, "ignore_eos"),
        (CHAT, {"top_logprobs": 2}, "top_logprobs"),
        (CHAT, {"logprobs": 2}, "logprobs"),
        (CHAT, {"add_generation_prompt": True, "continue_final_message": True}, None),
    ],
)
def test_values_vllm_refuses_are_bad_requests_naming_the_field(
    kind: str, body: dict[str, Any], param: str | None
) -> None:
    error = refused(kind, **body)
    assert error.error is BAD_REQUEST
    assert error.param == (param or "continue_final_message")


@pytest.mark.parametrize(
    ("kind", "body", "param"),
    [
        (COMPLETIONS, {"n": 2}, "n"),
        (COMPLETIONS, {"use_beam_search": True}, "use_beam_search"),
        (COMPLETIONS, {"prompt_logprobs": 1}, "prompt_logprobs"),
        (COMPLETIONS, {"response_format": {"type": "json_object"}}, "response_format"),
        (COMPLETIONS, {"logprobs": 1, "echo": True}, "logprobs"),
        (COMPLETIONS, {"logprobs": 1, "stop": "x"}, "logprobs"),
        (CHAT, {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ],
)
def test_values_no_engine_here_can_honour_are_refused_as_unsupported(
    kind: str, body: dict[str, Any], param: str
) -> None:
    error = refused(kind, **body)
    assert error.error is UNSUPPORTED_PARAMETER and error.param == param
    shaped = orjson.loads(error_body(error.error, error.message, error.param))["error"]
    assert shaped == {
        "message": error.message,
        "type": "BadRequestError",
        "param": param,
        "code": "unsupported_parameter",
    }


@pytest.mark.parametrize("table", [fields.COMPLETION_FIELDS, fields.CHAT_FIELDS])
def test_every_field_at_its_unused_value_is_accepted(table: dict[str, fields.Field]) -> None:
    for spec in table.values():
        for value in spec.unused:
            if value is not None:
                assert fields.check(table, {spec.name: value}) == {spec.name: value}


def test_chat_takes_max_completion_tokens_over_max_tokens_as_vllm_does() -> None:
    assert parse(CHAT, max_tokens=9, max_completion_tokens=4).max_tokens == 4
    assert parse(CHAT, max_tokens=9).max_tokens == 9


def test_echo_puts_the_prompt_or_the_assistants_last_message_first() -> None:
    assert parse(COMPLETIONS, prompt="say", echo=True).echo == "say"
    turn = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "partial"}]
    assert parse(CHAT, messages=turn, echo=True).echo == "partial"
    assert parse(CHAT, echo=True).echo == ""


stop_texts = st.text(alphabet="abc", min_size=1, max_size=3)


@given(
    chunks=st.lists(st.text(alphabet="abcd", max_size=6), max_size=12),
    stops=st.lists(stop_texts, min_size=1, max_size=4),
    include=st.booleans(),
)
def test_stop_strings_end_the_answer_and_none_is_ever_sent(
    chunks: list[str], stops: list[str], include: bool
) -> None:
    matcher = StopMatcher(tuple(stops), include)
    sent, hit = "", None
    for chunk in chunks:
        out, hit = matcher.feed(chunk)
        sent += out
        if hit is not None:
            break
    else:
        sent += matcher.flush()
    full = "".join(chunks)
    assert full.startswith(sent)
    if hit is None:
        assert sent == full and not any(s in full for s in stops)
    else:
        assert hit in stops
        body = sent[: -len(hit)] if include else sent
        assert full[len(body) :].startswith(hit)
        assert not any(s in body for s in stops)


def _answer(kind: str, **body: Any) -> Answer:
    return Answer(kind, "r1", "m", parse(kind, **body), "zerolayer-sim")


def _events(raw: bytes) -> list[Any]:
    return [orjson.loads(e[6:]) for e in raw.split(b"\n\n") if e.startswith(b"data: {")]


IDS = [[5, 9], [300], [7, 4095]]


@pytest.mark.parametrize("kind", [COMPLETIONS, CHAT])
def test_streamed_logprobs_come_per_token_in_vllms_shape(kind: str) -> None:
    options = {"logprobs": 2} if kind == COMPLETIONS else {"logprobs": True, "top_logprobs": 2}
    answer = _answer(kind, stream=True, max_tokens=5, **options)
    raw = b""
    for n, ids in enumerate(IDS):
        finish = "length" if n == len(IDS) - 1 else None
        text = "".join(VOCAB[i] for i in ids)
        raw += answer.step(text, finish, 3, 2 * n + 2, uniform_logprobs(ids, 2))
    events = _events(raw)
    tokens = [VOCAB[i] for ids in IDS for i in ids]
    if kind == COMPLETIONS:
        shaped = [e["choices"][0]["logprobs"] for e in events if e["choices"][0]["logprobs"]]
        assert [t for s in shaped for t in s["tokens"]] == tokens
        offsets = [o for s in shaped for o in s["text_offset"]]
        assert offsets == [sum(map(len, tokens[:i])) for i in range(len(tokens))]
        assert all(len(top) == 2 for s in shaped for top in s["top_logprobs"])
        lps = [lp for s in shaped for lp in s["token_logprobs"]]
    else:
        content = [c for e in events if e["choices"][0]["logprobs"] for c in
                   e["choices"][0]["logprobs"]["content"]]  # fmt: skip
        assert [c["token"] for c in content] == tokens
        assert all(c["bytes"] == list(c["token"].encode()) for c in content)
        assert all(len(c["top_logprobs"]) == 2 for c in content)
        lps = [c["logprob"] for c in content]
    assert all(math.isclose(lp, -math.log(4096)) for lp in lps)
    last = events[-1]
    assert last["choices"][0]["finish_reason"] == "length"
    assert last["usage"]["completion_tokens"] == 6 and last["system_fingerprint"] == "zerolayer-sim"


def test_a_stop_string_ends_a_whole_body_with_its_reason() -> None:
    answer = _answer(COMPLETIONS, max_tokens=8, stop=[" po"])
    assert answer.step(" ka lo", None, 3, 2) == b""
    out = answer.step(" mi po ne", None, 3, 5)
    assert answer.done
    body = orjson.loads(out)
    choice = body["choices"][0]
    assert choice["text"] == " ka lo mi" and choice["finish_reason"] == "stop"
    assert choice["stop_reason"] == " po" and choice["logprobs"] is None
    assert body["system_fingerprint"] == "zerolayer-sim"


def test_continuous_usage_counts_on_every_chunk() -> None:
    answer = _answer(
        CHAT,
        stream=True,
        max_tokens=3,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )
    raw = answer.step(" a", None, 4, 1) + answer.step(" b", None, 4, 2)
    raw += answer.step(" c", "length", 4, 3)
    events = _events(raw)
    content = [e for e in events if e["choices"] and e["choices"][0]["delta"].get("content")]
    assert [e["usage"]["completion_tokens"] for e in content] == [1, 2, 3]
    assert all("usage" in e for e in events), "vLLM puts the running usage on every chunk"
    assert events[-1]["choices"] == [] and events[-1]["usage"]["total_tokens"] == 7
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1]) == " a b c"


def test_the_doc_names_every_refused_field_and_the_vllm_version() -> None:
    doc = (DOCS / "openai-fields.md").read_text()
    assert f"vLLM {fields.VLLM_VERSION}" in doc
    for table in (fields.COMPLETION_FIELDS, fields.CHAT_FIELDS):
        for spec in table.values():
            if spec.use is fields.Use.UNSUPPORTED:
                assert f"`{spec.name}`" in doc, spec.name


def test_the_model_list_has_the_root_tools_written_for_vllm_read() -> None:
    (card,) = orjson.loads(models_body("zl-sim"))["data"]
    assert card["id"] == card["root"] == "zl-sim" and card["object"] == "model"
