"""The zero-layer engine replica: an HTTP/2 (and HTTP/1.1) server with an embedded scheduler.

Modules: ``core`` (routing, admission and the engine run, independent of the wire), ``openai``
(request bodies and response framing), ``h2proto`` and ``h1proto`` (the two protocols),
``connection`` (protocol detection, ALPN), ``status`` (``/health``, ``/metrics``), ``app``
(:func:`start_replica`), ``cli`` (``zl-replica``).
"""

from zerolayer.server.app import ReplicaHandle, start_replica, tls_context

__all__ = ["ReplicaHandle", "start_replica", "tls_context"]
