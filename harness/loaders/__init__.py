"""Loaders: ``native`` (open-loop asyncio, the default), ``k6`` and ``locust``, one interface.

Each takes the whole stack (``harness.stacks.Stack``); ``LOADERS`` holds one of each with its
defaults (build a ``NativeLoader``, ``K6Loader`` or ``LocustLoader`` for other settings, or
``loader_with`` for one of them with another progress style).
"""

from collections.abc import Mapping
from dataclasses import replace
from types import MappingProxyType
from typing import Final

from harness.loaders.base import Loader, LoadResult, RequestFailed
from harness.loaders.k6 import K6Loader
from harness.loaders.locust import LocustLoader
from harness.loaders.native import NativeLoader
from harness.progress import ProgressStyle
from harness.stacks import StackName, stack_kind

_DEFAULTS: Final = (NativeLoader(), K6Loader(), LocustLoader())
LOADERS: Final[Mapping[str, Loader]] = MappingProxyType({ld.name: ld for ld in _DEFAULTS})


def loader_with(name: str, *, progress: ProgressStyle | None) -> Loader:
    """``LOADERS[name]`` showing its progress in ``progress`` (None or QUIET: nothing)."""
    for loader in _DEFAULTS:
        if loader.name == name:
            return replace(loader, progress=progress)
    raise KeyError(name)


def needs_tls(loader: str, stack: StackName) -> bool:
    """Whether ``stack`` must be started with TLS for ``loader``: k6 (Go's HTTP client) speaks
    HTTP/2 only over TLS, and the zero-layer replicas speak HTTP/2."""
    return loader == "k6" and stack_kind(stack).protocol == "h2"


__all__ = [
    "LOADERS",
    "LoadResult",
    "Loader",
    "ProgressStyle",
    "RequestFailed",
    "loader_with",
    "needs_tls",
]
