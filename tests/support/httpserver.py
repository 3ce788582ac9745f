"""A loopback HTTP server for tests: by default one that answers every request (501, the
standard library's bare handler), an external stack that speaks HTTP; or any handler's."""

from __future__ import annotations

import contextlib
import http.server
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def answering_url(
    handler: type[http.server.BaseHTTPRequestHandler] = http.server.BaseHTTPRequestHandler,
) -> Iterator[str]:
    """The URL of a server answering with ``handler`` until the block ends."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
