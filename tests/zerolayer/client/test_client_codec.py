"""The client's sans-IO parts: SSE parsing, request encoding, header validation, response sink."""

from __future__ import annotations

import orjson
import pytest

from serving.wire import contract
from serving.wire.tokens import count_prompt_tokens
from zerolayer.client.codec import CLIENT_BODY_FIELDS, RequestIssuer, SSEParser, prepare
from zerolayer.client.stream import Response
from zerolayer.client.timing import CONNECTION_LOST, STREAM_RESET, Timing


def sse(obj: object) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def chunk(text: str, finish: str | None = None, usage: dict | None = None) -> bytes:
    obj: dict = {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}
    if usage is not None:
        obj["usage"] = usage
    return sse(obj)


STREAM = (
    chunk(" kalo mine")
    + chunk(" su")
    + chunk(" ta", "length", {"prompt_tokens": 5, "completion_tokens": 4})
    + b"data: [DONE]\n\n"
)


@pytest.mark.parametrize("step", [1, 3, 7, 50, len(STREAM)])
def test_sse_parser_reassembles_events_split_anywhere(step: int) -> None:
    parser = SSEParser()
    out = []
    for i in range(0, len(STREAM), step):
        out += parser.feed(STREAM[i : i + step])
    assert out[-1] == b"[DONE]"
    assert [orjson.loads(p)["choices"][0]["text"] for p in out[:-1]] == [" kalo mine", " su", " ta"]


def test_sse_parser_handles_crlf_and_multiline_data() -> None:
    parser = SSEParser()
    assert parser.feed(b"event: x\r\ndata: a\r\ndata: b\r\n\r\n: comment\n\n") == [b"a\nb"]


def test_response_counts_tokens_times_chunks_and_takes_usage() -> None:
    timing = Timing()
    resp = Response(timing, chat=False)
    resp.on_response(200, [(b":status", b"200")])
    for i in range(0, len(STREAM), 11):
        resp.on_data(STREAM[i : i + 11])
    assert resp.done and resp.error is None
    assert [c.text for c in resp.chunks] == [" kalo mine", " su", " ta"]
    assert sum(c.tokens for c in resp.chunks) == 4
    assert timing.output_tokens == 4 and timing.prompt_tokens == 5
    assert timing.finish_reason == "length"
    assert len(timing.chunk_ns) == 3 and timing.first_token_ns == timing.chunk_ns[0]
    assert timing.headers_ns <= timing.first_token_ns


def test_response_reads_chat_deltas() -> None:
    resp = Response(Timing(), chat=True)
    resp.on_response(200, [])
    resp.on_data(sse({"choices": [{"delta": {"role": "assistant", "content": " ka"}}]}))
    resp.on_data(sse({"choices": [{"delta": {"content": " lo"}}]}))
    assert [c.text for c in resp.chunks] == [" ka", " lo"]


def test_refusal_becomes_a_retryable_error_with_its_code() -> None:
    timing = Timing()
    resp = Response(timing, chat=False)
    resp.on_response(
        429, [(b":status", b"429"), (b"zl-error", b"queue_full"), (b"retry-after-ms", b"40")]
    )
    resp.on_data(contract.error_body(contract.QUEUE_FULL, "queue is full"))
    resp.on_reset(0)
    assert resp.error is not None
    assert resp.error.code == "queue_full" and resp.error.retryable
    assert resp.error.retry_after_ms == 40 and resp.error.status == 429
    assert "queue is full" in resp.error.message


def test_non_retryable_refusal_and_unknown_status() -> None:
    resp = Response(Timing(), chat=False)
    resp.on_response(400, [(b"zl-error", b"bad_request")])
    resp.on_end()
    assert resp.error is not None and not resp.error.retryable
    plain = Response(Timing(), chat=False)
    plain.on_response(502, [])
    plain.on_data(b"<html>bad gateway</html>")
    plain.on_end()
    assert plain.error is not None and plain.error.code == "http_502"


def test_mid_stream_error_event_and_loss_after_first_token_are_not_retryable() -> None:
    resp = Response(Timing(), chat=False)
    resp.on_response(200, [])
    resp.on_data(chunk(" ka"))
    resp.on_data(sse({"error": {"code": "deadline_exceeded", "message": "late"}}))
    assert resp.error is not None and resp.error.code == "deadline_exceeded"
    lost = Response(Timing(), chat=False)
    lost.on_response(200, [])
    lost.on_data(chunk(" ka"))
    lost.on_lost("boom")
    assert lost.error is not None and lost.error.code == CONNECTION_LOST
    assert not lost.error.retryable


