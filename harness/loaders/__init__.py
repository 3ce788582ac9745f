"""Loaders: ``native`` (open-loop asyncio, the default), ``k6`` and ``locust``."""

from harness.loaders.base import LOADERS, LoadResult, RequestFailed

__all__ = ["LOADERS", "LoadResult", "RequestFailed"]
