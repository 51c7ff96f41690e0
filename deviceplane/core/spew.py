"""The text the kubelet hashes for its checkpoint checksum (spec §4.9).

Upstream hashes `spew.ConfigState{SortKeys: true, DisableMethods: true, ...}.Sprintf("%#v", checkpointData)`
(k8s.io/utils `dump.ForHash`). This reproduces that output for the checkpoint's types only:
- a struct field's value is preceded by its Go type in parentheses; slice and map elements, keys and values are not;
- strings are printed raw (no quotes, no escaping), byte slices as decimal numbers;
- nil slices and maps print `<nil>`, empty ones `[]` and `map[]`;
- map keys are sorted: int64 keys numerically, string keys bytewise.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from deviceplane.core.checkpoint_data import CheckpointData, PodDevicesEntry

_NIL = "<nil>"
# Each byte's decimal text: looking it up is ~1.7x faster than str() per byte, and an Allocate response of a few
# hundred bytes (a GPU's device nodes, mounts and CDI names) is most of an entry's text.
_BYTE_TEXTS = tuple(str(value) for value in range(256))


def spew_entry(entry: PodDevicesEntry) -> str:
    return (
        f"{{PodUID:(string){entry.PodUID}"
        f" ContainerName:(string){entry.ContainerName}"
        f" ResourceName:(string){entry.ResourceName}"
        f" DeviceIDs:(checkpoint.DevicesPerNUMA){_numa_keyed_map(entry.DeviceIDs)}"
        f" AllocResp:([]uint8){_bytes(entry.AllocResp)}}}"
    )


_OPENING = "(checkpoint.checkpointData){PodDeviceEntries:([]checkpoint.PodDevicesEntry)"
_MIDDLE = " RegisteredDevices:(map[string][]string)"


def spew_text(data: CheckpointData) -> str:
    """go-spew `%#v` of upstream `checkpoint.checkpointData` holding `data`: `spew_pieces` joined, as the encoder."""
    entries, devices = data.PodDeviceEntries, data.RegisteredDevices
    entry_parts = None if entries is None else [spew_entry(entry).encode() for entry in entries]
    registered = None if devices is None else [spew_registered_item(k, devices[k]).encode() for k in sorted(devices)]
    return b"".join(spew_pieces(entry_parts, registered)).decode()


def spew_pieces(entry_chunks: Sequence[bytes] | None, registered_items: Sequence[bytes] | None) -> list[bytes]:
    """`spew_text` in UTF-8, as pieces to join once: from the entries' parts already encoded (None: a nil list;
    each chunk one entry's part, or runs of consecutive ones joined by a space) and each resource's
    `spew_registered_item`, in the order of their names (None: a nil map)."""
    pieces = [_OPENING.encode()]
    pieces += [_NIL.encode()] if entry_chunks is None else framed_pieces(b"[", entry_chunks, b" ", b"]")
    pieces.append(_MIDDLE.encode())
    pieces += [_NIL.encode()] if registered_items is None else framed_pieces(b"map[", registered_items, b" ", b"]")
    pieces.append(b"}")
    return pieces


def spew_registered_item(resource: str, ids: list[str] | None) -> str:
    """One resource's part of RegisteredDevices' text; the parts go in the order of the names (code-point order is
    UTF-8 byte order, which is how Go compares strings)."""
    return f"{resource}:{_string_list(ids)}"


def framed_pieces(opening: bytes, parts: Sequence[bytes], separator: bytes, closing: bytes) -> list[bytes]:
    """opening + separator.join(parts) + closing as pieces, for one `b"".join` of a whole text: at a megabyte each
    copy of a fresh buffer costs ~0.5-1 ms (its pages faulted in), and the checkpoint's encoder runs on the agent's
    event loop."""
    if not parts:
        return [opening, closing]
    pieces = [separator] * (2 * len(parts) + 1)
    pieces[0], pieces[-1] = opening, closing
    pieces[1:-1:2] = parts
    return pieces


def _string_list(values: Iterable[str] | None) -> str:
    if values is None:
        return _NIL
    return "[" + " ".join(values) + "]"


def _numa_keyed_map(devices: Mapping[int, list[str] | None] | None) -> str:
    if devices is None:
        return _NIL
    return "map[" + " ".join(f"{numa}:{_string_list(devices[numa])}" for numa in sorted(devices)) + "]"


def _bytes(data: bytes | None) -> str:
    if data is None:
        return _NIL
    return "[" + " ".join(map(_BYTE_TEXTS.__getitem__, data)) + "]"
