"""Clients of a stack: the SDK client for its URLs (``client_for``), an HTTP/1.1 router over
several replicas by the SDK's ring (``Http1Router``), the body fields a vLLM OpenAI front
needs, and the reachability check of an external stack's URL."""

from __future__ import annotations

import http.client
import itertools
import os
import socket
import ssl
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Unpack, cast
from urllib.parse import urlsplit

from harness.stacks.spec import StackUnreachable
from harness.stacks.tls import client_tls
from zerolayer.client.ring import DEFAULT_VNODES, HashRing

if TYPE_CHECKING:
    from zerolayer.client import Http1Client, ZeroLayerClient
    from zerolayer.client.codec import RequestFields
    from zerolayer.client.stream import Completion, Stream

REACH_TIMEOUT_S: Final = 2.0


def openai_server_body(engine_options: Mapping[str, Any]) -> dict[str, Any]:
    """Body fields for a stack whose front is vLLM's OpenAI server code (``vllm-serve``, Ray
    Serve LLM) so it serves what the zero-layer replica's engine serves: exactly ``max_tokens``
    (``ignore_eos``), the engine's temperature, and usage in the stream's last event."""
    from serving.engine.vllm_engine import VllmEngineConfig

    return {
        "ignore_eos": True,
        "temperature": VllmEngineConfig(**engine_options).temperature,
        "stream_options": {"include_usage": True},
    }


class Http1Router:
    """HTTP/1.1 to several replicas, each request to the one the SDK's ring picks: keyed by its
    session, or (like the SDK, which places a sessionless request by its own request id) by a
    fresh id. One ``Http1Client`` per replica URL; ``stream``/``complete`` as theirs."""

    def __init__(self, clients: Sequence[Http1Client]) -> None:
        self.clients = {c.url: c for c in clients}
        self.ring = HashRing(dict.fromkeys(self.clients), DEFAULT_VNODES)
        self._ids = itertools.count()
        self._prefix = f"r{os.getpid():x}-"

    def pick(self, session: str = "") -> Http1Client:
        """The client of the replica the ring gives ``session`` (or a fresh id)."""
        return self.clients[self.ring.lookup(session or f"{self._prefix}{next(self._ids)}")]

    def stream(self, **fields: Unpack[RequestFields]) -> Stream:
        return self.pick(fields.get("session", "")).stream(**fields)

    async def complete(self, **fields: Unpack[RequestFields]) -> Completion:
        return await self.pick(fields.get("session", "")).complete(**fields)

    async def close(self) -> None:
        for client in self.clients.values():
            await client.close()

    async def __aenter__(self) -> Http1Router:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def client_for(
    protocol: str, urls: Sequence[str], tls_ca: Path | None = None, **options: Any
) -> ZeroLayerClient | Http1Client:
    """The SDK client for a stack's URLs: ``h2`` routes over all of them with the zero-layer SDK,
    ``http1`` goes to the one front door. ``Stack.open_client`` (which puts an
    :class:`Http1Router` over one of these per replica for vllm-serve) and chaos (whose load goes
    through its fault proxy) build every client here."""
    from zerolayer.client import Http1Client, ZeroLayerClient

    tls = client_tls(tls_ca, ("h2",) if protocol == "h2" else ("http/1.1",))
    if tls is not None:
        options.setdefault("tls", tls)
    if protocol == "h2":
        return ZeroLayerClient(list(urls), **options)
    if protocol == "http1":
        if len(urls) != 1:
            raise ValueError(f"an HTTP/1.1 client takes exactly one URL, got {list(urls)}")
        return Http1Client(urls[0], **options)
    raise ValueError(f"protocol must be h2 or http1, got {protocol!r}")


def open_client(
    protocol: str,
    urls: Sequence[str],
    tls_ca: Path | None = None,
    *,
    model: str | None = None,
    extra_body: Mapping[str, Any] | None = None,
    api_key: str | None = None,
    **options: Any,
) -> ZeroLayerClient | Http1Client | Http1Router:
    """The client of a stack at ``urls`` (``Stack.open_client``'s, and a loader worker's on
    another node): naming ``model`` and adding ``extra_body`` to every request, sending
    ``api_key`` by default; over HTTP/1.1 with several replicas an :class:`Http1Router` over
    one client each."""
    options.setdefault("model", model)
    options.setdefault("extra_body", dict(extra_body or {}))
    if api_key is not None:
        options.setdefault("api_key", api_key)
    if protocol == "http1" and len(urls) > 1:
        clients = [client_for("http1", [url], tls_ca, **options) for url in urls]
        return Http1Router([cast("Http1Client", c) for c in clients])
    return client_for(protocol, urls, tls_ca, **options)


def check_reachable(url: str, timeout_s: float = REACH_TIMEOUT_S) -> None:
    """The URL answers HTTP: a TCP connect to its host and port, then a ``GET /health`` whose
    answer has an HTTP status line (any status: a front that refuses the path still speaks
    HTTP). Raises StackUnreachable naming the URL and what failed."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise StackUnreachable(f"{url} is not an http:// or https:// URL")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
        with socket.create_connection((parts.hostname, port), timeout=timeout_s):
            pass
    except (OSError, ValueError) as exc:
        raise StackUnreachable(f"{url} is not reachable: {exc}") from exc
    if parts.scheme == "https":
        tls = ssl.create_default_context()
        tls.check_hostname, tls.verify_mode = False, ssl.CERT_NONE  # liveness only
        conn: http.client.HTTPConnection = http.client.HTTPSConnection(
            parts.hostname, port, timeout=timeout_s, context=tls
        )
    else:
        conn = http.client.HTTPConnection(parts.hostname, port, timeout=timeout_s)
    try:
        conn.request("GET", "/health")
        conn.getresponse().read()
    except (OSError, http.client.HTTPException) as exc:
        reason = str(exc) or type(exc).__name__
        raise StackUnreachable(f"{url} does not answer HTTP ({reason})") from exc
    finally:
        conn.close()
