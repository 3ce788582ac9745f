"""The SDK's request encoding and response parsing, shared by both transports: request bodies,
SSE parsing, errors, chunks (the wire contract itself is ``serving.wire``).

No sockets here, so the parsing that runs once per chunk can be tested and profiled alone.
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Mapping
from functools import lru_cache
from typing import Any, Final, NamedTuple, Required, TypedDict

import orjson

from serving.wire import contract
from serving.wire.tokens import count_prompt_tokens
from zerolayer.client.timing import Timing

DONE = b"[DONE]"

# What a server can make the client hold. These bound the client, not the replica, so they live
# here rather than in the replica's ``Limits``.
# One SSE event (the bytes up to its blank line): an event carries one chunk of a completion, a
# few hundred bytes from our replica and from vLLM; past this the stream fails as
# ``upstream_failed`` instead of buffering a server that never sends a separator.
MAX_SSE_EVENT_BYTES: Final = 1 << 20
# The part of a non-2xx body (or of a /health body) the client keeps to report; the rest is read
# and dropped. The replica's error bodies are one short JSON object.
MAX_ERROR_BODY_BYTES: Final = 64 << 10


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


class BadRequestError(ZeroLayerError, ValueError):
    """A request the SDK refuses before sending it (``bad_request``, never retried): a header
    that would break the connection every caller shares, or a malformed API key. A ValueError
    too, like every other bad argument."""

    def __init__(self, message: str) -> None:
        super().__init__(contract.BAD_REQUEST.code, message, status=contract.BAD_REQUEST.status)


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


class SSEEventTooLarge(ValueError):
    """A server sent more than ``max_event_bytes`` without ending an SSE event."""


class SSEParser:
    """Splits a byte stream into SSE ``data:`` payloads; holds a partial event between feeds.

    Linear in the bytes fed: a held partial event is appended to, never re-joined, and a feed
    searches it only from where the last one stopped (``bytes_scanned`` counts the bytes
    searched). An event may hold at most ``max_event_bytes``; past that ``feed`` raises
    SSEEventTooLarge.
    """

    __slots__ = ("_buf", "_cr", "bytes_scanned", "max_event_bytes")

    def __init__(self, max_event_bytes: int = MAX_SSE_EVENT_BYTES) -> None:
        self._buf = bytearray()
        self._cr = False  # the last feed ended in CR: it may be half of a CRLF
        self.bytes_scanned = 0
        self.max_event_bytes = max_event_bytes

    def feed(self, data: bytes) -> list[bytes]:
        """The complete events' payloads in ``data`` (joined with what was held back)."""
        if self._cr or b"\r" in data:
            data = self._crlf_to_lf(data)
        held = self._buf
        if held:
            events = self._complete_held(data)
            if events is None:
                return []
        else:
            size = len(data)
            self.bytes_scanned += size
            events = data.split(b"\n\n")
            if size > self.max_event_bytes:
                self._check_size(max(map(len, events)))
        tail = events.pop()
        if tail:
            self._check_size(len(tail))
            held += tail
        out = []
        for event in events:
            if event.startswith(b"data:") and b"\n" not in event:
                out.append(event[5:].lstrip(b" "))
                continue
            lines = [ln[5:].lstrip(b" ") for ln in event.split(b"\n") if ln.startswith(b"data:")]
            if lines:
                out.append(b"\n".join(lines))
        return out

    def _complete_held(self, data: bytes) -> list[bytes] | None:
        """The events the held partial event and ``data`` make (the last one partial, maybe
        empty), or None when the held event is still open. Searches only the new bytes and
        the one before them (a separator may straddle the two)."""
        held = self._buf
        scan_from = len(held) - 1
        held += data
        end = held.find(b"\n\n", scan_from)
        if end < 0:
            self.bytes_scanned += len(held) - scan_from
            self._check_size(len(held))
            return None
        self._check_size(end)
        rest = bytes(held[end + 2 :])
        self.bytes_scanned += end + 2 - scan_from + len(rest)
        first = bytes(held[:end])
        held.clear()
        events = [first, *rest.split(b"\n\n")]
        if len(rest) > self.max_event_bytes:
            self._check_size(max(map(len, events)))
        return events

    def _check_size(self, size: int) -> None:
        if size > self.max_event_bytes:
            raise SSEEventTooLarge(f"an SSE event over {self.max_event_bytes} bytes")

    def _crlf_to_lf(self, data: bytes) -> bytes:
        """CRLF line ends as LF, holding back a final CR until the next byte is known."""
        if self._cr:
            data = b"\r" + data
        self._cr = data.endswith(b"\r")
        if self._cr:
            data = data[:-1]
        return data.replace(b"\r\n", b"\n")


