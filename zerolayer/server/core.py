"""The replica's request handling, independent of the wire: routing, admission, the engine run.

A protocol (HTTP/2 or HTTP/1.1) hands :meth:`ReplicaCore.on_request` a *sink* for each request, the
headers, and then the body as it arrives; everything after that talks to the sink only:

- ``respond(status, headers, body)``: a whole response; a sink whose request body is not
  finished also tells the client to stop uploading (HTTP/2: RST_STREAM(NO_ERROR) after it);
- ``start(status, headers)``, ``write(data)``, ``end(data)``: a streamed response;
- ``cancel()``: abandon the response now (HTTP/2: RST_STREAM(CANCEL));
- ``open_window(n)``: let the client upload ``n`` more body bytes (HTTP/2 flow control);
- ``writable()``: backpressure. While a client does not read, its response waits in a bounded
  buffer and the replica stops pulling tokens from the engine for it; after the limits'
  ``send_stall_s`` with no progress the stream is reset and the engine request aborted.

Admission is decided on the headers: when ``zl-prompt-tokens`` and ``zl-max-tokens`` are there,
the scheduler decides completely before a byte of body is read; without them it refuses on the
load already there, and decides again on the body's cost. A refusal is answered at once.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections import Counter
from functools import lru_cache
from typing import Final, NamedTuple, Protocol

from serving.auth import Authenticator
from serving.engine.kv import blocks_for
from serving.engine.types import (
    Engine,
    EngineError,
    EngineRequest,
    TokenChunk,
    token_counter,
)
from serving.wire import contract, openai
from serving.wire.contract import (
    BAD_REQUEST,
    DEADLINE_EXCEEDED,
    DRAINING,
    ENGINE_DOWN,
    ERRORS,
    METHOD_NOT_ALLOWED,
    MODEL_NOT_FOUND,
    NOT_FOUND,
    PAYLOAD_TOO_LARGE,
    SEND_STALLED,
    ContractError,
    ErrorCode,
    RequestMeta,
    error_headers,
)
from serving.wire.openai import CHAT, COMPLETIONS, Answer, Body
from zerolayer.accounting import CANCELLED, COMPLETED, ERROR, Accounting
from zerolayer.scheduler import (
    AdmissionQueue,
    QueueEntry,
    SchedulerConfig,
    decide,
    engine_has_room,
)
from zerolayer.server import status
from zerolayer.server.eager import start_eager
from zerolayer.server.lifecycle import CallEvent, Lifecycle
from zerolayer.server.limits import DEFAULT_LIMITS, Limits

log = logging.getLogger("zerolayer.server")

DEFAULT_MAX_BODY_BYTES: Final = 4 << 20
PUMP_INTERVAL_S: Final = 0.005

JSON: Final = (b"content-type", b"application/json")
SSE_HEADERS: Final = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
_REQUEST_ID: Final = contract.REQUEST_ID.encode()

# Routes: path -> (method, handler name). Generation routes take a body; the rest are GETs.
ROUTES: Final = {
    b"/v1/completions": (b"POST", COMPLETIONS),
    b"/v1/chat/completions": (b"POST", CHAT),
    b"/v1/models": (b"GET", "models"),
    b"/health": (b"GET", "health"),
    b"/metrics": (b"GET", "metrics"),
}
# The routes answered on their headers alone, from the replica's own state.
GET_ROUTES: Final = frozenset(kind for method, kind in ROUTES.values() if method == b"GET")


class Sink(Protocol):
    """What a protocol gives the replica for one request; see the module docstring."""

    def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None: ...
    def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None: ...
    def write(self, data: bytes) -> None: ...
    def end(self, data: bytes) -> None: ...
    def cancel(self) -> None: ...
    def open_window(self, size: int) -> None: ...
    def writable(self) -> asyncio.Future[None] | None:
        """None while the response's unsent output is under its bound; else a future that is
        done once the client has read it back under (or the stream is gone)."""
        ...


@lru_cache(maxsize=4096)
def _request_meta(fields: tuple[tuple[bytes, bytes], ...]) -> RequestMeta:
    """``contract.parse_headers``, cached: a session's contract headers repeat request after
    request. Only valid headers are cached (a ContractError is raised again every time), and
    RequestMeta is frozen, so requests can share one."""
    return contract.parse_headers(fields)


class RequestHead(NamedTuple):
    """What routing and admission read of a request's headers, in one pass over them.

    ``content_length`` is -1 when absent and -2 when not a number; ``zl`` holds the contract
    headers but the request id, which is read apart (it is no admission input)."""

    method: bytes
    path: bytes
    content_length: int
    zl: list[tuple[bytes, bytes]]
    request_id: bytes | None
    authorization: bytes | None


def read_head(headers: list[tuple[bytes, bytes]]) -> RequestHead:
    """One pass over a request's headers for what the replica reads of them."""
    method = path = b""
    content_length = -1
    zl: list[tuple[bytes, bytes]] = []
    request_id: bytes | None = None
    authorization: bytes | None = None
    for name, value in headers:
        if name[0] == 58:  # b":"
            if name == b":method":
                method = value
            elif name == b":path":
                path = value
        elif name[:3] == b"zl-":
            if name == _REQUEST_ID:
                request_id = value
            else:
                zl.append((name, value))
        elif name == b"content-length":
            content_length = int(value) if value.isdigit() else -2
        elif name == b"authorization":
            authorization = value
    return RequestHead(method, path, content_length, zl, request_id, authorization)


