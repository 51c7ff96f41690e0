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
    """go-spew `%#v` of upstream `checkpoint.checkpointData` holding `data`; `entry_texts`: each entry's part, in
    order, when the caller kept them (else made here by `spew_entry`)."""
    entries = data.PodDeviceEntries
    if entries is None:
        listed = _NIL
    else:
        listed = "[" + " ".join(entry_texts if entry_texts is not None else map(spew_entry, entries)) + "]"
    return (
        "(checkpoint.checkpointData){"
        f"PodDeviceEntries:([]checkpoint.PodDevicesEntry){listed} "
        f"RegisteredDevices:(map[string][]string){_string_keyed_map(data.RegisteredDevices)}"
        "}"
    )


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