class Prepared(NamedTuple):
    """A request encoded once, sent as is on every attempt (only ``:authority`` differs)."""

    path: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    chat: bool
    request_id: str
    deadline_ms: int

    def __repr__(self) -> str:
        # The API key travels in ``headers``: keep it out of anything that prints a request.
        headers = [(k, b"<redacted>" if k == _AUTHORIZATION else v) for k, v in self.headers]
        return (
            f"Prepared(path={self.path!r}, headers={headers!r}, body=<{len(self.body)} bytes>, "
            f"chat={self.chat}, request_id={self.request_id!r}, deadline_ms={self.deadline_ms})"
        )


_REQUEST_ID = contract.REQUEST_ID.encode()
_AUTHORIZATION = b"authorization"
Header = tuple[bytes, bytes]

# RFC 9110 section 5.1: a field name is a token; HTTP/2 wants it lowercase (RFC 9113 section
# 8.2.1), so a valid name is lowercased rather than refused.
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
# RFC 9110 section 5.5: a field value is visible characters, SP and HTAB (and obs-text); RFC 9113
# section 8.2.1 singles out NUL, CR and LF, which would split or end the header block.
_FIELD_VALUE = re.compile(r"[^\x00-\x08\x0a-\x1f\x7f]*")
# RFC 9113 section 8.2.2: connection-specific fields are malformed in HTTP/2 (``te`` is allowed
# with the value ``trailers`` only); the HTTP/1.1 client manages its connection itself.
_CONNECTION_SPECIFIC = frozenset(
    {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade"}
)
# Set by the SDK itself on every request (the API key goes in as ``api_key=``).
_RESERVED = frozenset(
    {"content-length", "content-type", "host", "accept", "authorization", contract.REQUEST_ID}
)


class CallerHeaders(NamedTuple):
    """A caller's extra headers, checked and encoded: those to send, and those that restate a
    contract header (to be checked against the request's own values)."""

    extra: tuple[Header, ...]
    contract: tuple[tuple[str, str], ...]


def _header_problem(name: object, value: object) -> str | None:
    """Why a caller's header may not be sent (None when it may)."""
    if not isinstance(name, str) or not isinstance(value, str):
        return f"header {name!r} must be a str name with a str value"
    if name.startswith(":"):
        return f"header {name!r} is a pseudo-header, which the client sets"
    if not _TOKEN.fullmatch(name):
        return f"header name {name!r} is not an RFC 9110 token"
    key = name.lower()
    if key in _RESERVED:
        return f"header {name!r} is set by the client and cannot be overridden"
    if key in _CONNECTION_SPECIFIC or (key == "te" and value != "trailers"):
        return f"header {name!r} is connection-specific (RFC 9113 section 8.2.2)"
    if not _FIELD_VALUE.fullmatch(value) or value[:1] in " \t" or value[-1:] in " \t":
        return (
            f"header {name!r} has a value with a control character or leading or trailing "
            "whitespace (RFC 9113 section 8.2.1)"
        )
    return None


@lru_cache(maxsize=256)
def caller_headers(items: tuple[tuple[str, str], ...]) -> CallerHeaders:
    """Check and encode a caller's extra headers; cached, as loaders send the same set each time.

    Raises BadRequestError for a header that must not reach a connection other callers share.
    """
    extra: list[Header] = []
    claims: list[tuple[str, str]] = []
    for name, value in items:
        problem = _header_problem(name, value)
        if problem is not None:
            raise BadRequestError(problem)
        key = name.lower()
        if key in contract.CONTRACT_HEADERS:
            claims.append((key, value))
        else:
            extra.append((key.encode(), value.encode()))
    return CallerHeaders(tuple(extra), tuple(claims))


@lru_cache(maxsize=4096)
def bearer(api_key: str) -> Header:
    """The ``authorization`` header for an API key (RFC 6750 section 2.1), checked once per key.

    Raises BadRequestError (a ValueError) for a key that is not visible ASCII without
    whitespace; the message never contains the key.
    """
    if not api_key or not all("\x21" <= c <= "\x7e" for c in api_key):
        raise BadRequestError("api_key must be non-empty visible ASCII, without whitespace")
    return _AUTHORIZATION, b"Bearer " + api_key.encode()


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
    api_key: str | None = None,
    authorization: Header | None = None,
    extra_body: Mapping[str, Any] | None = None,
) -> Prepared:
    """Validate and encode a request; raise ValueError on bad values or conflicting headers.

    A caller's header that could break the shared connection raises BadRequestError (see
    :func:`caller_headers`). A caller's own header that names a contract header must agree with
    what the arguments say, so the routing key and the key the replica accounts under can never
    differ. ``api_key`` is this request's key; without one, ``authorization`` (the client's own,
    from :func:`bearer`) is sent, if any.
    """
    pairs, contract_fields = _contract_headers(
        session, tenant, priority, deadline_ms, count_prompt_tokens(prompt), max_tokens
    )
    body = request_body(prompt, max_tokens, seed, chat, model, extra_body)
    encoded = [*contract_fields, (_REQUEST_ID, request_id.encode())]
    if headers:
        checked = caller_headers(tuple(headers.items()))
        if checked.contract:
            built = dict(pairs)
            for key, value in checked.contract:
                if built.get(key) != value:
                    raise ValueError(
                        f"header {key}={value!r} conflicts with the request's "
                        f"{key}={built.get(key)!r}; pass it as an argument instead"
                    )
        encoded += checked.extra
    if api_key is not None:
        authorization = bearer(api_key)
    if authorization is not None:
        encoded.append(authorization)
    encoded.append((b"content-length", str(len(body)).encode()))
    path = b"/v1/chat/completions" if chat else b"/v1/completions"
    return Prepared(path, encoded, body, chat, request_id, deadline_ms)