class Call(Lifecycle):
    """One generation request from its headers to its last byte; its state moves only through
    the lifecycle's table (``lifecycle.TRANSITIONS``)."""

    __slots__ = ("answer", "blocks", "body", "body_len", "completion_tokens", "deadline_at",
                 "engine_id", "id_headers", "kind", "launched", "max_body", "meta", "parts",
                 "promised", "prompt_tokens", "queue_entry", "replica", "request_id", "sink",
                 "start_ns", "started", "task", "timer")  # fmt: skip

    def __init__(
        self,
        replica: ReplicaCore,
        sink: Sink,
        kind: str,
        meta: RequestMeta,
        request_id: str,
        max_body: int,
        echo_id: bool,
    ) -> None:
        super().__init__()
        self.replica = replica
        self.sink = sink
        self.kind = kind
        self.meta = meta
        self.request_id = request_id
        # A client that named its request knows the id: echo only the ones the replica made up.
        self.id_headers = [(_REQUEST_ID, request_id.encode())] if echo_id else []
        self.engine_id = ""
        self.max_body = max_body
        self.parts: list[bytes] = []
        self.body_len = 0
        self.body: Body | None = None
        self.answer: Answer | None = None
        self.prompt_tokens = meta.prompt_tokens or 0
        self.completion_tokens = 0
        self.blocks = 0
        # KV blocks its headers said it needs, promised from admission until it is dispatched.
        self.promised = 0
        self.started = False
        self.launched = False
        self.task: asyncio.Task[None] | None = None
        self.queue_entry: QueueEntry[Call] | None = None
        self.start_ns = time.time_ns()
        loop = replica.loop
        self.deadline_at = loop.time() + meta.deadline_ms / 1000.0
        self.timer: asyncio.TimerHandle | None = loop.call_at(self.deadline_at, self.on_deadline)

    # -- the request body ---------------------------------------------------------------------

    def on_data(self, data: bytes) -> None:
        if not self.accepts_data:
            return
        self.body_len += len(data)
        if self.body_len > self.max_body:
            self.refuse(PAYLOAD_TOO_LARGE, f"request body exceeds {self.max_body} bytes")
            return
        self.parts.append(data)

    def on_end(self) -> None:
        """The body is complete: parse it once, admit on its cost, run or queue."""
        if not self.accepts_data:
            return
        replica = self.replica
        raw = self.parts[0] if len(self.parts) == 1 else b"".join(self.parts)
        self.parts = []
        meta = self.meta
        try:
            body = openai.parse_body(self.kind, raw, meta)
        except ContractError as exc:
            self.refuse(exc.error, exc.message, param=exc.param)
            return
        if body.ignored:
            log.debug("ignored fields outside vLLM's schema: %s", ", ".join(body.ignored))
        if body.model and body.model not in replica.models:
            self.refuse(MODEL_NOT_FOUND, f"the model {body.model!r} is not served here")
            return
        if replica.count_tokens is not None:
            body.prompt_tokens = replica.count_tokens(body.prompt) or body.prompt_tokens
        self.body = body
        self.prompt_tokens = body.prompt_tokens
        if meta.prompt_tokens is None or meta.max_tokens is None:
            decision = decide(
                meta,
                replica.engine.stats(),
                replica.queue.state,
                replica.config,
                prompt_tokens=body.prompt_tokens,
                max_tokens=body.max_tokens,
            )
            if decision.error is not None:
                self.refuse(decision.error, decision.message, decision.retry_after_ms)
                return
        model = body.model or replica.model
        self.answer = Answer(self.kind, self.request_id, model, body, replica.fingerprint)
        replica.dispatch(self)

    # -- the engine run -----------------------------------------------------------------------

    def on_chunk(self, chunk: TokenChunk) -> None:
        self.completion_tokens = chunk.completion_tokens
        if chunk.prompt_tokens:
            self.prompt_tokens = chunk.prompt_tokens
        answer = self.answer
        assert answer is not None and self.body is not None
        if chunk.finish_reason == "abort":
            self.fail(ENGINE_DOWN, "the engine aborted the request")
            return
        out = answer.step(
            chunk.text,
            chunk.finish_reason,
            self.prompt_tokens,
            self.completion_tokens,
            chunk.logprobs,
        )
        if self.body.stream:
            if not self.started:
                self.started = True
                self.sink.start(200, [*SSE_HEADERS, *self.id_headers])
            if not answer.done:
                self.sink.write(out)
                return
            if chunk.finish_reason is None:  # a stop string ended it: the engine stops here
                self.stop()
            self.sink.end(out)
            self.finish(COMPLETED)
        elif answer.done:
            if chunk.finish_reason is None:
                self.stop()
            headers = [JSON, (b"content-length", str(len(out)).encode()), *self.id_headers]
            self.sink.respond(200, headers, out)
            self.finish(COMPLETED)

    def fail(self, error: ErrorCode, message: str, retry_after_ms: int | None = None) -> None:
        """End the request with an error: a whole error response if nothing was sent yet, else
        a final SSE error event and RST_STREAM(CANCEL)."""
        if not self.is_open:
            return
        if self.started:
            self.sink.write(openai.error_event(error, message))
            self.sink.cancel()
            self.replica.failures[error.code] += 1
            self.finish(ERROR, error.code)
        else:
            self.refuse(error, message, retry_after_ms)

    def refuse(
        self,
        error: ErrorCode,
        message: str,
        retry_after_ms: int | None = None,
        param: str | None = None,
    ) -> None:
        """Answer with an error before any output (the sink stops an unfinished upload)."""
        if not self.is_open:
            return
        self.sink.respond(
            error.status,
            error_headers(error, self.request_id.encode(), retry_after_ms),
            contract.error_body(error, message, param),
        )
        self.replica.refusals[error.code] += 1
        self.finish(ERROR, error.code)

    # -- endings ------------------------------------------------------------------------------

    def on_deadline(self) -> None:
        self.timer = None
        if self.is_open:
            self.stop()
            self.fail(DEADLINE_EXCEEDED, f"deadline of {self.meta.deadline_ms} ms expired")

    def on_reset(self) -> None:
        """The client reset the stream or the connection went away: stop the engine's work."""
        if self.is_open:
            self.stop()
            self.finish(CANCELLED)

    def stall(self) -> None:
        """The client read nothing for ``send_stall_s``: abort the engine request, reset the
        stream, account it as ``send_stalled``."""
        if not self.is_open:
            return
        self.stop()
        self.sink.cancel()
        self.replica.failures[SEND_STALLED.code] += 1
        self.finish(ERROR, SEND_STALLED.code)

    def stop(self) -> None:
        """Leave the queue or stop the engine run (the engine request is aborted)."""
        replica = self.replica
        if self.is_queued and self.queue_entry is not None:
            replica.queue.remove(self.queue_entry)
        elif self.is_running:
            if not self.launched:
                replica.mark_launched(self)
            task = self.task
            if task is not None and not task.done():
                task.cancel()
            replica.engine.abort(self.engine_id)

    def finish(self, outcome: str, error: str | None = None) -> None:
        if not self.is_open:
            return
        self.advance(CallEvent.FINISH)
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.replica.finished(self, outcome, error)


