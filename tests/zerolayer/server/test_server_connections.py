"""Connection-level defences of the replica: HTTP/1.1 backpressure, the header, body, idle and TLS
handshake timeouts, the connection cap, framing the RFC says to close on, and mutual TLS.

Each test talks raw bytes over a loopback socket, as a hostile or broken client would.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import socket
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import orjson
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.certs import self_signed
from serving.auth import Authenticator, Grant, key_digest
from serving.engine import NullEngine
from serving.engine.types import EngineRequest, TokenChunk
from serving.wire.contract import PRIORITIES
from tests.support.server_client import run
from tests.support.waiting import HANG_GUARD_S
from zerolayer.server import ReplicaHandle, start_replica
from zerolayer.server.limits import Limits

WAIT_S = 5.0  # the most any test waits for one event; a pass takes a fraction of it
TICK_S = 0.02
GET_METRICS = b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n"
GET_HEALTH = b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"


def completion_request(body: bytes, extra: bytes = b"") -> bytes:
    return (
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        + extra
        + b"content-length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )


async def connect(
    port: int, receive_buffer: int | None = None, tls: ssl.SSLContext | None = None
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A loopback connection; ``receive_buffer`` shrinks the kernel's buffer for a client that
    means not to read, so the replica's own buffers are what fills."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if receive_buffer is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    return await asyncio.open_connection(
        sock=sock, ssl=tls, server_hostname="127.0.0.1" if tls else None
    )


async def read_to_eof(reader: asyncio.StreamReader) -> bytes:
    """Everything the replica sends until it closes; TimeoutError if it never does."""
    seen = b""
    try:
        async with asyncio.timeout(WAIT_S):
            while chunk := await reader.read(65536):
                seen += chunk
    except TimeoutError:
        raise AssertionError(f"still open after {WAIT_S} s; received {seen[:300]!r}") from None
    return seen


async def wait_until(predicate: object, what: str) -> None:
    """Poll ``predicate`` (a callable) every tick, for at most WAIT_S."""
    assert callable(predicate)
    for _ in range(int(WAIT_S / TICK_S)):
        if predicate():
            return
        await asyncio.sleep(TICK_S)
    raise AssertionError(f"timed out waiting for {what}")


async def read_response(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One response with a content-length: its head (status line and headers) and body."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT_S)
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    return head, await asyncio.wait_for(reader.readexactly(length), WAIT_S)


def server_transports(handle: ReplicaHandle) -> list[asyncio.Transport]:
    return [p.transport for p in handle._protocols if p.transport is not None]


# -- backpressure ---------------------------------------------------------------------------------


@run
async def test_pipelined_requests_never_read_keep_the_write_buffer_bounded() -> None:
    """212k pipelined GET /metrics never read grew a replica by 420 MB: the replica must stop
    taking requests while its output is over the high-water mark, and resume once read."""
    limits = Limits(connection_buffer_bytes=256 << 10)
    async with await start_replica(NullEngine(), limits=limits) as handle:
        reader, writer = await connect(handle.port, receive_buffer=4096)
        count = 4000
        writer.write(GET_METRICS * count)
        await wait_until(lambda: handle.replica.connections == 1, "the connection")
        (transport,) = server_transports(handle)
        high = transport.get_write_buffer_limits()[1]
        peak, last, still = 0, -1, 0
        for _ in range(int(WAIT_S / TICK_S)):  # until the replica's buffer stops changing
            size = transport.get_write_buffer_size()
            peak = max(peak, size)
            still = still + 1 if size == last else 0
            last = size
            if still >= 10:
                break
            await asyncio.sleep(TICK_S)
        head, metrics = await read_response(reader)
        one_response = len(head) + len(metrics)
        assert peak <= high + one_response, (peak, high, one_response)
        # Reading it all back resumes the replica: every request is answered (some 16 MB of
        # metrics, seconds on a loaded host: the bound only turns a hang into a failure).
        marker, answered, tail = b"HTTP/1.1 200 ", 1, b""
        async with asyncio.timeout(HANG_GUARD_S):
            while answered < count:
                chunk = await reader.read(1 << 20)
                assert chunk, answered
                tail += chunk
                answered += tail.count(marker)
                tail = tail[1 - len(marker) :]
        writer.close()


class Later(NullEngine):
    """Answers after the loop's next turn, so a pipelined request finds the last one in flight."""

    async def generate(self, request: EngineRequest) -> AsyncIterator[TokenChunk]:
        await asyncio.sleep(0)
        async for chunk in super().generate(request):
            yield chunk


