"""h2's connection state machine with cheaper stream counting and header decoding.

Both ends of the zero-layer path (the SDK's connection and the replica's) use this subclass of
``h2.connection.H2Connection``: the protocol logic is h2's, unchanged, and so is its inbound header
validation. Two things differ: header blocks are decoded by ``hpackdec.FastDecoder`` (same results
as hpack's decoder, less CPU), and h2 scans its stream table less often. h2 counts open streams, to
enforce MAX_CONCURRENT_STREAMS, by walking every stream it holds each time a stream opens (dropping
closed ones as it goes). That is O(streams) per new stream, so a backlog of a few thousand streams
makes every request cost milliseconds and turns a short overload into a collapse. Here the table
size is used whenever it is below both concurrency limits and below a rescan mark: it is an upper
bound of the open count, so h2's ``count + 1 > limit`` checks decide exactly as they would with the
exact count. Otherwise h2's own scan runs, and the next one waits until the table has doubled (plus
a margin), so closed streams are still purged and the table stays within twice the live streams.
"""

from __future__ import annotations

import h2.config
import h2.connection

from zerolayer.wire.hpackdec import FastDecoder

RESCAN_MARGIN = 64


class H2State(h2.connection.H2Connection):
    """``h2.connection.H2Connection`` with cheap open-stream counting (see the module docstring).

    ``open_outbound_streams`` and ``open_inbound_streams`` may return an upper bound (never
    above the concurrency limit in force) instead of the exact count.
    """

    def __init__(self, config: h2.config.H2Configuration | None = None) -> None:
        super().__init__(config=config)
        self._rescan_at = RESCAN_MARGIN
        decoder = FastDecoder()
        decoder.max_header_list_size = self.decoder.max_header_list_size
        decoder.max_allowed_table_size = self.decoder.max_allowed_table_size
        self.decoder = decoder

    def _open_streams(self, remainder: int) -> int:
        bound = len(self.streams)
        limit = min(
            self.local_settings.max_concurrent_streams,
            self.remote_settings.max_concurrent_streams,
        )
        if bound < self._rescan_at and bound + 1 <= limit:
            return bound
        count = super()._open_streams(remainder)
        self._rescan_at = 2 * len(self.streams) + RESCAN_MARGIN
        return count