class RequestFields(TypedDict, total=False):
    """The keyword arguments of every client's ``stream``, ``submit`` and ``complete``.

    One list for all of them: ``prompt`` and the contract's fields (defaults as in
    :func:`prepare`), ``seed``, ``chat``, ``headers`` for extra request headers, and ``api_key``
    for this request's key in place of the client's (a loader sending each tenant's own).
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
    api_key: str | None


class RequestIssuer:
    """Gives each request of one client a unique id and encodes it once, for either transport.

    ``api_key`` is the client's key, checked here once and sent on every request that does not
    name its own.
    """

    def __init__(
        self,
        tag: str,
        model: str | None,
        extra_body: Mapping[str, Any] | None = None,
        api_key: str | None = None,
    ) -> None:
        self._ids = itertools.count()
        self._prefix = f"{tag}{os.getpid():x}-{id(self) & 0xFFFFFF:x}-"
        self.model = model
        self.extra_body = check_extra_body(extra_body)
        self._authorization = None if api_key is None else bearer(api_key)

    def __call__(self, fields: RequestFields) -> Prepared:
        """Raises ValueError for bad values (and TypeError for unknown fields) at once."""
        return prepare(
            request_id=f"{self._prefix}{next(self._ids)}",
            model=self.model,
            extra_body=self.extra_body,
            authorization=self._authorization,
            **fields,
        )