def served_models(engine: Engine, listed: str) -> frozenset[str]:
    """The model names a request may give: the one ``/v1/models`` lists, the engine's name, and
    for an engine loaded from a directory that path and its last component (as vLLM serves)."""
    names = {listed, engine.name}
    path = getattr(getattr(engine, "config", None), "model", None)
    if isinstance(path, str | os.PathLike) and str(path):
        names |= {str(path), os.path.basename(os.path.normpath(str(path)))}
    return frozenset(names)


class ReplicaCore:
    """One engine, its scheduler and its counters; shared by every connection of the server."""

    def __init__(
        self,
        engine: Engine,
        *,
        name: str = "replica",
        config: SchedulerConfig | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        accounting: Accounting | None = None,
        limits: Limits = DEFAULT_LIMITS,
        auth: Authenticator | None = None,
    ) -> None:
        self.engine = engine
        self.name = name
        self.model = str(getattr(getattr(engine, "config", None), "model_shape", engine.name))
        self.config = config or SchedulerConfig.for_engine(engine)
        self.max_body_bytes = max_body_bytes
        self.accounting = accounting or Accounting(replica=name, max_tenants=limits.max_tenants)
        self.limits = limits
        # None: every request is trusted as sent (local benchmarking); see server/auth.py.
        self.auth = auth
        self.loop = asyncio.get_running_loop()
        self.queue: AdmissionQueue[Call] = AdmissionQueue()
        self.draining = False
        self.active = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._ids = itertools.count(1)
        self._engine_ids = itertools.count(1)
        self._launching = 0
        self._launching_prefill = 0
        self._pump_timer: asyncio.TimerHandle | None = None
        self.refusals: Counter[str] = Counter()
        # Generation requests admitted on their headers, and the KV blocks their headers said
        # they need while their bodies are read (what the KV watch counts as taken in, promised).
        self.admitted = 0
        self.promised_blocks = 0
        self.failures: Counter[str] = Counter()
        self.outcomes: Counter[str] = Counter()
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.connections = 0
        # Connections closed at once for being past limits.connection_cap() (server/connection.py).
        self.refused_connections = 0
        self._models_body = openai.models_body(self.model)
        self.fingerprint = openai.fingerprint(engine.name)
        self.models = served_models(engine, self.model)
        self.block_size = engine.stats().block_size or 1
        # An engine with its own tokenizer counts prompt tokens itself (see TokenCounter);
        # None keeps the wire's four-bytes-a-token rule, with no call on the sim's hot path.
        self.count_tokens = token_counter(engine)

    # -- requests -----------------------------------------------------------------------------

    def on_request(
        self,
        sink: Sink,
        headers: list[tuple[bytes, bytes]],
        body_follows: bool,
        identity: str | None = None,
    ) -> Call | None:
        """Route one request from its headers; a Call when a body is to be read, else None.

        ``headers`` holds the pseudo-headers (``:method``, ``:path``) and the regular ones;
        ``identity`` is the tenant a verified client certificate names (mutual TLS), if any.
        """
        head = read_head(headers)
        path = head.path
        route = ROUTES.get(path)
        if route is None and b"?" in path:
            route = ROUTES.get(path.split(b"?", 1)[0])
        if route is None:
            self._refuse(sink, NOT_FOUND, f"no route for {path.decode('latin-1')}")
            return None
        if head.method != route[0]:
            message = f"{path.decode('latin-1')} takes {route[0].decode()}"
            self._refuse(sink, METHOD_NOT_ALLOWED, message)
            return None
        kind = route[1]
        if kind in GET_ROUTES:
            self._serve_get(sink, kind, head.authorization, identity)
            return None
        return self._admit(sink, kind, head, body_follows, identity)

    def _serve_get(
        self, sink: Sink, kind: str, authorization: bytes | None, identity: str | None
    ) -> None:
        """Answer ``/health``, ``/metrics`` or ``/v1/models`` (the last needs credentials, as
        every /v1 route does in vllm serve)."""
        if kind == "health":
            body = status.health_body(self)
            content_type = JSON
        elif kind == "metrics":
            body = status.metrics_text(self)
            content_type = (b"content-type", status.METRICS_TYPE)
        else:
            if self.auth is not None:
                try:
                    self.auth.credentials(authorization, identity)
                except ContractError as exc:
                    self._refuse(sink, exc.error, exc.message)
                    return
            body = self._models_body
            content_type = JSON
        sink.respond(200, [content_type, (b"content-length", str(len(body)).encode())], body)

    def _admit(
        self,
        sink: Sink,
        kind: str,
        head: RequestHead,
        body_follows: bool,
        identity: str | None,
    ) -> Call | None:
        """A generation request: check its id, contract headers and credentials, size and
        admission on the headers; the Call that reads its body, or None once refused."""
        request_id = head.request_id
        if request_id is not None and len(request_id) > self.limits.max_request_id_bytes:
            limit = self.limits.max_request_id_bytes
            self._refuse(sink, BAD_REQUEST, f"{contract.REQUEST_ID} is longer than {limit} bytes")
            return None
        rid = request_id.decode("latin-1") if request_id else f"{self.name}-{next(self._ids)}"
        if self.draining:
            self._refuse(sink, DRAINING, "the replica is draining", rid, retry_after_ms=0)
            return None
        try:
            meta = _request_meta(tuple(head.zl))
            if self.auth is not None:
                meta = self.auth.authorize(meta, head.authorization, identity)
        except ContractError as exc:
            self._refuse(sink, exc.error, exc.message, rid)
            return None
        content_length = head.content_length
        if content_length == -2:
            self._refuse(sink, BAD_REQUEST, "content-length is not a number", rid, None, meta)
            return None
        if content_length > self.max_body_bytes:
            message = f"request body exceeds {self.max_body_bytes} bytes"
            self._refuse(sink, PAYLOAD_TOO_LARGE, message, rid, None, meta)
            return None
        decision = decide(meta, self.engine.stats(), self.queue.state, self.config)
        if decision.error is not None:
            self._refuse(sink, decision.error, decision.message, rid, decision.retry_after_ms, meta)
            return None
        if not body_follows:
            self._refuse(sink, BAD_REQUEST, "the request has no body", rid, None, meta)
            return None
        call = Call(self, sink, kind, meta, rid, self.max_body_bytes, request_id is None)
        call.promised = blocks_for(
            (meta.prompt_tokens or 0) + (meta.max_tokens or 0), self.block_size
        )
        self.promised_blocks += call.promised
        self.admitted += 1
        self.active += 1
        self._idle.clear()
        sink.open_window(content_length if content_length >= 0 else self.max_body_bytes)
        return call

    def _refuse(
        self,
        sink: Sink,
        error: ErrorCode,
        message: str,
        request_id: str | None = None,
        retry_after_ms: int | None = None,
        meta: RequestMeta | None = None,
    ) -> None:
        """Answer an error on the headers alone; a generation request is also accounted."""
        self.refusals[error.code] += 1
        sink.respond(
            error.status,
            error_headers(error, request_id.encode() if request_id else None, retry_after_ms),
            contract.error_body(error, message),
        )
        if request_id is not None:
            now = time.time_ns()
            self.accounting.record(
                request_id,
                meta.tenant if meta else "",
                meta.session if meta else "",
                0,
                0,
                now,
                now,
                ERROR,
                error.code,
                meta.priority if meta else 1,
            )

    # -- dispatch to the engine -----------------------------------------------------------------

    def settle(self, call: Call) -> None:
        """The call's promise ends: it reaches the engine or the queue, or it ended first."""
        self.promised_blocks -= call.promised
        call.promised = 0

    def dispatch(self, call: Call) -> None:
        """Run the call now if the engine has room and nothing waits, else queue it in order."""
        self.settle(call)
        body = call.body
        assert body is not None
        if not self.queue and engine_has_room(
            self.engine.stats(), self.config, self._launching, self._launching_prefill
        ):
            self._start(call)
            return
        call.blocks = blocks_for(body.prompt_tokens + body.max_tokens, self.block_size)
        call.advance(CallEvent.QUEUE)
        call.queue_entry = self.queue.push(
            call, call.meta.priority, call.deadline_at, body.prompt_tokens, call.blocks
        )
        if self._pump_timer is None:
            self._pump_timer = self.loop.call_later(PUMP_INTERVAL_S, self._pump_tick)

    def _start(self, call: Call) -> None:
        call.advance(CallEvent.START)
        call.queue_entry = None
        call.engine_id = f"{self.name}:{next(self._engine_ids)}"
        self._launching += 1
        self._launching_prefill += call.prompt_tokens
        call.task = start_eager(self.loop, self._run(call))

    def mark_launched(self, call: Call) -> None:
        call.launched = True
        self._launching -= 1
        self._launching_prefill -= call.prompt_tokens

    def pump(self) -> None:
        """Start queued calls, in order, while the engine has room for them."""
        queue = self.queue
        engine = self.engine
        config = self.config
        while queue:
            if not engine_has_room(
                engine.stats(), config, self._launching, self._launching_prefill
            ):
                return
            call = queue.pop()
            if call is None:
                return
            self._start(call)

    def _pump_tick(self) -> None:
        self._pump_timer = None
        self.pump()
        if self.queue:
            self._pump_timer = self.loop.call_later(PUMP_INTERVAL_S, self._pump_tick)

    async def _run(self, call: Call) -> None:
        body = call.body
        assert body is not None
        self.mark_launched(call)
        request = EngineRequest(
            request_id=call.engine_id,
            prompt_tokens=body.prompt_tokens,
            max_tokens=body.max_tokens,
            seed=body.seed,
            priority=call.meta.priority,
            prompt=body.prompt,
            sampling=body.sampling,
            logprobs=body.logprobs,
        )
        queue = self.queue
        try:
            async for chunk in self.engine.generate(request):
                if not call.is_running:
                    return
                call.on_chunk(chunk)
                if queue:
                    self.pump()
                waiter = call.sink.writable()
                if waiter is not None and not await self._drained(call, waiter):
                    return
            if call.is_running:
                call.fail(ENGINE_DOWN, "the engine ended the stream without a finish reason")
        except asyncio.CancelledError:
            return
        except EngineError as exc:
            call.fail(ERRORS.get(exc.code, ENGINE_DOWN), str(exc))
        except Exception as exc:  # an engine bug must not take the connection down
            log.exception("engine failed on %s", call.request_id)
            call.fail(ENGINE_DOWN, f"engine error: {exc}")

    async def _drained(self, call: Call, waiter: asyncio.Future[None]) -> bool:
        """Wait (without pulling more tokens) until the client reads the call's output back
        under its bound; False, with the stream reset and the engine request aborted, when it
        reads nothing for ``send_stall_s`` or the call ended meanwhile."""
        try:
            await asyncio.wait_for(asyncio.shield(waiter), self.limits.send_stall_s or None)
        except TimeoutError:
            call.stall()
            return False
        return call.is_running

    def finished(self, call: Call, outcome: str, error: str | None) -> None:
        """Count and account a call that ended; tokens are those the client was sent."""
        self.settle(call)
        self.outcomes[outcome] += 1
        delivered = call.started or outcome == COMPLETED
        prompt = call.prompt_tokens if delivered else 0
        completion = call.completion_tokens if delivered else 0
        self.prompt_tokens_total += prompt
        self.generation_tokens_total += completion
        meta = call.meta
        self.accounting.record(
            call.request_id,
            meta.tenant,
            meta.session,
            prompt,
            completion,
            call.start_ns,
            time.time_ns(),
            outcome,
            error,
            meta.priority,
        )
        self.active -= 1
        if self.active == 0:
            self._idle.set()
        if self.queue:
            self.pump()

    # -- drain ----------------------------------------------------------------------------------

    async def drain(self, timeout: float | None = None) -> bool:
        """Refuse new requests with ``draining`` and wait for the admitted ones to finish;
        False if ``timeout`` passed first."""
        self.draining = True
        if self._idle.is_set():
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True
