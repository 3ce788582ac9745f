"""A request driven by callbacks instead of a task: ``ZeroLayerClient.submit``.

A load generator sends thousands of requests a second and wants only each one's timing record,
not its chunks; a task, a deadline timer context and a future per request cost it more CPU than
the HTTP/2 work itself. A ``Submission`` sends at once when the replica's connection is up and
has a free stream slot (the usual case), hears about its response through ``Response.notify``,
retries before the first token on the same rules as ``Stream`` (both follow ``failover``: next
replica on the ring, up to ``max_retries``; never after the first token), and calls
``on_done(timing, tokens)`` exactly once.
Only the rare cases (no connection yet, the peer's stream limit reached) fall back to a task.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Callable, Iterator
from typing import Protocol

from zerolayer.client import failover
from zerolayer.client.codec import Prepared, ZeroLayerError
from zerolayer.client.failover import Action, Outcome, next_replica
from zerolayer.client.h2conn import H2Connection
from zerolayer.client.replica import ReplicaEndpoint
from zerolayer.client.stream import Response
from zerolayer.client.timing import Timing

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
        candidates: Iterator[ReplicaEndpoint],
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
        self._replica: ReplicaEndpoint | None = None
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
        client = self._client
        replica = next_replica(self._candidates, self.timing, client.max_retries)
        if replica is None:
            self._end(failover.final_error(self._error, self.timed_out))
            return
        self._replica = replica
        conn = replica.conn
        if conn is not None and conn.usable and conn.has_slot:
            self._send(conn)
        else:
            task = asyncio.ensure_future(self._send_later(replica))
            client.background.add(task)
            task.add_done_callback(client.background.discard)

    def _response(self) -> Response:
        resp = self._resp = Response(self.timing, self._req.chat, self._on_response)
        if not self.timing.sent_ns:
            self.timing.sent_ns = _now()
        return resp

    def _send(self, conn: H2Connection) -> None:
        req = self._req
        conn.start(req.path, req.headers, req.body, self._response())

    async def _send_later(self, replica: ReplicaEndpoint) -> None:
        """The slow path: open the connection, or wait for a stream slot, then send."""
        client = self._client
        try:
            conn = await replica.connection(client.tls, client.connect_timeout_s)
        except (OSError, TimeoutError) as exc:
            self._follow(failover.unreachable(replica.url, exc, self.timed_out), replica, False)
            return
        if self.ended:
            return
        req = self._req
        await conn.request(req.path, req.headers, req.body, self._response())

    def _on_response(self, resp: Response) -> None:
        """The attempt is over: end, or move on to the next replica when that is safe."""
        if resp is not self._resp or self.ended:
            return
        self._follow(Outcome(resp.error, resp.committed, self.timed_out), self._replica, True)

    def _follow(self, outcome: Outcome, replica: ReplicaEndpoint | None, in_dispatch: bool) -> None:
        """Do what ``failover`` decides for an attempt's outcome. ``in_dispatch``: called from
        inside the connection's event dispatch, so a retry waits for the next loop turn (the
        next send may reuse that connection)."""
        decision = failover.decide(outcome)
        if decision.mark_down and replica is not None:
            replica.force_down()
        if decision.action is Action.DELIVER:
            self._end(None)
            return
        self._error = decision.error
        if decision.action is Action.GIVE_UP:
            self._end(decision.error)
        elif in_dispatch:
            asyncio.get_running_loop().call_soon(self.next_attempt)
        else:
            self.next_attempt()

    def _on_timeout(self) -> None:
        self._timer = None
        self.timed_out = True
        error = failover.final_error(None, timed_out=True)
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
        if self.timed_out:
            error = failover.final_error(error, timed_out=True)
        if error is not None:
            timing.error_code = error.code
        resp = self._resp
        try:
            self._on_done(timing, resp.tokens if resp is not None else 0)
        except Exception:  # a caller's bug must not break the connection that delivered this
            log.exception("on_done callback failed for %s", timing.request_id)
