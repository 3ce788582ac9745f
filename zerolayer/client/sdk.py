"""The zero-layer routing client: sessions hashed onto replicas, one HTTP/2 connection each.

No proxy between caller and engine: this SDK does the routing a middle layer would. It walks the
consistent-hash ring from the session's owner, skipping replicas its background ``/health`` poll
(with hysteresis) or a lost connection marked down, unless every one is; a retryable refusal or
a connection lost before the first token moves the request to the next replica, up to
``max_retries``; after the first token nothing is retried and the caller gets the error.

The replica set is given (``replica_urls``) or discovered (``discovery``: a watched file, see
``zerolayer.client.discovery``); :meth:`ZeroLayerClient.set_replicas` changes it either way. A
replica that leaves gets no new request; the requests it is serving finish on their connection,
which closes once it is idle.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Unpack

import orjson

from zerolayer.client import failover
from zerolayer.client.codec import (
    Prepared,
    RequestFields,
    RequestIssuer,
    ZeroLayerError,
)
from zerolayer.client.discovery import DEFAULT_INTERVAL_S, ReplicaFile
from zerolayer.client.failover import Action, Outcome, next_replica
from zerolayer.client.health import DEFAULT_DOWN_AFTER, DEFAULT_UP_AFTER, healthy
from zerolayer.client.replica import ReplicaEndpoint, default_tls, split_url
from zerolayer.client.ring import DEFAULT_VNODES, HashRing
from zerolayer.client.stream import Completion, Response, Stream, collect
from zerolayer.client.submit import OnDone, Submission
from zerolayer.client.timing import Timing

_now = time.time_ns
log = logging.getLogger("zerolayer.client")


@dataclass(frozen=True, slots=True)
class ReplicaChange:
    """One change of the client's replica set: when it took effect (wall-clock ns) and what it
    added and removed."""

    t_ns: int
    added: tuple[str, ...]
    removed: tuple[str, ...]


class ZeroLayerClient:
    """Route and stream completions straight to engine replicas (see the module docstring).

    Use as ``async with ZeroLayerClient(urls) as client:``; ``stream`` and ``complete`` are
    safe to call from many tasks at once, and all of a replica's requests share one connection,
    so a caller's header that could break it is refused before sending (``bad_request``).
    ``api_key`` goes on every request as ``authorization: Bearer``, unless a request names its
    own ``api_key``. With ``discovery`` (a replica file, ``zerolayer.client.discovery``) the
    replicas are the file's, read now and watched every ``discovery_interval_s`` once started
    (``replica_urls`` may then be empty); ``changes`` records every change of the set.
    """

    def __init__(
        self,
        replica_urls: Iterable[str],
        *,
        vnodes: int = DEFAULT_VNODES,
        health_interval_s: float = 1.0,
        health_timeout_s: float = 0.5,
        down_after: int = DEFAULT_DOWN_AFTER,
        up_after: int = DEFAULT_UP_AFTER,
        max_retries: int = 2,
        grace_ms: int = 2000,
        connect_timeout_s: float = 2.0,
        tls: ssl.SSLContext | None = None,
        model: str | None = None,
        extra_body: Mapping[str, Any] | None = None,
        api_key: str | None = None,
        discovery: str | Path | None = None,
        discovery_interval_s: float = DEFAULT_INTERVAL_S,
    ) -> None:
        self.discovery = None if discovery is None else ReplicaFile(discovery)
        urls = list(dict.fromkeys(replica_urls))
        if self.discovery is not None:
            urls = self.discovery.changed() or urls
        if not urls:
            why = f": {self.discovery.error}" if self.discovery is not None else ""
            raise ValueError(f"need at least one replica URL{why}")
        if discovery_interval_s <= 0:
            raise ValueError(f"discovery_interval_s must be > 0, got {discovery_interval_s}")
        self.discovery_interval_s = discovery_interval_s
        self._down_after, self._up_after = down_after, up_after
        self.replicas = {url: ReplicaEndpoint(url, down_after, up_after) for url in urls}
        self.ring = HashRing(urls, vnodes)
        self.changes: list[ReplicaChange] = []
        # Replicas that left while serving: closed once their connection is idle.
        self._leaving: list[ReplicaEndpoint] = []
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s
        self.max_retries = max_retries
        self.grace_ms = grace_ms
        self.connect_timeout_s = connect_timeout_s
        # Used for every https:// replica; None when all are plain http://.
        self.tls = (
            tls
            if tls is not None
            else (default_tls() if any(r.tls for r in self.replicas.values()) else None)
        )
        self._issue = RequestIssuer("zl", model, extra_body, api_key)
        self._poller: asyncio.Task[None] | None = None
        self._watcher: asyncio.Task[None] | None = None
        # Tasks of submitted requests that had to wait for a connection or a stream slot.
        self.background: set[asyncio.Future[None]] = set()

    async def __aenter__(self) -> ZeroLayerClient:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Start the background health poll (no-op when ``health_interval_s`` is 0) and the
        discovery file's watch (with ``discovery``)."""
        if self._poller is None and self.health_interval_s > 0:
            self._poller = asyncio.create_task(self._poll_forever())
        if self._watcher is None and self.discovery is not None:
            self._watcher = asyncio.create_task(self._watch_forever())

    async def close(self) -> None:
        """Stop polling and watching and close every connection; live streams end as lost."""
        for task in (self._poller, self._watcher):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._poller = self._watcher = None
        for replica in [*self.replicas.values(), *self._leaving]:
            if replica.conn is not None:
                replica.conn.close()
                replica.conn = None
        self._leaving.clear()

    def is_up(self, url: str) -> bool:
        return self.replicas[url].health.up

    # membership

    def set_replicas(self, urls: Iterable[str]) -> ReplicaChange | None:
        """Route over ``urls`` from now on: new replicas join the ring (starting up, as at
        construction), missing ones leave it; None when nothing changed. ValueError for an
        empty set (the client keeps the one it has)."""
        wanted = list(dict.fromkeys(urls))
        if not wanted:
            raise ValueError("need at least one replica URL")
        added = tuple(u for u in wanted if u not in self.replicas)
        removed = tuple(u for u in self.replicas if u not in wanted)
        if not added and not removed:
            return None
        endpoints = {u: ReplicaEndpoint(u, self._down_after, self._up_after) for u in added}
        for url in removed:
            self.ring.remove(url)
            self._leaving.append(self.replicas.pop(url))
        for url, endpoint in endpoints.items():
            self.replicas[url] = endpoint
            self.ring.add(url)
        if self.tls is None and any(e.tls for e in endpoints.values()):
            self.tls = default_tls()
        change = ReplicaChange(_now(), added, removed)
        self.changes.append(change)
        self._close_idle_leavers()
        return change

    def _close_idle_leavers(self) -> None:
        """Close the connections of replicas that left once no request of ours is on them."""
        still = []
        for replica in self._leaving:
            conn = replica.conn
            if conn is not None and not conn.closed and conn.open_streams:
                still.append(replica)
            elif conn is not None:
                conn.close()
                replica.conn = None
        self._leaving = still

    async def _watch_forever(self) -> None:
        """Apply the discovery file's changes, checked every ``discovery_interval_s``."""
        assert self.discovery is not None
        reported = ""
        while True:
            await asyncio.sleep(self.discovery_interval_s)
            urls = self.discovery.changed()
            if urls is not None:
                self.set_replicas(urls)
            elif self.discovery.error and self.discovery.error != reported:
                log.warning("discovery file ignored, keeping %d replicas: %s",
                            len(self.replicas), self.discovery.error)  # fmt: skip
            reported = self.discovery.error
            self._close_idle_leavers()

    # health

    async def _poll_forever(self) -> None:
        """Poll on an absolute schedule, so a slow poll does not stretch the interval."""
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            await self.poll_health()
            next_at = max(next_at + self.health_interval_s, loop.time())
            await asyncio.sleep(next_at - loop.time())

    async def poll_health(self) -> None:
        """Poll every replica's ``/health`` once and feed the verdicts to their hysteresis."""
        await asyncio.gather(*(self._poll(r) for r in self.replicas.values()))

    async def _poll(self, replica: ReplicaEndpoint) -> None:
        try:
            conn = await replica.connection(self.tls, self.connect_timeout_s)
            if not conn.has_slot:
                # Every stream the replica allows carries one of our requests: it is busy, not
                # down, and a probe stream would be over its limit. Skip this round.
                return
            status, body = await conn.get("/health", self.health_timeout_s)
            payload = orjson.loads(body) if status == 200 else None
            replica.last_health = payload if isinstance(payload, dict) else None
            replica.observe(healthy(status, replica.last_health))
        except (TimeoutError, orjson.JSONDecodeError):
            # No answer in time (a frozen replica, or a loaded host's slow one), or not JSON:
            # one bad verdict. TimeoutError is an OSError, so it is caught first.
            replica.observe(False)
        except OSError:
            # Refused or reset: no process serves there, so down at once; hysteresis still
            # governs coming back.
            replica.force_down()

    # requests

    def _candidates(self, key: str) -> Iterator[ReplicaEndpoint]:
        """The up replicas in ``key``'s ring order; when none is up, every replica in that
        order (panic routing, as Envoy's panic threshold: a verdict that has them all down is
        as likely a loaded host's slow answers, and with no poll running nothing would ever
        mark one up again)."""
        replicas = self.replicas
        down: list[ReplicaEndpoint] = []
        any_up = False
        for url in self.ring.preference(key):
            replica = replicas.get(url)  # None: it left the set since the walk began
            if replica is None:
                continue
            if replica.health.up:
                any_up = True
                yield replica
            elif not any_up:
                down.append(replica)
        if not any_up:
            yield from down

    def stream(self, **fields: Unpack[RequestFields]) -> Stream:
        """A streamed completion; ``async with`` it, then ``async for chunk in it``.

        Entering waits for the first token (retrying before it where that is safe) and raises
        ZeroLayerError if none comes; iterating raises it if the stream breaks later. A bad
        argument raises ValueError at once (a bad header or key: BadRequestError, ``bad_request``).
        ``stream.timing`` holds the record either way (and the error carries it too).
        """
        req = self._issue(fields)
        key = fields.get("session") or req.request_id
        return Stream(
            lambda s: self._open(s, req, key),
            Timing(request_id=req.request_id),
            (req.deadline_ms + self.grace_ms) / 1000,
        )

    def submit(self, on_done: OnDone, **fields: Unpack[RequestFields]) -> Timing:
        """Send a streamed completion now and return its timing record at once.

        ``on_done(timing, tokens)`` runs exactly once when the request has ended: completed, or
        with ``timing.error_code`` set (``client_timeout`` when no answer came by deadline plus
        grace). Same routing, retries and timing as :meth:`stream`, without a task or chunk
        objects per request: the API for load generators, which want only the record. Raises
        ValueError at once for bad arguments (BadRequestError for a bad header or key), like
        :meth:`stream`.
        """
        req = self._issue(fields)
        timing = Timing(request_id=req.request_id)
        Submission(
            self,
            req,
            self._candidates(fields.get("session") or req.request_id),
            timing,
            on_done,
            (req.deadline_ms + self.grace_ms) / 1000,
        ).next_attempt()
        return timing

    async def complete(self, **fields: Unpack[RequestFields]) -> Completion:
        """The whole answer at once; takes ``stream``'s arguments."""
        return await collect(self.stream(**fields))

    async def _open(self, stream: Stream, req: Prepared, key: str) -> Response:
        """Try replicas in ring order until one gives a first token, or stop with the error
        (the rules are ``failover``'s)."""
        timing = stream.timing
        candidates = self._candidates(key)
        error: ZeroLayerError | None = None
        while (replica := next_replica(candidates, timing, self.max_retries)) is not None:
            resp = Response(timing, req.chat)
            stream.current = resp
            outcome = await self._attempt(replica, req, resp, stream)
            decision = failover.decide(outcome)
            if decision.mark_down:
                replica.force_down()
            if decision.action is Action.DELIVER:
                return resp
            error = decision.error
            if decision.action is Action.GIVE_UP:
                break
        raise failover.final_error(error, stream.timed_out)

    async def _attempt(
        self, replica: ReplicaEndpoint, req: Prepared, resp: Response, stream: Stream
    ) -> Outcome:
        """Send on ``replica`` (opening its connection if need be) and wait for a first token
        or the response's end."""
        conn = replica.conn
        if conn is None or not conn.usable:
            try:
                conn = await replica.connection(self.tls, self.connect_timeout_s)
            except (OSError, TimeoutError) as exc:
                return failover.unreachable(replica.url, exc, stream.timed_out)
        timing = stream.timing
        if not timing.sent_ns:
            timing.sent_ns = _now()
        await conn.request(req.path, req.headers, req.body, resp)
        if not resp.chunks and not resp.done:
            await resp.wait()
        return Outcome(resp.error, resp.committed, stream.timed_out)


__all__ = ["ReplicaChange", "ReplicaEndpoint", "ZeroLayerClient", "default_tls", "split_url"]
