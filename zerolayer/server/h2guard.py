"""The limits one HTTP/2 connection is held to, apart from the frames' meaning.

- Rate budgets (``budget.TokenBucket``) on the frames a client sends at no cost to itself but
  some to the replica: RST_STREAM (rapid reset, CVE-2023-44487), PING (CVE-2019-9512), SETTINGS
  (CVE-2019-9515) and empty DATA frames (CVE-2019-9518); the handler closes the connection with
  GOAWAY(ENHANCE_YOUR_CALM) when one is spent.
- The byte budget (``connection_buffer_bytes``) that the request bodies in progress share with
  the responses the client has not read.
- The clocks: a body must keep arriving (``body_timeout_s``: 408), a keepalive PING must be
  answered (``keepalive_s``), and a connection with no stream open for ``idle_timeout_s`` is
  closed. One timer each per connection, so a request costs none of its own.

Every number comes from the replica's ``Limits`` (``zerolayer.server.limits``).
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import TYPE_CHECKING, Final, Protocol

from serving.wire.contract import REQUEST_TIMEOUT
from zerolayer.server.budget import TokenBucket
from zerolayer.server.limits import Limits

if TYPE_CHECKING:
    from zerolayer.server.core import Call

log = logging.getLogger("zerolayer.server.h2")

PING_PAYLOAD_BYTES: Final = 8  # RFC 9113 6.7: a PING carries exactly 8 octets
IDLE_CHECKS: Final = 4  # idle checks per idle_timeout_s (see ConnectionGuard._on_idle_check)
STALLED_FRACTION: Final = 0.1
"""A keepalive timer this late, as a share of its interval, fired after a stalled loop: the
ACK may be waiting unread in the socket (see ConnectionGuard._on_keepalive)."""


class Guarded(Protocol):
    """What the guard's clocks need of the connection they watch."""

    @property
    def idle(self) -> bool:
        """No stream is open."""
        ...

    @property
    def newest_stream(self) -> int:
        """The highest stream id the client has opened."""
        ...

    def ping(self, payload: bytes) -> None: ...
    def goaway(self) -> None: ...
    def close(self) -> None: ...
    def flush(self) -> None: ...