def test_loss_or_refused_stream_before_first_token_is_retryable() -> None:
    lost = Response(Timing(), chat=False)
    lost.on_lost("boom")
    assert lost.error is not None and lost.error.retryable
    refused = Response(Timing(), chat=False)
    refused.on_reset(7)
    assert refused.error is not None and refused.error.code == STREAM_RESET
    assert refused.error.retryable
    cancelled = Response(Timing(), chat=False)
    cancelled.on_reset(8)
    assert cancelled.error is not None and not cancelled.error.retryable


def test_prepare_encodes_contract_headers_and_body() -> None:
    req = prepare(
        prompt="hello there", max_tokens=7, request_id="r1", session="s", tenant="t", seed=3
    )
    headers = dict(req.headers)
    assert headers[b"zl-session"] == b"s" and headers[b"zl-tenant"] == b"t"
    assert headers[b"zl-max-tokens"] == b"7"
    assert headers[b"zl-prompt-tokens"] == str(count_prompt_tokens("hello there")).encode()
    assert headers[b"content-length"] == str(len(req.body)).encode()
    assert orjson.loads(req.body) == {
        "prompt": "hello there",
        "max_tokens": 7,
        "stream": True,
        "seed": 3,
    }
    chat = prepare(prompt="hi", max_tokens=2, request_id="r2", chat=True)
    assert chat.path == b"/v1/chat/completions"
    assert orjson.loads(chat.body)["messages"] == [{"role": "user", "content": "hi"}]


def test_extra_body_adds_fields_but_never_replaces_the_clients_own() -> None:
    extra = {"ignore_eos": True, "temperature": 0.0, "stream_options": {"include_usage": True}}
    issue = RequestIssuer("t", "tiny", extra)
    body = orjson.loads(issue({"prompt": "hi", "max_tokens": 3, "seed": 1}).body)
    assert body == {"prompt": "hi", "max_tokens": 3, "stream": True, "seed": 1, "model": "tiny"} | (
        extra
    )
    for name in sorted(CLIENT_BODY_FIELDS):
        with pytest.raises(ValueError, match=name):
            RequestIssuer("t", None, {name: 1})


def test_conflicting_or_reserved_caller_headers_raise() -> None:
    base = {"prompt": "p", "max_tokens": 2, "request_id": "r", "session": "s"}
    with pytest.raises(ValueError):
        prepare(**base, headers={"zl-session": "other"})
    with pytest.raises(ValueError):
        prepare(**base, headers={"ZL-Tenant": "someone"})
    with pytest.raises(ValueError):
        prepare(**base, headers={"content-length": "1"})
    with pytest.raises(ValueError):
        prepare(**base, priority="urgent")
    same = prepare(**base, headers={"zl-session": "s", "x-trace": "abc"})
    assert (b"x-trace", b"abc") in same.headers
    assert sum(1 for k, _ in same.headers if k == b"zl-session") == 1


class _Carrier:
    """Records what a response asked its connection to stop."""

    def __init__(self) -> None:
        self.cancelled: list[int] = []

    def cancel(self, stream_id: int) -> None:
        self.cancelled.append(stream_id)


def test_cancel_reaches_the_carrying_stream_once_and_only_once_sent() -> None:
    resp = Response(Timing(), chat=False)
    resp.cancel()  # not sent yet: nothing to stop
    carrier = _Carrier()
    resp.attach(carrier, 7)
    resp.cancel()
    resp.cancel()
    assert carrier.cancelled == [7]


def test_every_event_with_a_choice_is_a_chunk_even_without_text() -> None:
    """vLLM streams one event per token, and a token can decode to no text yet (part of a
    UTF-8 character, or a byte-level BPE piece): vLLM's ``bench serve`` times each as a chunk,
    so TTFT is the first such event and ITL has one gap per event after it; a usage-only event
    (no choice) is not a chunk."""
    resp = Response(Timing(), chat=False)
    resp.on_response(200, [])
    usage = {"prompt_tokens": 5, "completion_tokens": 3}
    resp.on_data(chunk("") + chunk(" a") + chunk("", "length"))
    resp.on_data(sse({"choices": [], "usage": usage}) + b"data: [DONE]\n\n")
    resp.on_end()
    t = resp.timing
    assert len(t.chunk_ns) == 3 and t.first_token_ns == t.chunk_ns[0]
    assert t.output_tokens == 3 and t.finish_reason == "length"
