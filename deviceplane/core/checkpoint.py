"""The device manager's checkpoint file `kubelet_internal_checkpoint`: model, checksum, JSON codec (spec §4.9).

Byte-compatible with the kubelet in both directions: what one writes, the other reads and verifies. Go's nil and
empty values are kept apart (None versus [] or {}) because the checksum hashes them differently.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, NoReturn, TypeVar

from deviceplane.core.checkpoint_data import CheckpointData, DevicesByResource, DevicesPerNuma, PodDevicesEntry
from deviceplane.core.constants import INT64_MAX, INT64_MIN
from deviceplane.core.spew import framed_pieces, spew_entry, spew_pieces, spew_registered_item, spew_text

__all__ = [
    "CheckpointData",
    "CheckpointEncoder",
    "CheckpointError",
    "CheckpointFormatError",
    "CorruptCheckpointError",
    "DevicesByResource",
    "DevicesPerNuma",
    "PodDevicesEntry",
    "checkpoint_data_for_write",
    "checksum",
    "decode",
    "encode",
    "fnv1a_32",
    "spew_text",
]


def checkpoint_data_for_write(
    entries: Iterable[PodDevicesEntry], healthy_devices: Mapping[str, Iterable[str]]
) -> CheckpointData:
    """What the kubelet's `writeCheckpoint` builds.

    Entries without an allocation response are skipped, and no entries at all is a nil list (`null`). Every resource
    is listed with its healthy IDs, `[]` when it has none; sorted here, where upstream's order is random.
    """
    kept = [entry for entry in entries if entry.AllocResp is not None]
    registered = {resource: sorted(ids) for resource, ids in healthy_devices.items()}
    return CheckpointData(PodDeviceEntries=kept or None, RegisteredDevices=registered)


# -- checksum ---------------------------------------------------------------------------------------------------------

_FNV32_OFFSET_BASIS = 0x811C9DC5
_FNV32_PRIME = 0x01000193


def fnv1a_32_pure(data: bytes) -> int:
    value = _FNV32_OFFSET_BASIS
    for byte in data:
        value = ((value ^ byte) * _FNV32_PRIME) & 0xFFFFFFFF
    return value


def _compiled_fnv1a_32() -> Callable[[bytes], int]:
    """The compiled implementation: ~100x faster, which matters for checkpoints of 100,000 devices (~1 MB)."""
    try:
        from fnv_hash_fast import fnv1a_32 as compiled
    except ImportError:  # pragma: no cover - the dependency is declared; keep working without it
        return fnv1a_32_pure
    return compiled


fnv1a_32 = _compiled_fnv1a_32()


def checksum(data: CheckpointData) -> int:
    """The kubelet's checksum: FNV-1a 32 of the go-spew text of the data."""
    return fnv1a_32(spew_text(data).encode())


# -- errors -----------------------------------------------------------------------------------------------------------


class CheckpointError(ValueError):
    """The checkpoint cannot be used; the kubelet would start with empty state."""


class CheckpointFormatError(CheckpointError):
    """Not JSON the kubelet could decode into its checkpoint types."""


class CorruptCheckpointError(CheckpointError):
    """Decoded, but the stored checksum is not the checksum of the decoded data (upstream's message and fields)."""

    def __init__(self, actual: int, expected: int) -> None:
        super().__init__("checkpoint is corrupted")
        self.actual = actual  # computed from the decoded data
        self.expected = expected  # stored in the file


# -- encoding: Go encoding/json output, byte for byte -----------------------------------------------------------------


def encode(data: CheckpointData) -> bytes:
    """The file's bytes, as the kubelet's `json.Marshal` would write them, checksum included (from scratch; a
    `CheckpointEncoder` kept from one checkpoint to the next makes the same bytes, faster).

    Raises ValueError for what Go could not hold: a NUMA id outside int64 or a string that is not valid Unicode.
    """
    return CheckpointEncoder().encode(data)