class ConnectionGuard:
    """One connection's rate budgets, byte budget and clocks (see the module docstring)."""

    __slots__ = ("_body_timer", "_idle_check", "_keepalive", "_newest_stream", "_ping_graced",
                 "_ping_payload", "_quiet_checks", "_stopped", "budget", "empty_frames", "limits",
                 "loop", "owner", "pings", "resets", "settings", "upload_bytes",
                 "uploads")  # fmt: skip

    def __init__(self, limits: Limits, loop: asyncio.AbstractEventLoop, owner: Guarded) -> None:
        self.limits = limits
        self.loop = loop
        self.owner = owner
        now = loop.time()
        self.resets = TokenBucket(limits.reset_burst, limits.reset_rate, now)
        self.pings = TokenBucket(limits.control_burst, limits.control_rate, now)
        self.settings = TokenBucket(limits.control_burst, limits.control_rate, now)
        self.empty_frames = TokenBucket(limits.control_burst, limits.control_rate, now)
        # Request bodies in progress: the time each got its last byte, and their bytes in all.
        self.uploads: dict[Call, float] = {}
        self.upload_bytes = 0
        self.budget = limits.connection_buffer_bytes
        self._stopped = False
        self._body_timer: asyncio.TimerHandle | None = None
        self._ping_payload: bytes | None = None
        self._ping_graced = False
        self._keepalive: asyncio.TimerHandle | None = None
        if limits.keepalive_s > 0:
            self._keepalive = loop.call_later(limits.keepalive_s, self._on_keepalive)
        self._idle_check: asyncio.TimerHandle | None = None
        self._quiet_checks = 1  # nothing is open when a connection starts
        self._newest_stream = 0
        if limits.idle_timeout_s > 0:
            self._arm_idle_check()

    # -- the byte budget --------------------------------------------------------------------

    def over_budget(self, unsent: int) -> bool:
        """Whether the connection holds more than ``connection_buffer_bytes`` in response data
        its client has not read (``unsent``) and request bodies in progress."""
        return unsent + self.upload_bytes > self.budget

    def has_room(self, size: int, unsent: int) -> bool:
        """Whether ``size`` more body bytes fit the budget beside ``unsent`` response bytes."""
        return self.upload_bytes + unsent + size <= self.budget

    def started_upload(self, call: Call, now: float) -> None:
        self.uploads[call] = now

    def uploaded(self, call: Call, size: int, now: float) -> None:
        """``size`` body bytes of ``call`` arrived at ``now`` and are held."""
        self.uploads[call] = now
        self.upload_bytes += size

    def end_upload(self, call: Call) -> None:
        """The call reads no more body: its bytes leave the connection's budget (they are
        exactly its ``body_len``, counted as they arrived)."""
        if self.uploads.pop(call, None) is not None:
            self.upload_bytes -= call.body_len

    def clear_uploads(self) -> None:
        self.uploads.clear()
        self.upload_bytes = 0

    # -- the body clock ----------------------------------------------------------------------

    def watch_uploads(self) -> None:
        """Arm the body clock for the oldest upload, if one is in progress and none is armed."""
        if self.uploads and self._body_timer is None and self.limits.body_timeout_s > 0:
            first = min(self.uploads.values())
            when = first + self.limits.body_timeout_s
            self._body_timer = self.loop.call_at(when, self._on_body_timeout)

    def _on_body_timeout(self) -> None:
        """408 (and the stream reset) for each body that got no byte for ``body_timeout_s``
        (nginx's client_body_timeout): armed for the oldest upload only while one is in
        progress, so a body that arrives in the same read costs none."""
        self._body_timer = None
        if self._stopped:
            return
        timeout = self.limits.body_timeout_s
        cutoff = self.loop.time() - timeout
        for call, last in list(self.uploads.items()):
            if last <= cutoff:
                self.end_upload(call)
                call.refuse(REQUEST_TIMEOUT, f"no request body byte for {timeout:g} s")
        self.watch_uploads()
        self.owner.flush()

    # -- keepalive ---------------------------------------------------------------------------

    def _on_keepalive(self) -> None:
        """PING with an unpredictable payload; close if the last one was not acknowledged.
        TCP delivers in order, so the ACK of a payload the client could not guess proves it
        read everything sent before that PING (RFC 9113 6.7).

        A timer that fires late fired after the loop stalled (a loaded host, a flood on another
        connection), and a loop that runs its due timers before it polls the sockets (uvloop's,
        libuv's order) has not yet read an ACK that came meanwhile: the verdict on that PING
        then waits one more interval, once."""
        timer = self._keepalive
        if self._stopped or timer is None:
            return
        keepalive_s = self.limits.keepalive_s
        if self._ping_payload is not None:
            stalled = self.loop.time() - timer.when() > STALLED_FRACTION * keepalive_s
            if not stalled or self._ping_graced:
                log.info("peer did not answer a PING within %.1f s; closing", keepalive_s)
                self.owner.close()
                return
            self._ping_graced = True
        else:
            self._ping_payload = os.urandom(PING_PAYLOAD_BYTES)
            self._ping_graced = False
            self.owner.ping(self._ping_payload)
        self._keepalive = self.loop.call_later(keepalive_s, self._on_keepalive)

    def ping_acked(self, payload: bytes) -> None:
        """Only the ACK of the PING in flight counts; any other payload proves nothing."""
        if payload == self._ping_payload:
            self._ping_payload = None

    # -- the idle clock ----------------------------------------------------------------------

    def _arm_idle_check(self) -> None:
        interval = self.limits.idle_timeout_s / IDLE_CHECKS
        self._idle_check = self.loop.call_later(interval, self._on_idle_check)

    def _on_idle_check(self) -> None:
        """GOAWAY(NO_ERROR) and close once no stream has been open for ``idle_timeout_s``.

        Checked IDLE_CHECKS times per timeout rather than on each stream's open and close, so
        streams cost nothing. A check is quiet when no stream is open and none opened since the
        previous check. A stream seen at the last busy check may have closed just after it, so
        the first quiet check proves nothing before itself; IDLE_CHECKS more in a row prove the
        whole timeout idle. The close thus comes at most 1/IDLE_CHECKS of the timeout late (a
        new connection, with nothing open yet, starts with its first quiet check done)."""
        if self._stopped:
            return
        owner = self.owner
        newest = owner.newest_stream
        if not owner.idle or newest != self._newest_stream:
            self._newest_stream = newest
            self._quiet_checks = 0
        else:
            self._quiet_checks += 1
            if self._quiet_checks > IDLE_CHECKS:
                log.debug("closing a connection idle for %.1f s", self.limits.idle_timeout_s)
                owner.goaway()
                owner.close()
                return
        self._arm_idle_check()

    def stop(self) -> None:
        """The connection is closing: no clock fires any more."""
        self._stopped = True
        for timer in (self._keepalive, self._idle_check, self._body_timer):
            if timer is not None:
                timer.cancel()
