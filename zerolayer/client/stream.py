"""One response as it streams in, and the caller-facing stream that may span several attempts.

``Response`` is the sink a connection feeds (headers, data, end, reset, loss); it parses SSE as
bytes arrive and wakes its one reader, or, for a callback-driven request (``Submission``), calls
``notify`` once when it is over and keeps only the token count, not the chunks.

``Stream`` is what ``client.stream(...)`` returns: its ``__aenter__`` runs the transport's
attempts until a first token (the last point where a retry is safe), then it yields chunks; a
timer per request makes sure nothing waits past deadline + grace.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from serving.wire import contract
from zerolayer.client.codec import (
    DONE,
    MAX_ERROR_BODY_BYTES,
    Chunk,
    SSEEventTooLarge,
    SSEParser,
    ZeroLayerError,
    server_error,
)
from zerolayer.client.timing import (
    CLIENT_TIMEOUT,
    CONNECTION_LOST,
    PROTOCOL_ERROR,
    STREAM_RESET,
    Timing,
)

_now = time.time_ns
_loads = orjson.loads
_ATTEMPTS = contract.ATTEMPTS.encode()
_ZL_ERROR = contract.ERROR.encode()
_RETRY_AFTER_MS = contract.RETRY_AFTER_MS.encode()
# HTTP/2 error codes (RFC 9113 section 7) a reset carries.
H2_PROTOCOL_ERROR = 0x1
H2_REFUSED_STREAM = 0x7


class Carrier(Protocol):
    """The connection a response arrives on, which can stop it (HTTP/2: RST_STREAM CANCEL)."""

    def cancel(self, stream_id: int) -> None: ...


class Response:
    """The sink for one attempt: fed by a connection, read by one ``Stream``."""

    __slots__ = (
        "_body",
        "_carrier",
        "_parser",
        "_retry_after",
        "_stream_id",
        "_waiter",
        "_zl_error",
        "chat",
        "chunks",
        "committed",
        "done",
        "error",
        "notify",
        "status",
        "timing",
        "tokens",
    )

    def __init__(
        self, timing: Timing, chat: bool, notify: Callable[[Response], None] | None = None
    ) -> None:
        self.timing = timing
        self.chat = chat
        self.notify = notify
        self.status = 0
        self.chunks: deque[Chunk] = deque()
        self.done = False
        self.committed = False
        self.error: ZeroLayerError | None = None
        self._carrier: Carrier | None = None
        self._stream_id = 0
        self.tokens = 0
        self._parser = SSEParser()
        self._body: bytearray | None = None
        self._zl_error = ""
        self._retry_after: str | None = None
        self._waiter: asyncio.Future[None] | None = None

    def attach(self, carrier: Carrier, stream_id: int) -> None:
        """The connection (and its stream) this response now arrives on, for :meth:`cancel`."""
        self._carrier = carrier
        self._stream_id = stream_id

    def cancel(self) -> None:
        """Ask the connection to stop sending this response; once, and only if it was sent."""
        carrier = self._carrier
        if carrier is not None:
            self._carrier = None
            carrier.cancel(self._stream_id)

    def _wake(self) -> None:
        notify = self.notify
        if notify is not None:
            if self.done:
                self.notify = None
                notify(self)
            return
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def wait(self) -> None:
        """Until there is a chunk to read or the response is over."""
        while not self.chunks and not self.done:
            self._waiter = waiter = asyncio.get_running_loop().create_future()
            await waiter

    def on_response(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        timing = self.timing
        timing.headers_ns = now = _now()
        self.status = timing.status = status
        for name, value in headers:
            if name == _ATTEMPTS and value.isdigit():
                timing.attempts = int(value)
        if status == 200:
            return
        timing.refused_ns = now
        self._body = bytearray()
        for name, value in headers:
            if name == _ZL_ERROR:
                self._zl_error = value.decode("latin-1")
            elif name == _RETRY_AFTER_MS:
                self._retry_after = value.decode("latin-1")

    def on_data(self, data: bytes) -> None:
        if self.done:
            return
        body = self._body
        if body is not None:
            # An error body is reported, not streamed: keep its head, drop the rest.
            room = MAX_ERROR_BODY_BYTES - len(body)
            if room > 0:
                body += data[:room]
            return
        try:
            payloads = self._parser.feed(data)
        except SSEEventTooLarge as exc:
            self.fail(ZeroLayerError(contract.UPSTREAM_FAILED.code, f"{exc}: the stream is cut"))
            self.cancel()
            return
        if payloads:
            for payload in payloads:
                self._event(payload)
            if self.chunks or self.done:
                self._wake()

    def _event(self, payload: bytes) -> None:
        if payload == DONE:
            self._finish()
            return
        try:
            obj: dict[str, Any] = _loads(payload)
        except orjson.JSONDecodeError:
            self.fail(ZeroLayerError(PROTOCOL_ERROR, f"bad SSE payload {payload[:80]!r}"))
            return
        err = obj.get("error")
        if err is not None:
            code = str(err.get("code", "")) if isinstance(err, dict) else ""
            known = contract.ERRORS.get(code)
            self.fail(
                ZeroLayerError(
                    code or "stream_error",
                    str(err.get("message", err)) if isinstance(err, dict) else str(err),
                    status=self.status,
                    retryable=bool(known and known.retryable and not self.committed),
                )
            )
            return
        timing = self.timing
        usage = obj.get("usage")
        choices = obj.get("choices")
        if choices:
            choice = choices[0]
            text = (
                (choice.get("delta") or {}).get("content") or ""
                if self.chat
                else choice.get("text") or ""
            )
            if usage and "completion_tokens" in usage:
                tokens = usage["completion_tokens"] - self.tokens
            else:
                # Our engines' vocabulary gives every token one leading space.
                tokens = text.count(" ")
            # Every event with a choice is a chunk, text or not (a token may decode to no text
            # yet): vLLM's ``bench serve`` times TTFT and ITL so.
            now = _now()
            if not self.committed:
                self.committed = True
                timing.first_token_ns = now
            timing.chunk_ns.append(now)
            self.tokens += tokens
            if self.notify is None:
                self.chunks.append(Chunk(text, tokens))
            reason = choice.get("finish_reason")
            if reason:
                timing.finish_reason = reason
        if usage:
            timing.prompt_tokens = usage.get("prompt_tokens", timing.prompt_tokens)
            timing.output_tokens = usage.get("completion_tokens", timing.output_tokens)

    def _finish(self) -> None:
        if not self.done:
            self.done = True
            if not self.timing.output_tokens:
                self.timing.output_tokens = self.tokens
            self._wake()

    def on_end(self) -> None:
        """The peer ended the stream: a full error body, or the end of the SSE stream."""
        if self.done:
            return
        if self._body is not None:
            self.fail(
                server_error(self.status, self._zl_error, bytes(self._body), self._retry_after)
            )
        else:
            self._finish()

    def on_reset(self, error_code: int) -> None:
        """The replica reset the stream: REFUSED_STREAM was not processed (RFC 9113 section
        8.7), so another replica may take it before the first token; PROTOCOL_ERROR says this
        request was malformed (section 8.1.1), the caller's error, and retrying it elsewhere
        would only meet the same answer."""
        if self.done:
            return
        if self._body is not None and self.status:
            self.on_end()
            return
        if not self.committed:
            self.timing.refused_ns = _now()
        if error_code == H2_PROTOCOL_ERROR:
            self.fail(
                ZeroLayerError(
                    contract.BAD_REQUEST.code,
                    "the replica found this request malformed (HTTP/2 PROTOCOL_ERROR)",
                    status=contract.BAD_REQUEST.status,
                )
            )
            return
        self.fail(
            ZeroLayerError(
                STREAM_RESET,
                f"stream reset by the replica (h2 error {error_code})",
                retryable=error_code == H2_REFUSED_STREAM and not self.committed,
            )
        )

    def on_lost(self, reason: str) -> None:
        if not self.done:
            self.fail(ZeroLayerError(CONNECTION_LOST, reason, retryable=not self.committed))

    def fail(self, error: ZeroLayerError) -> None:
        """End with an error (first one wins) and wake the reader."""
        if self.done:
            return
        self.error = error
        self.done = True
        self._wake()


class Stream:
    """``async with client.stream(...) as s: async for chunk in s`` (see the module docstring).

    ``open_fn`` is the transport's attempt loop; it sets ``current`` to each attempt's
    ``Response`` so the deadline timer can end whichever one is live.
    """

    __slots__ = ("_open_fn", "_resp", "_timeout_s", "_timer", "current", "timed_out", "timing")

    def __init__(
        self,
        open_fn: Callable[[Stream], Awaitable[Response]],
        timing: Timing,
        timeout_s: float,
    ) -> None:
        self._open_fn = open_fn
        self.timing = timing
        self._timeout_s = timeout_s
        self._timer: asyncio.TimerHandle | None = None
        self._resp: Response | None = None
        self.current: Response | None = None
        self.timed_out = False

    def _on_timeout(self) -> None:
        self.timed_out = True
        resp = self.current
        if resp is not None and not resp.done:
            resp.fail(ZeroLayerError(CLIENT_TIMEOUT, f"no answer within {self._timeout_s:.3f} s"))
            resp.cancel()

    async def __aenter__(self) -> Stream:
        self._timer = asyncio.get_running_loop().call_later(self._timeout_s, self._on_timeout)
        try:
            self._resp = await self._open_fn(self)
        except ZeroLayerError as exc:
            self._end(exc)
            raise
        except BaseException:
            self._end(None)
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        resp = self._resp
        if resp is not None and not resp.done:
            resp.fail(ZeroLayerError("cancelled", "the caller left the stream early"))
            resp.cancel()
            self._end(resp.error)
        elif self._timer is not None:
            self._end(resp.error if resp is not None else None)

    def _end(self, error: ZeroLayerError | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
            timing = self.timing
            timing.end_ns = _now()
            if error is not None:
                timing.error_code = error.code
                error.timing = timing

    def __aiter__(self) -> Stream:
        return self

    async def __anext__(self) -> Chunk:
        resp = self._resp
        if resp is None:
            raise RuntimeError("use the stream inside 'async with'")
        chunks = resp.chunks
        if chunks:
            return chunks.popleft()
        if not resp.done:
            await resp.wait()
            if chunks:
                return chunks.popleft()
        self._end(resp.error)
        if resp.error is not None:
            raise resp.error
        raise StopAsyncIteration

    async def text(self) -> str:
        """Drain the stream and return its whole text."""
        return "".join([c.text async for c in self])


@dataclass(slots=True)
class Completion:
    """A whole non-streamed answer, with the same timing record a stream gives."""

    text: str
    tokens: int
    timing: Timing


async def collect(stream: Stream) -> Completion:
    """Read a stream to its end (``complete`` on both clients)."""
    async with stream as s:
        text = []
        tokens = 0
        async for chunk in s:
            text.append(chunk.text)
            tokens += chunk.tokens
    return Completion("".join(text), tokens, s.timing)
