"""A rate budget per connection: a token bucket (a burst at once, then a steady rate).

The HTTP/2 side keeps one per kind of frame a client can send at no cost to itself but some to
the replica: RST_STREAM (rapid reset, CVE-2023-44487), PING and SETTINGS (each answered with an
ACK: CVE-2019-9512, CVE-2019-9515) and empty DATA frames (CVE-2019-9518). Taking a token is a few
float operations, so the buckets cost nothing noticeable on a well-behaved connection.
"""

from __future__ import annotations


class TokenBucket:
    """``burst`` events at once, refilled at ``rate`` per second, never above ``burst``."""

    __slots__ = ("burst", "rate", "stamp", "tokens")

    def __init__(self, burst: int, rate: float, now: float) -> None:
        self.burst = float(burst)
        self.rate = rate
        self.tokens = float(burst)
        self.stamp = now

    def take(self, now: float) -> bool:
        """Spend one token at time ``now`` (seconds, monotonic); False when none is left."""
        tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if tokens < 1.0:
            self.tokens = tokens
            return False
        self.tokens = tokens - 1.0
        return True
