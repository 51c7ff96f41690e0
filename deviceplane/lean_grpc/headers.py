"""HPACK (RFC 7541) for the client side of gRPC: request blocks built once per method, response blocks decoded.

Requests are encoded without the dynamic table (literal fields without indexing, names from the static table where
it has them): there is nothing to keep in step with the server, and each method's block is the same bytes every
call, built once. Responses are decoded by a complete decoder, since the server may index and Huffman-code what it
likes. A response block that leaves the dynamic table unchanged decodes to the same headers for as long as the table
stays unchanged, so those results are remembered until it changes: a gRPC server's steady responses (indexed fields
only) cost one dict lookup per block.
"""

from __future__ import annotations

import math
from collections import deque
from urllib.parse import unquote

from hpack.exceptions import HPACKDecodingError
from hpack.huffman_table import decode_huffman
from hpack.table import HeaderTable

Headers = tuple[tuple[str, str], ...]

# Names and values are kept as latin-1 text: one character per octet, so lengths (and table sizes) are octets.
_STATIC: tuple[tuple[str, str], ...] = tuple(
    (name.decode("latin-1"), value.decode("latin-1")) for name, value in HeaderTable.STATIC_TABLE
)
DEFAULT_TABLE_SIZE = 4096  # SETTINGS_HEADER_TABLE_SIZE: the client never announces another
ENTRY_OVERHEAD = 32
MAX_INTEGER = 1 << 32  # far above any legitimate length or index; bounds what a hostile peer can make us compute
CACHE_ENTRIES = 64


class HeaderDecodeError(Exception):
    """A header block that does not decode: a connection error (COMPRESSION_ERROR), since the table is now unknown."""


class HeaderDecoder:
    def __init__(self, max_list_size: int) -> None:
        self._table: deque[tuple[str, str]] = deque()  # newest first: dynamic index 62 is the head
        self._size = 0
        self._max_size = DEFAULT_TABLE_SIZE
        self._max_list_size = max_list_size
        self._cache: dict[bytes, Headers] = {}

    def decode(self, block: bytes) -> Headers:
        found = self._cache.get(block)
        if found is not None:
            return found
        headers, changed = self._decode(block)
        if changed:
            self._cache.clear()  # remembered results may name entries that have moved or gone
        elif len(self._cache) < CACHE_ENTRIES:
            self._cache[block] = headers
        return headers

    def _decode(self, block: bytes) -> tuple[Headers, bool]:
        out: list[tuple[str, str]] = []
        changed = False
        listed = 0
        pos, end = 0, len(block)
        while pos < end:
            first = block[pos]
            if first & 0x80:  # indexed field
                index, pos = _integer(block, pos, 7)
                field = self._entry(index)
            elif first & 0x20 and not first & 0x40:  # dynamic table size update
                size, pos = _integer(block, pos, 5)
                if size > DEFAULT_TABLE_SIZE:
                    raise HeaderDecodeError(f"table size update to {size} exceeds {DEFAULT_TABLE_SIZE}")
                self._max_size = size
                self._evict()
                changed = True
                continue
            else:  # literal: with incremental indexing (01), without indexing (0000) or never indexed (0001)
                indexing = bool(first & 0x40)
                index, pos = _integer(block, pos, 6 if indexing else 4)
                if index:
                    name = self._entry(index)[0]
                else:
                    name, pos = _string(block, pos)
                value, pos = _string(block, pos)
                field = (name, value)
                if indexing:
                    self._add(field)
                    changed = True
            listed += len(field[0]) + len(field[1]) + ENTRY_OVERHEAD
            if listed > self._max_list_size:
                raise HeaderDecodeError(f"header list larger than {self._max_list_size} bytes")
            out.append(field)
        return tuple(out), changed

    def _entry(self, index: int) -> tuple[str, str]:
        if 0 < index <= len(_STATIC):
            return _STATIC[index - 1]
        dynamic = index - len(_STATIC) - 1
        if index == 0 or dynamic >= len(self._table):
            raise HeaderDecodeError(f"header index {index} out of range")
        return self._table[dynamic]

    def _add(self, field: tuple[str, str]) -> None:
        size = len(field[0]) + len(field[1]) + ENTRY_OVERHEAD
        if size > self._max_size:  # RFC 7541 4.4: the table is emptied and the entry is not added
            self._table.clear()
            self._size = 0
            return
        self._table.appendleft(field)
        self._size += size
        self._evict()

    def _evict(self) -> None:
        while self._size > self._max_size:
            name, value = self._table.pop()
            self._size -= len(name) + len(value) + ENTRY_OVERHEAD