def _registered_parts(name: str, ids: list[str] | None) -> tuple[bytes, bytes]:
    """One resource's part of RegisteredDevices, in JSON and in go-spew, UTF-8."""
    return f"{_json_string(name)}:{_string_list_json(ids)}".encode(), spew_registered_item(name, ids).encode()


def _encode_steps(
    listed: bool,
    json_chunks: Sequence[bytes],
    spew_chunks: Sequence[bytes],
    registered: tuple[Sequence[bytes], Sequence[bytes]] | None,
) -> Generator[None, None, bytes]:
    """`encode` from the entries' texts in UTF-8 (`listed` False: a nil list), each chunk one entry's or the texts
    of consecutive entries joined by "," (JSON) and " " (go-spew), and RegisteredDevices' JSON and go-spew parts in
    the order of the resources' names (None: a nil map); yielding between its steps, each one pass over the text."""
    hashed = b"".join(spew_pieces(spew_chunks if listed else None, None if registered is None else registered[1]))
    yield
    digest = fnv1a_32(hashed)
    yield
    pieces = [b'{"Data":{"PodDeviceEntries":']
    pieces += framed_pieces(b"[", json_chunks, b",", b"]") if listed else [b"null"]
    pieces.append(b',"RegisteredDevices":')
    pieces += [b"null"] if registered is None else framed_pieces(b"{", registered[0], b",", b"}")
    pieces.append(b'},"Checksum":%d}' % digest)
    return b"".join(pieces)