@settings(max_examples=20, deadline=None)
@given(count=st.integers(1, 6), cuts=st.lists(st.integers(1, 300), max_size=10))
def test_pipelined_requests_cut_anywhere_are_all_answered_in_order(
    count: int, cuts: list[int]
) -> None:
    """Reading pauses while a pipelined request waits and resumes after each response: however
    the bytes are cut into reads, every request is answered, in order, and none twice."""
    stream = b"".join(
        completion_request(orjson.dumps({"prompt": f"p{i}", "max_tokens": 2}),
                           extra=f"zl-request-id: r{i}\r\n".encode())
        for i in range(count)
    )  # fmt: skip

    @run
    async def scenario() -> None:
        async with await start_replica(Later()) as handle:
            reader, writer = await connect(handle.port)
            rest = stream
            for cut in cuts:
                writer.write(rest[:cut])
                rest = rest[cut:]
                await writer.drain()
                await asyncio.sleep(0.001)  # most likely a read of its own
            writer.write(rest)
            bodies = [(await read_response(reader))[1] for _ in range(count)]
            ids = [orjson.loads(body)["id"] for body in bodies]
            assert ids == [f"cmpl-r{i}" for i in range(count)]
            writer.close()

    scenario()


class Firehose(NullEngine):
    """Streams as fast as it is pulled, 4 KiB a chunk, and counts the chunks pulled."""

    def __init__(self) -> None:
        super().__init__()
        self.pulled = 0

    async def generate(self, request: EngineRequest) -> AsyncIterator[TokenChunk]:
        for i in range(1, request.max_tokens + 1):
            self.pulled += 1
            finish = "length" if i == request.max_tokens else None
            yield TokenChunk([0], "x" * 4096, finish, request.prompt_tokens, i)
            await asyncio.sleep(0)


@run
async def test_a_stream_nobody_reads_stops_pulling_tokens_then_stalls() -> None:
    engine = Firehose()
    limits = Limits(connection_buffer_bytes=256 << 10, send_stall_s=0.3)
    async with await start_replica(engine, limits=limits) as handle:
        max_tokens = 20_000  # 80 MB of output, far past any kernel buffer
        body = orjson.dumps({"prompt": "p", "max_tokens": max_tokens, "stream": True})
        _, writer = await connect(handle.port, receive_buffer=4096)
        writer.write(completion_request(body))
        await wait_until(lambda: handle.replica.outcomes.total() == 1, "the request to end")
        assert handle.replica.failures["send_stalled"] == 1
        assert engine.pulled < max_tokens
        assert handle.replica.active == 0
        writer.close()


# -- timeouts ---------------------------------------------------------------------------------


@run
async def test_slowloris_headers_are_cut_at_the_header_timeout(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="zerolayer.server")
    limits = Limits(header_timeout_s=0.3)
    async with await start_replica(NullEngine(), limits=limits) as handle:
        reader, writer = await connect(handle.port)
        request = GET_HEALTH[:-2] + b"x-slow: " + b"s" * 200 + b"\r\n\r\n"
        sent = 0
        eof = asyncio.ensure_future(reader.read(1))
        for byte in request:  # one byte a tick: 4.6 s for the whole head
            if eof.done():
                break
            writer.write(bytes([byte]))
            sent += 1
            await asyncio.sleep(TICK_S)
        assert eof.done() and eof.result() == b"", f"sent all {sent} bytes, still open"
        assert sent < len(request)
        writer.close()
    assert any("header" in r.getMessage() and r.levelno == logging.INFO for r in caplog.records)


