"""Sans-IO pieces shared by both transports: request bodies, SSE parsing, errors, chunks.

No sockets here, so the parsing that runs once per chunk can be tested and profiled alone.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping
from functools import lru_cache
from typing import Any, Final, NamedTuple, Required, TypedDict

import orjson

from zerolayer.client.timing import Timing
from zerolayer.wire import contract
from zerolayer.wire.tokens import count_prompt_tokens

DONE = b"[DONE]"
# Refusals that say the replica itself is going away: the client marks it down at once.
MARK_DOWN = frozenset({contract.DRAINING.code, contract.ENGINE_DOWN.code})


class Chunk(NamedTuple):
    """One streamed piece of output: its text and how many tokens it carries."""

    text: str
    tokens: int


class ZeroLayerError(Exception):
    """A request that did not complete: server refusal, lost connection, reset, or timeout.

    ``code`` is a ``zl-error`` code or one of the client codes in ``timing``; ``retryable`` says
    whether another replica may be tried (only ever before the first token).
    """

    def __init__(
        self,
        code: str,
        message: str,
        *,
        status: int = 0,
        retryable: bool = False,
        retry_after_ms: int | None = None,
    ) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.status = status
        self.retryable = retryable
        self.retry_after_ms = retry_after_ms
        self.timing: Timing | None = None  # set when the request ends, for the caller


def server_error(status: int, code: str, body: bytes, retry_after: str | None) -> ZeroLayerError:
    """The error for a non-200 answer: the ``zl-error`` code, or one inferred from the status."""
    message = ""
    try:
        parsed = orjson.loads(body) if body else None
        if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
            message = str(parsed["error"].get("message", ""))
            code = code or str(parsed["error"].get("code") or "")
    except orjson.JSONDecodeError:
        message = body[:200].decode("utf-8", "replace")
    known = contract.ERRORS.get(code)
    if not code:
        code = f"http_{status}"
    return ZeroLayerError(
        code,
        message or f"HTTP {status}",
        status=status,
        retryable=known.retryable if known else False,
        retry_after_ms=int(retry_after) if retry_after and retry_after.isdigit() else None,
    )


# The body fields the client itself sets; ``extra_body`` may add others but not replace these.
CLIENT_BODY_FIELDS: Final = frozenset(
    {"prompt", "messages", "max_tokens", "stream", "seed", "model"}
)


def check_extra_body(extra_body: Mapping[str, Any] | None) -> dict[str, Any]:
    """``extra_body`` as a dict; ValueError when it names a field the client sets itself."""
    extra = dict(extra_body or {})
    clash = sorted(CLIENT_BODY_FIELDS & extra.keys())
    if clash:
        raise ValueError(f"extra_body cannot set {', '.join(clash)}: the client sets them")
    return extra


def request_body(
    prompt: str,
    max_tokens: int,
    seed: int | None,
    chat: bool,
    model: str | None,
    extra_body: Mapping[str, Any] | None = None,
) -> bytes:
    """The OpenAI-compatible streaming request body, encoded once per request. ``extra_body``
    (checked by :func:`check_extra_body`) adds fields a server needs, such as vLLM's
    ``ignore_eos``."""
    body: dict[str, Any] = (
        {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
    )
    body["max_tokens"] = max_tokens
    body["stream"] = True
    if seed is not None:
        body["seed"] = seed
    if model is not None:
        body["model"] = model
    if extra_body:
        body.update(extra_body)
    return orjson.dumps(body)


class SSEParser:
    """Splits a byte stream into SSE ``data:`` payloads; holds a partial event between feeds."""

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes) -> list[bytes]:
        """The complete events' payloads in ``data`` (joined with what was held back)."""
        buf = self._buf + data if self._buf else data
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n")
        parts = buf.split(b"\n\n")
        self._buf = parts.pop()
        out = []
        for event in parts:
            if event.startswith(b"data:") and b"\n" not in event:
                out.append(event[5:].lstrip(b" "))
                continue
            lines = [ln[5:].lstrip(b" ") for ln in event.split(b"\n") if ln.startswith(b"data:")]
            if lines:
                out.append(b"\n".join(lines))
        return out


