"""Replica discovery for the SDK: a watched file listing the replicas, as a deployment tells it.

A deployment (Kubernetes' endpoints written out by a sidecar, Consul's ``consul-template``, an
operator's script, or ``chaos.elastic`` in this suite) publishes the replicas clients may use as
one JSON file, ``{"replicas": ["http://host:port", ...]}``, replaced atomically (written beside
it, then renamed over it) so that a reader never sees half a file. The SDK polls the file's
``stat`` every ``interval_s`` (no inotify: it works on any filesystem, and the delay it adds is
at most one interval) and, when the inode, size or modification time changed, reads it and
hands the new set to the ring: a replica that joins takes the sessions on its arcs, one that
leaves gives back only its own (``zerolayer.client.ring``).

A file that cannot be read or parsed, or that lists no replica, changes nothing: the SDK keeps
routing over the set it has (an empty set would refuse every request) and reports the error
once per change of the file (:attr:`ReplicaFile.error`).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Final

import orjson

from zerolayer.client.replica import split_url

DEFAULT_INTERVAL_S: Final = 0.1
KEY: Final = "replicas"
_UNSEEN: Final = (-1, -1, -1)


def parse_replicas(data: bytes) -> list[str]:
    """The replica URLs a discovery file lists, in its order, duplicates dropped; ValueError
    (one line) for anything but a JSON object whose ``replicas`` is a non-empty list of
    ``http://`` or ``https://`` URLs."""
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    urls = doc.get(KEY) if isinstance(doc, dict) else None
    if not isinstance(urls, list) or not urls or not all(isinstance(u, str) for u in urls):
        raise ValueError(f'expected {{"{KEY}": ["http://host:port", ...]}} with at least one URL')
    for url in urls:
        split_url(url)  # ValueError naming the URL
    return list(dict.fromkeys(urls))


def write_replicas(path: str | os.PathLike[str], urls: Sequence[str]) -> Path:
    """Publish ``urls`` to the discovery file at ``path`` atomically (a rename over it)."""
    path = Path(path)
    data = orjson.dumps({KEY: list(urls)})
    parse_replicas(data)  # never publish a file a client would refuse
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    os.replace(tmp, path)
    return path


def read_replicas(path: str | os.PathLike[str]) -> list[str]:
    """The replicas the file lists now (ValueError as :func:`parse_replicas`; OSError if it
    cannot be read)."""
    return parse_replicas(Path(path).read_bytes())


class ReplicaFile:
    """A discovery file, watched by polling its ``stat``: :meth:`changed` gives the new replica
    list when the file changed since the last call and parses, else None."""

    __slots__ = ("_seen", "error", "path")

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._seen: tuple[int, int, int] | None = _UNSEEN
        self.error = ""

    def _signature(self) -> tuple[int, int, int] | None:
        try:
            st = self.path.stat()
        except OSError:
            return None
        return st.st_ino, st.st_size, st.st_mtime_ns

    def changed(self) -> list[str] | None:
        """The listed replicas when the file changed and parses; None when it did not change,
        or changed to something unusable (then :attr:`error` says why)."""
        signature = self._signature()
        if signature == self._seen:
            return None
        self._seen = signature
        if signature is None:
            self.error = f"{self.path}: cannot be read"
            return None
        try:
            urls = read_replicas(self.path)
        except (OSError, ValueError) as exc:
            self.error = f"{self.path}: {exc}"
            return None
        self.error = ""
        return urls
