"""Outbound flow control of one HTTP/2 connection: each stream's bounded buffer of unsent data.

A stream's DATA goes out as far as the peer's windows and the transport allow; the rest waits
in the stream's own buffer (``H2Stream.pending``), and the stream joins the blocked set until a
WINDOW_UPDATE, a SETTINGS change or the transport's ``resume_writing`` lets it drain. The bound
is the limits' ``stream_send_buffer_bytes``: past it, :meth:`StreamBuffer.full` tells the
stream to hand the engine loop a future, so no more tokens are pulled for a client that does
not read. A finished response still held for such a client is reset once it reads none of it
for ``send_stall_s`` (:meth:`StreamBuffer.watch`).

Sending in the common case (the window is open, nothing is buffered) allocates nothing: the
chunk goes to h2 as it is.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Generic, Protocol, TypeVar

import h2.exceptions
from h2.errors import ErrorCodes

from serving.wire.h2base import H2ServerState

log = logging.getLogger("zerolayer.server.h2")


class Buffered(Protocol):
    """What the buffer keeps on each stream (``h2proto.H2Stream``): its unsent data, whether
    that ends the stream, and the engine loop's wait on it."""

    sid: int
    pending: bytearray | None
    pending_end: bool
    local_ended: bool
    reset_after: ErrorCodes | None
    waiter: asyncio.Future[None] | None

    def wake(self) -> None: ...


S = TypeVar("S", bound=Buffered)
S_contra = TypeVar("S_contra", bound=Buffered, contravariant=True)


class Owner(Protocol[S_contra]):
    """What the buffer needs of its connection."""

    @property
    def closed(self) -> bool: ...
    def framed(self, size: int) -> None:
        """``size`` bytes of DATA were framed into h2's output."""
        ...

    def reset(self, stream: S_contra, code: ErrorCodes) -> None: ...
    def forget(self, stream: S_contra) -> None:
        """Drop a stream h2 has closed, and its call, from the connection's streams."""
        ...

    def forget_if_done(self, stream: S_contra) -> None: ...
    def over_budget(self) -> bool: ...
    def mark_dirty(self) -> None: ...
    def flush(self) -> None: ...


class StreamBuffer(Generic[S]):
    """The streams' unsent DATA on one connection, each stream's bounded by ``bound``."""

    __slots__ = ("blocked", "bound", "h2", "loop", "owner", "paused", "stall_s", "unsent")

    def __init__(
        self,
        conn: H2ServerState,
        owner: Owner[S],
        loop: asyncio.AbstractEventLoop,
        bound: int,
        stall_s: float,
    ) -> None:
        self.h2 = conn
        self.owner = owner
        self.loop = loop
        self.bound = bound
        self.stall_s = stall_s
        # Streams with data waiting on a window (or on the transport, while paused).
        self.blocked: set[S] = set()
        # Response bytes held for the client in the streams' buffers, in all.
        self.unsent = 0
        # The transport is over its high-water mark: frame no more DATA into it.
        self.paused = False

    def send(self, stream: S, data: bytes, end: bool) -> None:
        """Send ``data`` on ``stream`` as far as the peer's windows and the transport allow;
        buffer the rest."""
        if stream.local_ended:
            return
        if stream.pending is None:
            conn = self.h2
            size = len(data)
            if (
                size <= conn.max_outbound_frame_size
                and size <= conn.local_flow_control_window(stream.sid)
                and not self.paused
            ):
                conn.send_data(stream.sid, data, end_stream=end)
                if end:
                    stream.local_ended = True
                self.owner.framed(size)
                return
            stream.pending = bytearray(data)
        else:
            stream.pending += data
        self.unsent += len(data)
        stream.pending_end = end
        self.drain(stream)

    def drain(self, stream: S) -> None:
        """Send what a stream has buffered, as far as the windows and the transport allow; wake
        the engine loop once the buffer is back under its bound."""
        pending = stream.pending
        if pending is None:
            return
        conn = self.h2
        sid = stream.sid
        try:
            while pending:
                window = conn.local_flow_control_window(sid)
                if window <= 0 or self.paused:
                    self.blocked.add(stream)
                    if stream.waiter is not None and len(pending) < self.bound:
                        stream.wake()
                    return
                size = min(window, conn.max_outbound_frame_size, len(pending))
                last = size == len(pending)
                conn.send_data(sid, bytes(pending[:size]), end_stream=last and stream.pending_end)
                del pending[:size]
                self.unsent -= size
                self.owner.framed(size)
        except h2.exceptions.StreamClosedError:
            self.release(stream)
            self.owner.forget(stream)
            stream.wake()
            return
        self._sent_all(stream)

    def _sent_all(self, stream: S) -> None:
        if stream.pending_end:
            stream.local_ended = True
        stream.pending = None
        self.blocked.discard(stream)
        stream.wake()
        if stream.reset_after is not None:
            self.owner.reset(stream, stream.reset_after)
        self.owner.forget_if_done(stream)

    def drain_blocked(self) -> None:
        for stream in list(self.blocked):
            self.drain(stream)

    def drain_unpaused(self) -> None:
        """The transport drained (``paused`` is cleared): send what the streams hold, one stream
        per write so that the transport pausing again stops it."""
        owner = self.owner
        for stream in list(self.blocked):
            if self.paused:
                return
            self.drain(stream)
            owner.flush()

    def full(self, stream: S) -> bool:
        """Whether ``stream`` holds its bound, or the connection its budget, of unsent data."""
        pending = stream.pending
        return pending is not None and (len(pending) >= self.bound or self.owner.over_budget())

    def release(self, stream: S) -> None:
        """Forget what a stream still holds for the client (reset, closed)."""
        if stream.pending is not None:
            self.unsent -= len(stream.pending)
            stream.pending = None
        self.blocked.discard(stream)

    def clear(self) -> None:
        """The connection is going: nothing it holds will be sent."""
        self.blocked.clear()
        self.unsent = 0

    def watch(self, stream: S) -> None:
        """A finished response still held for a client that does not read: no engine run is left
        for core to stall, so the stream is reset here once the client reads none of it for
        ``send_stall_s`` (as nginx's send_timeout: the time between two reads)."""
        pending = stream.pending
        if pending is None or self.owner.closed:
            return
        if self.owner.over_budget():
            # A finished response that would keep the connection past its budget (the client
            # reads none of its streams): cut it now rather than hold it for send_stall_s.
            log.info("stream %d: response unread and the connection over budget", stream.sid)
            self.owner.reset(stream, ErrorCodes.CANCEL)
            return
        if self.stall_s > 0:
            self.loop.call_later(self.stall_s, self._check_unsent, stream, len(pending))

    def _check_unsent(self, stream: S, unsent_before: int) -> None:
        pending = stream.pending
        if pending is None or self.owner.closed:
            return
        if len(pending) < unsent_before:
            self.watch(stream)
            return
        log.info("stream %d: the client read nothing of its response; resetting", stream.sid)
        self.owner.reset(stream, ErrorCodes.CANCEL)
        self.owner.mark_dirty()