def _integer(block: bytes, pos: int, prefix: int) -> tuple[int, int]:
    mask = (1 << prefix) - 1
    value = block[pos] & mask
    pos += 1
    if value < mask:
        return value, pos
    shift = 0
    while True:
        if pos >= len(block):
            raise HeaderDecodeError("truncated integer")
        octet = block[pos]
        pos += 1
        value += (octet & 0x7F) << shift
        shift += 7
        if value > MAX_INTEGER:
            raise HeaderDecodeError("integer too large")
        if not octet & 0x80:
            return value, pos


def _string(block: bytes, pos: int) -> tuple[str, int]:
    if pos >= len(block):
        raise HeaderDecodeError("truncated string")
    huffman = block[pos] & 0x80
    length, pos = _integer(block, pos, 7)
    end = pos + length
    if end > len(block):
        raise HeaderDecodeError("truncated string")
    raw = block[pos:end]
    if huffman:
        try:
            raw = decode_huffman(raw)
        except HPACKDecodingError as err:
            raise HeaderDecodeError(f"invalid Huffman string: {err}") from None
    return raw.decode("latin-1"), end


# -- requests --------------------------------------------------------------------------------------------------------


def _encode_integer(value: int, prefix: int, pattern: int) -> bytes:
    mask = (1 << prefix) - 1
    if value < mask:
        return bytes((pattern | value,))
    out = bytearray((pattern | mask,))
    value -= mask
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _encode_string(text: str) -> bytes:
    raw = text.encode("ascii")
    return _encode_integer(len(raw), 7, 0x00) + raw


def _literal(static_name_index: int, value: str) -> bytes:
    """A literal field without indexing, its name from the static table."""
    return _encode_integer(static_name_index, 4, 0x00) + _encode_string(value)


def _literal_new_name(name: str, value: str) -> bytes:
    return b"\x00" + _encode_string(name) + _encode_string(value)


def request_block(path: str, authority: str, user_agent: str) -> bytes:
    """The header block of a gRPC request to `path`, without its grpc-timeout (see `timeout_field`)."""
    return (
        b"\x83"  # :method POST (static 3)
        + b"\x86"  # :scheme http (static 6)
        + _literal(4, path)  # :path
        + _literal(1, authority)  # :authority
        + _literal(31, "application/grpc")  # content-type
        + _literal_new_name("te", "trailers")
        + _literal(58, user_agent)  # user-agent
    )


TIMEOUT_UNITS = (("n", 1), ("u", 10**3), ("m", 10**6), ("S", 10**9), ("M", 60 * 10**9), ("H", 3600 * 10**9))


def encode_timeout(seconds: float) -> str:
    """grpc-timeout: at most 8 digits and a unit, rounded up (the server must not give up before the client)."""
    nanos = max(0, math.ceil(seconds * 1e9))
    for unit, per in TIMEOUT_UNITS:
        value = -(-nanos // per)
        if value < 10**8:
            return f"{value}{unit}"
    return "99999999H"


def timeout_field(seconds: float) -> bytes:
    return _literal_new_name("grpc-timeout", encode_timeout(seconds))


def grpc_message(value: str) -> str:
    """A grpc-message header's text: percent-encoded UTF-8 (what a server sends unencoded is kept as it came)."""
    return unquote(value.encode("latin-1").decode("utf-8", "replace"), errors="replace")