class Prepared(NamedTuple):
    """A request encoded once, sent as is on every attempt (only ``:authority`` differs)."""

    path: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    chat: bool
    request_id: str
    deadline_ms: int


_REQUEST_ID = contract.REQUEST_ID.encode()


@lru_cache(maxsize=4096)
def _contract_headers(
    session: str, tenant: str, priority: str, deadline_ms: int, prompt_tokens: int, max_tokens: int
) -> tuple[tuple[tuple[str, str], ...], tuple[tuple[bytes, bytes], ...]]:
    """``contract.build_headers`` (validated) and its bytes; cached: sessions and shapes repeat."""
    pairs = contract.build_headers(
        session=session,
        tenant=tenant,
        priority=priority,
        deadline_ms=deadline_ms,
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
    )
    return tuple(pairs), tuple((k.encode(), v.encode()) for k, v in pairs)


def prepare(
    *,
    prompt: str,
    request_id: str,
    max_tokens: int = contract.DEFAULT_MAX_TOKENS,
    session: str = "",
    tenant: str = "default",
    priority: str = "normal",
    deadline_ms: int = contract.DEFAULT_DEADLINE_MS,
    seed: int | None = None,
    chat: bool = False,
    model: str | None = None,
    headers: Mapping[str, str] | None = None,
    extra_body: Mapping[str, Any] | None = None,
) -> Prepared:
    """Validate and encode a request; raise ValueError on bad values or conflicting headers.

    A caller's own header that names a contract header must agree with what the arguments say,
    so the routing key and the key the replica accounts under can never differ.
    """
    pairs, contract_fields = _contract_headers(
        session, tenant, priority, deadline_ms, count_prompt_tokens(prompt), max_tokens
    )
    body = request_body(prompt, max_tokens, seed, chat, model, extra_body)
    encoded = [*contract_fields, (_REQUEST_ID, request_id.encode())]
    if headers:
        built = dict(pairs)
        for name, value in headers.items():
            key = name.lower()
            if key.startswith(":") or key in _RESERVED:
                raise ValueError(f"header {name!r} is set by the client and cannot be overridden")
            if key in contract.CONTRACT_HEADERS and built.get(key) != value:
                raise ValueError(
                    f"header {name}={value!r} conflicts with the request's "
                    f"{key}={built.get(key)!r}; pass it as an argument instead"
                )
            if key not in built:
                encoded.append((key.encode(), value.encode()))
    encoded.append((b"content-length", str(len(body)).encode()))
    path = b"/v1/chat/completions" if chat else b"/v1/completions"
    return Prepared(path, encoded, body, chat, request_id, deadline_ms)


_RESERVED = frozenset({"content-length", "content-type", "host", contract.REQUEST_ID})


class RequestFields(TypedDict, total=False):
    """The keyword arguments of every client's ``stream``, ``submit`` and ``complete``.

    One list for all of them: ``prompt`` and the contract's fields (defaults as in
    :func:`prepare`), ``seed``, ``chat``, and ``headers`` for extra request headers.
    """

    prompt: Required[str]
    max_tokens: int
    session: str
    tenant: str
    priority: str
    deadline_ms: int
    seed: int | None
    chat: bool
    headers: Mapping[str, str] | None


class RequestIssuer:
    """Gives each request of one client a unique id and encodes it once, for either transport."""

    def __init__(
        self, tag: str, model: str | None, extra_body: Mapping[str, Any] | None = None
    ) -> None:
        self._ids = itertools.count()
        self._prefix = f"{tag}{os.getpid():x}-{id(self) & 0xFFFFFF:x}-"
        self.model = model
        self.extra_body = check_extra_body(extra_body)

    def __call__(self, fields: RequestFields) -> Prepared:
        """Raises ValueError for bad values (and TypeError for unknown fields) at once."""
        return prepare(
            request_id=f"{self._prefix}{next(self._ids)}",
            model=self.model,
            extra_body=self.extra_body,
            **fields,
        )
