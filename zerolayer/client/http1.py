"""The same streaming API over HTTP/1.1 keep-alive (h11), for endpoints that speak nothing else.

The Ray Serve baseline is one; driving it through this client gives timing records identical in
shape to the zero-layer SDK's, so the two stacks are measured the same way. One request at a time
per connection (HTTP/1.1 has no multiplexing), a bounded pool of kept-alive connections, no
routing and no retries beyond replaying a request whose reused idle connection had been closed
before any answer arrived.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections import deque
from collections.abc import Mapping
from typing import Any, Unpack, cast

import h11

from zerolayer.client.codec import Prepared, RequestFields, RequestIssuer, ZeroLayerError
from zerolayer.client.replica import split_url
from zerolayer.client.stream import Completion, Response, Stream, collect
from zerolayer.client.timing import CLIENT_TIMEOUT, CONNECTION_LOST, Timing

# As the HTTP/2 client sends it: vLLM's own server refuses a body without it (400).
JSON = (b"content-type", b"application/json")

_now = time.time_ns


class H11Connection(asyncio.Protocol):
    """One kept-alive HTTP/1.1 connection feeding one response sink at a time."""

    def __init__(self, pool: Http1Client) -> None:
        self._pool = pool
        self._conn = h11.Connection(h11.CLIENT)
        self._transport: asyncio.Transport | None = None
        self.sink: Response | None = None
        self.answered = False
        self.reused = False
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self._transport = cast(asyncio.Transport, transport)

    def request(self, req: Prepared, sink: Response) -> None:
        """Send the whole request in one write."""
        conn = self._conn
        self.sink = sink
        self.answered = False
        sink.attach(self, 0)
        head = h11.Request(
            method=b"POST", target=req.path, headers=[self._pool.host_header, JSON, *req.headers]
        )
        data = conn.send(head) + conn.send(h11.Data(data=req.body)) + conn.send(h11.EndOfMessage())
        assert self._transport is not None
        self._transport.write(data)

    def data_received(self, data: bytes) -> None:
        conn = self._conn
        try:
            conn.receive_data(data)
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA or event is h11.PAUSED:
                    return
                sink = self.sink
                if type(event) is h11.Data:
                    if sink is not None:
                        sink.on_data(bytes(event.data))
                elif type(event) is h11.Response:
                    self.answered = True
                    if sink is not None:
                        sink.on_response(event.status_code, list(event.headers))
                elif type(event) is h11.EndOfMessage:
                    self.sink = None
                    if sink is not None:
                        sink.on_end()
                    self._recycle()
                    return
                elif type(event) is h11.ConnectionClosed:
                    self.close()
                    return
        except h11.RemoteProtocolError as exc:
            self._lose(f"HTTP/1.1 protocol error: {exc}")
            self.close()

    def _recycle(self) -> None:
        conn = self._conn
        if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
            conn.start_next_cycle()
            self.reused = True
            self._pool.release(self)
        else:
            self.close()

    def _lose(self, reason: str) -> None:
        sink, self.sink = self.sink, None
        if sink is not None:
            sink.on_lost(reason)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._lose(f"connection lost: {exc or 'closed by the server'}")
        self._pool.forget(self)

    def cancel(self, stream_id: int) -> None:
        """HTTP/1.1 has one response per connection at a time: stopping it closes the connection."""
        self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self._transport is not None:
                self._transport.close()


class Http1Client:
    """``stream``/``complete`` like ZeroLayerClient, against one HTTP/1.1 URL (no routing);
    ``api_key`` and the per-request ``api_key`` as there."""

    def __init__(
        self,
        url: str,
        *,
        max_connections: int = 1024,
        grace_ms: int = 2000,
        connect_timeout_s: float = 2.0,
        tls: ssl.SSLContext | None = None,
        model: str | None = None,
        extra_body: Mapping[str, Any] | None = None,
        api_key: str | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.host, self.port, use_tls = split_url(self.url)
        self._tls = (tls or ssl.create_default_context()) if use_tls else None
        self.host_header = (b"host", f"{self.host}:{self.port}".encode())
        self.max_connections = max_connections
        self.grace_ms = grace_ms
        self.connect_timeout_s = connect_timeout_s
        self._idle: deque[H11Connection] = deque()
        self._all: set[H11Connection] = set()
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._issue = RequestIssuer("h1", model, extra_body, api_key)

    async def __aenter__(self) -> Http1Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close every connection; live streams end as lost."""
        for conn in list(self._all):
            conn.close()
        self._all.clear()
        self._idle.clear()

    def release(self, conn: H11Connection) -> None:
        self._idle.append(conn)
        self._wake()

    def forget(self, conn: H11Connection) -> None:
        self._all.discard(conn)
        with contextlib.suppress(ValueError):
            self._idle.remove(conn)
        self._wake()

    def _wake(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    async def _acquire(self) -> H11Connection:
        loop = asyncio.get_running_loop()
        while True:
            while self._idle:
                conn = self._idle.pop()
                if not conn.closed:
                    return conn
            if len(self._all) < self.max_connections:
                _, conn = await asyncio.wait_for(
                    loop.create_connection(
                        lambda: H11Connection(self),
                        self.host,
                        self.port,
                        ssl=self._tls,
                        server_hostname=self.host if self._tls else None,
                    ),
                    self.connect_timeout_s,
                )
                self._all.add(conn)
                return conn
            waiter = loop.create_future()
            self._waiters.append(waiter)
            await waiter

    def stream(self, **fields: Unpack[RequestFields]) -> Stream:
        """Same contract as ``ZeroLayerClient.stream``."""
        req = self._issue(fields)
        return Stream(
            lambda s: self._open(s, req),
            Timing(request_id=req.request_id, replica=self.url),
            (req.deadline_ms + self.grace_ms) / 1000,
        )

    async def complete(self, **fields: Unpack[RequestFields]) -> Completion:
        """The whole answer at once; takes ``stream``'s arguments."""
        return await collect(self.stream(**fields))

    async def _open(self, stream: Stream, req: Prepared) -> Response:
        timing = stream.timing
        timing.tried.append(self.url)
        for _ in range(2):
            resp = Response(timing, req.chat)
            stream.current = resp
            try:
                conn = await self._acquire()
            except (OSError, TimeoutError) as exc:
                raise ZeroLayerError(CONNECTION_LOST, f"{self.url}: {exc}") from exc
            if stream.timed_out:
                self.release(conn)
                raise ZeroLayerError(CLIENT_TIMEOUT, "no answer by deadline plus grace")
            if not timing.sent_ns:
                timing.sent_ns = _now()
            conn.request(req, resp)
            if not resp.chunks and not resp.done:
                await resp.wait()
            error = resp.error
            if error is None:
                return resp
            last = error
            # A kept-alive connection the server had already closed: replay once on a fresh one.
            if not (error.code == CONNECTION_LOST and conn.reused and not conn.answered):
                raise error
        raise last
