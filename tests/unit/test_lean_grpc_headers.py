"""HPACK in the lean gRPC client: decoding checked against the hpack library's encoder (every representation:
indexed, literal with and without indexing, Huffman or not, table size updates, eviction), the decode cache never
returning what the current table would not, and the request blocks and grpc-timeout as a server reads them."""

from __future__ import annotations

import hpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from deviceplane.lean_grpc.headers import (
    HeaderDecodeError,
    HeaderDecoder,
    encode_timeout,
    grpc_message,
    request_block,
    timeout_field,
)
from tests.support.fuzz import fuzz_settings

NAMES = st.sampled_from([":status", "content-type", "grpc-status", "grpc-message", "x-custom", "date", "a" * 70])
VALUES = st.one_of(st.sampled_from(["200", "0", "application/grpc", "", "13"]), st.text("abcXYZ %é\t", max_size=90))
HEADER_LISTS = st.lists(st.tuples(NAMES, VALUES), max_size=6)
BLOCKS = st.lists(st.one_of(HEADER_LISTS, st.sampled_from([[(":status", "200"), ("grpc-status", "0")]])), min_size=1,
                  max_size=12)  # fmt: skip


def latin1(headers: list[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
    """What the decoder returns for these headers: octets as latin-1 text."""
    return tuple((n.encode().decode("latin-1"), v.encode().decode("latin-1")) for n, v in headers)


@fuzz_settings(bounded=300, long=20_000)
@given(BLOCKS, st.booleans(), st.lists(st.sampled_from([None, 0, 100, 256, 4096]), min_size=12, max_size=12))
def test_decodes_what_hpack_encodes(
    blocks: list[list[tuple[str, str]]], huffman: bool, sizes: list[int | None]
) -> None:
    encoder = hpack.Encoder()
    decoder = HeaderDecoder(1 << 20)
    for headers, size in zip(blocks, sizes, strict=False):
        if size is not None:
            encoder.header_table_size = size  # the next block starts with a size update
        block = encoder.encode(headers, huffman=huffman)
        # Repeated headers come back as the same indexed bytes: those decodes are served by the cache.
        assert decoder.decode(block) == latin1(headers)


def test_cache_follows_the_dynamic_table() -> None:
    """The same bytes mean different headers once the table changed: never answered from a stale cache."""
    encoder = hpack.Encoder()
    decoder = HeaderDecoder(1 << 20)
    first = encoder.encode([("x-a", "one")])  # literal with indexing: x-a: one becomes dynamic index 62
    assert decoder.decode(first) == (("x-a", "one"),)
    indexed = encoder.encode([("x-a", "one")])  # now one byte: index 62
    assert indexed == b"\xbe"
    assert decoder.decode(indexed) == (("x-a", "one"),)
    assert decoder.decode(indexed) == (("x-a", "one"),)  # from the cache
    assert decoder.decode(encoder.encode([("x-b", "two")])) == (("x-b", "two"),)  # inserted: index 62 is now x-b
    assert decoder.decode(b"\xbe") == (("x-b", "two"),)
    assert decoder.decode(b"\xbf") == (("x-a", "one"),)


@pytest.mark.parametrize(
    "block",
    [b"\x80", b"\xff\xff\xff\xff\xff\xff\x7f", b"\x40\x05ab", b"\x00\x85\xff\xff", b"\x3f\xe2\x1f", b"\xc0", b"\x0f"],
)
def test_broken_blocks_are_refused(block: bytes) -> None:
    with pytest.raises(HeaderDecodeError):
        HeaderDecoder(1 << 20).decode(block)


def test_header_list_size_is_bounded() -> None:
    block = hpack.Encoder().encode([("x-big", "v" * 5000)])
    with pytest.raises(HeaderDecodeError, match="larger than"):
        HeaderDecoder(4096).decode(block)


def test_request_block_reads_as_a_grpc_request() -> None:
    block = request_block("/v1beta1.DevicePlugin/Allocate", "localhost", "ua/1") + timeout_field(10)
    assert hpack.Decoder().decode(block) == [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", "/v1beta1.DevicePlugin/Allocate"),
        (":authority", "localhost"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
        ("user-agent", "ua/1"),
        ("grpc-timeout", "10000000u"),
    ]


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "0n"), (1e-9, "1n"), (0.0999, "99900000n"), (0.1, "100000u"), (10, "10000000u"), (100_000, "100000S"),
     (1e7, "10000000S"), (1e9, "16666667M"), (1e12, "99999999H")],
)  # fmt: skip
def test_grpc_timeout_is_at_most_8_digits_rounded_up(seconds: float, text: str) -> None:
    assert encode_timeout(seconds) == text


def test_grpc_message_is_percent_decoded_utf8() -> None:
    assert grpc_message("caf%C3%A9 100%25 %ZZ") == "café 100% %ZZ"
    assert grpc_message("caf\xc3\xa9") == "café"  # sent unencoded: kept as the server meant it
