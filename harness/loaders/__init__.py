"""Loaders: ``native`` (open-loop asyncio, the default), ``k6`` and ``locust``, one interface.

Each takes the whole stack (``harness.stacks.Stack``); ``LOADERS`` holds one of each with its
defaults (build a ``NativeLoader``, ``K6Loader`` or ``LocustLoader`` for other settings).
"""

from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

from harness.loaders.base import Loader, LoadResult, RequestFailed
from harness.loaders.k6 import K6Loader
from harness.loaders.locust import LocustLoader
from harness.loaders.native import NativeLoader
from harness.stacks import StackName

LOADERS: Final[Mapping[str, Loader]] = MappingProxyType(
    {"native": NativeLoader(), "k6": K6Loader(), "locust": LocustLoader()}
)


def needs_tls(loader: str, stack: StackName) -> bool:
    """Whether ``stack`` must be started with TLS for ``loader``: k6 (Go's HTTP client) speaks
    HTTP/2 only over TLS, and the zero-layer replicas speak HTTP/2."""
    return loader == "k6" and stack == StackName.ZEROLAYER


__all__ = ["LOADERS", "LoadResult", "Loader", "RequestFailed", "needs_tls"]
