"""A bare h2 echo server: the floor of HTTP/2 in pure Python, measured beside the replica.

``python -m bench.overhead.echo [--per-token/--no-per-token] [--itl-ms MS]`` listens on a free
loopback port and prints ``h2-echo listening on URL``. It answers every request with the SSE
stream the null engine's replica would send for its ``zl-max-tokens`` (pre-encoded: the same
bytes for every token), with nothing of the replica around the ``h2`` library: no routing,
admission, parsing, engine or accounting; h2 configured as the replica configures it (inbound
headers validated, outbound not), under uvloop. Per token, as the null engine streams: one DATA
frame written in its own turn of the event loop (or ``--itl-ms`` apart); with
``--no-per-token`` the whole answer in one frame. What the replica adds over it is the cost of
everything that is not the h2 library.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable
from typing import Any, Final

import h2.config
import h2.connection
import h2.events
import orjson
import uvloop

PROG: Final = "h2-echo"
CONFIG: Final = h2.config.H2Configuration(
    client_side=False,
    header_encoding=None,
    validate_outbound_headers=False,
    normalize_outbound_headers=False,
)
HEADERS: Final = [
    (b":status", b"200"),
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
]
TOKEN_TEXT: Final = " kaka"
DEFAULT_TOKENS: Final = 16


def _event(finish: str | None, usage: dict[str, int] | None = None) -> bytes:
    choice = {"index": 0, "text": TOKEN_TEXT, "logprobs": None, "finish_reason": finish}
    body: dict[str, Any] = {"id": "echo", "object": "text_completion", "created": 0,
                            "model": "echo", "choices": [choice]}  # fmt: skip
    if usage is not None:
        body["usage"] = usage
    return b"data: " + orjson.dumps(body) + b"\n\n"


TOKEN_EVENT: Final = _event(None)


def last_event(tokens: int) -> bytes:
    """The stream's last token, its usage and ``[DONE]``."""
    usage = {"prompt_tokens": 0, "completion_tokens": tokens, "total_tokens": tokens}
    return _event("length", usage) + b"data: [DONE]\n\n"


def answer(tokens: int) -> list[bytes]:
    """The SSE events of an answer of ``tokens`` tokens, one per token."""
    return [TOKEN_EVENT] * (tokens - 1) + [last_event(tokens)]


def max_tokens(headers: list[tuple[bytes, bytes]]) -> int:
    for name, value in headers:
        if name == b"zl-max-tokens" and value.isdigit():
            return max(1, int(value))
    return DEFAULT_TOKENS


class EchoProtocol(asyncio.Protocol):
    """One h2c connection: each request answered once its body has arrived."""

    def __init__(self, per_token: bool, itl_s: float) -> None:
        self.per_token = per_token
        self.itl_s = itl_s
        self.conn = h2.connection.H2Connection(CONFIG)
        self.transport: asyncio.Transport | None = None
        self.tokens: dict[int, int] = {}
        self.loop = asyncio.get_running_loop()
        self.dirty = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.conn.initiate_connection()
        self.flush()

    def mark_dirty(self) -> None:
        """One write per loop turn for every stream's frames of that turn (as the replica)."""
        if not self.dirty:
            self.dirty = True
            self.loop.call_soon(self.flush)

    def flush(self) -> None:
        self.dirty = False
        data = self.conn.data_to_send()
        if data and self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def data_received(self, data: bytes) -> None:
        for event in self.conn.receive_data(data):
            if isinstance(event, h2.events.RequestReceived):
                self.tokens[event.stream_id] = max_tokens(event.headers)
            elif isinstance(event, h2.events.DataReceived):
                self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            elif isinstance(event, h2.events.StreamEnded):  # after HEADERS with END_STREAM too
                self.respond(event.stream_id)
        self.flush()

    def respond(self, sid: int) -> None:
        tokens = self.tokens.pop(sid, None)
        if tokens is None:
            return
        self.conn.send_headers(sid, HEADERS)
        events = answer(tokens)
        if not self.per_token:
            self.conn.send_data(sid, b"".join(events), end_stream=True)
            return
        self.conn.send_data(sid, events[0], end_stream=len(events) == 1)
        if len(events) > 1:
            self._later(self._send, sid, events, 1)

    def _later(self, callback: Callable[..., None], *args: Any) -> None:
        if self.itl_s:
            self.loop.call_later(self.itl_s, callback, *args)
        else:
            self.loop.call_soon(callback, *args)

    def _send(self, sid: int, events: list[bytes], i: int) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        last = i == len(events) - 1
        self.conn.send_data(sid, events[i], end_stream=last)
        self.mark_dirty()
        if not last:
            self._later(self._send, sid, events, i + 1)


async def serve(per_token: bool, itl_ms: float) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: EchoProtocol(per_token, itl_ms / 1000.0), "127.0.0.1", 0
    )
    port = server.sockets[0].getsockname()[1]
    print(f"{PROG} listening on http://127.0.0.1:{port}", flush=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    parser.add_argument("--per-token", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--itl-ms", type=float, default=0.0)
    args = parser.parse_args(argv)
    uvloop.run(serve(args.per_token, args.itl_ms))


if __name__ == "__main__":
    main()
