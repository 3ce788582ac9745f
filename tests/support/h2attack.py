"""Raw HTTP/2 frames for hostile-client tests: hyperframe and hpack over an asyncio socket.

A client library (h2 included) validates what it sends and enforces the server's SETTINGS, so it
cannot send what an attacker sends: a RST_STREAM right behind each HEADERS, streams past
MAX_CONCURRENT_STREAMS, uppercase or connection-specific header names, a body that disagrees with
its content-length, floods of PING or SETTINGS. ``RawH2`` builds frames as bytes (``headers``,
``data``, ``rst``, ``ping``, ``settings``), writes any concatenation of them in one ``write``, and
decodes what the server sends back into a ``Reply`` per stream plus the GOAWAY, if any.
"""

from __future__ import annotations

import asyncio
import contextlib

import hpack
from hyperframe.frame import (
    ContinuationFrame,
    DataFrame,
    Frame,
    GoAwayFrame,
    HeadersFrame,
    PingFrame,
    RstStreamFrame,
    SettingsFrame,
    WindowUpdateFrame,
)

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
WINDOW = (1 << 31) - 1
REFUSED_STREAM = 0x7
ENHANCE_YOUR_CALM = 0xB


class Reply:
    """What the server sent on one stream."""

    def __init__(self) -> None:
        self.headers: dict[bytes, bytes] = {}
        self.data = bytearray()
        self.reset_code: int | None = None
        self.ended = False

    @property
    def status(self) -> int:
        return int(self.headers.get(b":status", b"0"))

    @property
    def error(self) -> str | None:
        value = self.headers.get(b"zl-error")
        return value.decode() if value is not None else None

    @property
    def closed(self) -> bool:
        return self.ended or self.reset_code is not None


