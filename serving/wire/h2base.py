"""h2's connection state machine with cheaper stream counting and header decoding.

Both ends of the zero-layer path (the SDK's connection and the replica's) use this subclass of
``h2.connection.H2Connection``: the protocol logic is h2's, unchanged, and so is its inbound header
validation. Two things differ: header blocks are decoded by ``hpackdec.FastDecoder`` (same results
as hpack's decoder, less CPU), and h2 scans its stream table less often. h2 counts open streams, to
enforce MAX_CONCURRENT_STREAMS, by walking every stream it holds each time a stream opens (dropping
closed ones as it goes). That is O(streams) per new stream, so a backlog of a few thousand streams
makes every request cost milliseconds and turns a short overload into a collapse. Here the table
size is used whenever it is below both concurrency limits and below a rescan mark: it is an upper
bound of the open count, so h2's ``count + 1 > limit`` checks decide exactly as they would with the
exact count. Otherwise h2's own scan runs, and the next one waits until the table has doubled (plus
a margin), so closed streams are still purged and the table stays within twice the live streams.

The replica's end uses ``H2ServerState``, which keeps a client's per-stream faults on their stream
(RFC 9113 section 5.4.2) where h2 would end the connection, and bounds a header block in progress.
"""

from __future__ import annotations

from typing import Any

import h2.config
import h2.connection
import h2.events
from h2.errors import ErrorCodes
from h2.exceptions import (
    DenialOfServiceError,
    InvalidBodyLengthError,
    ProtocolError,
    StreamClosedError,
    TooManyStreamsError,
)
from h2.frame_buffer import FrameBuffer
from hyperframe.frame import DataFrame, Frame, HeadersFrame

from serving.wire.hpackdec import FastDecoder

RESCAN_MARGIN = 64


class H2State(h2.connection.H2Connection):
    """``h2.connection.H2Connection`` with cheap open-stream counting (see the module docstring).

    ``open_outbound_streams`` and ``open_inbound_streams`` may return an upper bound (never
    above the concurrency limit in force) instead of the exact count.
    """

    def __init__(self, config: h2.config.H2Configuration | None = None) -> None:
        super().__init__(config=config)
        self._rescan_at = RESCAN_MARGIN
        decoder = FastDecoder()
        decoder.max_header_list_size = self.decoder.max_header_list_size
        decoder.max_allowed_table_size = self.decoder.max_allowed_table_size
        self.decoder = decoder

    def _open_streams(self, remainder: int) -> int:
        bound = len(self.streams)
        limit = min(
            self.local_settings.max_concurrent_streams,
            self.remote_settings.max_concurrent_streams,
        )
        if bound < self._rescan_at and bound + 1 <= limit:
            return bound
        count = super()._open_streams(remainder)
        self._rescan_at = 2 * len(self.streams) + RESCAN_MARGIN
        return count


class RequestMalformed(h2.events.Event):
    """A request RFC 9113 section 8.1.1 calls malformed (h2's header validation failed on a new
    stream, or its DATA disagrees with its content-length): a stream error, answered on that
    stream alone. ``opened``: the stream's HEADERS were refused (no RequestReceived came for it);
    ``flow_controlled_length``: bytes of a refused DATA frame that still count against the
    connection's window, to acknowledge."""

    def __init__(self, stream_id: int, reason: str, opened: bool, ended: bool,
                 flow_controlled_length: int = 0) -> None:  # fmt: skip
        self.stream_id = stream_id
        self.reason = reason
        self.opened = opened
        self.ended = ended
        self.flow_controlled_length = flow_controlled_length

    def __repr__(self) -> str:
        return f"<RequestMalformed stream_id:{self.stream_id}, reason:{self.reason}>"


class BoundedFrameBuffer(FrameBuffer):
    """h2's frame buffer with a byte bound on a header block in progress.

    h2 holds HEADERS and CONTINUATION frames until END_HEADERS and bounds only their count (64),
    so a client can pin 64 frames of the largest size for each connection. A block whose encoded
    bytes pass ``max_block`` is refused with ENHANCE_YOUR_CALM: it cannot be skipped, since the
    HPACK state would be lost with it (RFC 9113 section 4.3). HPACK never needs more bytes than
    the header list it encodes (each field counts 32 bytes more there, RFC 9113 section 6.5.2).
    """

    def __init__(self, max_block: int) -> None:
        super().__init__(server=True)
        self.max_block = max_block

    def _update_header_buffer(self, f: Frame | None) -> Frame | None:
        frame = super()._update_header_buffer(f)
        held = self._headers_buffer
        if held and sum(len(part.data) for part in held) > self.max_block:
            raise DenialOfServiceError(f"header block in progress over {self.max_block} bytes")
        return frame


class H2ServerState(H2State):
    """The replica's h2 state machine: a client's fault on one stream is a stream error.

    - A HEADERS past MAX_CONCURRENT_STREAMS gets RST_STREAM(REFUSED_STREAM), which tells the
      client it may retry (RFC 9113 section 5.1.2), where h2 would end the connection. Its block
      is still decoded, so the HPACK state stays in step (RFC 9113 section 4.3).
    - A malformed request (RFC 9113 section 8.1.1) becomes a ``RequestMalformed`` event instead of
      a connection error: h2's validation of a new stream's headers (uppercase names,
      connection-specific fields, pseudo-header errors, a content-length that is not a number)
      and its content-length check on DATA. Errors before the stream exists (HPACK, stream ids)
      and on a known stream's HEADERS (trailers) remain connection errors, as in h2.
    - A header block in progress is bounded by ``max_header_block`` bytes (``BoundedFrameBuffer``).
    """

    def __init__(self, config: h2.config.H2Configuration, max_header_block: int) -> None:
        super().__init__(config=config)
        self.incoming_buffer = BoundedFrameBuffer(max_header_block)
        self._refusing = False

    def _open_streams(self, remainder: int) -> int:
        if self._refusing:  # opening a stream only to refuse it (see _refuse_stream)
            return 0
        return super()._open_streams(remainder)

    def _receive_headers_frame(self, frame: HeadersFrame) -> tuple[list[Frame], list[Any]]:
        sid = frame.stream_id
        if sid in self.streams:
            return super()._receive_headers_frame(frame)
        try:
            return super()._receive_headers_frame(frame)
        except TooManyStreamsError:
            return self._refuse_stream(frame)
        except ProtocolError as exc:
            if sid not in self.streams or isinstance(exc, StreamClosedError):
                raise
            ended = "END_STREAM" in frame.flags
            return [], [RequestMalformed(sid, str(exc), opened=True, ended=ended)]

    def _refuse_stream(self, frame: HeadersFrame) -> tuple[list[Frame], list[Any]]:
        """Open the stream past the limit (h2 decodes its block and records its id), then reset
        it with REFUSED_STREAM; its events are dropped: the request was never accepted."""
        self._refusing = True
        try:
            super()._receive_headers_frame(frame)
        except ProtocolError:
            if frame.stream_id not in self.streams:
                raise
        finally:
            self._refusing = False
        self.reset_stream(frame.stream_id, ErrorCodes.REFUSED_STREAM)
        return [], []

    def _receive_data_frame(self, frame: DataFrame) -> tuple[list[Frame], list[Any]]:
        try:
            return super()._receive_data_frame(frame)
        except InvalidBodyLengthError as exc:
            length = frame.flow_controlled_length
            event = RequestMalformed(frame.stream_id, str(exc), False, False, length)
            return [], [event]
