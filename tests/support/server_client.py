"""A bare HTTP/2 test client for the replica tests: the ``h2`` library over an asyncio socket.

It exposes what the tests assert on and an SDK would hide: each stream's frames (response
headers, data, RST_STREAM code), how many body bytes it actually uploaded, and it uploads only
as far as the server's flow-control windows allow, like a real client.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ssl
from collections.abc import Callable, Coroutine
from typing import Any

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
import orjson
import uvloop


def run(coro_fn: Callable[..., Coroutine[Any, Any, Any]]) -> Callable[..., Any]:
    """Run an async test on a fresh uvloop loop (the replica's production loop)."""

    @functools.wraps(coro_fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(coro_fn(*args, **kwargs))

    return wrapper


class Stream:
    """What the client saw on one stream."""

    def __init__(self, sid: int) -> None:
        self.sid = sid
        self.headers: dict[bytes, bytes] = {}
        self.data = bytearray()
        self.reset_code: int | None = None
        self.ended = False
        self.sent = 0
        self.to_send = b""
        self.send_end = False
        self.responded = asyncio.Event()
        self.closed = asyncio.Event()
        self.got_data = asyncio.Event()

    @property
    def status(self) -> int:
        return int(self.headers.get(b":status", b"0"))

    @property
    def error(self) -> str | None:
        value = self.headers.get(b"zl-error")
        return value.decode() if value is not None else None

    def json(self) -> Any:
        return orjson.loads(bytes(self.data))

    def events(self) -> list[Any]:
        """SSE ``data:`` payloads, decoded (``[DONE]`` kept as the string)."""
        out: list[Any] = []
        for block in bytes(self.data).split(b"\n\n"):
            if block.startswith(b"data: "):
                payload = block[6:]
                out.append("[DONE]" if payload == b"[DONE]" else orjson.loads(payload))
        return out

    def text(self) -> str:
        parts = []
        for event in self.events():
            if isinstance(event, dict) and event.get("choices"):
                choice = event["choices"][0]
                parts.append(choice.get("text") or choice.get("delta", {}).get("content", ""))
        return "".join(parts)


class H2Client:
    """One HTTP/2 connection with prior knowledge (or TLS with ALPN h2)."""

    def __init__(self) -> None:
        self.conn = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=True, header_encoding=None)
        )
        self.streams: dict[int, Stream] = {}
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self._task: asyncio.Task[None] | None = None
        self.pings_received = 0
        self.terminated: h2.events.ConnectionTerminated | None = None
        self.lost = asyncio.Event()
        self.settings_acked = asyncio.Event()
        self.alpn: str | None = None

    @classmethod
    async def connect(
        cls, host: str, port: int, *, tls: ssl.SSLContext | None = None, window: int = 1 << 24
    ) -> H2Client:
        self = cls()
        self.reader, self.writer = await asyncio.open_connection(
            host, port, ssl=tls, server_hostname=host if tls else None
        )
        if tls is not None:
            self.alpn = self.writer.get_extra_info("ssl_object").selected_alpn_protocol()
        conn = self.conn
        conn.local_settings = h2.settings.Settings(
            client=True,
            initial_values={
                h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window,
                h2.settings.SettingCodes.ENABLE_PUSH: 0,
            },
        )
        conn.initiate_connection()
        if window:  # 0: a client that reads nothing until it opens a stream's window
            conn.increment_flow_control_window(window)
        self.flush()
        self._task = asyncio.get_running_loop().create_task(self._read())
        await asyncio.wait_for(self.settings_acked.wait(), 5)
        return self

    def flush(self) -> None:
        data = self.conn.data_to_send()
        if data and self.writer is not None and not self.writer.is_closing():
            self.writer.write(data)

    async def _read(self) -> None:
        assert self.reader is not None
        try:
            while True:
                data = await self.reader.read(1 << 16)
                if not data:
                    break
                for event in self.conn.receive_data(data):
                    self._on_event(event)
                self._pump_uploads()
                self.flush()
        except (ConnectionError, asyncio.CancelledError, h2.exceptions.ProtocolError):
            pass
        finally:
            self.lost.set()
            for stream in self.streams.values():
                stream.responded.set()
                stream.closed.set()

    def _on_event(self, event: h2.events.Event) -> None:
        if isinstance(event, h2.events.ResponseReceived):
            stream = self.streams[event.stream_id]
            stream.headers = dict(event.headers)
            stream.responded.set()
        elif isinstance(event, h2.events.DataReceived):
            stream = self.streams[event.stream_id]
            stream.data += event.data
            stream.got_data.set()
            self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        elif isinstance(event, h2.events.StreamEnded):
            stream = self.streams[event.stream_id]
            stream.ended = True
            stream.closed.set()
        elif isinstance(event, h2.events.StreamReset):
            stream = self.streams.get(event.stream_id)
            if stream is not None and stream.reset_code is None:
                stream.reset_code = int(event.error_code)
                stream.to_send = b""
                stream.responded.set()
                stream.closed.set()
        elif isinstance(event, h2.events.PingReceived):
            self.pings_received += 1
        elif isinstance(event, h2.events.RemoteSettingsChanged):
            pass
        elif isinstance(event, h2.events.SettingsAcknowledged):
            self.settings_acked.set()
        elif isinstance(event, h2.events.ConnectionTerminated):
            self.terminated = event

    def _pump_uploads(self) -> None:
        """Send as much of every pending body as the windows allow."""
        conn = self.conn
        for stream in self.streams.values():
            while stream.to_send and stream.reset_code is None:
                try:
                    window = conn.local_flow_control_window(stream.sid)
                except h2.exceptions.StreamClosedError:
                    stream.to_send = b""
                    break
                if window <= 0:
                    break
                size = min(window, conn.max_outbound_frame_size, len(stream.to_send))
                chunk, stream.to_send = stream.to_send[:size], stream.to_send[size:]
                end = stream.send_end and not stream.to_send
                conn.send_data(stream.sid, chunk, end_stream=end)
                stream.sent += size

    def request(
        self,
        path: str,
        body: bytes | None = None,
        *,
        method: str = "POST",
        headers: list[tuple[str, str]] | None = None,
        content_length: bool = True,
        end: bool = True,
    ) -> Stream:
        """Open a stream and start uploading ``body`` (as far as the windows allow)."""
        conn = self.conn
        sid = conn.get_next_available_stream_id()
        pairs = [
            (b":method", method.encode()),
            (b":path", path.encode()),
            (b":scheme", b"http"),
            (b":authority", b"replica"),
        ]
        if body is not None and content_length:
            pairs.append((b"content-length", str(len(body)).encode()))
        for name, value in headers or []:
            pairs.append((name.encode(), value.encode()))
        stream = Stream(sid)
        self.streams[sid] = stream
        conn.send_headers(sid, pairs, end_stream=body is None)
        if body is not None:
            stream.to_send = body
            stream.send_end = end
            self._pump_uploads()
        self.flush()
        return stream

    def completion(
        self,
        prompt: str = "hello",
        max_tokens: int = 8,
        *,
        stream: bool = False,
        chat: bool = False,
        headers: list[tuple[str, str]] | None = None,
        **fields: Any,
    ) -> Stream:
        payload: dict[str, Any] = {"max_tokens": max_tokens, "stream": stream, **fields}
        if chat:
            payload["messages"] = [{"role": "user", "content": prompt}]
        else:
            payload["prompt"] = prompt
        path = "/v1/chat/completions" if chat else "/v1/completions"
        return self.request(path, orjson.dumps(payload), headers=headers)

    def reset(self, stream: Stream, code: int = 8) -> None:
        self.conn.reset_stream(stream.sid, code)
        stream.to_send = b""
        self.flush()

    def ping(self) -> None:
        self.conn.ping(b"12345678")
        self.flush()

    async def get(self, path: str, timeout: float = 5) -> Stream:
        stream = self.request(path, method="GET")
        await asyncio.wait_for(stream.closed.wait(), timeout)
        return stream

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.close_connection()
            self.flush()
        if self.writer is not None:
            self.writer.close()
            with contextlib.suppress(Exception):
                await self.writer.wait_closed()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


async def wait_all(streams: list[Stream], timeout: float = 10) -> None:
    await asyncio.wait_for(asyncio.gather(*(s.closed.wait() for s in streams)), timeout)