class RawH2:
    """One cleartext connection with prior knowledge; the caller chooses every frame."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, ack_settings: bool
    ) -> None:
        self.ack_settings = ack_settings
        self.reader = reader
        self.writer = writer
        self.encoder = hpack.Encoder()
        self.decoder = hpack.Decoder()
        self.replies: dict[int, Reply] = {}
        self.goaway_code: int | None = None
        self.pings_acked = 0
        self.closed = asyncio.Event()
        self._changed = asyncio.Event()
        self._block: list[bytes] = []
        self._buffer = bytearray()
        self._task = asyncio.get_running_loop().create_task(self._read())

    @classmethod
    async def connect(cls, port: int, *, ack_settings: bool = True) -> RawH2:
        """Connect and send the preface; ``ack_settings=False``: never acknowledge the server's
        SETTINGS (so h2 on the server side never applies them). The ACK is written when the
        server's SETTINGS arrive: a caller that writes a frame in pieces turns it off."""
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        self = cls(reader, writer, ack_settings)
        window = WindowUpdateFrame(0, window_increment=WINDOW - 65_535)
        settings = SettingsFrame(0, settings={SettingsFrame.INITIAL_WINDOW_SIZE: WINDOW})
        self.write(PREFACE + settings.serialize() + window.serialize())
        return self

    # -- frames, as bytes -----------------------------------------------------------------------

    def headers(
        self, sid: int, pairs: list[tuple[bytes, bytes]], *, end_stream: bool = False
    ) -> bytes:
        flags = {"END_HEADERS", "END_STREAM"} if end_stream else {"END_HEADERS"}
        return HeadersFrame(sid, data=self.encoder.encode(pairs), flags=flags).serialize()

    def header_block(self, sid: int, pieces: int, size: int) -> bytes:
        """HEADERS and ``pieces - 1`` CONTINUATIONs of ``size`` bytes each, never END_HEADERS:
        a header block the server must hold until it ends (the bytes are not valid HPACK)."""
        first = HeadersFrame(sid, data=b"\x00" * size).serialize()
        rest = ContinuationFrame(sid, data=b"\x00" * size).serialize()
        return first + rest * (pieces - 1)

    @staticmethod
    def data(sid: int, payload: bytes, *, end_stream: bool = False) -> bytes:
        flags = {"END_STREAM"} if end_stream else set()
        return DataFrame(sid, data=payload, flags=flags).serialize()

    @staticmethod
    def rst(sid: int, code: int = 0x8) -> bytes:
        return RstStreamFrame(sid, error_code=code).serialize()

    @staticmethod
    def ping(payload: bytes = b"attack!!") -> bytes:
        return PingFrame(0, opaque_data=payload).serialize()

    @staticmethod
    def settings() -> bytes:
        return SettingsFrame(0, settings={SettingsFrame.ENABLE_PUSH: 0}).serialize()

    def request(
        self, sid: int, body: bytes, *, path: bytes = b"/v1/completions",
        extra: list[tuple[bytes, bytes]] | None = None, end_stream: bool = True,
    ) -> bytes:  # fmt: skip
        """HEADERS (with content-length) and one DATA frame per 16 KiB of ``body``."""
        pairs = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", path),
                 (b":authority", b"replica"), (b"content-length", str(len(body)).encode()),
                 *(extra or [])]  # fmt: skip
        out = [self.headers(sid, pairs)]
        chunks = [body[i : i + 16_384] for i in range(0, len(body), 16_384)] or [b""]
        for i, chunk in enumerate(chunks):
            out.append(self.data(sid, chunk, end_stream=end_stream and i == len(chunks) - 1))
        return b"".join(out)

    def write(self, data: bytes) -> None:
        self.writer.write(data)

    # -- what came back -------------------------------------------------------------------------

    def reply(self, sid: int) -> Reply:
        return self.replies.setdefault(sid, Reply())

    async def wait_for(self, sids: list[int], timeout: float = 5) -> None:
        """Until each stream in ``sids`` has ended or been reset (or the connection closed)."""

        async def until_closed() -> None:
            while not self.closed.is_set() and not all(self.reply(s).closed for s in sids):
                self._changed.clear()
                await self._changed.wait()

        await asyncio.wait_for(until_closed(), timeout)

    async def round_trip(self, timeout: float = 5) -> None:
        """PING and wait for its ACK: by then the server's SETTINGS were read (and acknowledged
        when ``ack_settings``), so the server applies them to every frame written after."""
        acked = self.pings_acked
        self.write(self.ping())

        async def until_acked() -> None:
            while self.pings_acked == acked and not self.closed.is_set():
                self._changed.clear()
                await self._changed.wait()

        await asyncio.wait_for(until_acked(), timeout)

    async def wait_closed(self, timeout: float = 5) -> None:
        await asyncio.wait_for(self.closed.wait(), timeout)

    async def _read(self) -> None:
        try:
            while data := await self.reader.read(1 << 16):
                self._buffer += data
                self._parse()
                self._changed.set()
        except ConnectionError:
            pass
        finally:
            self.closed.set()
            self._changed.set()

    def _parse(self) -> None:
        buffer = self._buffer
        while len(buffer) >= 9:
            frame, length = Frame.parse_frame_header(memoryview(buffer[:9]))
            if len(buffer) < 9 + length:
                return
            frame.parse_body(memoryview(buffer[9 : 9 + length]))
            del buffer[: 9 + length]
            self._on_frame(frame)

    def _on_frame(self, frame: Frame) -> None:
        if isinstance(frame, HeadersFrame | ContinuationFrame):
            self._block.append(frame.data)
            if "END_HEADERS" in frame.flags:
                fields = self.decoder.decode(b"".join(self._block), raw=True)
                self._block.clear()
                self.reply(frame.stream_id).headers.update(fields)
        elif isinstance(frame, DataFrame):
            self.reply(frame.stream_id).data += frame.data
        elif isinstance(frame, RstStreamFrame):
            reply = self.reply(frame.stream_id)
            if reply.reset_code is None:  # the first reset is the answer; later ones echo DATA
                reply.reset_code = frame.error_code
        elif isinstance(frame, GoAwayFrame):
            self.goaway_code = frame.error_code
        elif isinstance(frame, PingFrame) and "ACK" in frame.flags:
            self.pings_acked += 1
        elif isinstance(frame, SettingsFrame) and "ACK" not in frame.flags and self.ack_settings:
            self.write(SettingsFrame(0, flags={"ACK"}).serialize())
        if "END_STREAM" in frame.flags and frame.stream_id:
            self.reply(frame.stream_id).ended = True

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(Exception):
            await self.writer.wait_closed()
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
