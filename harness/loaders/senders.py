"""How the native loader sends one request (a ``Sender``): straight into an engine in-process
(``engine_sender``), or through a zero-layer client (``client_sender``), whose timing record
becomes the request's record (``copy_timing``).

A Sender's async ``send`` runs in one task per request; its ``submit``, where the client has a
callback API (the SDK's ``ZeroLayerClient.submit``), is called synchronously from the dispatcher
and reports back through a callback, so a request costs no task of the loader's own.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, TypedDict

from harness.loaders.base import RequestFailed
from harness.schema import Outcome, RequestRecord
from harness.workload import PlannedRequest
from serving.engine import Engine, EngineError, EngineRequest
from zerolayer.client import Http1Client, Timing, ZeroLayerClient, ZeroLayerError

if TYPE_CHECKING:
    from harness.stacks import Credentials, Http1Router

SendFn = Callable[[PlannedRequest, RequestRecord], Awaitable[None]]
# submit(request, record, done): start the request now; done(record) once it has ended.
SubmitFn = Callable[[PlannedRequest, RequestRecord, Callable[[RequestRecord], None]], None]


@dataclass(frozen=True, slots=True)
class Sender:
    """How ``run_schedule`` starts a request: ``send`` (async, one task per request) and, where
    the client has a callback API, ``submit`` (called synchronously, no task of our own)."""

    send: SendFn
    submit: SubmitFn | None = None


def engine_sender(engine: Engine) -> SendFn:
    """Send straight into an engine in-process: the no-network reference for 'where time goes'."""

    async def send(req: PlannedRequest, rec: RequestRecord) -> None:
        now = time.time_ns
        rec.sent_ns = now()
        ereq = EngineRequest(
            req.request_id, req.prompt_tokens, req.max_tokens, req.seed, prompt=req.prompt()
        )
        try:
            async for chunk in engine.generate(ereq):
                if chunk.token_ids:
                    t = now()
                    if not rec.first_token_ns:
                        rec.first_token_ns = t
                    rec.chunk_ns.append(t)
                    rec.output_tokens += len(chunk.token_ids)
        except EngineError as exc:
            raise RequestFailed(exc.code) from exc
        rec.end_ns = now()
        rec.outcome = "completed"

    return send


# The SDK's outcome names are the schema's; this checks them (a KeyError names a new one).
_OUTCOMES: Final[Mapping[str, Outcome]] = {
    "completed": "completed",
    "error": "error",
    "lost": "lost",
}


def copy_timing(timing: Timing, rec: RequestRecord, tokens: int) -> None:
    """Move an SDK timing record into our RequestRecord (the SDK and the schema share names)."""
    rec.sent_ns = timing.sent_ns
    rec.first_token_ns = timing.first_token_ns
    rec.end_ns = timing.end_ns
    rec.chunk_ns = list(timing.chunk_ns)
    rec.http_status = timing.status
    rec.retries = timing.retries
    rec.attempts = timing.attempts
    rec.replica = timing.replica
    rec.output_tokens = timing.output_tokens or tokens
    rec.error_code = timing.error_code
    rec.outcome = _OUTCOMES[timing.outcome]
    rec.refused_ns = timing.refused_ns if rec.outcome == "error" else 0


class _RequestArgs(TypedDict):
    """What both zero-layer clients' ``stream`` and the SDK's ``submit`` take of a request."""

    prompt: str
    max_tokens: int
    session: str
    tenant: str
    priority: str
    deadline_ms: int
    seed: int
    api_key: str | None


def _request_args(req: PlannedRequest, keys: Mapping[str, str]) -> _RequestArgs:
    """``req`` as the client's arguments, with its tenant's API key where there is one."""
    return {
        "prompt": req.prompt(),
        "max_tokens": req.max_tokens,
        "session": req.session,
        "tenant": req.tenant,
        "priority": req.priority,
        "deadline_ms": req.deadline_ms,
        "seed": req.seed,
        "api_key": keys.get(req.tenant),
    }


def client_sender(
    client: ZeroLayerClient | Http1Client | Http1Router, credentials: Credentials | None = None
) -> Sender:
    """Send through a zero-layer client (``ZeroLayerClient`` over HTTP/2 or ``Http1Client``),
    each request with its tenant's API key when the stack has ``credentials`` (else the client's
    own, if any).

    Both clients expose ``stream(prompt=..., ...)`` with a ``timing`` record and raise
    ``ZeroLayerError`` (which carries the timing) when a request does not complete. The SDK's
    callback API (``ZeroLayerClient.submit``) becomes the Sender's ``submit``, which
    ``run_schedule`` prefers: no task per request.
    """
    keys: Mapping[str, str] = {} if credentials is None else credentials.keys

    async def send(req: PlannedRequest, rec: RequestRecord) -> None:
        stream = client.stream(**_request_args(req, keys))
        tokens = 0
        try:
            async with stream as s:
                async for chunk in s:
                    tokens += chunk.tokens
        except ZeroLayerError:
            pass
        copy_timing(stream.timing, rec, tokens)

    if not isinstance(client, ZeroLayerClient):
        return Sender(send)
    client_submit = client.submit

    def submit(
        req: PlannedRequest, rec: RequestRecord, done: Callable[[RequestRecord], None]
    ) -> None:
        def on_done(timing: Timing, tokens: int) -> None:
            copy_timing(timing, rec, tokens)
            done(rec)

        client_submit(on_done, **_request_args(req, keys))

    return Sender(send, submit)
