"""A consistent-hash ring on xxh64 with virtual nodes: which replica serves a session.

Adding or removing one of N replicas moves only about 1/N of the keys, and only to or from that
replica, so sessions keep their KV-cache affinity when the fleet changes.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Iterator

from xxhash import xxh64_intdigest

DEFAULT_VNODES = 160


class HashRing:
    """Replicas placed at ``vnodes`` pseudo-random points each; a key belongs to the next point."""

    __slots__ = ("_nodes", "_owners", "_points", "vnodes")

    def __init__(self, nodes: Iterable[str] = (), vnodes: int = DEFAULT_VNODES) -> None:
        if vnodes < 1:
            raise ValueError(f"vnodes must be >= 1, got {vnodes}")
        self.vnodes = vnodes
        self._nodes: list[str] = []
        self._points: list[int] = []
        self._owners: list[str] = []
        for node in nodes:
            self.add(node)

    @property
    def nodes(self) -> list[str]:
        return list(self._nodes)

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, node: object) -> bool:
        return node in self._nodes

    def add(self, node: str) -> None:
        """Place a replica; the only keys that move are those its new points now own."""
        if node in self._nodes:
            raise ValueError(f"{node!r} is already on the ring")
        self._nodes.append(node)
        self._rebuild()

    def remove(self, node: str) -> None:
        """Take a replica off; only the keys it owned move, each to the next replica on."""
        self._nodes.remove(node)
        self._rebuild()

    def _rebuild(self) -> None:
        # Ties on a 64-bit hash are vanishingly rare; sorting on (point, node) keeps them stable.
        placed = sorted(
            (xxh64_intdigest(f"{node}#{i}".encode()), node)
            for node in self._nodes
            for i in range(self.vnodes)
        )
        self._points = [p for p, _ in placed]
        self._owners = [n for _, n in placed]

    def lookup(self, key: str) -> str:
        """The replica that owns ``key``."""
        if not self._points:
            raise LookupError("the ring is empty")
        i = bisect_right(self._points, xxh64_intdigest(key.encode()))
        return self._owners[i % len(self._owners)]

    def preference(self, key: str) -> Iterator[str]:
        """Every replica once, in ring order from ``key``'s owner: the failover order."""
        owners = self._owners
        n = len(owners)
        if not n:
            return
        start = bisect_right(self._points, xxh64_intdigest(key.encode()))
        seen: set[str] = set()
        total = len(self._nodes)
        for j in range(n):
            node = owners[(start + j) % n]
            if node not in seen:
                seen.add(node)
                yield node
                if len(seen) == total:
                    return