def _finish(steps: Generator[None, None, bytes]) -> bytes:
    """Run `steps` to their end without pausing; what they return."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            result: bytes = done.value
            return result


class CheckpointEncoder:
    """`encode`, keeping each entry's JSON and go-spew texts while the entry is in the data written. Entries never
    change once made (PodDevices replaces an entry, it does not edit one), and most outlive many checkpoints, so a
    checkpoint costs the texts of the entries new since the last one rather than of all: with 5,000 entries ~40 ms of
    pure Python became ~6 ms (benchmarks/checkpoint_encode.py). Each resource's RegisteredDevices texts are kept the
    same way, while its list is the same object (the registry shares a resource's sorted list until its devices
    change); a list passed in must not be modified afterwards. One writer at a time (the caller serialises).

    `encode_in_slices` does the same work in slices, for a caller on an event loop that runs other work between
    them (agent.state.checkpoint_writer): the encoding never holds the loop for long at once, and no thread competes
    with it for the GIL."""

    def __init__(self) -> None:
        # id(entry) -> (entry, (JSON, spew)); the entry is kept so that its id cannot be reused by another meanwhile.
        self._kept: dict[int, tuple[PodDevicesEntry, tuple[str, str]]] = {}
        # resource -> (its RegisteredDevices list, held so that the object stays the same one; its JSON and spew parts)
        self._registered: dict[str, tuple[list[str] | None, tuple[bytes, bytes]]] = {}

    def encode(self, data: CheckpointData) -> bytes:
        return _finish(self.encode_in_slices(data, lambda: 0.0, 1.0))

    def encode_in_slices(
        self, data: CheckpointData, clock: Callable[[], float], slice_seconds: float
    ) -> Generator[None, None, bytes]:
        """`encode(data)`, yielding whenever `slice_seconds` of `clock` have passed since it last yielded (checked
        every `_CHUNK_ENTRIES` entries), and between the final steps (one pass each over the text; the checksum's,
        a single call, ~1.5-2 ms at 5,000 entries). Returns the bytes. Raises what `encode` raises, and then keeps
        no text of this data."""
        kept = self._kept
        now: dict[int, tuple[PodDevicesEntry, tuple[str, str]]] = {}
        # The entries' texts joined and encoded a chunk at a time, so that the final joins copy a few long strings
        # rather than visit thousands of short ones spread over the heap (2-4 ms on the agent's loop).
        json_chunks: list[bytes] = []
        spew_chunks: list[bytes] = []
        chunk: list[tuple[str, str]] = []
        slice_ends = clock() + slice_seconds
        for entry in data.PodDeviceEntries or ():
            key = id(entry)
            known = kept.get(key)
            if known is None or known[0] is not entry:
                known = (entry, (_entry_json(entry), spew_entry(entry)))
            now[key] = known
            chunk.append(known[1])
            if len(chunk) == _CHUNK_ENTRIES:
                _add_chunk(chunk, json_chunks, spew_chunks)
                chunk = []
                if clock() >= slice_ends:
                    yield
                    slice_ends = clock() + slice_seconds
        _add_chunk(chunk, json_chunks, spew_chunks)
        devices = data.RegisteredDevices or {}
        registered: dict[str, tuple[list[str] | None, tuple[bytes, bytes]]] = {}
        for name in sorted(devices):  # Go's key order: code points, which is UTF-8 byte order
            ids = devices[name]
            known_part = self._registered.get(name)
            if known_part is None or known_part[0] is not ids:
                known_part = (ids, _registered_parts(name, ids))
                if clock() >= slice_ends:
                    yield
                    slice_ends = clock() + slice_seconds
            registered[name] = known_part
        self._kept = now  # only what this checkpoint holds: released entries are forgotten
        self._registered = registered
        parts = None
        if data.RegisteredDevices is not None:
            kept_parts = [known_part for _, known_part in registered.values()]
            parts = ([json_part for json_part, _ in kept_parts], [spew_part for _, spew_part in kept_parts])
        yield
        return (yield from _encode_steps(data.PodDeviceEntries is not None, json_chunks, spew_chunks, parts))


# Entries per chunk of text, and per reading of the clock: an entry costs ~1 us when its texts are kept, ~10 us when
# they are made.
_CHUNK_ENTRIES = 32


def _add_chunk(chunk: list[tuple[str, str]], json_chunks: list[bytes], spew_chunks: list[bytes]) -> None:
    if chunk:
        json_chunks.append(",".join(as_json for as_json, _ in chunk).encode())
        spew_chunks.append(" ".join(as_spew for _, as_spew in chunk).encode())


def _entry_json(entry: PodDevicesEntry) -> str:
    return (
        f'{{"PodUID":{_json_string(entry.PodUID)}'
        f',"ContainerName":{_json_string(entry.ContainerName)}'
        f',"ResourceName":{_json_string(entry.ResourceName)}'
        f',"DeviceIDs":{_numa_keyed_json(entry.DeviceIDs)}'
        f',"AllocResp":{_bytes_json(entry.AllocResp)}}}'
    )


def _numa_keyed_json(devices: DevicesPerNuma | None) -> str:
    if devices is None:
        return "null"
    for numa in devices:
        if not INT64_MIN <= numa <= INT64_MAX:
            raise ValueError(f"NUMA node id {numa} does not fit Go's int64")
    # Go sorts map keys by their encoded text, so 10 comes before 2.
    keys = sorted(str(numa) for numa in devices)
    return "{" + ",".join(f'"{key}":{_string_list_json(devices[int(key)])}' for key in keys) + "}"


def _string_list_json(values: Iterable[str] | None) -> str:
    if values is None:
        return "null"
    items = list(values)
    if not items:
        return "[]"
    if _JSON_NEEDS_ESCAPE.search(" ".join(items)) is None:  # the usual case: one scan for a whole device list
        return '["' + '","'.join(items) + '"]'
    return "[" + ",".join(_json_string(v) for v in items) + "]"


def _bytes_json(data: bytes | None) -> str:
    if data is None:
        return "null"
    return '"' + base64.b64encode(data).decode("ascii") + '"'


# Go escapes control characters, quote and backslash, and (HTML safety) <, >, &, U+2028 and U+2029.
_JSON_NEEDS_ESCAPE = re.compile('[\x00-\x1f"\\\\<>&\u2028\u2029\ud800-\udfff]')
_JSON_SHORT_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _json_string(text: str) -> str:
    return '"' + _JSON_NEEDS_ESCAPE.sub(_json_escape, text) + '"'


def _json_escape(match: re.Match[str]) -> str:
    char = match.group()
    if "\ud800" <= char <= "\udfff":
        raise ValueError(f"string {_preview(match.string)!r} is not valid Unicode (lone surrogate)")
    return _JSON_SHORT_ESCAPES.get(char) or f"\\u{ord(char):04x}"


def _preview(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


# -- decoding: what the kubelet's json.Unmarshal + VerifyChecksum accept, and the values they produce ------------------


def decode(raw: bytes) -> CheckpointData:
    """Decode a checkpoint file as the kubelet does, and verify its checksum.

    Raises CheckpointFormatError where Go's `json.Unmarshal` fails (bad JSON, wrong types) and CorruptCheckpointError
    where the checksum of the decoded values differs from the stored one. Go's decoding rules are followed, including
    the unusual ones: keys match field names case-insensitively, unknown keys are ignored, invalid UTF-8 in strings
    becomes U+FFFD, a repeated key decodes into what the previous one left.
    """
    document = _parse_json(raw)
    # The kubelet decodes into an empty (not nil) slice and map, so a missing key reads as [] or {}.
    state = _DataState(entries=_GoSlice(), registered={})
    stored = 0
    if document is not None:  # JSON null leaves everything as it was, as for any Go struct
        for name, value in _struct_fields(document, "checkpoint", _FILE_FIELDS):
            if name == "Data":
                _decode_checkpoint_data(value, state)
            else:
                stored = _decode_uint(value, stored, 64, "Checksum")
    data = state.freeze()
    actual = checksum(data)
    if actual != stored:
        raise CorruptCheckpointError(actual=actual, expected=stored)
    return data


class _JsonObject:
    """A parsed JSON object with its keys in order, repeats included (Go applies them one after the other)."""

    __slots__ = ("pairs",)

    def __init__(self, pairs: list[tuple[str, object]]) -> None:
        self.pairs = pairs


class _JsonNumber:
    """A JSON number, kept as its literal: Go parses it according to the target type."""

    __slots__ = ("literal",)

    def __init__(self, literal: str) -> None:
        self.literal = literal


def _parse_json(raw: bytes) -> object:
    # Bytes that are not UTF-8 become lone surrogates: a syntax error outside strings, U+FFFD inside (as in Go).
    text = raw.decode("utf-8", "surrogateescape")
    try:
        return json.loads(
            text,
            object_pairs_hook=_JsonObject,
            parse_int=_JsonNumber,
            parse_float=_JsonNumber,
            parse_constant=_reject_non_json_constant,
        )
    except (ValueError, RecursionError) as err:
        raise CheckpointFormatError(f"invalid JSON: {err}") from err


def _reject_non_json_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not a JSON value")


_SURROGATES = re.compile("[\ud800-\udfff]")


def _go_string(text: str) -> str:
    """Go decodes invalid UTF-8 and unpaired surrogate escapes in JSON strings to U+FFFD."""
    return _SURROGATES.sub("\ufffd", text)


# Go matches JSON keys to field names with Unicode simple case folding: besides ASCII case, the Kelvin sign folds
# to K and the long s to S.
_FOLD_TO_ASCII = {"\u212a": "K", "\u017f": "S"}


def _go_fold(key: str) -> str:
    return "".join(_FOLD_TO_ASCII.get(c, c.upper() if c.isascii() else c) for c in key)


def _field_index(*names: str) -> dict[str, str]:
    return {_go_fold(name): name for name in names}


_FILE_FIELDS = _field_index("Data", "Checksum")
_DATA_FIELDS = _field_index("PodDeviceEntries", "RegisteredDevices")
_ENTRY_FIELDS = _field_index("PodUID", "ContainerName", "ResourceName", "DeviceIDs", "AllocResp")


def _struct_fields(value: object, where: str, fields: dict[str, str]) -> Iterator[tuple[str, object]]:
    """The (field name, value) pairs of a JSON object decoded into a Go struct, unknown keys skipped."""
    if not isinstance(value, _JsonObject):
        _cannot_decode(value, where, "struct")
    for key, item in value.pairs:
        name = fields.get(_go_fold(key))
        if name is not None:
            yield name, item


def _cannot_decode(value: object, where: str, go_type: str) -> NoReturn:
    raise CheckpointFormatError(f"cannot decode a JSON {_json_kind(value)} into {where} ({go_type})")


def _json_kind(value: object) -> str:
    if isinstance(value, _JsonObject):
        return "object"
    if isinstance(value, list):
        return "array"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, _JsonNumber):
        return f"number {value.literal}"
    return "string" if isinstance(value, str) else "null"


T = TypeVar("T")


class _GoSlice(Generic[T]):
    """A Go slice: `length` items at the front of a backing array that can hold more.

    Go decodes a JSON array into the existing backing array element by element, so a repeated key decodes into (and
    through `null` keeps) what an earlier one left; modelled so such files verify exactly as in the kubelet.
    """

    __slots__ = ("backing", "length")

    def __init__(self, backing: list[T] | None = None, length: int = 0) -> None:
        self.backing = backing if backing is not None else []
        self.length = length

    def items(self) -> list[T]:
        return self.backing[: self.length]


def _decode_array(
    value: object,
    into: _GoSlice[T] | None,
    zero: Callable[[], T],
    decode_element: Callable[[object, T, str], T],
    where: str,
    go_type: str,
) -> _GoSlice[T] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        _cannot_decode(value, where, go_type)
    if not value:
        return _GoSlice()  # Go allocates a new empty slice
    target = into if into is not None else _GoSlice()
    for index, item in enumerate(value):
        if index == len(target.backing):
            target.backing.append(zero())
        target.backing[index] = decode_element(item, target.backing[index], f"{where}[{index}]")
    target.length = len(value)
    return target


def _decode_string(value: object, current: str, where: str) -> str:
    if value is None:
        return current
    if not isinstance(value, str):
        _cannot_decode(value, where, "string")
    return _go_string(value)


_UNSIGNED_LITERAL = re.compile("[0-9]+")
_SIGNED_LITERAL = re.compile("[-+]?[0-9]+")  # strconv.ParseInt, base 10


def _decode_uint(value: object, current: int, bits: int, where: str) -> int:
    if value is None:
        return current
    if isinstance(value, _JsonNumber) and _UNSIGNED_LITERAL.fullmatch(value.literal):
        number = int(value.literal)
        if number < 2**bits:
            return number
    _cannot_decode(value, where, f"uint{bits}")


def _decode_byte(value: object, current: int, where: str) -> int:
    return _decode_uint(value, current, 8, where)


def _decode_string_list(value: object, where: str) -> list[str] | None:
    # Map values are decoded into a fresh nil slice each time.
    decoded = _decode_array(value, None, str, _decode_string, where, "[]string")
    return None if decoded is None else decoded.items()


def _decode_bytes(value: object, into: _GoSlice[int] | None, where: str) -> _GoSlice[int] | None:
    if not isinstance(value, str):
        return _decode_array(value, into, int, _decode_byte, where, "[]uint8")  # Go accepts an array of numbers too
    # Go's StdEncoding: padding required, CR and LF skipped anywhere.
    compact = value.replace("\r", "").replace("\n", "")
    if len(compact) % 4 or not _BASE64.fullmatch(compact):
        raise CheckpointFormatError(f"{where}: illegal base64 data")
    decoded = base64.b64decode(compact)
    capacity = len(value) // 4 * 3  # Go decodes into make([]byte, DecodedLen(len(s)))
    return _GoSlice(list(decoded) + [0] * (capacity - len(decoded)), len(decoded))


_BASE64 = re.compile("[A-Za-z0-9+/]*={0,2}")


def _decode_numa_map(
    value: object, into: dict[int, list[str] | None] | None, where: str
) -> dict[int, list[str] | None] | None:
    if value is None:
        return None
    if not isinstance(value, _JsonObject):
        _cannot_decode(value, where, "checkpoint.DevicesPerNUMA")
    target = into if into is not None else {}  # Go adds to an existing map
    for key, item in value.pairs:
        devices = _decode_string_list(item, f"{where}[{key}]")
        if not _SIGNED_LITERAL.fullmatch(key) or not INT64_MIN <= int(key) <= INT64_MAX:
            raise CheckpointFormatError(f"{where}: map key {key!r} is not an int64")
        target[int(key)] = devices
    return target


def _decode_string_keyed_map(
    value: object, into: dict[str, list[str] | None] | None, where: str
) -> dict[str, list[str] | None] | None:
    if value is None:
        return None
    if not isinstance(value, _JsonObject):
        _cannot_decode(value, where, "map[string][]string")
    target = into if into is not None else {}  # Go adds to an existing map
    for key, item in value.pairs:
        target[_go_string(key)] = _decode_string_list(item, f"{where}[{key}]")
    return target


@dataclass
class _EntryState:
    """A PodDevicesEntry being decoded (mutable, as Go decodes into it in place)."""

    PodUID: str = ""
    ContainerName: str = ""
    ResourceName: str = ""
    DeviceIDs: dict[int, list[str] | None] | None = None
    AllocResp: _GoSlice[int] | None = None

    def freeze(self) -> PodDevicesEntry:
        return PodDevicesEntry(
            PodUID=self.PodUID,
            ContainerName=self.ContainerName,
            ResourceName=self.ResourceName,
            DeviceIDs=None if self.DeviceIDs is None else dict(self.DeviceIDs),
            AllocResp=None if self.AllocResp is None else bytes(self.AllocResp.items()),
        )


def _decode_entry(value: object, current: _EntryState, where: str) -> _EntryState:
    if value is None:
        return current
    for name, item in _struct_fields(value, where, _ENTRY_FIELDS):
        path = f"{where}.{name}"
        if name == "PodUID":
            current.PodUID = _decode_string(item, current.PodUID, path)
        elif name == "ContainerName":
            current.ContainerName = _decode_string(item, current.ContainerName, path)
        elif name == "ResourceName":
            current.ResourceName = _decode_string(item, current.ResourceName, path)
        elif name == "DeviceIDs":
            current.DeviceIDs = _decode_numa_map(item, current.DeviceIDs, path)
        else:
            current.AllocResp = _decode_bytes(item, current.AllocResp, path)
    return current


@dataclass
class _DataState:
    entries: _GoSlice[_EntryState] | None
    registered: dict[str, list[str] | None] | None = field(default=None)

    def freeze(self) -> CheckpointData:
        entries = None if self.entries is None else [e.freeze() for e in self.entries.items()]
        registered = None if self.registered is None else dict(self.registered)
        return CheckpointData(PodDeviceEntries=entries, RegisteredDevices=registered)


def _decode_checkpoint_data(value: object, state: _DataState) -> None:
    if value is None:
        return
    for name, item in _struct_fields(value, "Data", _DATA_FIELDS):
        path = f"Data.{name}"
        if name == "PodDeviceEntries":
            go_type = "[]checkpoint.PodDevicesEntry"
            state.entries = _decode_array(item, state.entries, _EntryState, _decode_entry, path, go_type)
        else:
            state.registered = _decode_string_keyed_map(item, state.registered, path)
