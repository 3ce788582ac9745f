"""The orchestrator ingress deployment: the per-request work of a production middle layer.

Per request: authenticate the tenant when given a key file (the same file and checks as the
zero-layer replica's ``--api-keys``, ``serving.auth``), parse and validate the header
contract and the OpenAI body, charge the (authenticated) tenant's token budget, wait in a bounded
FIFO, route to an engine replica by ``zl-session`` (Serve's router picks the replica), retry
before the first token with jittered backoff, stream SSE back, and write one log line.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from typing import Any, Final, cast

from ray import serve
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from baselines.rayserve.admission import FifoGate, TokenBuckets
from baselines.rayserve.items import ChunkItem, EngineItem, ErrorItem
from serving.auth import Authenticator, Grant
from serving.wire.contract import (
    ATTEMPTS,
    DEADLINE_EXCEEDED,
    ENGINE_DOWN,
    ERRORS,
    METHOD_NOT_ALLOWED,
    NOT_FOUND,
    PAYLOAD_TOO_LARGE,
    REQUEST_ID,
    UPSTREAM_FAILED,
    ContractError,
    ErrorCode,
    RequestMeta,
    error_body,
    error_headers,
    parse_headers,
)
from serving.wire.openai import (
    CHAT,
    COMPLETIONS,
    Answer,
    Body,
    error_event,
    fingerprint,
    models_body,
    parse_body,
    usage,
)

PATHS: Final = {"/v1/completions": COMPLETIONS, "/v1/chat/completions": CHAT}
RETRYABLE: Final = (RayActorError, BackPressureError, DeploymentUnavailableError)
SSE_HEADERS: Final = {"cache-control": "no-cache"}
log = logging.getLogger("ray.serve")


class RoutedError(ContractError):
    """A request that failed after ``attempts`` routed calls to the engines: its answer says
    ``zl-attempts`` as a success's does, so a client counts the orchestrator's retries."""

    def __init__(self, cause: ContractError, attempts: int) -> None:
        super().__init__(
            cause.error, cause.message, cause.param, retry_after_ms=cause.retry_after_ms
        )
        self.attempts = attempts


def error_response(exc: ContractError, request_id: str) -> Response:
    """The contract's error response: status, ``zl-error``, maybe ``retry-after-ms`` and
    ``zl-attempts``, JSON."""
    pairs = error_headers(exc.error, request_id.encode(), exc.retry_after_ms)
    headers = {name.decode(): value.decode() for name, value in pairs}
    if isinstance(exc, RoutedError):
        headers[ATTEMPTS] = str(exc.attempts)
    return Response(error_body(exc.error, exc.message, exc.param), exc.error.status, headers)


def _authorization(request: Request) -> bytes | None:
    """The raw ``authorization`` header, as the replica's authenticator takes it."""
    value = request.headers.get("authorization")
    return None if value is None else value.encode("latin-1")


class _Attempt:
    """One routed call to the engines: its stream of item batches (the engine replica's
    batching interval), its first item, fetched with retries, and the rest of the batch it came
    in."""

    __slots__ = ("attempts", "first", "pending", "stream")

    def __init__(
        self,
        stream: DeploymentResponseGenerator,
        first: ChunkItem,
        pending: deque[EngineItem],
        attempts: int,
    ) -> None:
        self.stream = stream
        self.first = first
        self.pending = pending
        self.attempts = attempts

    async def next_item(self, timeout_s: float) -> EngineItem:
        """The next item: the rest of the last batch first, then the next batch's."""
        if not self.pending:
            self.pending.extend(await asyncio.wait_for(self.stream.__anext__(), timeout_s))
        return self.pending.popleft()


class _Outcome:
    """How one response ended, for the non-streaming answer and the log line."""

    __slots__ = ("failure", "usage")

    def __init__(self) -> None:
        self.usage: dict[str, int] = usage(0, 0)
        self.failure: ContractError | None = None


