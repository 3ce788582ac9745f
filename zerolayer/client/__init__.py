"""The zero-layer client SDK: routing, HTTP/2 to replicas, and the same API over HTTP/1.1."""

from zerolayer.client.codec import BadRequestError, Chunk, ZeroLayerError
from zerolayer.client.health import Hysteresis, healthy
from zerolayer.client.http1 import Http1Client
from zerolayer.client.ring import HashRing
from zerolayer.client.sdk import ZeroLayerClient
from zerolayer.client.stream import Completion, Stream
from zerolayer.client.timing import Timing

__all__ = [
    "BadRequestError",
    "Chunk",
    "Completion",
    "HashRing",
    "Http1Client",
    "Hysteresis",
    "Stream",
    "Timing",
    "ZeroLayerClient",
    "ZeroLayerError",
    "healthy",
]
