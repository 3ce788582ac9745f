"""The header contract and error codes: the one module the server, SDK, baseline and loaders use.

Everything here is pure (no IO) so it can be tested without sockets and imported anywhere.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Final

import orjson

# Priority classes, most urgent first (the scheduler orders on these numbers).
PRIORITY_HIGH: Final = 0
PRIORITY_NORMAL: Final = 1
PRIORITY_LOW: Final = 2

SESSION: Final = "zl-session"
TENANT: Final = "zl-tenant"
PRIORITY: Final = "zl-priority"
DEADLINE_MS: Final = "zl-deadline-ms"
PROMPT_TOKENS: Final = "zl-prompt-tokens"
MAX_TOKENS: Final = "zl-max-tokens"
ERROR: Final = "zl-error"
RETRY_AFTER_MS: Final = "retry-after-ms"
REQUEST_ID: Final = "zl-request-id"
# How many engine replicas a layer that retries for its clients tried for a request (the
# orchestrator's answer, success or error); the zero-layer SDK counts its own retries.
ATTEMPTS: Final = "zl-attempts"

_JSON: Final = (b"content-type", b"application/json")
_ERROR: Final = ERROR.encode()
_RETRY_AFTER_MS: Final = RETRY_AFTER_MS.encode()
_REQUEST_ID: Final = REQUEST_ID.encode()

CONTRACT_HEADERS: Final = (SESSION, TENANT, PRIORITY, DEADLINE_MS, PROMPT_TOKENS, MAX_TOKENS)

PRIORITIES: Final[Mapping[str, int]] = {
    "high": PRIORITY_HIGH,
    "normal": PRIORITY_NORMAL,
    "low": PRIORITY_LOW,
}

MAX_KEY_LEN: Final = 256
MAX_DEADLINE_MS: Final = 3_600_000
MAX_PROMPT_TOKENS: Final = 1_048_576
MAX_OUTPUT_TOKENS: Final = 65_536
DEFAULT_DEADLINE_MS: Final = 60_000
DEFAULT_MAX_TOKENS: Final = 16


# The ``type`` of an error object by HTTP status: the names OpenAI's clients give these statuses
# (vLLM's server answers a refused parameter as ``BadRequestError`` too).
ERROR_TYPES: Final[Mapping[int, str]] = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    409: "ConflictError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
}


@dataclass(frozen=True, slots=True)
class ErrorCode:
    """A machine-readable error: its ``zl-error`` value, HTTP status, and whether retrying helps."""

    code: str
    status: int
    retryable: bool

    @property
    def kind(self) -> str:
        """The error object's ``type``: OpenAI's name for the status."""
        if self.status >= 500:
            return "InternalServerError"
        return ERROR_TYPES.get(self.status, HTTPStatus(self.status).phrase)


KV_EXHAUSTED: Final = ErrorCode("kv_exhausted", 503, True)
QUEUE_FULL: Final = ErrorCode("queue_full", 429, True)
DEADLINE_EXCEEDED: Final = ErrorCode("deadline_exceeded", 504, False)
BAD_REQUEST: Final = ErrorCode("bad_request", 400, False)
# A field of vLLM's schema set to a value no engine here can honour (tools, n > 1, ...).
UNSUPPORTED_PARAMETER: Final = ErrorCode("unsupported_parameter", 400, False)
PROMPT_TOO_LONG: Final = ErrorCode("prompt_too_long", 400, False)
PAYLOAD_TOO_LARGE: Final = ErrorCode("payload_too_large", 413, False)
NOT_FOUND: Final = ErrorCode("not_found", 404, False)
METHOD_NOT_ALLOWED: Final = ErrorCode("method_not_allowed", 405, False)
BUDGET_EXCEEDED: Final = ErrorCode("budget_exceeded", 429, True)
ENGINE_DOWN: Final = ErrorCode("engine_down", 503, True)
DRAINING: Final = ErrorCode("draining", 503, True)
UPSTREAM_FAILED: Final = ErrorCode("upstream_failed", 502, False)
# The model the request names is not one this replica serves (vLLM answers 404 too).
MODEL_NOT_FOUND: Final = ErrorCode("model_not_found", 404, False)
# The client read nothing of its response for the replica's send_stall_s: the stream is reset and
# the engine request aborted. Only ever seen in accounting (the client is not reading).
SEND_STALLED: Final = ErrorCode("send_stalled", 408, False)
# A request whose headers or body did not arrive within the replica's timeouts.
REQUEST_TIMEOUT: Final = ErrorCode("request_timeout", 408, False)
# A header block (or a zl-request-id) over the replica's limits.
HEADERS_TOO_LARGE: Final = ErrorCode("headers_too_large", 431, False)
# The connection's memory budget (bodies in progress, unread output) is spent; retry elsewhere.
OVERLOADED: Final = ErrorCode("overloaded", 503, True)
# Authentication (server/auth.py): no or an unknown API key; a zl-tenant other than the key's; a
# zl-priority above what the key allows.
UNAUTHORIZED: Final = ErrorCode("unauthorized", 401, False)
TENANT_MISMATCH: Final = ErrorCode("tenant_mismatch", 403, False)
PRIORITY_NOT_ALLOWED: Final = ErrorCode("priority_not_allowed", 403, False)

ERRORS: Final[Mapping[str, ErrorCode]] = {
    e.code: e
    for e in (
        KV_EXHAUSTED,
        QUEUE_FULL,
        DEADLINE_EXCEEDED,
        BAD_REQUEST,
        UNSUPPORTED_PARAMETER,
        PROMPT_TOO_LONG,
        PAYLOAD_TOO_LARGE,
        NOT_FOUND,
        METHOD_NOT_ALLOWED,
        BUDGET_EXCEEDED,
        ENGINE_DOWN,
        DRAINING,
        UPSTREAM_FAILED,
        MODEL_NOT_FOUND,
        SEND_STALLED,
        REQUEST_TIMEOUT,
        HEADERS_TOO_LARGE,
        OVERLOADED,
        UNAUTHORIZED,
        TENANT_MISMATCH,
        PRIORITY_NOT_ALLOWED,
    )
}


class ContractError(ValueError):
    """A request that breaks the contract; carries the error code to answer with."""

    def __init__(
        self,
        error: ErrorCode,
        message: str,
        param: str | None = None,
        *,
        retry_after_ms: int | None = None,
    ) -> None:
        super().__init__(message)
        self.error = error
        self.message = message
        self.param = param
        self.retry_after_ms = retry_after_ms


@dataclass(frozen=True, slots=True)
class RequestMeta:
    """What the contract headers say about a request: all an admission decision needs."""

    session: str
    tenant: str
    priority: int
    deadline_ms: int
    prompt_tokens: int | None
    max_tokens: int | None


def _text(value: bytes | str) -> str:
    return value.decode("latin-1") if isinstance(value, bytes) else value


def _bounded_int(name: str, raw: str, low: int, high: int) -> int:
    if not raw.isdigit() or len(raw) > 10:
        raise ContractError(BAD_REQUEST, f"header {name} must be an integer, got {raw!r}")
    value = int(raw)
    if not low <= value <= high:
        raise ContractError(BAD_REQUEST, f"header {name}={value} is outside [{low}, {high}]")
    return value


def _key(name: str, raw: str) -> str:
    if len(raw) > MAX_KEY_LEN or not raw.isprintable():
        raise ContractError(BAD_REQUEST, f"header {name} must be printable, <= {MAX_KEY_LEN} chars")
    return raw


def parse_headers(headers: Iterable[tuple[bytes | str, bytes | str]]) -> RequestMeta:
    """Read the contract headers (any case, bytes or str); raise ContractError on bad values.

    Headers that are absent get defaults; ``zl-prompt-tokens`` and ``zl-max-tokens`` stay None
    when absent, which tells the server to take the cost from the body instead.
    """
    found: dict[str, str] = {}
    for name, value in headers:
        key = _text(name).lower()
        if key.startswith("zl-"):
            found[key] = _text(value).strip()
    priority_raw = found.get(PRIORITY, "normal")
    if priority_raw not in PRIORITIES:
        raise ContractError(
            BAD_REQUEST, f"header {PRIORITY} must be one of high, normal, low; got {priority_raw!r}"
        )
    prompt = found.get(PROMPT_TOKENS)
    max_tokens = found.get(MAX_TOKENS)
    deadline = found.get(DEADLINE_MS)
    return RequestMeta(
        session=_key(SESSION, found.get(SESSION, "")),
        tenant=_key(TENANT, found.get(TENANT, "default")),
        priority=PRIORITIES[priority_raw],
        deadline_ms=(
            DEFAULT_DEADLINE_MS
            if deadline is None
            else _bounded_int(DEADLINE_MS, deadline, 1, MAX_DEADLINE_MS)
        ),
        prompt_tokens=(
            None if prompt is None else _bounded_int(PROMPT_TOKENS, prompt, 1, MAX_PROMPT_TOKENS)
        ),
        max_tokens=(
            None
            if max_tokens is None
            else _bounded_int(MAX_TOKENS, max_tokens, 1, MAX_OUTPUT_TOKENS)
        ),
    )


def build_headers(
    *,
    session: str = "",
    tenant: str = "default",
    priority: str = "normal",
    deadline_ms: int = DEFAULT_DEADLINE_MS,
    prompt_tokens: int | None = None,
    max_tokens: int | None = None,
) -> list[tuple[str, str]]:
    """The contract headers for a request, validated by the same rules the server applies."""
    pairs = [(TENANT, tenant), (PRIORITY, priority), (DEADLINE_MS, str(deadline_ms))]
    if session:
        pairs.insert(0, (SESSION, session))
    if prompt_tokens is not None:
        pairs.append((PROMPT_TOKENS, str(prompt_tokens)))
    if max_tokens is not None:
        pairs.append((MAX_TOKENS, str(max_tokens)))
    try:
        parse_headers(pairs)
    except ContractError as exc:
        raise ValueError(str(exc)) from exc
    return pairs


def error_body(error: ErrorCode, message: str, param: str | None = None) -> bytes:
    """The JSON body of an error response: OpenAI's error object (``message``, ``type``,
    ``param``, ``code``) with our machine-readable code."""
    return orjson.dumps(
        {"error": {"message": message, "type": error.kind, "param": param, "code": error.code}}
    )


def error_headers(
    error: ErrorCode, request_id: bytes | None = None, retry_after_ms: int | None = None
) -> list[tuple[bytes, bytes]]:
    """Response headers for an error (not ``:status``): JSON content type, ``zl-error``, maybe a
    retry hint and the request id; bytes, as the replica writes them."""
    headers = [_JSON, (_ERROR, error.code.encode())]
    if retry_after_ms is not None:
        headers.append((_RETRY_AFTER_MS, str(retry_after_ms).encode()))
    if request_id is not None:
        headers.append((_REQUEST_ID, request_id))
    return headers
