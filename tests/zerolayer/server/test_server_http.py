"""The replica as off-the-shelf clients see it: curl over h2c and HTTP/1.1, and TLS with ALPN."""

from __future__ import annotations

import asyncio
import shutil
import ssl
from pathlib import Path

import orjson
import pytest

from harness.certs import self_signed
from serving.engine import NullEngine, SimConfig, SimEngine
from serving.engine.streams import detokenize, token_ids
from serving.wire.tokens import request_seed
from tests.support.server_client import H2Client, run, wait_all
from zerolayer.server import start_replica

SMALL = {"model_shape": "llama-3.2-1b"}
needs_curl = pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")


async def curl(*args: str, stdin: bytes | None = None) -> tuple[int, bytes, bytes]:
    """curl's exit status, stdout and stderr; ``--max-time`` only guards against a hang."""
    proc = await asyncio.create_subprocess_exec(
        "curl", "-sS", "--max-time", "60", *args,
        stdin=asyncio.subprocess.PIPE if stdin is not None else None,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await proc.communicate(stdin)
    assert proc.returncode is not None
    return proc.returncode, out, err


def sse_text(body: bytes) -> tuple[str, list[object]]:
    events = [
        orjson.loads(block[6:])
        for block in body.split(b"\n\n")
        if block.startswith(b"data: ") and block != b"data: [DONE]"
    ]
    text = "".join(
        e["choices"][0].get("text") or e["choices"][0].get("delta", {}).get("content", "")
        for e in events
        if e.get("choices")
    )
    return text, events


def expected(prompt: str, n: int) -> str:
    return detokenize(token_ids(request_seed(prompt, None), n))


@needs_curl
@pytest.mark.parametrize(
    "flag,version", [("--http2-prior-knowledge", b"HTTP/2 200"), ("--http1.1", b"HTTP/1.1 200")]
)
@run
async def test_curl_streams_a_completion(flag: str, version: bytes) -> None:
    engine = SimEngine(SimConfig(**SMALL))
    async with await start_replica(engine) as replica:
        body = orjson.dumps({"prompt": "curl me", "max_tokens": 30, "stream": True})
        rc, out, err = await curl(
            flag, "-N", "-i", "-H", "content-type: application/json", "-d", body.decode(),
            f"{replica.url}/v1/completions",
        )  # fmt: skip
        assert rc == 0, err
        head, _, payload = out.partition(b"\r\n\r\n")
        assert head.startswith(version), head
        assert b"text/event-stream" in head
        text, events = sse_text(payload)
        assert text == expected("curl me", 30)
        assert 1 < len(events) <= 30  # an event per engine chunk (a loaded loop merges steps)
        assert events[-1]["usage"]["completion_tokens"] == 30
        assert payload.endswith(b"data: [DONE]\n\n")
    await engine.close()


@needs_curl
@run
async def test_curl_http11_chat_and_errors() -> None:
    async with await start_replica(NullEngine(), max_body_bytes=1024) as replica:
        body = orjson.dumps(
            {"messages": [{"role": "user", "content": "hey"}], "max_tokens": 4, "stream": True}
        )
        rc, out, _ = await curl("--http1.1", "-N", "-d", body.decode(),
                                f"{replica.url}/v1/chat/completions")  # fmt: skip
        text, events = sse_text(out)
        assert rc == 0 and text == expected("hey", 4)
        assert events[0]["choices"][0]["delta"]["role"] == "assistant"
        rc, out, _ = await curl("--http1.1", "-i", "-d", "{nope", f"{replica.url}/v1/completions")
        assert out.startswith(b"HTTP/1.1 400") and b"zl-error: bad_request" in out
        rc, out, _ = await curl(
            "--http1.1", "-i", "-d", "x" * 5000, f"{replica.url}/v1/completions"
        )
        assert out.startswith(b"HTTP/1.1 413") and b"zl-error: payload_too_large" in out
        rc, out, _ = await curl("--http1.1", "-i", f"{replica.url}/health")
        assert out.startswith(b"HTTP/1.1 200")
        assert orjson.loads(out.partition(b"\r\n\r\n")[2])["health"] == 1.0


@run
async def test_http11_keep_alive_serves_requests_in_turn() -> None:
    async with await start_replica(NullEngine()) as replica:
        reader, writer = await asyncio.open_connection("127.0.0.1", replica.port)
        body = orjson.dumps({"prompt": "a", "max_tokens": 2})
        request = (
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        writer.write(request + request)  # pipelined
        seen = b""
        while seen.count(b"HTTP/1.1 200") < 2 or not seen.endswith(b"}"):
            chunk = await asyncio.wait_for(reader.read(65536), 5)
            assert chunk, seen
            seen += chunk
        assert seen.count(b'"completion_tokens":2') == 2
        writer.close()


def test_tls_with_alpn(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)

    @run
    async def scenario() -> None:
        engine = SimEngine(SimConfig(**SMALL))
        async with await start_replica(engine, tls_cert=cert, tls_key=key) as replica:
            assert replica.url.startswith("https://")
            trust = ssl.create_default_context(cafile=str(cert))
            trust.set_alpn_protocols(["h2"])
            client = await H2Client.connect("127.0.0.1", replica.port, tls=trust)
            assert client.alpn == "h2"
            streams = [client.completion(f"tls {i}", max_tokens=3, stream=True) for i in range(20)]
            await wait_all(streams, 10)
            for i, stream in enumerate(streams):
                assert stream.status == 200
                assert stream.text() == expected(f"tls {i}", 3)
            await client.close()
            if shutil.which("curl"):
                for flag, version in (("--http2", b"HTTP/2 200"), ("--http1.1", b"HTTP/1.1 200")):
                    rc, out, err = await curl(
                        flag, "--cacert", str(cert), "-i", "-N", "-d",
                        '{"prompt": "tls curl", "max_tokens": 3, "stream": true}',
                        f"{replica.url}/v1/completions",
                    )  # fmt: skip
                    assert rc == 0, err
                    assert out.startswith(version), out[:100]
                    assert sse_text(out.partition(b"\r\n\r\n")[2])[0] == expected("tls curl", 3)
        await engine.close()

    scenario()


@needs_curl
@run
async def test_http11_big_body_with_expect_100_continue() -> None:
    """The body goes up on the replica's 100 Continue, which curl -v logs: curl's own wait for
    one is set past its --max-time, so curl never uploads without it (no timing judged)."""
    async with await start_replica(NullEngine()) as replica:
        body = orjson.dumps({"prompt": "b" * (512 * 1024), "max_tokens": 2, "stream": True})
        rc, out, err = await curl(
            "--http1.1", "-v", "-N", "-H", "expect: 100-continue", "--expect100-timeout", "120",
            "--data-binary", "@-", f"{replica.url}/v1/completions", stdin=body,
        )  # fmt: skip
        assert rc == 0, err
        assert b"\n< HTTP/1.1 100" in err, err  # curl -v: the interim response it got
        assert b"Done waiting for 100-continue" not in err
        assert sse_text(out)[1][-1]["usage"]["prompt_tokens"] == 131_072
