"""A request driven by callbacks instead of a task: ``ZeroLayerClient.submit``.

A load generator sends thousands of requests a second and wants only each one's timing record,
not its chunks; a task, a deadline timer context and a future per request cost it more CPU than
the HTTP/2 work itself. A ``Submission`` sends at once when the replica's connection is up and
has a free stream slot (the usual case), hears about its response through ``Response.notify``,
retries before the first token on the same rules as ``Stream`` (next replica on the ring, up to
``max_retries``; never after the first token), and calls ``on_done(timing, tokens)`` exactly once.
Only the rare cases (no connection yet, the peer's stream limit reached) fall back to a task.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Callable, Iterator
from typing import Protocol

from zerolayer.client.h2conn import H2Connection
from zerolayer.client.replica import Replica, take_attempt
from zerolayer.client.stream import Response
from zerolayer.client.timing import CLIENT_TIMEOUT, CONNECTION_LOST, NO_REPLICA, Timing
from zerolayer.client.wire import MARK_DOWN, Prepared, ZeroLayerError

OnDone = Callable[[Timing, int], None]


class Router(Protocol):
    """What a submission needs of its client (``ZeroLayerClient``): retry budget and TLS."""

    max_retries: int
    connect_timeout_s: float
    tls: ssl.SSLContext | None
    # Tasks of submissions that had to wait for a connection or a stream slot.
    background: set[asyncio.Future[None]]


log = logging.getLogger("zerolayer.client")
_now = time.time_ns


class Submission:
    """One request from send to ``on_done`` (see the module docstring)."""

    __slots__ = ("_candidates", "_client", "_error", "_on_done", "_replica", "_req", "_resp",
                 "_timer", "ended", "timed_out", "timing")  # fmt: skip

    def __init__(
        self,
        client: Router,
        req: Prepared,
        candidates: Iterator[Replica],
        timing: Timing,
        on_done: OnDone,
        timeout_s: float,
    ) -> None:
        self._client = client
        self._req = req
        self._candidates = candidates
        self.timing = timing
        self._on_done = on_done
        self._error: ZeroLayerError | None = None
        self._replica: Replica | None = None
        self._resp: Response | None = None
        self.ended = False
        self.timed_out = False
        self._timer: asyncio.TimerHandle | None = asyncio.get_running_loop().call_later(
            timeout_s, self._on_timeout
        )

    def next_attempt(self) -> None:
        """Send to the next candidate replica, or end with the last error when none is left."""
        if self.ended:
            return
        timing = self.timing
        client = self._client
        for replica in self._candidates:
            if not take_attempt(timing, replica, client.max_retries):
                break
            self._replica = replica
            conn = replica.conn
            if conn is not None and conn.usable and conn.has_slot:
                self._send(conn)
            else:
                task = asyncio.ensure_future(self._send_later(replica))
                client.background.add(task)
                task.add_done_callback(client.background.discard)
            return
        self._end(self._error or ZeroLayerError(NO_REPLICA, "no replica is up"))

    def _response(self) -> Response:
        resp = self._resp = Response(self.timing, self._req.chat, self._on_response)
        if not self.timing.sent_ns:
            self.timing.sent_ns = _now()
        return resp

    def _send(self, conn: H2Connection) -> None:
        req = self._req
        conn.start(req.path, req.headers, req.body, self._response())

    async def _send_later(self, replica: Replica) -> None:
        """The slow path: open the connection, or wait for a stream slot, then send."""
        client = self._client
        try:
            conn = await replica.connection(client.tls, client.connect_timeout_s)
        except (OSError, TimeoutError) as exc:
            replica.health.force_down()
            self._error = ZeroLayerError(CONNECTION_LOST, f"{replica.url}: {exc}", retryable=True)
            if not self.timed_out:
                self.next_attempt()
            return
        if self.ended:
            return
        req = self._req
        await conn.request(req.path, req.headers, req.body, self._response())

    def _on_response(self, resp: Response) -> None:
        """The attempt is over: end, or move on to the next replica when that is safe."""
        if resp is not self._resp or self.ended:
            return
        error = resp.error
        if error is None:
            self._end(None)
            return
        self._error = error
        if error.code in MARK_DOWN and self._replica is not None:
            self._replica.health.force_down()
        if error.retryable and not self.timed_out:
            # Not from inside the connection's event dispatch: the next send may reuse it.
            asyncio.get_running_loop().call_soon(self.next_attempt)
            return
        self._end(error)

    def _on_timeout(self) -> None:
        self._timer = None
        self.timed_out = True
        error = ZeroLayerError(CLIENT_TIMEOUT, "no answer by deadline plus grace")
        resp = self._resp
        if resp is not None and not resp.done:
            resp.fail(error)
            resp.cancel()
        self._end(error)

    def _end(self, error: ZeroLayerError | None) -> None:
        if self.ended:
            return
        self.ended = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        timing = self.timing
        timing.end_ns = _now()
        if self.timed_out and (error is None or error.code != CLIENT_TIMEOUT):
            error = ZeroLayerError(CLIENT_TIMEOUT, "no answer by deadline plus grace")
        if error is not None:
            timing.error_code = error.code
        resp = self._resp
        try:
            self._on_done(timing, resp.tokens if resp is not None else 0)
        except Exception:  # a caller's bug must not break the connection that delivered this
            log.exception("on_done callback failed for %s", timing.request_id)
