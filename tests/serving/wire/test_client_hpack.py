"""The HPACK pieces of the zero-layer path against the hpack library, field for field.

``FastDecoder`` must decode every block exactly as ``hpack.Decoder`` does (same headers, same
tuple types, same table state, same errors), whatever the encoder chose: static and dynamic
indexes, incremental indexing, never-indexed fields, Huffman or not, table size updates.
"""

from __future__ import annotations

import pytest
from hpack import Decoder, Encoder, HeaderTuple, NeverIndexedHeaderTuple
from hpack.exceptions import HPACKDecodingError, InvalidTableSizeError, OversizedHeaderListError
from hypothesis import given, settings
from hypothesis import strategies as st

from serving.wire.hpackdec import FastDecoder
from serving.wire.hpackenc import LiteralEncoder

_names = st.sampled_from(
    [b":method", b":path", b"content-type", b"zl-session", b"zl-tenant", b"x-long-" + b"n" * 150]
)
_values = st.binary(min_size=0, max_size=300)
_field = st.tuples(_names, _values, st.booleans())  # (name, value, never indexed)
_blocks = st.lists(st.lists(_field, min_size=0, max_size=12), min_size=1, max_size=8)


def _tuples(fields: list[tuple[bytes, bytes, bool]]) -> list[HeaderTuple]:
    return [NeverIndexedHeaderTuple(n, v) if never else HeaderTuple(n, v) for n, v, never in fields]


def _same(a: object, b: object) -> None:
    assert [(type(h), tuple(h)) for h in a] == [(type(h), tuple(h)) for h in b]  # type: ignore[attr-defined]


@settings(max_examples=150, deadline=None)
@given(blocks=_blocks, huffman=st.booleans(), table_size=st.sampled_from([0, 256, 4096]))
def test_fast_decoder_matches_hpack_on_library_encoded_blocks(
    blocks: list[list[tuple[bytes, bytes, bool]]], huffman: bool, table_size: int
) -> None:
    encoder = Encoder()
    encoder.header_table_size = table_size
    ours, theirs = FastDecoder(), Decoder()
    for fields in blocks:
        block = encoder.encode(_tuples(fields), huffman=huffman)
        _same(ours.decode(block, raw=True), theirs.decode(block, raw=True))
        assert ours.header_table.dynamic_entries == theirs.header_table.dynamic_entries
        assert ours.header_table_size == theirs.header_table_size


@settings(max_examples=50, deadline=None)
@given(blocks=_blocks)
def test_fast_decoder_matches_hpack_on_our_literal_encoder(
    blocks: list[list[tuple[bytes, bytes, bool]]],
) -> None:
    encoder = LiteralEncoder()
    ours, theirs = FastDecoder(), Decoder()
    for fields in blocks:
        block = encoder.encode([(n, v) for n, v, _ in fields])
        _same(ours.decode(block, raw=True), theirs.decode(block, raw=True))


def test_unicode_mode_matches() -> None:
    block = Encoder().encode([(b":path", "/caf\u00e9".encode()), (b"zl-tenant", b"t")])
    expected = [(":path", "/caf\u00e9"), ("zl-tenant", "t")]
    assert FastDecoder().decode(block) == Decoder().decode(block) == expected


@pytest.mark.parametrize(
    ("block", "error"),
    [
        (b"\xff", HPACKDecodingError),  # indexed field, integer cut short
        (b"\xff\x80\x80\x80\x80\x80\x80\x01", HPACKDecodingError),  # integer far too long
        (b"\xc0", HPACKDecodingError),  # index 64: nothing in the dynamic table
        (b"\x00\x05ab", HPACKDecodingError),  # literal name longer than the block
        (b"\x82\x20", HPACKDecodingError),  # size update after a field
        (b"\x3f\xe2\x1f", InvalidTableSizeError),  # size update to 4097, above the maximum
    ],
)
def test_malformed_blocks_raise_what_hpack_raises(block: bytes, error: type[Exception]) -> None:
    for decoder in (FastDecoder(), Decoder()):
        with pytest.raises(error):
            decoder.decode(block, raw=True)


def test_oversized_header_list_is_refused() -> None:
    block = Encoder().encode([(b"x-big", b"v" * 200)] * 5, huffman=False)
    for decoder in (FastDecoder(), Decoder()):
        decoder.max_header_list_size = 600
        with pytest.raises(OversizedHeaderListError):
            decoder.decode(block, raw=True)