class Orchestrator:
    """The ingress deployment's class (see module docstring)."""

    def __init__(self, engine: DeploymentHandle, settings: dict[str, Any]) -> None:
        self.engine = engine
        self.model: str = settings["model"]
        self.fingerprint = fingerprint(settings["engine"])
        self.max_retries: int = settings["max_retries"]
        self.backoff_s: float = settings["retry_backoff_s"]
        self.max_body: int = settings["max_body_bytes"]
        budget = settings["default_budget"]
        self.budgets = TokenBuckets(
            (budget["rate"], budget["burst"]),
            {t: (b["rate"], b["burst"]) for t, b in settings["tenant_budgets"].items()},
        )
        self.gate = FifoGate(settings["inflight_limit"], settings["queue_limit"])
        grants = settings.get("api_keys")
        # None: zl-tenant and zl-priority are trusted as sent (local benchmarking).
        self.auth = (
            None
            if grants is None
            else Authenticator({digest: Grant(**grant) for digest, grant in grants.items()})
        )

    async def __call__(self, request: Request) -> Response:
        start = time.monotonic()
        request_id = request.headers.get(REQUEST_ID) or uuid.uuid4().hex
        path = request.url.path
        try:
            kind = PATHS.get(path)
            if kind is not None:
                if request.method != "POST":
                    raise ContractError(METHOD_NOT_ALLOWED, f"{path} takes POST")
                return await self._complete(request, kind, request_id, start)
            if request.method != "GET":
                raise ContractError(METHOD_NOT_ALLOWED, f"{path} takes GET")
            if path == "/v1/models":
                if self.auth is not None:  # every /v1 route needs credentials, as in vllm serve
                    self.auth.credentials(_authorization(request), None)
                return Response(models_body(self.model), 200, media_type="application/json")
            if path == "/health":
                return Response(
                    b'{"status":"ok","inflight":%d,"queued":%d}'
                    % (self.gate.inflight, self.gate.queued),
                    200,
                    media_type="application/json",
                )
            raise ContractError(NOT_FOUND, f"no route {path}")
        except ContractError as exc:
            tried = exc.attempts if isinstance(exc, RoutedError) else 0
            status, code = exc.error.status, exc.error.code
            self._log(request_id, path, None, status, code, start, None, 0, tried)
            return error_response(exc, request_id)

    async def _complete(
        self, request: Request, kind: str, request_id: str, start: float
    ) -> Response:
        meta = parse_headers(request.headers.items())
        if self.auth is not None:
            meta = self.auth.authorize(meta, _authorization(request), None)
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            raise ContractError(PAYLOAD_TOO_LARGE, f"body over {self.max_body} bytes")
        raw = await request.body()
        if len(raw) > self.max_body:
            raise ContractError(PAYLOAD_TOO_LARGE, f"body over {self.max_body} bytes")
        body = parse_body(kind, raw, meta)
        self.budgets.take(meta.tenant, body.prompt_tokens + body.max_tokens, time.monotonic())
        deadline = start + meta.deadline_ms / 1000
        await self.gate.acquire(max(0.0, deadline - time.monotonic()))
        slot_at = time.monotonic()
        try:
            attempt = await self._open(body, meta, request_id, deadline)
        except BaseException:
            self.gate.release(time.monotonic() - slot_at)
            raise
        model = body.model or self.model
        answer = Answer(kind, request_id, model, body, self.fingerprint)
        outcome = _Outcome()
        events = self._events(attempt, answer, outcome, meta, request_id, start, slot_at, deadline)
        headers = {REQUEST_ID: request_id, ATTEMPTS: str(attempt.attempts)}
        if body.stream:
            return StreamingResponse(
                events, 200, {**SSE_HEADERS, **headers}, media_type="text/event-stream"
            )
        whole = b"".join([part async for part in events])
        if outcome.failure is not None:
            return error_response(outcome.failure, request_id)
        return Response(whole, 200, headers, media_type="application/json")

    async def _open(
        self, body: Body, meta: RequestMeta, request_id: str, deadline: float
    ) -> _Attempt:
        """Route and fetch the first item; retry replica failures (never after a first token)."""
        session = meta.session or request_id
        payload = {
            "request_id": request_id,
            "prompt": body.prompt,  # as any orchestrator forwards it: the engine caches on it
            "prompt_tokens": body.prompt_tokens,
            "max_tokens": body.max_tokens,
            "seed": body.seed,
            "priority": meta.priority,
            "sampling": body.sampling,
            "logprobs": body.logprobs,
        }
        handle = self.engine.options(stream=True, session_id=session)
        last: BaseException | None = None
        for attempt in range(1, self.max_retries + 2):
            # A streaming handle (``stream=True``) always answers with a generator.
            # The session goes too, for the engine replica's request log (profile G).
            stream = cast(DeploymentResponseGenerator, handle.generate.remote(payload, session))
            try:
                batch = deque(
                    await asyncio.wait_for(stream.__anext__(), deadline - time.monotonic())
                )
            except TimeoutError:
                stream.cancel()
                failed = ContractError(DEADLINE_EXCEEDED, "deadline passed before the first token")
                raise RoutedError(failed, attempt) from None
            except RETRYABLE as exc:
                last = exc
                delay = self.backoff_s * 2 ** (attempt - 1) * random.uniform(0.5, 1.5)
                if time.monotonic() + delay >= deadline:
                    break
                await asyncio.sleep(delay)
                continue
            first = batch.popleft()
            if isinstance(first, ErrorItem):
                failed = ContractError(ERRORS.get(first.code, UPSTREAM_FAILED), first.message)
                raise RoutedError(failed, attempt)
            return _Attempt(stream, first, batch, attempt)
        message = f"no engine replica answered after {attempt} tries: {last!r}"
        raise RoutedError(ContractError(ENGINE_DOWN, message, retry_after_ms=1000), attempt)

    async def _events(
        self,
        attempt: _Attempt,
        answer: Answer,
        outcome: _Outcome,
        meta: RequestMeta,
        request_id: str,
        start: float,
        slot_at: float,
        deadline: float,
    ) -> AsyncIterator[bytes]:
        """The SSE events of one request; releases its FIFO slot and logs when it ends."""
        ttft = time.monotonic() - start
        item: ChunkItem | None = attempt.first
        try:
            while item is not None:
                text, _, finish, prompt_tokens, completion_tokens, logprobs = item
                out = answer.step(text, finish, prompt_tokens, completion_tokens, logprobs)
                outcome.usage = answer.usage
                if out:
                    yield out
                if answer.done:  # the last chunk, or a stop string (the stream is cancelled)
                    return
                item = await self._next(attempt, deadline, outcome)
            failure = outcome.failure
            if failure is not None:
                yield error_event(failure.error, failure.message)
        finally:
            attempt.stream.cancel()
            self.gate.release(time.monotonic() - slot_at)
            failure = outcome.failure
            self._log(
                request_id,
                CHAT if answer.framer.chat else COMPLETIONS,
                meta,
                200 if failure is None else failure.error.status,
                "ok" if failure is None else failure.error.code,
                start,
                ttft,
                outcome.usage["completion_tokens"],
                attempt.attempts,
            )

    @staticmethod
    async def _next(attempt: _Attempt, deadline: float, outcome: _Outcome) -> ChunkItem | None:
        """The next engine chunk; None after recording in ``outcome`` a failure after the first
        token (never retried)."""
        error: ErrorCode
        try:
            item = await attempt.next_item(deadline - time.monotonic())
        except TimeoutError:
            error, message = DEADLINE_EXCEEDED, "deadline passed mid-stream"
        except RETRYABLE as exc:
            error, message = ENGINE_DOWN, f"engine replica lost mid-stream: {exc!r}"
        except StopAsyncIteration:
            error, message = UPSTREAM_FAILED, "engine stream ended without a finish reason"
        else:
            if not isinstance(item, ErrorItem):
                return item
            error, message = ERRORS.get(item.code, UPSTREAM_FAILED), item.message
        outcome.failure = ContractError(error, message)
        return None

    def _log(
        self,
        request_id: str,
        path: str,
        meta: RequestMeta | None,
        status: int,
        code: str,
        start: float,
        ttft: float | None,
        tokens: int,
        attempts: int,
    ) -> None:
        """One line per request, the access log every production gateway writes."""
        log.info(
            "zl-request id=%s path=%s tenant=%s session=%s status=%d code=%s ttft_ms=%s "
            "e2e_ms=%.2f tokens=%d attempts=%d inflight=%d queued=%d",
            request_id,
            path,
            meta.tenant if meta else "-",
            meta.session if meta else "-",
            status,
            code,
            f"{ttft * 1000:.2f}" if ttft is not None else "-",
            (time.monotonic() - start) * 1000,
            tokens,
            attempts,
            self.gate.inflight,
            self.gate.queued,
        )


def ingress_deployment() -> serve.Deployment:
    """The undecorated class as a Serve deployment (options are applied by the stand-up)."""
    return serve.deployment(name="Orchestrator")(Orchestrator)