@pytest.mark.parametrize("sent", [b"", b"PRI * HTTP/2.0\r\n"], ids=["silent", "half-preface"])
@run
async def test_a_cleartext_connection_that_never_finishes_its_preface_is_closed(
    sent: bytes,
) -> None:
    limits = Limits(header_timeout_s=0.2)
    async with await start_replica(NullEngine(), limits=limits) as handle:
        reader, writer = await connect(handle.port)
        writer.write(sent)
        assert await read_to_eof(reader) == b""
        assert handle.replica.connections == 0
        writer.close()


@run
async def test_an_idle_keep_alive_connection_is_closed(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="zerolayer.server")
    limits = Limits(idle_timeout_s=0.3)
    async with await start_replica(NullEngine(), limits=limits) as handle:
        reader, writer = await connect(handle.port)
        for _ in range(3):  # requests in turn keep it open
            writer.write(GET_HEALTH)
            head, _ = await read_response(reader)
            assert head.startswith(b"HTTP/1.1 200")
        assert await read_to_eof(reader) == b""
        writer.close()
    assert any("idle" in r.getMessage() for r in caplog.records)


@run
async def test_a_body_that_stops_arriving_gets_408_and_a_close() -> None:
    limits = Limits(body_timeout_s=0.3)
    async with await start_replica(NullEngine(), limits=limits) as handle:
        reader, writer = await connect(handle.port)
        body = orjson.dumps({"prompt": "never finished", "max_tokens": 2})
        writer.write(completion_request(body)[:-5])
        response = await read_to_eof(reader)
        assert response.startswith(b"HTTP/1.1 408"), response
        assert b"zl-error: request_timeout" in response
        await wait_until(lambda: handle.replica.active == 0, "the call to end")
        assert handle.replica.refusals["request_timeout"] == 1
        writer.close()


def test_a_tls_handshake_that_never_starts_is_cut(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)

    @run
    async def scenario() -> None:
        limits = Limits(handshake_timeout_s=0.2)
        async with await start_replica(
            NullEngine(), tls_cert=cert, tls_key=key, limits=limits
        ) as handle:
            reader, writer = await connect(handle.port)
            assert await read_to_eof(reader) == b""
            writer.close()

    scenario()


# -- the connection cap -------------------------------------------------------------------------


@run
async def test_connections_past_the_cap_are_refused_counted_and_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="zerolayer.server")
    async with await start_replica(NullEngine(), limits=Limits(max_connections=2)) as handle:
        kept = [await connect(handle.port) for _ in range(2)]
        await wait_until(lambda: handle.replica.connections == 2, "two connections")
        for _ in range(5):
            reader, writer = await connect(handle.port)
            writer.write(GET_HEALTH)
            assert await read_to_eof(reader) == b""
            writer.close()
        assert handle.replica.refused_connections == 5
        refusals = [r for r in caplog.records if "refused" in r.getMessage()]
        assert len(refusals) == 1 and refusals[0].levelno == logging.WARNING
        reader, writer = kept[0]
        writer.write(GET_METRICS)
        head, metrics = await read_response(reader)
        assert head.startswith(b"HTTP/1.1 200")
        assert b"\nzl_refused_connections_total 5\n" in metrics
        for _, kept_writer in kept:
            kept_writer.close()
        await wait_until(lambda: handle.replica.connections == 0, "the kept ones to close")
        reader, writer = await connect(handle.port)  # room again
        writer.write(GET_HEALTH)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT_S)
        assert head.startswith(b"HTTP/1.1 200")
        writer.close()


# -- framing the RFC says to close on ------------------------------------------------------------


@run
async def test_content_length_with_transfer_encoding_gets_400_and_a_close() -> None:
    """RFC 9112 section 6.1: such a request may be smuggling; the server MUST close."""
    async with await start_replica(NullEngine()) as handle:
        reader, writer = await connect(handle.port)
        body = orjson.dumps({"prompt": "smuggled?", "max_tokens": 2})
        chunked = hex(len(body))[2:].encode() + b"\r\n" + body + b"\r\n0\r\n\r\n"
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 4\r\n"
            b"transfer-encoding: chunked\r\n\r\n" + chunked + GET_HEALTH
        )
        response = await read_to_eof(reader)
        assert response.startswith(b"HTTP/1.1 400"), response
        assert b"zl-error: bad_request" in response
        assert response.count(b"HTTP/1.1") == 1  # nothing after it was served
        writer.close()


