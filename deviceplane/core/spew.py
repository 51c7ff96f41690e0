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


def spew_entry(entry: PodDevicesEntry) -> str:
    return (
        f"{{PodUID:(string){entry.PodUID}"
        f" ContainerName:(string){entry.ContainerName}"
        f" ResourceName:(string){entry.ResourceName}"
        f" DeviceIDs:(checkpoint.DevicesPerNUMA){_numa_keyed_map(entry.DeviceIDs)}"
        f" AllocResp:([]uint8){_bytes(entry.AllocResp)}}}"
    )


def spew_text(data: CheckpointData, entry_texts: Sequence[str] | None = None) -> str:
    """go-spew `%#v` of upstream `checkpoint.checkpointData` holding `data`; `entry_texts`: the entries' parts, in
    order, when the caller kept them (else made here by `spew_entry`): one per entry, or runs of consecutive ones
    already joined by a space."""
    entries = data.PodDeviceEntries
    if entries is None:
        listed = _NIL
    else:
        listed = "[" + " ".join(entry_texts if entry_texts is not None else map(spew_entry, entries)) + "]"
    opening, closing = _frame(spew_registered(data.RegisteredDevices))
    return opening + listed + closing


def spew_bytes(entry_chunks: Sequence[bytes] | None, registered: str) -> bytes:
    """`spew_text` in UTF-8, from the entries' parts already encoded (None: a nil list; runs of entries joined by a
    space, as for `spew_text`) and `spew_registered`'s text; the long part is copied once."""
    opening, closing = _frame(registered)
    if entry_chunks is None:
        return (opening + _NIL + closing).encode()
    return join_framed((opening + "[").encode(), entry_chunks, b" ", ("]" + closing).encode())


def spew_registered(devices: Mapping[str, list[str] | None] | None) -> str:
    """The RegisteredDevices part of `spew_text`."""
    return _string_keyed_map(devices)


def _frame(registered: str) -> tuple[str, str]:
    """The text before and after the entries' list."""
    return (
        "(checkpoint.checkpointData){PodDeviceEntries:([]checkpoint.PodDevicesEntry)",
        f" RegisteredDevices:(map[string][]string){registered}}}",
    )


def join_framed(opening: bytes, parts: Sequence[bytes], separator: bytes, closing: bytes) -> bytes:
    """opening + separator.join(parts) + closing, in one copy: at a megabyte each copy of a fresh buffer costs
    ~0.5-1 ms (its pages faulted in), and the checkpoint's encoder runs on the agent's event loop."""
    if not parts:
        return opening + closing
    pieces = [separator] * (2 * len(parts) + 1)
    pieces[0], pieces[-1] = opening, closing
    pieces[1:-1:2] = parts
    return b"".join(pieces)


def _string_list(values: Iterable[str] | None) -> str:
    if values is None:
        return _NIL
    return "[" + " ".join(values) + "]"


def _numa_keyed_map(devices: Mapping[int, list[str] | None] | None) -> str:
    if devices is None:
        return _NIL
    return "map[" + " ".join(f"{numa}:{_string_list(devices[numa])}" for numa in sorted(devices)) + "]"


def _string_keyed_map(devices: Mapping[str, list[str] | None] | None) -> str:
    if devices is None:
        return _NIL
    # Code-point order is UTF-8 byte order, which is how Go compares strings.
    return "map[" + " ".join(f"{key}:{_string_list(devices[key])}" for key in sorted(devices)) + "]"


def _bytes(data: bytes | None) -> str:
    if data is None:
        return _NIL
    return "[" + " ".join(str(b) for b in data) + "]"
