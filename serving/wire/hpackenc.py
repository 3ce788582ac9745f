"""A stateless HPACK encoder: cached field encodings instead of a per-request table search.

hpack's own encoder searches its dynamic table for every field of every request and indexes
per-request values (request ids, sessions) that only churn the table; that costs more than the
rest of the client's request path. This one never uses the dynamic table: each field is a
static-table index or a literal without indexing (RFC 7541 6.1, 6.2.2), so its bytes depend on
the field alone and are cached. The first block sets the peer's table size to 0 (6.3), so later
SETTINGS_HEADER_TABLE_SIZE changes need no signal.
"""

from __future__ import annotations

from collections.abc import Iterable

from hpack.hpack import encode_integer
from hpack.table import HeaderTable

CACHE_LIMIT = 8192
_STATIC = HeaderTable.STATIC_TABLE_MAPPING
_TABLE_SIZE_ZERO = b"\x20"


def _string(data: bytes) -> bytes:
    return bytes(encode_integer(len(data), 7)) + data


def encode_field(name: bytes, value: bytes) -> bytes:
    """One field: a static-table index if it is there whole, else a literal without indexing."""
    entry = _STATIC.get(name)
    if entry is not None:
        index = entry[1].get(value)
        if index is not None:
            out = encode_integer(index, 7)
            out[0] |= 0x80
            return bytes(out)
        return bytes(encode_integer(entry[0], 4)) + _string(value)
    return b"\x00" + _string(name) + _string(value)


class LiteralEncoder:
    """Drop-in for ``hpack.Encoder`` as h2 uses it (``encode`` and ``header_table_size``)."""

    __slots__ = ("_cache", "_started", "header_table_size")

    def __init__(self) -> None:
        self._cache: dict[tuple[bytes, bytes], bytes] = {}
        self._started = False
        self.header_table_size = 4096

    def encode(self, headers: Iterable[tuple[bytes, bytes]], huffman: bool = True) -> bytes:
        cache = self._cache
        parts = []
        if not self._started:
            self._started = True
            parts.append(_TABLE_SIZE_ZERO)
        for name, value in headers:
            field = cache.get((name, value))
            if field is None:
                field = encode_field(name, value)
                if len(cache) >= CACHE_LIMIT:
                    cache.clear()
                cache[(name, value)] = field
            parts.append(field)
        return b"".join(parts)
