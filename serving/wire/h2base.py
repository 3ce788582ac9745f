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

DATA frames that need no decision go out without h2's frame objects (``send_data``): the token
path sends one small DATA frame per token per stream, and h2 builds a hyperframe ``DataFrame``
(flags set, padding object, serialised field by field) and walks both state machines for each,
about half the replica's CPU per streamed token. Where the stream and the connection are open for
data (h2's own transition tables say SEND_DATA leaves their state as it is), the frame fits both
windows and the peer's frame size, and no padding is asked for, the nine-byte frame header is
packed here and h2's accounting done as h2 does it (both windows, END_STREAM through the stream's
state machine); anything else is h2's ``send_data`` itself. The bytes are h2's to the byte
(``tests/serving/wire/test_h2_fastdata.py`` holds the two against each other).

The replica's end uses ``H2ServerState``, which keeps a client's per-stream faults on their stream
(RFC 9113 section 5.4.2) where h2 would end the connection, and bounds a header block in progress.
"""

from __future__ import annotations

import struct
from typing import Any, Final

import h2.config
import h2.connection
import h2.events
import h2.stream
from h2.connection import ConnectionInputs, H2ConnectionStateMachine
from h2.errors import ErrorCodes
from h2.exceptions import (
    DenialOfServiceError,
    InvalidBodyLengthError,
    ProtocolError,
    StreamClosedError,
    StreamIDTooLowError,
    TooManyStreamsError,
)
from h2.frame_buffer import FrameBuffer
from hyperframe.frame import DataFrame, Frame, HeadersFrame, RstStreamFrame

from serving.wire.hpackdec import FastDecoder

RESCAN_MARGIN = 64
# A DATA frame's header: 24-bit length (a byte and a short), type 0, flags, stream id.
_DATA_HEAD: Final = struct.Struct(">BHBBL")
_END_STREAM: Final = 0x1


def _keeps_state(transitions: dict[Any, Any], event: Any) -> frozenset[Any]:
    """The states in which ``event`` is allowed, runs no callback and leaves the state as it is,
    read from h2's own transition table."""
    return frozenset(
        state
        for (state, input_), (func, target) in transitions.items()
        if input_ is event and func is None and target is state
    )


# Where sending DATA changes nothing in h2's state machines (open, and half closed remote).
_CONNECTION_SENDS: Final = _keeps_state(
    H2ConnectionStateMachine._transitions, ConnectionInputs.SEND_DATA
)
_STREAM_SENDS: Final = _keeps_state(h2.stream._transitions, h2.stream.StreamInputs.SEND_DATA)


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

    def send_data(
        self,
        stream_id: int,
        data: bytes | memoryview,
        end_stream: bool = False,
        pad_length: Any = None,
    ) -> None:
        """h2's ``send_data``, framed here when nothing needs h2 (see the module docstring)."""
        stream = self.streams.get(stream_id)
        size = len(data)
        if (
            stream is None
            or pad_length is not None
            or not 0 < size <= self.max_outbound_frame_size
            or size > self.outbound_flow_control_window
            or size > stream.outbound_flow_control_window
            or self.state_machine.state not in _CONNECTION_SENDS
            or stream.state_machine.state not in _STREAM_SENDS
        ):
            super().send_data(stream_id, data, end_stream, pad_length)
            return
        if end_stream:
            stream.state_machine.process_input(h2.stream.StreamInputs.SEND_END_STREAM)
        out = self._data_to_send
        out += _DATA_HEAD.pack(size >> 16, size & 0xFFFF, 0, _END_STREAM if end_stream else 0,
                               stream_id)  # fmt: skip
        out += data
        stream.outbound_flow_control_window -= size
        self.outbound_flow_control_window -= size

    def _receive_frame(self, frame: Frame) -> list[Any]:
        """h2's own, less the ``repr(frame)`` it builds for a trace log that is off: h2 4.x
        formats every frame it receives (a DATA frame's payload included) before the logger can
        say it does not want it, a fifth of the cost of receiving a small frame."""
        events: list[Any]
        try:
            frames, events = self._frame_dispatch_table[frame.__class__](frame)
        except StreamClosedError as e:
            if self._stream_is_closed_by_reset(e.stream_id):
                f = RstStreamFrame(e.stream_id)
                f.error_code = e.error_code
                self._prepare_for_sending([f])
                events = e._events
            else:
                raise
        except StreamIDTooLowError as e:
            if self._stream_is_closed_by_reset(e.stream_id):
                f = RstStreamFrame(e.stream_id)
                f.error_code = ErrorCodes.STREAM_CLOSED
                self._prepare_for_sending([f])
                events = []
            elif self._stream_is_closed_by_end(e.stream_id):
                raise StreamClosedError(e.stream_id) from e
            else:
                raise
        else:
            self._prepare_for_sending(frames)
        return events

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