@pytest.mark.parametrize("ending", [b"\r\n\r\n", b""], ids=["whole", "unfinished"])
@run
async def test_a_header_block_over_the_limit_gets_431_and_a_close(ending: bytes) -> None:
    """Whole: h11 parses a block of any size that arrives in one read; unfinished: h11's own
    bound on an incomplete event trips."""
    async with await start_replica(NullEngine()) as handle:
        limit = handle.replica.limits.max_header_list_size
        reader, writer = await connect(handle.port)
        writer.write(GET_HEALTH[:-2] + b"x-pad: " + b"p" * (limit + 4096) + ending)
        response = await read_to_eof(reader)
        assert response.startswith(b"HTTP/1.1 431"), response[:200]
        assert b"zl-error: headers_too_large" in response
        writer.close()


# -- mutual TLS ---------------------------------------------------------------------------------


def issue(
    path: Path, subject: str, issuer: str | None = None, issuer_key: object = None
) -> ec.EllipticCurvePrivateKey:
    """Write ``path``.crt and .key: a certificate for ``subject`` signed by ``issuer_key`` (a
    CA, self-signed, when no issuer is given); return its key, to sign others with."""
    key = ec.generate_private_key(ec.SECP256R1())
    signer = issuer_key if issuer_key is not None else key
    assert isinstance(signer, ec.EllipticCurvePrivateKey)
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer or subject)]))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), critical=True)
        .sign(signer, hashes.SHA256())
    )
    path.with_suffix(".crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    path.with_suffix(".key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return key


def test_mutual_tls_names_the_tenant_and_refuses_other_clients(tmp_path: Path) -> None:
    """The tenant comes from a certificate the client CA signed: enough to be served without an
    API key; a client without one, or with one another CA signed, gets no TLS connection."""
    server_cert, server_key = self_signed(tmp_path / "server")
    ca_key = issue(tmp_path / "ca", "tenants CA")
    for tenant in ("acme", "globex"):
        issue(tmp_path / tenant, tenant, "tenants CA", ca_key)
    issue(tmp_path / "stranger", "acme")  # names acme, but signed by itself, not the tenants' CA

    def client_context(name: str | None) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(server_cert))
        context.set_alpn_protocols(["http/1.1"])
        if name is not None:
            context.load_cert_chain(tmp_path / f"{name}.crt", tmp_path / f"{name}.key")
        return context

    @run
    async def scenario() -> None:
        auth = Authenticator({key_digest("a key nobody sends"): Grant("acme", PRIORITIES["high"])})
        body = orjson.dumps({"prompt": "mtls", "max_tokens": 2})
        async with await start_replica(
            NullEngine(), tls_cert=server_cert, tls_key=server_key,
            tls_client_ca=tmp_path / "ca.crt", auth=auth,
        ) as handle:  # fmt: skip
            for tenant, status in (("acme", b"200"), ("globex", b"401")):
                reader, writer = await connect(handle.port, tls=client_context(tenant))
                writer.write(completion_request(body, extra=b"zl-priority: high\r\n"))
                head, _ = await read_response(reader)
                assert head.startswith(b"HTTP/1.1 " + status), (tenant, head)
                writer.close()
            for name in (None, "stranger"):
                with pytest.raises((ssl.SSLError, ConnectionError, asyncio.IncompleteReadError)):
                    reader, writer = await connect(handle.port, tls=client_context(name))
                    writer.write(GET_HEALTH)
                    # TLS 1.3: the server's refusal arrives after the client's handshake ends.
                    await asyncio.wait_for(reader.readexactly(1), WAIT_S)
        assert handle.replica.accounting.totals.keys() >= {"acme"}

    scenario()
